"""The data plane of a delay group with real processes (docs/REPLICATION.md 8): a slave copies
the master's delay log and done journal; kill -9 of the master while it dispatches delays due
over the next seconds: after the failover every one is delivered, none early, none lost, and
none that was answered "cancelled"."""

from __future__ import annotations

import asyncio
import random

import pytest

import qmq
from tests.harness import (
    Arrivals, Cluster, admin, consume_into, epoch_ms, start_delay, start_realtime, start_server,
    wait_for, wait_registered,
)

CONSUMER_OPTIONS = {"wait_ms": 500, "heartbeat_interval_ms": 500, "reconnect_backoff_max_ms": 500,
                    "start": "earliest"}
DELAY_FLAGS = ("--bucket-ms", "1000", "--flush", "sync")
COUNT = 1_000
CANCELS = 100


def group_row(url: str, group: str) -> dict:
    return next(r for r in admin(url, "replication") if r["group"] == group)


@pytest.mark.timeout(240)
async def test_a_kill_9_of_a_delay_master_delivers_every_delay_after_the_failover(
        cluster: Cluster):
    cluster.meta = cluster.keep(start_server("metaserver", [
        "metaserver", "--db", f"sqlite+aiosqlite:///{cluster.root / 'meta.db'}", "--port", "0",
        "--lease-ms", "2000"]))
    url = cluster.meta_url
    cluster.keep(start_realtime(url, str(cluster.root / "rt1"), "rt1"))
    master = cluster.keep(start_delay(url, str(cluster.root / "d1a"), "d1", *DELAY_FLAGS))
    cluster.keep(start_delay(url, str(cluster.root / "d1b"), "d1", *DELAY_FLAGS))
    await asyncio.to_thread(wait_registered, url, {("realtime", "rt1"): "rw",
                                                   ("delay", "d1"): "rw"})
    await wait_for(lambda: bool(group_row(url, "d1")["insync"]), 60, "the delay slave in sync",
                   in_thread=True)
    subject = "orders.timeout"
    arrivals = Arrivals()
    rng = random.Random(13)
    async with qmq.Consumer(url, group="orders", **CONSUMER_OPTIONS) as consumer:
        consuming = asyncio.create_task(consume_into(consumer.subscribe(subject), arrivals))
        async with qmq.Producer(url) as producer:
            first_ms = epoch_ms() + 3_000
            receipts: list[qmq.Receipt] = []
            for start in range(0, COUNT, 500):
                receipts += await asyncio.gather(*(
                    producer.send(subject, b"due", deliver_at=rng.randint(first_ms,
                                                                          first_ms + 4_000))
                    for _ in range(start, start + 500)))
            assert all(r.status == "stored" and r.delayed for r in receipts)
            late = sorted(receipts, key=lambda r: r.deliver_at_ms)[-CANCELS:]
            outcomes = await asyncio.gather(*(producer.cancel(r) for r in late))
            assert set(outcomes) == {"cancelled"}
        cancelled = {r.message_id for r in late}
        expected = {r.message_id for r in receipts} - cancelled
        epoch = group_row(url, "d1")["epoch"]
        await wait_for(lambda: len(arrivals.ids) >= COUNT // 10, 60,
                       "a tenth of the delays dispatched", interval_s=0.01)
        await asyncio.to_thread(master.kill9)
        at_kill = len(arrivals.ids)
        await wait_for(lambda: group_row(url, "d1")["epoch"] > epoch, 60, "the promotion",
                       in_thread=True)
        await wait_for(lambda: arrivals.ids >= expected, 90,
                       "every delay delivered after the failover", interval_s=0.2)
        await asyncio.sleep(1.5)  # a cancelled one, if it were wrongly dispatched, shows now
        consuming.cancel()
    assert expected - arrivals.ids == set()
    assert arrivals.early() == []
    assert arrivals.ids & cancelled == set()
    print(f"{len(expected)} delays delivered ({at_kill} before the kill), "
          f"{len(arrivals.duplicates())} twice; {arrivals.lateness_summary()}")
