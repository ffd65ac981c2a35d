"""The data plane of a delay group with real processes (docs/REPLICATION.md 8): a slave copies
the master's delay log and done journal; kill -9 of the master while it dispatches 10k delays
due over the next 30 s: after the failover every one is delivered, none early, none lost, and
none that was answered "cancelled"."""

from __future__ import annotations

import asyncio
import random

import pytest

import qmq
from tests.e2e import replication_support as replication
from tests.e2e.replication_support import start_leased_meta
from tests.harness import (
    Arrivals, Cluster, consume_into, epoch_ms, start_realtime, wait_for, wait_registered,
)

CONSUMER_OPTIONS = {"wait_ms": 500, "heartbeat_interval_ms": 500, "reconnect_backoff_max_ms": 500,
                    "start": "earliest"}
DELAY_FLAGS = ("--bucket-ms", "1000", "--flush", "sync")
# 10k delays due over 30 s, as the replication issue asks: the window alone holds the test ~45 s
# on a quiet machine, which the suite's two workers absorb.
COUNT = 10_000
DUE_OVER_MS = 30_000
LEAD_MS = 5_000  # the first is due this long after sending began (sending takes seconds)
CANCELS = 100
# The cancelled ones are sent last and fall due this long after they were sent (plus up to a
# second), so their cancel is never too late however slowly the machine sends; before, they
# were the latest of the window, and a slow send on a loaded machine could make them due before
# their cancel, answered "already_dispatched" (the 1-in-5 failure seen under heavy load).
CANCEL_LEAD_MS = 8_000
SEEN_MS = 1_500  # a cancelled one, if it were wrongly dispatched, has arrived this long after due

group_row = replication.group_row


@pytest.mark.timeout(240)
async def test_a_kill_9_of_a_delay_master_delivers_every_delay_after_the_failover(
        cluster: Cluster):
    url = start_leased_meta(cluster).url
    cluster.keep(start_realtime(url, str(cluster.root / "rt1"), "rt1"))
    master = replication.start_member(cluster, "delay", "d1", "d1a", *DELAY_FLAGS)
    replication.start_member(cluster, "delay", "d1", "d1b", *DELAY_FLAGS)
    await asyncio.to_thread(wait_registered, url, {("realtime", "rt1"): "rw",
                                                   ("delay", "d1"): "rw"})
    await wait_for(lambda: bool(group_row(url, "d1")["insync"]), 60, "the delay slave in sync",
                   in_thread=True)
    subject = "orders.timeout"
    arrivals = Arrivals()
    rng = random.Random(13)
    async with qmq.Consumer(url, group="orders", **CONSUMER_OPTIONS) as consumer:
        consuming = asyncio.create_task(consume_into(consumer.subscribe(subject), arrivals))
        # Patient sends: on a loaded machine the MetaServer can miss the master's renewals for
        # seconds, and the master then refuses writes (not_master) until one gets through.
        async with qmq.Producer(url, retries_max=12) as producer:
            first_ms = epoch_ms() + LEAD_MS
            receipts: list[qmq.Receipt] = []
            for start in range(0, COUNT, 500):
                receipts += await asyncio.gather(*(
                    producer.send(subject, b"due", deliver_at=rng.randint(
                        first_ms, first_ms + DUE_OVER_MS))
                    for _ in range(start, start + 500)))
            print(f"{COUNT} delays sent in {epoch_ms() - first_ms + LEAD_MS} ms")
            late_ms = epoch_ms() + CANCEL_LEAD_MS
            late = await asyncio.gather(*(
                producer.send(subject, b"cancelled", deliver_at=late_ms + rng.randint(0, 1_000))
                for _ in range(CANCELS)))
            assert all(r.status == "stored" and r.delayed for r in receipts + late)
            outcomes = await asyncio.gather(*(producer.cancel(r) for r in late))
            assert set(outcomes) == {"cancelled"}, outcomes
        cancelled = {r.message_id for r in late}
        expected = {r.message_id for r in receipts}
        epoch = group_row(url, "d1")["epoch"]
        await wait_for(lambda: len(arrivals.ids) >= COUNT // 10, 60,
                       "a tenth of the delays dispatched", interval_s=0.01)
        await asyncio.to_thread(master.kill9)
        at_kill = len(arrivals.ids)
        await wait_for(lambda: group_row(url, "d1")["epoch"] > epoch, 60, "the promotion",
                       in_thread=True)
        await wait_for(lambda: arrivals.ids >= expected, 90,
                       "every delay delivered after the failover", interval_s=0.2)
        last_cancelled_ms = max(r.deliver_at_ms for r in late)
        await wait_for(lambda: epoch_ms() >= last_cancelled_ms + SEEN_MS, 60,
                       "the cancelled ones' due time to pass")
        consuming.cancel()
    assert expected - arrivals.ids == set()
    assert arrivals.early() == []
    assert arrivals.ids & cancelled == set()
    print(f"{len(expected)} delays delivered ({at_kill} before the kill), "
          f"{len(arrivals.duplicates())} twice; {arrivals.lateness_summary()}")
