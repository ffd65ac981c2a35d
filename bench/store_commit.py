"""The store thread's CPU per group commit of a few messages (issue 18, "CPU per message at
2,000 msg/s"): what ``Sends._append_and_commit_io`` asks of the message store per commit,
with no event loop, no network and (on tmpfs) no disk.

    python -m bench.store_commit                      # 3 messages per commit, /dev/shm
    python -m bench.store_commit --per-commit 1 --commits 50000
    python -m bench.store_commit --profile            # + function calls per commit (cProfile)
    python -m bench.store_commit --cold               # caches evicted before each commit
    python -m bench.store_commit --dedup-ids-max 1000 # the dedup index full from the warm-up on

One ``MessageStore`` (flush sync, the broker's defaults) in a temp dir under /dev/shm (or
``--dir``), its fsync observed by a metric as ``qmq up`` observes it (``RealtimeMetrics``),
then ``--commits`` commits of ``--per-commit`` messages of one subject, each: ``append_commit``
of the columns, ``copy_end``. Printed: CPU-us per commit and per
message (``time.process_time``, this process has one thread) for each of ``--runs`` runs, and
with ``--profile`` the calls per commit by function (the heaviest first). On tmpfs an fsync
is a system call that returns at once: what is left is the Python path, the part a change to
the store's code moves. CPU time survives a loaded machine better than wall time; still
compare before/after in one sitting, alternating, and state the load.

``--cold`` copies 8 MiB and walks 30,000 small objects before each commit, so the commit finds
its code and data out of the CPU caches, as the store thread of a ``qmq up`` at 2,000 msg/s
does (the event loop runs between two commits): there, 3 messages per commit cost about 220
CPU-us against about 55 hot, near what ``bench.latency_steps`` shows for the store thread.
Then only the commit's own CPU is counted (``time.thread_time`` around it), not the eviction.

``--dedup-ids-max`` below the warm-up's messages (2,000 commits) runs every timed commit with a
full dedup index, as a broker's after ``dedup_ids_max`` (1,000,000) ids, ~8 minutes at 2,000
msg/s: each commit then also evicts as many ids as it adds (``DedupIndex._evict``).
"""

from __future__ import annotations

import argparse
import dataclasses
import cProfile
import os
import pstats
import shutil
import tempfile
import time

from realtime.metrics import RealtimeMetrics
from realtime.storage import MessageStore, StoreConfig

SUBJECT = "rt.commit"
PAYLOAD_BYTES = 120  # about a small SDK message's encoded size
WARMUP_COMMITS = 2_000
EVICT_BYTES = 8 << 20  # copied before each commit with --cold: more than this host's caches
EVICT_OBJECTS = 30_000  # small objects walked with --cold (Python's own data evicted too)


def _commit(store: MessageStore, ids: list[str], payloads: list[bytes], now_ms: int) -> None:
    count = len(ids)
    sequences = store.append_commit([SUBJECT] * count, ids, [()] * count, now_ms, payloads)
    assert len(sequences) == count and None not in sequences
    store.copy_end()


def _cold_commits(store: MessageStore, id_batches: list[list[str]], payloads: list[bytes],
                  now_ms: int) -> float:
    """The CPU seconds of the commits alone, each after the caches were evicted."""
    scratch = bytearray(EVICT_BYTES)
    objects = [str(i) * 3 for i in range(EVICT_OBJECTS)]
    cpu_s = 0.0
    for ids in id_batches:
        scratch[:] = scratch
        sum(map(len, objects))
        now_ms += 1
        started = time.thread_time()
        _commit(store, ids, payloads, now_ms)
        cpu_s += time.thread_time() - started
    return cpu_s


def run(directory: str, per_commit: int, commits: int, profile: bool,
        cold: bool = False, dedup_ids_max: int | None = None) -> tuple[float, dict]:
    """CPU seconds of ``commits`` commits on a fresh store in ``directory`` (and, profiled,
    the calls by function); ``cold``: each commit's own, after evicting the caches."""
    metrics = RealtimeMetrics("bench")
    config = StoreConfig()
    if dedup_ids_max is not None:
        config = dataclasses.replace(config, dedup_ids_max=dedup_ids_max)
    store = MessageStore(directory, config, now_ms=1)
    store.observe_fsync(metrics.fsync_seconds.observe)
    payloads = [os.urandom(PAYLOAD_BYTES) for _ in range(per_commit)]
    now_ms = 1_700_000_000_000
    serial = 0

    def batch_ids() -> list[str]:
        nonlocal serial
        serial += per_commit
        return [f"m-{serial - per_commit + i:012d}" for i in range(per_commit)]

    try:
        for _ in range(WARMUP_COMMITS):
            _commit(store, batch_ids(), payloads, now_ms)
        id_batches = [batch_ids() for _ in range(commits)]  # made before the clock starts
        profiler = cProfile.Profile() if profile else None
        if cold:
            cpu_s = _cold_commits(store, id_batches, payloads, now_ms)
        else:
            started = time.process_time()
            if profiler is not None:
                profiler.enable()
            for ids in id_batches:
                now_ms += 1
                _commit(store, ids, payloads, now_ms)
            if profiler is not None:
                profiler.disable()
            cpu_s = time.process_time() - started
    finally:
        store.close()
    calls = {}
    if profiler is not None:
        stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
        for (path, line, name), (_cc, ncalls, *_rest) in stats.items():
            calls[f"{os.path.basename(path)}:{line}({name})"] = ncalls
    return cpu_s, calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-commit", type=int, default=3, help="messages per commit")
    parser.add_argument("--commits", type=int, default=30_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", default="/dev/shm", help="parent of the temp data dir")
    parser.add_argument("--profile", action="store_true", help="one more run under cProfile")
    parser.add_argument("--cold", action="store_true",
                        help="evict the CPU caches before each commit (see the module doc)")
    parser.add_argument("--dedup-ids-max", type=int, default=None,
                        help="the store's dedup_ids_max (default: StoreConfig's)")
    args = parser.parse_args(argv)
    print(f"load {os.getloadavg()[0]:.1f}; {args.per_commit} messages per commit, "
          f"{args.commits} commits{', caches evicted before each' if args.cold else ''}"
          f"{f', dedup_ids_max {args.dedup_ids_max}' if args.dedup_ids_max else ''}, "
          f"data dir under {args.dir}")
    for index in range(args.runs + (1 if args.profile else 0)):
        profiled = index == args.runs
        directory = tempfile.mkdtemp(prefix="qmq-store-commit-", dir=args.dir)
        try:
            cpu_s, calls = run(directory, args.per_commit, args.commits, profiled,
                               args.cold and not profiled, args.dedup_ids_max)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        if not profiled:
            per_commit_us = cpu_s / args.commits * 1e6
            print(f"run {index + 1}: {per_commit_us:.1f} CPU-us per commit, "
                  f"{per_commit_us / args.per_commit:.1f} per message")
            continue
        total = sum(calls.values()) / args.commits
        print(f"profiled: {total:.1f} function calls per commit; the heaviest:")
        for name, count in sorted(calls.items(), key=lambda item: -item[1])[:25]:
            print(f"  {count / args.commits:6.2f}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
