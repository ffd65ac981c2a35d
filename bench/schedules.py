"""Schedules benchmark: N recurring schedules all firing every minute (cron ``* * * * *``), with
real processes on loopback: how late each occurrence arrives, and what the MetaServer and the
delay server spend on it.

Run: ``.venv/bin/python -m bench.schedules`` (100,000 schedules, 3 measured minutes, about 6
minutes in all) or ``--quick`` (10,000 schedules, 1 minute).

Processes (``python -m qmq``, 127.0.0.1 port 0, temp dir removed at the end, as
``bench/delay.py`` starts them, without trace): a MetaServer on SQLite, a realtime broker
(``--flush sync``) and a delay server (``--flush sync``, 1-minute buckets). The
schedules are written straight into the MetaServer's database (the API's create path is not what
is measured; a sample of ``--api-creates`` schedules goes through the API to report its rate).
One SDK ``qmq.Consumer`` in a child process records, for every occurrence, its receive wall time
minus its fire time (property ``qmq-fire-at-ms``).

Reported, over the measured minutes (those after the first full minute, whose occurrences were
all handed over by the runner one minute ahead, as in steady state):

- fire lateness p50 / p99 / max (receive time minus fire time) and the count of early ones,
  beside the delay server's own lateness histogram (dispatch confirmed minus due): all
  occurrences of a minute fall due in the same second, so the consumer's pace shows in the first;
- occurrences received per minute vs expected, and duplicates;
- CPU seconds per minute of the MetaServer, the delay server and the broker (utime + stime from
  /proc), and the load average and CPU pressure meanwhile (the machine may be shared).

A benchmark, not a test: it asserts nothing and every wait is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any

from bench._cluster import cpu_model, percentile, process_cpu_s
from bench.delay import DelayCluster, Pressure

MINUTE_MS = 60_000
INSERT_CHUNK = 5_000
CONSUMER_READY_TIMEOUT_S = 30.0
SETTLE_S = 20.0  # after the last measured minute, the longest wait for its occurrences


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


def cpu_of(cluster: DelayCluster) -> dict[str, float]:
    """CPU seconds used so far by each server of the cluster."""
    return {s.name: process_cpu_s(s.pid) for s in cluster.servers}


async def insert_schedules(db_url: str, count: int, now_ms: int) -> float:
    """Write ``count`` active every-minute schedules into the database; returns the seconds."""
    from sqlalchemy import insert
    from sqlalchemy.ext.asyncio import create_async_engine

    from metaserver.models import Schedule

    started = time.monotonic()
    engine = create_async_engine(db_url)
    try:
        for first in range(0, count, INSERT_CHUNK):
            rows = [dict(name=f"bench-{i:07d}", app="bench", subject="ticks", body=b"tick",
                         tags=[], properties={}, kind="cron", cron="* * * * *", every_ms=None,
                         at_ms=None, tz="UTC", start_ms=now_ms, end_ms=None, misfire="skip",
                         state="active", created_at_ms=now_ms, updated_at_ms=now_ms,
                         after_ms=now_ms - 1, sent_count=0, skipped_count=0, action_ms=now_ms)
                    for i in range(first, min(count, first + INSERT_CHUNK))]
            async with engine.begin() as connection:
                await connection.execute(insert(Schedule), rows)
    finally:
        await engine.dispose()
    return time.monotonic() - started


async def api_creates(meta_url: str, count: int) -> float:
    """Create ``count`` schedules through the API, 32 at a time; returns creates per second."""
    import qmq

    started = time.monotonic()
    async with qmq.Schedules(meta_url) as schedules:
        semaphore = asyncio.Semaphore(32)

        async def one(i: int) -> None:
            async with semaphore:
                await schedules.create(f"api-{i:06d}", "api.ticks", "t", cron="0 0 1 1 *")

        await asyncio.gather(*(one(i) for i in range(count)))
    return count / (time.monotonic() - started)


async def _consume(meta_url: str, out_path: str, until_ms: int) -> None:
    """Child process: record (fire ms, receive ms, id) of every occurrence until ``until_ms``."""
    import qmq

    with open(out_path, "w", encoding="ascii") as out:
        async with qmq.Consumer(meta_url, group="bench", start="earliest",
                                pull_batch=256) as consumer:
            print("ready", flush=True)
            stream = consumer.subscribe("ticks").__aiter__()
            while wall_ms() < until_ms:
                try:
                    msg = await asyncio.wait_for(stream.__anext__(), 1.0)
                except asyncio.TimeoutError:
                    continue
                out.write(f"{msg.properties['qmq-fire-at-ms']} {wall_ms()} {msg.id}\n")
                await msg.ack()


def start_consumer(meta_url: str, out_path: str, until_ms: int) -> subprocess.Popen[str]:
    process = subprocess.Popen([sys.executable, "-m", "bench.schedules", "--consumer", meta_url,
                                out_path, str(until_ms)], stdout=subprocess.PIPE, text=True,
                               cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert process.stdout is not None
    deadline = time.monotonic() + CONSUMER_READY_TIMEOUT_S
    while time.monotonic() < deadline and process.stdout.readline().strip() != "ready":
        pass
    return process


def analyse(path: str, first_ms: int, last_ms: int, count: int) -> dict[str, Any]:
    """Lateness and counts of the occurrences fired in [first_ms, last_ms]."""
    lateness: list[int] = []
    seen: set[str] = set()
    duplicates = 0
    per_minute: dict[int, int] = {}
    with open(path, encoding="ascii") as f:
        for line in f:
            fire, at, message_id = line.split()
            fire_ms = int(fire)
            if not first_ms <= fire_ms <= last_ms:
                continue
            if message_id in seen:
                duplicates += 1
                continue
            seen.add(message_id)
            lateness.append(int(at) - fire_ms)
            per_minute[fire_ms] = per_minute.get(fire_ms, 0) + 1
    lateness.sort()
    minutes = (last_ms - first_ms) // MINUTE_MS + 1
    return {"received": len(lateness), "expected": count * minutes, "duplicates": duplicates,
            "per_minute": [per_minute.get(first_ms + i * MINUTE_MS, 0) for i in range(minutes)],
            "p50_ms": percentile(lateness, 0.5), "p99_ms": percentile(lateness, 0.99),
            "max_ms": lateness[-1] if lateness else float("nan"),
            "early": sum(1 for value in lateness if value < 0)}


async def run(args: argparse.Namespace) -> None:
    print(f"bench.schedules {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC; {cpu_model()}, "
          f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}; {args.schedules:,} "
          f"schedules every minute, {args.minutes} measured minute(s)", flush=True)
    cluster = DelayCluster(trace=False)
    db_url = f"sqlite+aiosqlite:///{os.path.join(cluster.directory, 'meta.db')}"
    out_path = os.path.join(cluster.directory, "arrivals.txt")
    consumer = None
    try:
        if args.api_creates:
            rate = await api_creates(cluster.meta_url, args.api_creates)
            print(f"  API creates: {args.api_creates:,} at {rate:,.0f}/s (32 in flight)")
        now = wall_ms()
        seconds = await insert_schedules(db_url, args.schedules, now)
        print(f"  {args.schedules:,} schedules written to the database in {seconds:.1f} s",
              flush=True)
        # Measured: the minutes starting with the second full minute from now.
        first_ms = (now // MINUTE_MS + 2) * MINUTE_MS
        last_ms = first_ms + (args.minutes - 1) * MINUTE_MS
        consumer = start_consumer(cluster.meta_url, out_path, last_ms + int(SETTLE_S * 1000))
        while wall_ms() < first_ms - 1_000:
            await asyncio.sleep(0.5)
        cpu_before, pressure, load_before = cpu_of(cluster), Pressure(), os.getloadavg()
        window_start = time.monotonic()
        while wall_ms() < last_ms + MINUTE_MS - 1_000:
            await asyncio.sleep(0.5)
        window_s = time.monotonic() - window_start
        cpu_after, pressure_share = cpu_of(cluster), pressure.share()
        consumer.wait(timeout=SETTLE_S + 60)
        result = analyse(out_path, first_ms, last_ms, args.schedules)
        print(f"  occurrences fired in the measured minutes: {result['received']:,} received of "
              f"{result['expected']:,} (per minute {result['per_minute']}), duplicates "
              f"{result['duplicates']}, early {result['early']}")
        print(f"  fire lateness p50 {result['p50_ms']:.0f} ms, p99 {result['p99_ms']:.0f} ms, "
              f"max {result['max_ms']:.0f} ms (at the consumer)")
        stats = cluster.admin("delay")["delay"][0]["stats"]
        print(f"  the delay server's own view (dispatch confirmed minus due, whole run): p50 <= "
              f"{stats['lateness_ms_p50_le']} ms, p99 <= {stats['lateness_ms_p99_le']} ms, max "
              f"{stats['lateness_ms_max']} ms over {stats['dispatched']:,} dispatched")
        minutes = window_s / 60
        for name in ("metaserver", "delay", "realtime"):
            used = cpu_after[name] - cpu_before[name]
            print(f"  CPU {name:<10} {used / minutes:6.1f} s per minute "
                  f"({100 * used / window_s:5.1f}% of one core)")
        print(f"  CPU pressure meanwhile: some task waited for a CPU {100 * pressure_share:.0f}% "
              "of the time")
        print(f"  load average: {load_before[0]:.2f} at the start of the window, "
              f"{os.getloadavg()[0]:.2f} at its end")
    finally:
        if consumer is not None and consumer.poll() is None:
            consumer.kill()
            consumer.wait()
        cluster.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--consumer"]:
        asyncio.run(_consume(argv[1], argv[2], int(argv[3])))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", type=int, default=100_000)
    parser.add_argument("--minutes", type=int, default=3, help="measured minutes")
    parser.add_argument("--quick", action="store_true", help="10,000 schedules, 1 minute")
    parser.add_argument("--api-creates", type=int, default=1_000,
                        help="schedules created through the API first, for its rate")
    args = parser.parse_args(argv)
    if args.quick:
        args.schedules, args.minutes, args.api_creates = 10_000, 1, 200
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
