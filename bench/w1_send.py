"""The send side of the peers benchmark's W1 alone, with the CPU each side spends per send:
32 ``send(deliver_at=...)`` calls in flight from one process against one fresh ``qmq up``
(flush sync by default), every message due an hour ahead so nothing is dispatched meanwhile
(``--delays LOW-HIGH``: each due at its send time plus a delay drawn uniformly from [LOW, HIGH]
ms, with the peers benchmark's seed, as W1 does: the due messages enter the delay server's
window and are dispatched to the broker during the run). ``--slave``: ``qmq up --replicas 2``,
each group with one ``sync`` slave in the same process, the run started once both are in sync.

    python -m bench.w1_send                        # 10,000 sends, 3 runs on one server
    python -m bench.w1_send --messages 20000 --runs 5 --in-flight 64
    python -m bench.w1_send --slave                # each group with one sync slave
    python -m bench.w1_send --delays 1000-20000    # W1's delays: due during the run
    python -m bench.w1_send --split-sends-min 8    # the Producer's overlap of two batches
    python -m bench.w1_send --runs 1 --profile F   # qmq up's event loop under cProfile, to F

Printed per run: sends/s (first send to last confirmation), the server's CPU per send (user +
system of the whole ``qmq up`` process, MetaServer included, from /proc) and the client's
(this process, ``time.process_time``). With 32 in flight the client waits while the server
works and the other way round, so the rate follows the sum of the two CPU figures plus the
fsync: compare before/after by those figures, which a loaded machine disturbs less than the
rate, and state the load average (printed with each run). Before the runs, the idle server's
CPU in ms per second (``--idle-s``): what a run's CPU per send carries at a low rate. After
each run, the server's CPU per send by OS thread name ("main" is the event loop of every server
in the process; a master's and its slave's store threads share a name and are summed), and the
delay server's group commits during the run from its /metrics (``qmq_delay_fsync_seconds``):
how many, and the mean fsync time. With one batch of 32 per commit the rate cannot pass
32 / (fsync time + both sides' CPU per batch), and on a shared host the fsync time swings from
~0.1 to several ms within minutes: read the rate beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import sys
import time
import urllib.request
from typing import Any

from bench._cluster import process_cpu_s, thread_cpu_s
from bench.path_cpu import qmq_up
from bench.peers.servers import wait_in_sync
from bench.peers.workloads import DELAY_SEED  # --delays are drawn as W1's are

SUBJECT = "bench.w1"
BODY = b"x" * 256  # the peers benchmark's message size
DUE_AHEAD_MS = 3_600_000  # every message due this far ahead: none is dispatched during a run
WARM_UP_SENDS = 200


async def _one_run(url: str, pid: int, count: int, in_flight: int,
                   delays: tuple[int, int] | None = None, split_sends_min: int = 0,
                   metrics_url: str | None = None) -> dict[str, Any]:
    from sdk import Producer

    producer = Producer(url, split_sends_min=split_sends_min)
    rng = random.Random(DELAY_SEED)
    ahead = ([rng.randint(*delays) for _ in range(count)] if delays is not None
             else [DUE_AHEAD_MS] * count)

    async def one(seq: int = 0) -> None:
        await producer.send(SUBJECT, BODY, deliver_at=time.time_ns() // 1_000_000 + ahead[seq])

    try:
        for _ in range(WARM_UP_SENDS):
            await one()
        left = iter(range(count))

        async def sender() -> None:
            for seq in left:
                await one(seq)

        # Read before the timed part (a blocking HTTP get on a quiet loop).
        fsyncs_before = fsync_totals(metrics_url) if metrics_url else (0.0, 0.0)
        server_cpu_s, client_cpu_s = process_cpu_s(pid), time.process_time()
        threads_before = thread_cpu_s(pid)
        start = time.monotonic()
        await asyncio.gather(*(sender() for _ in range(in_flight)))
        elapsed_s = time.monotonic() - start
        server_cpu_s = process_cpu_s(pid) - server_cpu_s
        client_cpu_s = time.process_time() - client_cpu_s
        threads = thread_cpu_s(pid)
        fsyncs_after = fsync_totals(metrics_url) if metrics_url else (0.0, 0.0)
    finally:
        await producer.close()
    commits = fsyncs_after[1] - fsyncs_before[1]  # the delay log's group commits in the run
    # By OS thread name (a master's and its slave's threads of one name are summed).
    by_thread = {name: (cpu_s - threads_before.get(name, 0.0)) / count * 1e6
                 for name, cpu_s in threads.items()}
    return {"sends_per_s": count / elapsed_s, "server_cpu_us": server_cpu_s / count * 1e6,
            "client_cpu_us": client_cpu_s / count * 1e6, "load_1min": os.getloadavg()[0],
            "thread_cpu_us": by_thread, "commits": commits,
            "fsync_us": (fsyncs_after[0] - fsyncs_before[0]) / commits * 1e6 if commits else 0.0}


_DELAY_METRICS = re.compile(r"(http://\S+/metrics)\s+\(delay\)")
_FSYNC_SERIES = re.compile(r"^qmq_delay_fsync_seconds_(sum|count)(?:\{[^}]*\})? (\S+)$", re.M)


def delay_metrics_url(lines: list[str]) -> str | None:
    """The delay server's /metrics URL from what ``qmq up`` printed (None: not found)."""
    for line in lines:
        match = _DELAY_METRICS.search(line)
        if match:
            return match.group(1)
    return None


def fsync_totals(metrics_url: str) -> tuple[float, float]:
    """(seconds, commits) of the delay log's fsyncs so far, summed over the delay groups."""
    with urllib.request.urlopen(metrics_url, timeout=10) as answer:
        text = answer.read().decode()
    totals = {"sum": 0.0, "count": 0.0}
    for kind, value in _FSYNC_SERIES.findall(text):
        totals[kind] += float(value)
    return totals["sum"], totals["count"]


def _delays(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    try:
        bounds = int(low), int(high)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--delays wants LOW-HIGH in ms, got {text!r}")
    if not 0 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"--delays {text!r}: want 0 <= LOW <= HIGH")
    return bounds


def main(argv: list[str] | None = None) -> int:
    """Run the measurement; prints one line per run."""
    parser = argparse.ArgumentParser(prog="python -m bench.w1_send", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--in-flight", type=int, default=32)
    parser.add_argument("--flush", choices=("sync", "async"), default="sync")
    parser.add_argument("--split-sends-min", type=int, default=0,
                        help="the Producer's split_sends_min (the overlap; 0: off)")
    parser.add_argument("--slave", action="store_true",
                        help="qmq up --replicas 2: each group with one sync slave in the process")
    parser.add_argument("--idle-s", type=float, default=3.0,
                        help="first measure the idle server's CPU for this long (0: not)")
    parser.add_argument("--delays", type=_delays, default=None, metavar="LOW-HIGH",
                        help="each due LOW..HIGH ms after its send (W1: 1000-20000); "
                             "default: all an hour ahead")
    parser.add_argument("--profile", default=None, metavar="FILE",
                        help="run qmq up under cProfile (its event loop's thread), stats to FILE")
    args = parser.parse_args(argv)
    with qmq_up("qmq-w1-send-", args.flush, ["--replicas", "2"] if args.slave else [],
                interpreter_args=(["-m", "cProfile", "-o", os.path.abspath(args.profile)]
                                  if args.profile else None)) as server:
        if args.slave:
            wait_in_sync(f"http://{server.address}")
        due = (f"due {args.delays[0]}-{args.delays[1]} ms ahead" if args.delays
               else "due an hour ahead")
        print(f"qmq up (flush {args.flush}{', one sync slave' if args.slave else ''}), "
              f"{args.messages} delayed sends {due}, {args.in_flight} in flight:", flush=True)
        if args.idle_s > 0:
            idle_cpu_s = process_cpu_s(server.pid)
            time.sleep(args.idle_s)
            idle_cpu_s = process_cpu_s(server.pid) - idle_cpu_s
            print(f"  idle: {idle_cpu_s / args.idle_s * 1000:.0f} ms/s of server CPU over "
                  f"{args.idle_s:g} s; load {os.getloadavg()[0]:.2f}", flush=True)
        metrics_url = delay_metrics_url(server.lines)
        for run in range(args.runs):
            figures = asyncio.run(_one_run(f"http://{server.address}", server.pid,
                                           args.messages, args.in_flight, args.delays,
                                           args.split_sends_min, metrics_url))
            print(f"  run {run + 1}: {figures['sends_per_s']:,.0f} sends/s, server "
                  f"{figures['server_cpu_us']:.0f} us/send, client "
                  f"{figures['client_cpu_us']:.0f} us/send; load "
                  f"{figures['load_1min']:.2f}", flush=True)
            busiest = sorted(figures["thread_cpu_us"].items(), key=lambda item: -item[1])
            print("    server CPU by thread, us/send: " + ", ".join(
                f"{name} {us:.0f}" for name, us in busiest if us >= 0.5), flush=True)
            if figures["commits"]:
                print(f"    delay commits: {figures['commits']:,.0f} "
                      f"({args.messages / figures['commits']:.1f} sends each), fsync mean "
                      f"{figures['fsync_us']:,.0f} us", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
