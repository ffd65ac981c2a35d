"""Delay-store capacity benchmark: many pending messages on disk, little memory, fast restart.

Appends N delayed messages of 256 B spread uniformly over 40 days (commit every 1000, sync flush),
reports appends/s and disk bytes, closes, then reopens in a fresh process and reports the reopen
time and that process's peak RSS after reopen + pending_stats + loading the first two buckets.
A second child then appends just under one checkpoint interval and is killed (os._exit, no
close), and a third reopens after that crash: the worst-case replay.

    python bench/delay_capacity.py --quick   # 100k messages
    python bench/delay_capacity.py           # 1M
    python bench/delay_capacity.py --full    # 10M (about 3 GB of disk)

Goals printed beside the figures (docs/DESIGN.md section 14): 10 M pending in <= 256 MB RSS,
restart <= 15 s, >= 40,000 delayed sends/s. Time here is the benchmark's own (perf_counter);
the store itself is given a fixed fake now_ms.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from delayserver.storage import DelayStore, DelayStoreConfig  # noqa: E402

NOW_MS = 1_700_000_000_000
SPREAD_MS = 40 * 86_400_000
PAYLOAD_BYTES = 256
COMMIT_EVERY = 1_000
SUBJECTS = [f"bench.subject.{i}" for i in range(16)]
SEED = 20240601
GOAL_RSS_MB = 256
GOAL_RESTART_S = 15
GOAL_SENDS_PER_S = 40_000
FULL_PENDING = 10_000_000


def rss_mb() -> float:
    """Peak RSS of this process in MB (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cpu_seconds() -> float:
    """User + system CPU time of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def disk_bytes(path: str) -> tuple[int, int, int]:
    """(allocated bytes, apparent bytes, files) under ``path``."""
    allocated = apparent = files = 0
    for root, _dirs, names in os.walk(path):
        for name in names:
            st = os.stat(os.path.join(root, name))
            allocated += st.st_blocks * 512
            apparent += st.st_size
            files += 1
    return allocated, apparent, files


def append_messages(store: DelayStore, start: int, count: int, rng: random.Random,
                    report_every: int = 0) -> list[tuple[int, float]]:
    """Append and commit ``count`` messages; returns (messages done, seconds) progress marks."""
    payload = bytes(rng.getrandbits(8) for _ in range(PAYLOAD_BYTES))
    marks = []
    began = time.perf_counter()
    append, commit = store.append, store.commit
    randrange = rng.randrange
    for i in range(start, start + count):
        append(f"msg-{i:010d}", SUBJECTS[i % len(SUBJECTS)], NOW_MS + randrange(SPREAD_MS),
               payload)
        if (i + 1) % COMMIT_EVERY == 0:
            commit()
            if report_every and (i + 1 - start) % report_every == 0:
                marks.append((i + 1 - start, time.perf_counter() - began))
    commit()
    marks.append((count, time.perf_counter() - began))
    return marks


def child_reopen(data_dir: str) -> None:
    """Reopen, read the stats, load the first two buckets; print JSON figures."""
    began = time.perf_counter()
    store = DelayStore(data_dir, DelayStoreConfig(), now_ms=NOW_MS)
    opened = time.perf_counter()
    stats = store.pending_stats()
    buckets = store.buckets_with_pending(store.bucket_of(NOW_MS), NOW_MS + SPREAD_MS)[:2]
    loaded = sum(len(store.load_bucket(bucket)) for bucket in buckets)
    done = time.perf_counter()
    report = store.recovery
    print(json.dumps({
        "reopen_s": opened - began,
        "reopen_stats_load_s": done - began,
        "pending_total": stats.total,
        "hours": len(stats.per_hour),
        "subjects": len(stats.per_subject),
        "entries_loaded": loaded,
        "records_replayed": report.records_replayed,
        "peak_rss_mb": rss_mb(),
    }))
    store.close()


def child_crash(data_dir: str, start: int, count: int) -> None:
    """Append ``count`` more messages and die without closing (no final checkpoint)."""
    store = DelayStore(data_dir, DelayStoreConfig(), now_ms=NOW_MS)
    append_messages(store, start, count, random.Random(SEED + 1))
    sys.stdout.flush()
    os._exit(0)


def run_child(*args: str) -> dict:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), *args], check=True,
                         capture_output=True, text=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="100k messages")
    size.add_argument("--full", action="store_true", help="10M messages")
    parser.add_argument("--count", type=int, help="messages (overrides --quick/--full)")
    parser.add_argument("--dir", help="parent directory for the data (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the data directory")
    parser.add_argument("--child-reopen", help=argparse.SUPPRESS)
    parser.add_argument("--child-crash", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_reopen:
        child_reopen(args.child_reopen)
        return
    if args.child_crash:
        child_crash(args.child_crash[0], int(args.child_crash[1]), int(args.child_crash[2]))
        return

    count = args.count or (100_000 if args.quick else FULL_PENDING if args.full else 1_000_000)
    root = tempfile.mkdtemp(prefix="delay-capacity-", dir=args.dir)
    data_dir = os.path.join(root, "data")
    try:
        print(f"delay capacity: {count:,} messages of {PAYLOAD_BYTES} B over 40 days, commit "
              f"every {COMMIT_EVERY}, flush=sync, data in {data_dir}")
        store = DelayStore(data_dir, DelayStoreConfig(), now_ms=NOW_MS)
        cpu_before = cpu_seconds()
        marks = append_messages(store, 0, count, random.Random(SEED),
                                report_every=max(COMMIT_EVERY, count // 10))
        cpu_s = cpu_seconds() - cpu_before
        began_close = time.perf_counter()
        store.close()
        close_s = time.perf_counter() - began_close
        total_s = marks[-1][1]
        rate = count / total_s
        half = [mark for mark in marks if mark[0] <= count // 2]
        half_from = half[-1] if half else (0, 0.0)
        second_half_rate = (count - half_from[0]) / (total_s - half_from[1])
        allocated, apparent, files = disk_bytes(data_dir)
        print(f"  appends/s (append + group commit, sync): {rate:,.0f}   "
              f"(goal >= {GOAL_SENDS_PER_S:,}); second half: {second_half_rate:,.0f}/s (every bucket "
              f"file exists by then)")
        print(f"  appends per CPU-second of the writer (user + sys, insensitive to other load): "
              f"{count / cpu_s:,.0f}; load average at the end: {os.getloadavg()[0]:.2f}")
        print(f"  writer peak RSS: {rss_mb():.0f} MB; close (final checkpoint): {close_s:.2f} s")
        print(f"  disk: {allocated / 1e6:,.0f} MB allocated, {apparent / 1e6:,.0f} MB apparent, "
              f"{files:,} files ({apparent / count:.0f} B/message)")

        reopen = run_child("--child-reopen", data_dir)
        print(f"  reopen after close: {reopen['reopen_s']:.2f} s; + pending_stats + 2 buckets "
              f"({reopen['entries_loaded']} entries): {reopen['reopen_stats_load_s']:.2f} s; "
              f"peak RSS {reopen['peak_rss_mb']:.0f} MB; pending {reopen['pending_total']:,} in "
              f"{reopen['hours']} hours")

        # Just under one checkpoint interval of ~318-byte framed records: the longest replay.
        crash_count = (DelayStoreConfig().checkpoint_every_bytes // 320) - COMMIT_EVERY
        run_child("--child-crash", data_dir, str(count), str(crash_count))
        crashed = run_child("--child-reopen", data_dir)
        print(f"  reopen after kill (no final checkpoint, {crashed['records_replayed']:,} records "
              f"replayed): {crashed['reopen_s']:.2f} s; + stats + 2 buckets "
              f"{crashed['reopen_stats_load_s']:.2f} s; peak RSS {crashed['peak_rss_mb']:.0f} MB; "
              f"pending {crashed['pending_total']:,}")
        worst_rss = max(reopen["peak_rss_mb"], crashed["peak_rss_mb"])
        worst_restart = max(reopen["reopen_stats_load_s"], crashed["reopen_stats_load_s"])
        scale = "" if count >= FULL_PENDING else f" (measured at {count:,}, goal is for 10M)"
        print(f"  goal: 10M pending in <= {GOAL_RSS_MB} MB RSS -> {worst_rss:.0f} MB{scale}; "
              f"restart <= {GOAL_RESTART_S} s -> {worst_restart:.2f} s{scale}")
        assert reopen["pending_total"] == count, reopen
        assert crashed["pending_total"] == count + crash_count, crashed
    finally:
        if args.keep:
            print(f"  kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
