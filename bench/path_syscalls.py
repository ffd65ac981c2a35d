"""System calls and context switches per message of ``qmq up``, by thread: exact counts, which
the machine's load does not move (``bench.path_cpu``'s CPU figures do).

    python -m bench.path_syscalls                    # 5,000 messages, data dir in /dev/shm
    python -m bench.path_syscalls --messages 20000
    python -m bench.path_syscalls --replicas 2       # with one sync slave of each group
    python -m bench.path_syscalls --disk             # data dir in /tmp

One fresh ``qmq up`` (flush sync) and ``bench.path_cpu``'s client: a Producer and a Consumer,
one message at a time (send, wait for the confirmation and the receipt, next). After the
warm-up, ``perf stat --per-thread`` counts the server's system calls by kind (the
``raw_syscalls`` and ``syscalls`` tracepoints: no ptrace, so nothing is slowed) while
``--messages`` messages go, then over an idle window as long; the idle counts are taken off, and
what is left is divided by the messages. The context switches per thread (voluntary: the thread
slept; involuntary: it was preempted) come from /proc over the messages (idle not taken off:
at one message a cycle it is a few in a thousand). Threads are summed by OS name as
``bench.path_cpu`` names them: the event loop is "main". Needs ``perf`` and the right to trace
another process (root, or kernel.perf_event_paranoid and tracefs permissions that allow it).

Which calls a message needs and which it could do without (an ``epoll_ctl`` per write, a
second write per answer, a read that returns EAGAIN, a timer re-armed per message) show up
here as counts: docs/BENCHMARKS.md, session 23 (loopc).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Any

from bench._cluster import thread_switches
from bench.path_cpu import BODY, SUBJECT, WARM_UP_MESSAGES, qmq_up

# The system calls counted one by one (each one the kernel has a tracepoint for); "all" is
# every system call.
SYSCALLS = ("futex", "read", "write", "readv", "writev", "recvfrom", "sendto", "recvmsg",
            "sendmsg", "epoll_wait", "epoll_pwait", "epoll_ctl", "pwrite64", "pwritev",
            "pread64", "fdatasync", "fsync", "getpid", "clock_gettime", "mmap", "munmap",
            "timerfd_settime", "sched_yield", "fcntl", "ioctl")
ALL = "all"
# How long perf is given to attach before the counted part starts, and to stop.
PERF_SETTLE_S = 1.0


def available_events() -> list[str]:
    """The tracepoints to count: every system call, and those of SYSCALLS this kernel has."""
    listed = subprocess.run(["perf", "list", "tracepoint"], capture_output=True, text=True,
                            check=False).stdout
    known = {word for line in listed.splitlines() for word in line.split()}
    return ["raw_syscalls:sys_enter"] + [f"syscalls:sys_enter_{name}" for name in SYSCALLS
                                         if f"syscalls:sys_enter_{name}" in known]


def thread_names(pid: int) -> dict[str, str]:
    """tid -> the name its counts are summed under: "main" for the process's first thread,
    else its OS name (/proc/<pid>/task/<tid>/comm)."""
    names: dict[str, str] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm", encoding="utf-8", errors="replace") as f:
                names[tid] = "main" if tid == str(pid) else f.read().strip()
        except OSError:
            continue  # ended meanwhile
    return names


def parse_perf_stat(text: str, names: dict[str, str]) -> dict[str, Counter[str]]:
    """``perf stat --per-thread -x ,`` output -> {thread name: {syscall: count}}. A line is
    ``<comm>-<tid>,<count>,<unit>,<event>,...``; "all" is ``raw_syscalls:sys_enter``. A thread
    that is not in ``names`` (started after they were read) is summed under its comm."""
    counts: dict[str, Counter[str]] = {}
    for line in text.splitlines():
        fields = line.split(",")
        if line.startswith("#") or len(fields) < 4 or "-" not in fields[0]:
            continue
        comm, _, tid = fields[0].rpartition("-")
        try:
            value = int(fields[1])
        except ValueError:
            continue  # "<not counted>", "<not supported>"
        event = fields[3]
        kind = ALL if event == "raw_syscalls:sys_enter" else event.rpartition("sys_enter_")[2]
        counts.setdefault(names.get(tid, comm), Counter())[kind] += value
    return counts


def per_message(busy: dict[str, Counter[str]], idle: dict[str, Counter[str]], messages: int
                ) -> dict[str, dict[str, float]]:
    """Counts per message, the idle window's taken off: {thread: {syscall: calls}}; a thread
    with less than 0.01 system call a message is left out."""
    out: dict[str, dict[str, float]] = {}
    for name, counts in busy.items():
        rest = idle.get(name, Counter())
        row = {kind: (count - rest[kind]) / messages for kind, count in counts.items()}
        if row.get(ALL, 0.0) >= 0.01:
            out[name] = row
    return out


def _perf(pid: int, events: list[str], path: str) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(["perf", "stat", "--per-thread", "-x", ",", "-o", path,
                                "-e", ",".join(events), "-p", str(pid)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(PERF_SETTLE_S)
    return process


def _stop(process: subprocess.Popen[bytes], path: str) -> str:
    process.send_signal(signal.SIGINT)
    process.wait()
    with open(path, encoding="utf-8") as f:
        return f.read()


async def _one_run(url: str, pid: int, count: int, events: list[str], directory: str
                   ) -> dict[str, Any]:
    """Warm up; count ``count`` messages one at a time, then an idle window as long."""
    from sdk import Consumer, Producer

    producer = Producer(url)
    consumer = Consumer(url, group="path-syscalls", start="earliest")
    received: asyncio.Queue[None] = asyncio.Queue()

    async def receive() -> None:
        async for msg in consumer.subscribe(SUBJECT):
            received.put_nowait(None)
            await msg.ack()

    async def one() -> None:
        await producer.send(SUBJECT, BODY)
        await received.get()

    receiving = asyncio.create_task(receive())
    try:
        for _ in range(WARM_UP_MESSAGES + 1):  # the first makes the route and the group
            await one()
        names = thread_names(pid)
        busy_path, idle_path = os.path.join(directory, "busy"), os.path.join(directory, "idle")
        perf = _perf(pid, events, busy_path)
        switches_before, start = thread_switches(pid), time.monotonic()
        for _ in range(count):
            await one()
        elapsed_s, switches = time.monotonic() - start, thread_switches(pid)
        busy = _stop(perf, busy_path)
        perf = _perf(pid, events, idle_path)
        await asyncio.sleep(elapsed_s)
        idle = _stop(perf, idle_path)
    finally:
        receiving.cancel()
        await asyncio.gather(receiving, return_exceptions=True)
        await consumer.close()
        await producer.close()
    calls = per_message(parse_perf_stat(busy, names), parse_perf_stat(idle, names), count)
    switched = {name: ((after[0] - switches_before.get(name, (0, 0))[0]) / count,
                       (after[1] - switches_before.get(name, (0, 0))[1]) / count)
                for name, after in switches.items()}
    return {"calls": calls, "switches": switched, "msgs_per_s": count / elapsed_s,
            "load_1min": os.getloadavg()[0]}


def _lines(figures: dict[str, Any]) -> list[str]:
    lines = [f"{figures['msgs_per_s']:.0f} msg/s, load {figures['load_1min']:.2f}; per message "
             "(system calls, idle window taken off; context switches voluntary/involuntary):"]
    for name, row in sorted(figures["calls"].items(), key=lambda item: -item[1][ALL]):
        kinds = sorted(((kind, calls) for kind, calls in row.items() if kind != ALL),
                       key=lambda item: -item[1])
        voluntary, involuntary = figures["switches"].get(name, (0.0, 0.0))
        lines.append(f"  {name}: {row[ALL]:.2f} system calls: "
                     + ", ".join(f"{kind} {calls:.2f}" for kind, calls in kinds
                                 if abs(calls) >= 0.005)
                     + f"; switches {voluntary:.2f}/{involuntary:.2f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Run the count; prints one block per run."""
    parser = argparse.ArgumentParser(prog="python -m bench.path_syscalls", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=5_000)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--disk", action="store_true", help="data dir in /tmp, not /dev/shm")
    parser.add_argument("--replicas", type=int, default=1,
                        help="qmq up --replicas: 2 adds a sync slave of each group")
    parser.add_argument("--event-loop", choices=("auto", "uvloop", "asyncio"), default=None)
    args = parser.parse_args(argv)
    events = available_events()
    extra = ["--replicas", str(args.replicas)] if args.replicas > 1 else []
    if args.event_loop is not None:
        extra += ["--event-loop", args.event_loop]
    with qmq_up("qmq-path-syscalls-", "sync", extra, tmpfs=not args.disk) as server, \
            tempfile.TemporaryDirectory(prefix="qmq-path-syscalls-") as directory:
        url = f"http://{server.address}"
        if args.replicas > 1:
            from bench.peers.servers import wait_in_sync
            wait_in_sync(url)
        print(f"qmq up ({'disk' if args.disk else 'tmpfs'} data dir, flush sync, replicas "
              f"{args.replicas}), {args.messages} messages one at a time:", flush=True)
        for run in range(args.runs):
            figures = asyncio.run(_one_run(url, server.pid, args.messages, events, directory))
            print(f"run {run + 1}: " + "\n".join(_lines(figures)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
