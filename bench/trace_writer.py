"""The trace writer's thread at a steady rate and after a burst: its CPU per message, the CPU of
each of its writes (how long it can hold the GIL at a stretch), and how long a busy thread
waits for the GIL while a burst is written.

    .venv/bin/python -m bench.trace_writer                 # 2,000 msg/s for 4 s, 3 runs
    .venv/bin/python -m bench.trace_writer --rate 500 --seconds 8

Steady: a background ``TraceWriter`` gets, paced in real time, what a broker's tracer gives it
per message at a low rate (``emit_framed`` of a commit's ``stored`` lines, of a pull's
``pulled`` lines, and every 20 ms an ack's 40 ``acked`` lines: about 3 events per message in
small items). Printed: the writer thread's CPU per message (/proc schedstat: its run time)
and its writes with the CPU of each (``time.thread_time`` around ``flush``).
Burst: ~80,000 events are queued, then another thread writes them while the main thread spins;
printed: the write's CPU and wall time and the main thread's longest gaps between iterations
(it waiting for the GIL; on a loaded host, also the OS running something else: compare A/B in
the same minutes). Linux only (schedstat). Wall-clock figures: state the load.
A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
import threading
import time
from typing import Any

from tracelog.events import PRODUCED_MEMBER
from tracelog.writer import TraceWriter

T0_MS = 1_767_225_600_000
Item = tuple[str, int, list[str], Any]


def items(seconds: float, rate: int) -> list[Item]:
    """(kind, ts_ms, members, extra) of ``emit_framed`` calls for ``seconds`` at ``rate``."""
    rnd = random.Random(1)
    out: list[Item] = []
    seq = 0
    per_ms = rate / 1000
    for ms in range(int(1000 * seconds)):
        ts_ms = T0_MS + ms
        # Commits of 1-3 messages, about ``per_ms`` messages a millisecond.
        count = max(1, round(per_ms * rnd.choice((0.5, 1, 1, 1.5))))
        base = [f'"msg_id":"{seq + i:032x}","subject":"rt.bench","created_at_ms":{ts_ms - 1}'
                for i in range(count)]
        out.append(("stored", ts_ms, [f'{m},"seq":{seq + i}' for i, m in enumerate(base)],
                    PRODUCED_MEMBER))
        out.append(("pulled", ts_ms, base, ("g1", "c-1")))
        if ms % 20 == 0 and seq >= 40:
            acked = [f'"msg_id":"{seq - i:032x}","subject":"rt.bench","created_at_ms":{ts_ms}'
                     for i in range(40)]
            out.append(("acked", ts_ms, acked, ("g1", "c-1")))
        seq += count
    return out


class _TimedWriter(TraceWriter):
    """A TraceWriter that notes the CPU of each flush."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.flush_cpu_s: list[float] = []
        super().__init__(*args, **kwargs)

    def flush(self) -> None:
        started = time.thread_time()
        super().flush()
        self.flush_cpu_s.append(time.thread_time() - started)


def _run_time_ns(native_id: int) -> int:
    with open(f"/proc/self/task/{native_id}/schedstat", encoding="ascii") as f:
        return int(f.read().split()[0])


def steady(seconds: float, rate: int) -> str:
    """One paced run: the writer thread's CPU per message and its writes."""
    directory = tempfile.mkdtemp(prefix="qmq-bench-trace-writer-")
    try:
        writer = _TimedWriter(directory, "realtime:bench")
        assert writer._thread is not None and writer._thread.native_id is not None
        native_id = writer._thread.native_id
        queued = items(seconds, rate)
        messages = sum(len(m) for kind, _, m, _ in queued if kind == "stored")
        cpu_ns = _run_time_ns(native_id)
        started = time.monotonic()
        done = 0
        for ms in range(int(1000 * seconds)):
            while done < len(queued) and queued[done][1] <= T0_MS + ms:
                kind, ts_ms, members, extra = queued[done]
                writer.emit_framed(kind, ts_ms, members, extra)
                done += 1
            wait_s = started + (ms + 1) / 1000 - time.monotonic()
            if wait_s > 0:
                time.sleep(wait_s)
        cpu_ns = _run_time_ns(native_id) - cpu_ns
        writes = sorted(writer.flush_cpu_s)
        writer.close()
        median = writes[len(writes) // 2] * 1e3 if writes else 0.0
        top = writes[-1] * 1e3 if writes else 0.0
        return (f"writer thread {cpu_ns / 1e3 / messages:.2f} CPU-us/msg; {len(writes)} writes, "
                f"CPU each: median {median:.2f} ms, max {top:.2f} ms")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def burst(events: int) -> str:
    """A write of ``events`` queued events by another thread while this one spins."""
    directory = tempfile.mkdtemp(prefix="qmq-bench-trace-writer-")
    try:
        writer = TraceWriter(directory, "realtime:bench", background=False)
        count = 0
        for kind, ts_ms, members, extra in items(events / 1000, 1000):  # more than enough
            if count >= events:
                break
            writer.emit_framed(kind, ts_ms, members, extra)
            count += len(members)
        done = threading.Event()
        window: list[float] = []

        def write() -> None:
            window.append(time.perf_counter())
            cpu_s = time.thread_time()
            writer.flush()
            window.extend((time.perf_counter(), time.thread_time() - cpu_s))
            done.set()

        stamps: list[float] = []
        threading.Thread(target=write, name="bench-writer").start()
        now = time.perf_counter()
        deadline = now + 60
        while not done.is_set() and now < deadline:
            stamps.append(now)
            now = time.perf_counter()
        writer.close()
        start, stop, cpu_s = window
        gaps = sorted(b - a for a, b in zip(stamps, stamps[1:]) if a >= start and b <= stop)
        gaps = gaps or [0.0]
        longest = ", ".join(f"{g * 1e3:.2f}" for g in gaps[::-1][:3])
        return (f"burst of {count:,} events: written in {cpu_s * 1e3:.1f} ms of CPU, "
                f"{(stop - start) * 1e3:.1f} ms of wall time; the spinning thread's longest "
                f"gaps meanwhile {longest} ms, {sum(g > 0.001 for g in gaps)} over 1 ms")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=int, default=2_000, help="messages per second")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--burst-events", type=int, default=80_000)
    args = parser.parse_args()
    print(f"bench.trace_writer: {args.rate:,} msg/s for {args.seconds} s, {args.runs} runs; "
          f"load average {os.getloadavg()[0]:.2f}")
    for run in range(1, args.runs + 1):
        print(f"  run {run}: {steady(args.seconds, args.rate)}")
        print(f"  run {run}: {burst(args.burst_events)}")


if __name__ == "__main__":
    main()
