"""Outbox benchmark: relay throughput from PostgreSQL to the realtime broker.

Run: ``.venv/bin/python -m bench.outbox`` (100,000 messages) or ``--quick`` (20,000). ``--db
postgresql://...`` uses that database; by default a throwaway PostgreSQL 15 cluster is started
(``tests/pg.py``: initdb in a temp dir as the ``postgres`` user, 127.0.0.1, removed at the end).

Processes: a MetaServer (SQLite) and a realtime broker (``--flush sync``), ``python -m qmq`` on
127.0.0.1 port 0, and one ``qmq outbox relay --db URL`` process. First the application side
writes N outbox rows with ``outbox.send`` in transactions of ``--per-transaction`` (1,000) rows
(256-byte bodies, one subject) and the rate is reported; then the relay is started and the time
from its "holds the lock" line until the table is empty (every row sent, confirmed stored by the
broker and deleted) gives the relay throughput. Goal: >= 10,000 msg/s (procrastinate enqueued
about 1,000 jobs/s on this machine). The relay's and the broker's CPU, and the load average, are
printed beside it (the machine may be shared).

A benchmark, not a test: it asserts nothing and every wait is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

from bench._cluster import Cluster, cpu_model, process_cpu_s
from bench.delay import Pressure

GOAL_MSG_PER_S = 10_000
BODY_BYTES = 256
DRAIN_TIMEOUT_S = 600.0
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def database(url: str | None) -> Iterator[str]:
    """``url``, or a database in a throwaway PostgreSQL cluster."""
    if url:
        yield url
        return
    sys.path.insert(0, REPO_ROOT)
    from tests.pg import PgCluster

    with PgCluster() as cluster:
        yield cluster.create_database("bench_outbox")


async def write_rows(db_url: str, count: int, per_transaction: int) -> float:
    """Write ``count`` outbox rows; returns rows per second."""
    from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

    from qmq import outbox
    from qmq.outbox_relay import async_url

    engine = create_async_engine(async_url(db_url))
    try:
        async with engine.begin() as connection:
            await connection.run_sync(outbox.create_tables)
        sessions = async_sessionmaker(engine)
        body = os.urandom(BODY_BYTES)
        started = time.monotonic()
        for first in range(0, count, per_transaction):
            async with sessions() as session, session.begin():
                for _ in range(min(per_transaction, count - first)):
                    outbox.send(session, "bench.outbox", body)
        return count / (time.monotonic() - started)
    finally:
        await engine.dispose()


async def any_left(engine) -> bool:
    """True while a row is left (an index probe: the poll must not load the database itself)."""
    from sqlalchemy import select

    from qmq.outbox import OutboxRow

    async with engine.connect() as connection:
        return (await connection.execute(select(OutboxRow.id).limit(1))).first() is not None


async def rows_left(engine) -> int:
    from sqlalchemy import func, select

    from qmq.outbox import OutboxRow

    async with engine.connect() as connection:
        return (await connection.execute(select(func.count()).select_from(OutboxRow))).scalar()


def start_relay(db_url: str, meta_url: str, batch: int) -> tuple[subprocess.Popen[str], threading.Event]:
    process = subprocess.Popen([sys.executable, "-m", "qmq", "--log-level", "warning", "outbox",
                                "relay", "--db", db_url, "--meta", meta_url, "--batch",
                                str(batch)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, cwd=REPO_ROOT)
    holding = threading.Event()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            if re.search("holds the lock", line):
                holding.set()

    threading.Thread(target=read, daemon=True).start()
    return process, holding


async def run(args: argparse.Namespace) -> None:
    print(f"bench.outbox {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC; {cpu_model()}, "
          f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}; {args.messages:,} "
          f"messages of {BODY_BYTES} bytes, relay batch {args.batch}", flush=True)
    with database(args.db) as db_url, Cluster(flush="sync", broker_args=["--no-trace"]) as cluster:
        rate = await write_rows(db_url, args.messages, args.per_transaction)
        print(f"  application: {args.messages:,} outbox rows written at {rate:,.0f}/s "
              f"({args.per_transaction} per transaction)", flush=True)
        from sqlalchemy.ext.asyncio import create_async_engine

        from qmq.outbox_relay import async_url

        engine = create_async_engine(async_url(db_url))
        relay, holding = start_relay(db_url, cluster.meta_url, args.batch)
        try:
            if not holding.wait(60):
                print("  the relay did not take the lock within 60 s")
                return
            started, load_before = time.monotonic(), os.getloadavg()
            cpu_before = (process_cpu_s(relay.pid), process_cpu_s(cluster.broker.pid))
            pressure = Pressure()
            while (await any_left(engine)) and time.monotonic() - started < DRAIN_TIMEOUT_S:
                await asyncio.sleep(0.1)
            elapsed = time.monotonic() - started
            left = await rows_left(engine)
            cpu_after = (process_cpu_s(relay.pid), process_cpu_s(cluster.broker.pid))
            pressure_share = pressure.share()
        finally:
            relay.terminate()
            relay.wait(30)
            await engine.dispose()
        sent = args.messages - left
        throughput = sent / elapsed
        verdict = "meets" if throughput >= GOAL_MSG_PER_S else "below"
        print(f"  relay: {sent:,} messages in {elapsed:.2f} s = {throughput:,.0f} msg/s "
              f"(goal >= {GOAL_MSG_PER_S:,}: {verdict}){'' if not left else f'; {left} left'}")
        print(f"  CPU: relay {cpu_after[0] - cpu_before[0]:.1f} s, broker "
              f"{cpu_after[1] - cpu_before[1]:.1f} s over {elapsed:.1f} s")
        print(f"  CPU pressure meanwhile: some task waited for a CPU {100 * pressure_share:.0f}% "
              "of the time")
        print(f"  load average: {load_before[0]:.2f} before the relay, {os.getloadavg()[0]:.2f} "
              "after")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--quick", action="store_true", help="20,000 messages")
    parser.add_argument("--db", default=None, help="postgresql://... (default: a throwaway one)")
    parser.add_argument("--batch", type=int, default=2_000, help="relay rows per pass")
    parser.add_argument("--per-transaction", type=int, default=1_000)
    args = parser.parse_args(argv)
    if args.quick:
        args.messages = 20_000
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
