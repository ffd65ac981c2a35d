"""Where a low-rate message's server CPU goes: ``qmq up``'s idle CPU, and its CPU per message
when every message travels alone (issue 18's "CPU per message at 2,000 msg/s").

    python -m bench.path_cpu                      # 2,000 messages, data dir in /tmp
    python -m bench.path_cpu --tmpfs              # data dir in /dev/shm: fsync costs ~nothing,
                                                  # what is left is the software path
    python -m bench.path_cpu --send-only          # no consumer: the send path alone
    python -m bench.path_cpu --no-trace --runs 3  # trace events off; 3 runs on one server
    python -m bench.path_cpu --replicas 2         # one sync slave of each group, same process
    python -m bench.path_cpu --event-loop asyncio # qmq up on asyncio's own loop (A/B uvloop)

One fresh ``qmq up`` (flush sync by default), one client process holding a Producer and a
Consumer (``start="earliest"``, acking each message). After a warm-up the server's idle CPU is
read over ``--idle-s`` seconds; then ``--messages`` messages go one at a time: send, wait for the
confirmation, wait until the consumer has it, next. So no send shares a batch, a commit or a
pull with another: the figure is the unbatched cost, an upper bound of what a message costs at
any rate, and it does not depend on how busy the machine is (batching does). Printed per run:

- ``server CPU/msg``: user + system CPU of the whole ``qmq up`` process (MetaServer included,
  from /proc) over the run, divided by the messages;
- ``path CPU/msg``: the same less the idle CPU rate times the run's length: what the messages
  themselves cost;
- ``idle``: the process's CPU per second with nobody sending (heartbeats, failover checks,
  schedules, flush rounds): at 2,000 msg/s each ms/s of it is 0.5 us per message;
- send -> confirmation and send -> receipt p50 / p99 (wall clock: noisy on a loaded machine);
- ``by thread``: the server CPU per message (idle not taken off) of the event loop ("main"),
  each I/O thread (``realtime-store-``, ``realtime-pulllo``, ``delay-io``: the kernel keeps 15
  bytes of a name) and every other thread together (trace writers, aiosqlite's): a hop to a
  thread costs CPU on both sides, so this shows which thread a change moved work to or from.

CPU figures are the ones that survive a loaded machine; still compare before/after in one
sitting and state the load average (printed with each run).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from typing import Any, Iterator

from bench._cluster import Server, percentile, process_cpu_s, start_process, thread_cpu_s
from bench.delay import wait_registered
from bench.peers.servers import _QMQ_UP_READY, REPO_ROOT, wait_in_sync

SUBJECT = "bench.path"
WARM_UP_MESSAGES = 50
BODY = b"x" * 256
# The OS names of the I/O threads (``IoThread`` names, cut to 15 bytes by the kernel).
IO_THREAD_SUFFIXES = ("-io", "-store-", "-pulllo")


async def _one_run(url: str, pid: int, count: int, idle_s: float,
                   send_only: bool) -> dict[str, Any]:
    """Warm up, read the idle CPU, then ``count`` messages one at a time."""
    from sdk import Consumer, Producer

    producer = Producer(url)
    consumer = Consumer(url, group="path-cpu", start="earliest")
    received: asyncio.Queue[int] = asyncio.Queue()

    async def receive() -> None:
        async for msg in consumer.subscribe(SUBJECT):
            received.put_nowait(time.monotonic_ns())
            await msg.ack()

    async def one() -> tuple[int, int]:
        sent_ns = time.monotonic_ns()
        await producer.send(SUBJECT, BODY)
        confirmed_ns = time.monotonic_ns()
        got_ns = confirmed_ns if send_only else await received.get()
        return confirmed_ns - sent_ns, got_ns - sent_ns

    receiving = None if send_only else asyncio.create_task(receive())
    try:
        # The subject's route exists before the consumer asks for it; its message is the
        # first the consumer takes, so each later receipt is matched to its own send.
        await producer.send(SUBJECT, BODY)
        if not send_only:
            await received.get()
        for _ in range(WARM_UP_MESSAGES):
            await one()
        idle_cpu_s, idle_start = process_cpu_s(pid), time.monotonic()
        await asyncio.sleep(idle_s)
        idle_per_s = (process_cpu_s(pid) - idle_cpu_s) / (time.monotonic() - idle_start)
        cpu_s, start, threads_before = process_cpu_s(pid), time.monotonic(), thread_cpu_s(pid)
        times = [await one() for _ in range(count)]
        cpu_s, elapsed_s = process_cpu_s(pid) - cpu_s, time.monotonic() - start
        threads = thread_cpu_s(pid)
    finally:
        if receiving is not None:
            receiving.cancel()
            await asyncio.gather(receiving, return_exceptions=True)
        await consumer.close()
        await producer.close()
    confirms = sorted(confirm for confirm, _ in times)
    receipts = sorted(receipt for _, receipt in times)
    return {
        "server_cpu_us_per_msg": cpu_s / count * 1e6,
        "path_cpu_us_per_msg": (cpu_s - idle_per_s * elapsed_s) / count * 1e6,
        "idle_cpu_ms_per_s": idle_per_s * 1000,
        "msgs_per_s": count / elapsed_s,
        "confirm_p50_ms": percentile(confirms, 0.5) / 1e6,
        "confirm_p99_ms": percentile(confirms, 0.99) / 1e6,
        "receive_p50_ms": percentile(receipts, 0.5) / 1e6,
        "receive_p99_ms": percentile(receipts, 0.99) / 1e6,
        "load_1min": os.getloadavg()[0],
        "threads_us_per_msg": _by_thread(threads_before, threads, count),
    }


def _by_thread(before: dict[str, float], after: dict[str, float], count: int
               ) -> dict[str, float]:
    """CPU per message of the event loop ("main") and each I/O thread of ``qmq up``; every
    other thread (trace writers, aiosqlite's) summed as "other"."""
    out: dict[str, float] = {"main": 0.0, "other": 0.0}
    for name, cpu_s in after.items():
        used_us = (cpu_s - before.get(name, 0.0)) / count * 1e6
        key = name if name == "main" or name.endswith(IO_THREAD_SUFFIXES) else "other"
        out[key] = out.get(key, 0.0) + used_us
    return out


def _line(figures: dict[str, Any], send_only: bool) -> str:
    receive = "" if send_only else (f", send->receipt p50 {figures['receive_p50_ms']:.2f} / "
                                    f"p99 {figures['receive_p99_ms']:.2f} ms")
    return (f"server CPU/msg {figures['server_cpu_us_per_msg']:.0f} us, path CPU/msg "
            f"{figures['path_cpu_us_per_msg']:.0f} us, idle {figures['idle_cpu_ms_per_s']:.1f} "
            f"ms/s, {figures['msgs_per_s']:.0f} msg/s, send->confirm p50 "
            f"{figures['confirm_p50_ms']:.2f} / p99 {figures['confirm_p99_ms']:.2f} ms{receive}; "
            f"load {figures['load_1min']:.2f}\n    by thread (us/msg): "
            + ", ".join(f"{name} {us:.0f}" for name, us in figures["threads_us_per_msg"].items()))


@contextmanager
def qmq_up(prefix: str, flush: str, extra_args: list[str], tmpfs: bool = False,
           interpreter_args: list[str] | None = None) -> Iterator[Server]:
    """``qmq up`` on a fresh data dir (named ``prefix``..., in /dev/shm with ``tmpfs``) with
    ``--flush flush`` and ``extra_args``, once its brokers are registered; on exit it is
    stopped and its data dir removed. ``interpreter_args`` go to Python before ``-m qmq``
    (bench.call_count's ``-m cProfile -o FILE``)."""
    directory = tempfile.mkdtemp(prefix=prefix, dir="/dev/shm" if tmpfs else None)
    try:
        server = start_process("qmq up", [
            sys.executable, *(interpreter_args or []), "-m", "qmq", "--log-level", "warning",
            "up",
            "--data-dir", os.path.join(directory, "qmq"), "--host", "127.0.0.1",
            "--meta-port", "0", "--realtime-port", "0", "--delay-port", "0",
            "--flush", flush, *extra_args,
        ], _QMQ_UP_READY, cwd=REPO_ROOT)
        try:
            wait_registered(f"http://{server.address}")
            yield server
        finally:
            server.stop()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """Run the measurement; prints one line per run."""
    parser = argparse.ArgumentParser(prog="python -m bench.path_cpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=2_000)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--idle-s", type=float, default=3.0, help="idle window per run")
    parser.add_argument("--tmpfs", action="store_true", help="data dir in /dev/shm")
    parser.add_argument("--send-only", action="store_true", help="no consumer")
    parser.add_argument("--no-trace", action="store_true", help="qmq up --no-trace")
    parser.add_argument("--flush", choices=("sync", "async"), default="sync")
    parser.add_argument("--replicas", type=int, default=1,
                        help="qmq up --replicas: 2 adds a sync slave to each group, in the "
                        "same process (its threads are summed with the master's of one name)")
    parser.add_argument("--event-loop", choices=("auto", "uvloop", "asyncio"), default=None,
                        help="qmq up --event-loop (A/B of the two loops in one tree)")
    args = parser.parse_args(argv)
    extra = ["--no-trace"] if args.no_trace else []
    if args.event_loop is not None:
        extra += ["--event-loop", args.event_loop]
    if args.replicas > 1:
        extra += ["--replicas", str(args.replicas)]
    with qmq_up("qmq-path-cpu-", args.flush, extra, tmpfs=args.tmpfs) as server:
        url = f"http://{server.address}"
        if args.replicas > 1:
            wait_in_sync(url)  # before that, a send is confirmed without waiting for a slave
        print(f"qmq up ({'tmpfs' if args.tmpfs else 'disk'} data dir, flush {args.flush}, "
              f"event loop {args.event_loop or 'default'}, "
              f"trace {'off' if args.no_trace else 'on'}, replicas {args.replicas}), "
              f"{args.messages} messages one at "
              f"a time{', no consumer' if args.send_only else ''}:", flush=True)
        for run in range(args.runs):
            figures = asyncio.run(_one_run(url, server.pid, args.messages, args.idle_s,
                                           args.send_only))
            print(f"  run {run + 1}: {_line(figures, args.send_only)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
