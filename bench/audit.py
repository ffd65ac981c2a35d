"""Audit benchmark: time ``qmq audit`` over N synthetic trace events on ``local[2]``.

Generates a realistic trace with ``tracelog.events.TraceWriter`` (one realtime and one delay server per
generator process, the writer clock following the simulated time so files rotate hourly over
about 3 hours), then runs ``qmq audit`` in a fresh process, as a user would, and times it.

Mix per message: produced, stored, pulled, acked (one group per subject, 16 subjects); 5% are
delayed (+ scheduled, dispatched, lateness 0-50 ms); 2% are nacked once and succeed on a retry
copy 5 s later (+ nacked, retried, scheduled, dispatched, stored, pulled, acked); 0.1% are
nacked twice and dead-lettered. The audit must find 0 lost, 0 early and exactly the dead ones.

    python -m bench.audit            # 1M events
    python -m bench.audit --full     # 10M events
    python -m bench.audit --events 200000 --keep /tmp/trace

Goal (issue "Trace events and the Spark audit"): 10M events audited in < 3 minutes on local[2].
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tracelog.events import TraceWriter, trace_event  # noqa: E402

START_MS = 1_767_225_600_000  # 2026-01-01T00:00:00Z
SPAN_MS = 3 * 3_600_000  # simulated time the trace covers
SUBJECTS = [f"bench.subject.{i}" for i in range(16)]
DELAYED_SHARE, RETRIED_SHARE, DEAD_SHARE = 0.05, 0.02, 0.001
EVENTS_PER_MESSAGE = 4 + 2 * DELAYED_SHARE + 7 * RETRIED_SHARE + 9 * DEAD_SHARE
RETRY_DELAY_MS = 5_000
DEADLINE_MS = 300_000
SEED = 20260101
GOAL_FULL_S = 180
FULL_EVENTS = 10_000_000
DEFAULT_EVENTS = 1_000_000


class SimClock:
    """The writers' clock: the simulated time of the latest event."""

    def __init__(self) -> None:
        self.now_ms = START_MS

    def __call__(self) -> int:
        return self.now_ms


def _message_events(rng: random.Random, msg_id: str, subject: str, t: int) -> list[dict]:
    """One message's events (realtime and delay server mixed), in time order."""
    group, root = subject + ".g", msg_id
    roll = rng.random()
    deliver_at = t + rng.randint(1_000, 60_000) if roll < DELAYED_SHARE else None
    ready = t if deliver_at is None else deliver_at + rng.randint(0, 50)
    common = dict(subject=subject, created_at_ms=t, deliver_at_ms=deliver_at)
    out = [("d" if deliver_at else "r", trace_event("produced", ts_ms=t, msg_id=msg_id, **common))]
    if deliver_at is not None:
        out.append(("d", trace_event("scheduled", ts_ms=t + 1, msg_id=msg_id, **common)))
        out.append(("d", trace_event("dispatched", ts_ms=ready, msg_id=msg_id, **common)))
    out.append(("r", trace_event("stored", ts_ms=ready + 1, msg_id=msg_id, **common)))
    pulled = ready + 1 + rng.randint(0, 20)
    out.append(("r", trace_event("pulled", ts_ms=pulled, msg_id=msg_id, group=group,
                                 consumer="c1", **common)))
    dead = roll > 1 - DEAD_SHARE
    if roll > 1 - RETRIED_SHARE - DEAD_SHARE:  # retried once; the dead ones fail again
        copy_id, copy_at = msg_id + ".r1", pulled + 5 + RETRY_DELAY_MS
        copy = dict(subject=subject, origin_id=msg_id, group=group, created_at_ms=pulled + 5,
                    deliver_at_ms=copy_at, retries=1)
        out += [("r", trace_event("nacked", ts_ms=pulled + 5, msg_id=msg_id, group=group,
                                  consumer="c1", **common)),
                ("r", trace_event("retried", ts_ms=pulled + 6, msg_id=copy_id, **copy)),
                ("d", trace_event("scheduled", ts_ms=pulled + 7, msg_id=copy_id, **copy)),
                ("d", trace_event("dispatched", ts_ms=copy_at + 3, msg_id=copy_id, **copy)),
                ("r", trace_event("stored", ts_ms=copy_at + 4, msg_id=copy_id, **copy)),
                ("r", trace_event("pulled", ts_ms=copy_at + 6, msg_id=copy_id, consumer="c2",
                                  **copy))]
        msg_id, pulled, common = copy_id, copy_at + 6, {**copy}
        common.pop("group")
        if dead:
            out += [("r", trace_event("nacked", ts_ms=pulled + 1, msg_id=msg_id, group=group,
                                      consumer="c2", **common)),
                    ("r", trace_event("dead", ts_ms=pulled + 2, msg_id=root + ".r2",
                                      group=group, **{**common, "retries": 2}))]
            return out
    out.append(("r", trace_event("acked", ts_ms=pulled + 2, msg_id=msg_id, group=group,
                                 consumer="c2" if ".r" in msg_id else "c1", **common)))
    return out


def generate(worker: int, workers: int, events_target: int, directory: str) -> tuple[int, float]:
    """Write about events_target / workers events; returns (events, seconds)."""
    rng = random.Random(SEED + worker)
    clock = SimClock()
    writers = {kind: TraceWriter(directory, f"{name}-{worker}", clock_ms=clock, background=False)
               for kind, name in (("r", "realtime:rt"), ("d", "delay:d"))}
    messages = int(events_target / workers / EVENTS_PER_MESSAGE)
    step_ms = SPAN_MS / messages
    written = 0
    started = time.perf_counter()
    for i in range(messages):
        t = START_MS + int(i * step_ms)
        clock.now_ms = t
        for kind, event in _message_events(rng, f"w{worker}-{i}", SUBJECTS[i % len(SUBJECTS)], t):
            writers[kind].emit(event)
            written += 1
        if i % 2_000 == 0:
            for writer in writers.values():
                writer.flush()
    for writer in writers.values():
        writer.close()
    return written, time.perf_counter() - started


def _generate_star(args: tuple[int, int, int, str]) -> tuple[int, float]:
    return generate(*args)


def disk_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path)
               for f in files)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=DEFAULT_EVENTS)
    parser.add_argument("--full", action="store_true", help=f"{FULL_EVENTS:,} events")
    parser.add_argument("--workers", type=int, default=2, help="generator processes")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--driver-memory", default="6g")
    parser.add_argument("--keep", default=None, help="write the trace here and keep it")
    args = parser.parse_args()
    events_target = FULL_EVENTS if args.full else args.events
    base = args.keep or tempfile.mkdtemp(prefix="qmq-bench-audit-")
    trace, out = os.path.join(base, "trace"), os.path.join(base, "out")
    for stale in (trace, out):  # a kept directory from an earlier run would be appended to
        shutil.rmtree(stale, ignore_errors=True)
    try:
        started = time.perf_counter()
        with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
            results = pool.map(_generate_star, [(w, args.workers, events_target, trace)
                                                for w in range(args.workers)])
        events = sum(n for n, _ in results)
        gen_s = time.perf_counter() - started
        size = disk_bytes(trace)
        per_process = sum(n / s for n, s in results) / len(results)
        print(f"trace: {events:,} events, {size / 1e6:,.0f} MB ({size / events:.0f} B/event), "
              f"written in {gen_s:.1f} s; TraceWriter {per_process:,.0f} events/s per process "
              f"(trace_event + emit + JSON + write)")
        command = [sys.executable, "-m", "qmq", "--log-level", "warning", "audit",
                   "--trace-dir", trace, "--out", out, "--master", args.master,
                   "--driver-memory", args.driver_memory, "--deadline-ms", str(DEADLINE_MS)]
        started = time.perf_counter()
        proc = subprocess.run(command, capture_output=True, text=True)
        audit_s = time.perf_counter() - started
        progress = [line for line in proc.stderr.splitlines() if line.startswith("[")]
        print("\n".join(progress))
        print(proc.stdout.splitlines()[0] if proc.stdout else proc.stderr[-3000:])
        # No pro-rata goal for smaller runs: JVM start and Spark's per-job costs are fixed.
        print(f"qmq audit ({args.master}, driver {args.driver_memory}): {audit_s:.1f} s for "
              f"{events:,} events = {events / audit_s:,.0f} events/s, exit code "
              f"{proc.returncode}   goal: < {GOAL_FULL_S} s for {FULL_EVENTS:,} (--full); "
              f"load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        return 0 if proc.returncode == 0 else 1
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
