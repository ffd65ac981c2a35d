"""Storage benchmark: SegmentedLog appends and sequential reads against a raw-file baseline.

Run: ``.venv/bin/python -m bench.storage`` (full, about a minute) or ``--quick`` (a few seconds).

Cases, each run 3 times and reported as the median:

- ``async``: ``LogConfig(flush_mode="async")``, ``tick(now_ms)`` with the real monotonic clock
  every 1000 appends (so an fsync at most every ``flush_interval_ms``), a final ``sync()``.
- ``sync``: ``sync()`` after every 100 appends (group commit of 100).
- ``async ... append_many/100``: as ``async`` but ``append_many`` of 100 bodies at a time (what the
  realtime and delay stores do per commit); compared with the same per-record raw baseline.
- ``read``: ``iterate()`` over the log the async case wrote (records/s and MB/s of bodies).

The baseline runs in the same process on the same disk, alternating with the log's runs: a buffered ``f.write`` of the same
framed bytes per record (header + body) with the same fsync pattern, and for reads a plain
1 MiB-chunk read of the same segment files. Each figure prints with its ratio to the baseline
and the goal beside it. Files go to a temp dir under /tmp that is removed at the end. The header
line says whether the log framed records with the C extension (``logstore._framing``) or the
pure-Python fallback.
This is a benchmark, not a test: it asserts nothing and exits 0 whether goals are met or not.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from logstore import LogConfig, SegmentedLog
from logstore.record import FRAMING, HEADER_SIZE_BYTES

RUNS = 3
TICK_EVERY_APPENDS = 1000
SYNC_EVERY_APPENDS = 100
READ_CHUNK_BYTES = 1 << 20
ASYNC_GOAL_APPENDS_PER_S = 300_000
ASYNC_GOAL_RATIO_TO_RAW = 0.5
SYNC_GOAL_APPENDS_PER_S = 100_000


@dataclass(frozen=True)
class Case:
    name: str
    body_size_bytes: int
    appends: int
    mode: str  # "async" or "sync"
    batch_size: int = 1  # > 1: append_many of this many bodies per call instead of append


@dataclass(frozen=True)
class Figure:
    per_s: float  # appends/s or records/s
    mb_per_s: float  # MB/s of bodies (10^6 bytes)


def now_ms() -> int:
    return time.monotonic_ns() // 1_000_000


def run_log_writes(directory: str, case: Case) -> Figure:
    config = LogConfig(flush_mode=case.mode)
    body = b"x" * case.body_size_bytes
    log = SegmentedLog(directory, config)
    append = log.append
    start = time.perf_counter()
    if case.batch_size > 1:
        batch = [body] * case.batch_size
        batches_per_tick = max(1, TICK_EVERY_APPENDS // case.batch_size)
        for i in range(1, case.appends // case.batch_size + 1):
            log.append_many(batch)
            if i % batches_per_tick == 0:
                log.tick(now_ms())
    elif case.mode == "async":
        for i in range(1, case.appends + 1):
            append(body)
            if i % TICK_EVERY_APPENDS == 0:
                log.tick(now_ms())
    else:
        for i in range(1, case.appends + 1):
            append(body)
            if i % SYNC_EVERY_APPENDS == 0:
                log.sync()
    log.sync()
    elapsed_s = time.perf_counter() - start
    log.close()
    return Figure(case.appends / elapsed_s, case.appends * case.body_size_bytes / elapsed_s / 1e6)


def run_raw_writes(directory: str, case: Case) -> Figure:
    framed = b"x" * (HEADER_SIZE_BYTES + case.body_size_bytes)
    interval_ms = LogConfig().flush_interval_ms
    with open(os.path.join(directory, "raw.bin"), "wb") as f:
        write, fd = f.write, f.fileno()
        start = time.perf_counter()
        if case.mode == "async":
            last_sync_ms = now_ms()
            for i in range(1, case.appends + 1):
                write(framed)
                if i % TICK_EVERY_APPENDS == 0:
                    f.flush()
                    if now_ms() - last_sync_ms >= interval_ms:
                        os.fsync(fd)
                        last_sync_ms = now_ms()
        else:
            for i in range(1, case.appends + 1):
                write(framed)
                if i % SYNC_EVERY_APPENDS == 0:
                    f.flush()
                    os.fsync(fd)
        f.flush()
        os.fsync(fd)
        elapsed_s = time.perf_counter() - start
    return Figure(case.appends / elapsed_s, case.appends * case.body_size_bytes / elapsed_s / 1e6)


def run_log_read(directory: str) -> Figure:
    log = SegmentedLog(directory, LogConfig())
    records = body_bytes = 0
    start = time.perf_counter()
    for _offset, body in log.iterate():
        records += 1
        body_bytes += len(body)
    elapsed_s = time.perf_counter() - start
    log.close()
    return Figure(records / elapsed_s, body_bytes / elapsed_s / 1e6)


def run_raw_read(directory: str, body_size_bytes: int) -> Figure:
    file_bytes = 0
    start = time.perf_counter()
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb", buffering=0) as f:
            while chunk := f.read(READ_CHUNK_BYTES):
                file_bytes += len(chunk)
    elapsed_s = time.perf_counter() - start
    records = file_bytes // (HEADER_SIZE_BYTES + body_size_bytes)
    return Figure(records / elapsed_s, records * body_size_bytes / elapsed_s / 1e6)


def median_figure(figures: list[Figure]) -> Figure:
    return Figure(statistics.median(f.per_s for f in figures),
                  statistics.median(f.mb_per_s for f in figures))


def goal_text(case: Case, figure: Figure, ratio: float) -> str:
    if case.mode == "async" and case.body_size_bytes == 100 and case.batch_size == 1:
        met = figure.per_s >= ASYNC_GOAL_APPENDS_PER_S and ratio >= ASYNC_GOAL_RATIO_TO_RAW
        return (f">= {ASYNC_GOAL_APPENDS_PER_S:,}/s and >= {ASYNC_GOAL_RATIO_TO_RAW:.0%} of raw: "
                f"{'met' if met else 'NOT met'}")
    if case.mode == "sync" and case.body_size_bytes == 100:
        met = figure.per_s >= SYNC_GOAL_APPENDS_PER_S
        return (f">= {SYNC_GOAL_APPENDS_PER_S:,}/s with {SYNC_EVERY_APPENDS} per fsync: "
                f"{'met' if met else 'NOT met'}")
    return "(no goal)"


def measure_pair(root: str, case: Case) -> tuple[list[Figure], list[Figure]]:
    """Run the log and the raw baseline alternately, so drift in fsync latency hits both."""
    logs, raws = [], []
    for attempt in range(RUNS):
        for label, run, figures in (("log", run_log_writes, logs), ("raw", run_raw_writes, raws)):
            directory = os.path.join(root, f"{label}-{attempt}")
            os.makedirs(directory)
            figures.append(run(directory, case))
            shutil.rmtree(directory)
    return logs, raws


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tenth of the appends")
    args = parser.parse_args(argv)
    scale = 10 if args.quick else 1
    cases = [
        Case("async 100 B", 100, 500_000 // scale, "async"),
        Case("async 1 KiB", 1024, 100_000 // scale, "async"),
        Case("async 100 B, many/100", 100, 500_000 // scale, "async", batch_size=100),
        Case("sync 100 B, sync/100", 100, 200_000 // scale, "sync"),
        Case("sync 1 KiB, sync/100", 1024, 50_000 // scale, "sync"),
    ]
    root = tempfile.mkdtemp(prefix="pyqmq-bench-storage-", dir="/tmp")
    print(f"bench.storage: {RUNS} runs per case, median shown; files under {root}; "
          f"{os.cpu_count()} CPUs; record framing in {FRAMING}{' (quick)' if args.quick else ''}")
    header = (f"{'case':<22} {'appends':>8} {'log /s':>11} {'log MB/s':>9} {'raw /s':>11} "
              f"{'raw MB/s':>9} {'ratio':>6}  goal")
    try:
        print(header)
        for case in cases:
            logs, raws = measure_pair(root, case)
            log_figure, raw_figure = median_figure(logs), median_figure(raws)
            ratio = log_figure.per_s / raw_figure.per_s
            print(f"{case.name:<22} {case.appends:>8,} {log_figure.per_s:>11,.0f} "
                  f"{log_figure.mb_per_s:>9.1f} {raw_figure.per_s:>11,.0f} "
                  f"{raw_figure.mb_per_s:>9.1f} {ratio:>6.2f}  {goal_text(case, log_figure, ratio)}")

        print()
        print(f"{'read (iterate)':<22} {'records':>8} {'log rec/s':>11} {'log MB/s':>9} "
              f"{'raw rec/s':>11} {'raw MB/s':>9} {'ratio':>6}")
        for case in (c for c in cases if c.mode == "async" and c.batch_size == 1):
            reads, raws = [], []
            for attempt in range(RUNS):
                directory = os.path.join(root, f"read-{attempt}")
                os.makedirs(directory)
                run_log_writes(directory, case)
                reads.append(run_log_read(directory))
                raws.append(run_raw_read(directory, case.body_size_bytes))
                shutil.rmtree(directory)
            log_figure, raw_figure = median_figure(reads), median_figure(raws)
            print(f"{case.body_size_bytes:>6} B bodies{'':<9} {case.appends:>8,} "
                  f"{log_figure.per_s:>11,.0f} {log_figure.mb_per_s:>9.1f} "
                  f"{raw_figure.per_s:>11,.0f} {raw_figure.mb_per_s:>9.1f} "
                  f"{log_figure.per_s / raw_figure.per_s:>6.2f}")
        print("(reads come from the page cache: the files were just written)")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
