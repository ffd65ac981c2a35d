"""What one request costs the realtime broker's event loop outside its handler (issue 18): the
frame read and decode, the parse, the dispatch, the role and access checks, the answer's encode
and write.

    python -m bench.request_cpu                       # heartbeats one at a time, 3 runs
    python -m bench.request_cpu --window 3            # 3 requests in flight (one write each)
    python -m bench.request_cpu --op ack              # acks of ranges nobody holds
    python -m bench.request_cpu --op send --tmpfs     # sends of one message each
    python -m bench.request_cpu --op pull             # pulls of a caught-up group, no wait
    python -m bench.request_cpu --profile             # Python calls per request (cProfile)

A standalone ``RealtimeServer`` (no MetaServer: the access gate grants everyone, the role is a
master without a lease) runs on this process's event loop; a child process with a blocking
socket sends pre-encoded request frames and counts the answers, ``--window`` in flight at a
time, each request in its own ``send`` system call (as separate clients' requests arrive). A
``heartbeat`` is answered without an await: what it costs is the request path itself. An
``ack`` (of a range nobody holds, in a group that exists) adds its handler: the pull-log
record, on the loop while the pull-log thread is idle. A ``send`` (one 256-byte message, each
its own id) adds the commit: with one in flight, each is a group commit of its own, and its
store thread's CPU is not counted (``--tmpfs``: no fsync to wait for). A ``pull`` (wait_ms 0,
of a group that exists and is caught up) is answered empty from the group's known cursor: the
pull path's cost without a pull-log call.

Printed per run: the event-loop thread's CPU per request (``time.thread_time`` on the loop:
the client's CPU and the I/O threads' are not in it), split into user and system time (from
/proc, 10 ms ticks), and requests per second; "less idle" takes off the loop's CPU rate with no request (read for
IDLE_S before each run) times the run's length: on a loaded host a slower run would otherwise
count more of the idle work per request. Over loopback TCP the answer's ``send`` system
call carries the client's side of the stack too: the system part is mostly that. ``--profile``
runs cProfile over ``--requests`` and twice as many, and prints the difference in calls per
request (a coroutine resumption counts as one call): a figure that does not depend on load.
CPU figures still move with the load (cache, frequency): compare A/B in the same minutes and
state the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from wire.protocol import encode_frame

_HEADER = struct.Struct(">I")
IDLE_S = 1.0  # the loop's idle CPU is read for this long before each run


def _frames(op: str, count: int) -> list[bytes]:
    """The request frames of ``op``: one reused, or for a send ``count`` of them, each with a
    message of its own (a resent id would be answered as a duplicate, without a commit)."""
    if op == "send":
        from wire.message import Message, encode_message

        now_ms = int(time.time() * 1000)
        return [encode_frame({"op": "send", "rid": 1, "compact": True, "messages": [
            encode_message(Message.create("bench.req", b"x" * 256, now_ms=now_ms))]})
            for _ in range(count)]
    return [_frame(op)]


def _frame(op: str) -> bytes:
    """One request frame of ``op`` (rid fixed: the server does not care)."""
    if op == "heartbeat":
        return encode_frame({"op": "heartbeat", "rid": 1, "consumer_id": "c1",
                             "subscriptions": [["bench.req", "g"]]})
    if op == "ack":
        return encode_frame({"op": "ack", "rid": 1, "subject": "bench.req", "group": "g",
                             "consumer_id": "c1", "ranges": [[1_000_000, 1_000_000]]})
    if op == "pull":
        return encode_frame({"op": "pull", "rid": 1, "subject": "bench.req", "group": "g",
                             "consumer_id": "c1", "max_count": 32, "wait_ms": 0})
    raise SystemExit(f"unknown --op {op}")


def _thread_ticks() -> tuple[int, int]:
    """This thread's (user, system) CPU in clock ticks, from /proc."""
    with open(f"/proc/self/task/{threading.get_native_id()}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]), int(fields[12])


def client_main(port: int, op: str, count: int, window: int) -> None:
    """The child: hello, then ``count`` requests with ``window`` in flight; prints 'done'."""
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(encode_frame({"op": "hello", "rid": 0, "client_id": "bench", "app": "bench",
                               "protocol": 1}))
    frames = _frames(op, count)
    buffer = bytearray()

    def read_answers(wanted: int) -> None:
        got = 0
        while got < wanted:
            while len(buffer) >= 4:
                (length,) = _HEADER.unpack_from(buffer, 0)
                if len(buffer) < 4 + length:
                    break
                del buffer[:4 + length]
                got += 1
                if got == wanted:
                    return
            data = sock.recv(65536)
            if not data:
                raise SystemExit("server closed the connection")
            buffer.extend(data)

    if op in ("ack", "pull"):  # the group exists: acks are recorded, pulls find it caught up
        sock.sendall(encode_frame({"op": "pull", "rid": 2, "subject": "bench.req", "group": "g",
                                   "consumer_id": "c1", "max_count": 1, "wait_ms": 0}))
        read_answers(2)
    else:
        read_answers(1)  # hello
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    sys.stdin.readline()
    in_flight = 0
    sent = 0
    while sent < count or in_flight:
        while sent < count and in_flight < window:
            sock.sendall(frames[sent % len(frames)])
            sent += 1
            in_flight += 1
        read_answers(1)
        in_flight -= 1
    sys.stdout.write("done\n")
    sys.stdout.flush()


async def _serve(op: str, counts: list[int], window: int, profile: bool,
                 tmpfs: bool) -> list[dict[str, Any]]:
    from realtime.config import RealtimeConfig
    from realtime.server import RealtimeServer

    results = []
    with tempfile.TemporaryDirectory(prefix="reqcpu-",
                                     dir="/dev/shm" if tmpfs else None) as directory:
        server = RealtimeServer(RealtimeConfig(data_dir=directory, port=0, trace=False))
        await server.start()
        try:
            for count in counts:
                results.append(await _one_run(server.port, op, count, window, profile))
        finally:
            await server.stop()
    return results


async def _one_run(port: int, op: str, count: int, window: int,
                   profile: bool) -> dict[str, Any]:
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.request_cpu", "--client", str(port), "--op", op,
        "--requests", str(count), "--window", str(window),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert child.stdout is not None and child.stdin is not None
    line = await child.stdout.readline()
    assert line == b"ready\n", line
    idle_cpu0 = time.thread_time()
    await asyncio.sleep(IDLE_S)  # the loop's own work with no request (flush rounds, ticks)
    idle_rate = (time.thread_time() - idle_cpu0) / IDLE_S
    profiler = cProfile.Profile() if profile else None
    wall0, cpu0, ticks0 = time.perf_counter(), time.thread_time(), _thread_ticks()
    if profiler is not None:
        profiler.enable()
    child.stdin.write(b"go\n")
    line = await child.stdout.readline()
    if profiler is not None:
        profiler.disable()
    cpu_s, wall_s = time.thread_time() - cpu0, time.perf_counter() - wall0
    ticks = _thread_ticks()
    tick_us = 1e6 / os.sysconf("SC_CLK_TCK")
    user_us, system_us = ((ticks[i] - ticks0[i]) * tick_us / count for i in (0, 1))
    assert line == b"done\n", line
    await child.wait()
    calls = None
    if profiler is not None:
        calls = pstats.Stats(profiler).total_calls  # type: ignore[attr-defined]
    return {"count": count, "cpu_us": cpu_s * 1e6 / count, "rate": count / wall_s,
            "path_us": (cpu_s - idle_rate * wall_s) * 1e6 / count, "idle_ms_s": idle_rate * 1e3,
            "calls": calls, "user_us": user_us, "system_us": system_us}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (or, with --client, be its child)."""
    parser = argparse.ArgumentParser(prog="python -m bench.request_cpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", default="heartbeat", choices=("heartbeat", "ack", "send", "pull"))
    parser.add_argument("--tmpfs", action="store_true",
                        help="data dir in /dev/shm (a send's fsync costs ~nothing)")
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--window", type=int, default=1, help="requests in flight")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--profile", action="store_true",
                        help="cProfile: Python calls per request")
    parser.add_argument("--client", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.client is not None:
        client_main(args.client, args.op, args.requests, args.window)
        return 0
    if args.profile:
        small = max(args.requests // 4, 1000)
        runs = asyncio.run(_serve(args.op, [small, small, 2 * small], args.window, True,
                                  args.tmpfs))
        per_request = (runs[2]["calls"] - runs[1]["calls"]) / small
        print(f"{args.op} window {args.window}: {per_request:.1f} Python calls per request "
              f"(cProfile, {2 * small} - {small} requests)")
        return 0
    counts = [args.requests // 10] + [args.requests] * args.runs  # the first warms up
    runs = asyncio.run(_serve(args.op, counts, args.window, False, args.tmpfs))[1:]
    load = os.getloadavg()[0]
    for run in runs:
        print(f"{args.op} window {args.window}: {run['cpu_us']:.1f} loop CPU-us/request "
              f"(user {run['user_us']:.1f}, system {run['system_us']:.1f}; less idle "
              f"{run['path_us']:.1f}, idle {run['idle_ms_s']:.1f} ms/s), "
              f"{run['rate']:,.0f} requests/s, load {load:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
