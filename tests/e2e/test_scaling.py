"""A consumer group scaling up and down under load: nothing lost, nothing delivered twice."""

from __future__ import annotations

import asyncio
import time

import pytest

import qmq
from tests.e2e.support import Ledger, RunningConsumer, close_all, send_all, start_cluster
from tests.harness import admin, group_lag, wait_for

MESSAGES = 50_000
SEND_CHUNK = 1_000
# The producer waits while the consumers are this far behind, so production goes on while the
# pool scales (unpaced, 50k sends finish before the second consumer has joined).
BEHIND_MAX = 4_000


@pytest.mark.timeout(180)
async def test_a_group_scaling_from_one_to_eight_to_two_consumers_gets_every_message_exactly_once(
    cluster,
):
    cluster.start_meta()
    cluster.start_broker("rt1", "--ack-timeout-ms", "3000", "--consumer-expiry-ms", "3000")
    await wait_for(lambda: admin(cluster.meta_url, "brokers"), 20, "the broker to register",
                   in_thread=True)
    subject, group = "orders.scaling", "billing"
    ids = [f"scale-{i:05d}" for i in range(MESSAGES)]
    ledger = Ledger()
    started = time.monotonic()
    marks: dict[str, float] = {}

    def consumer(n: int) -> RunningConsumer:
        return RunningConsumer(cluster.meta_url, group, subject, ledger, name=f"c{n}",
                               start="earliest")

    pool = [await consumer(0).start()]
    receipts: list[qmq.Receipt] = []
    try:
        async with qmq.Producer(cluster.meta_url) as producer:
            async def produce() -> None:
                for first in range(0, MESSAGES, SEND_CHUNK):
                    await wait_for(lambda: len(ledger.deliveries) >= first - BEHIND_MAX, 60,
                                   "the consumers to catch up with the producer")
                    receipts.extend(await asyncio.gather(*(
                        producer.send(subject, i.encode(), message_id=i)
                        for i in ids[first:first + SEND_CHUNK]
                    )))
                marks["produced"] = time.monotonic() - started

            producing = asyncio.create_task(produce())
            await wait_for(lambda: len(ledger.deliveries) >= 10_000, 60, "10k deliveries to c0")
            marks["scale to 8"] = time.monotonic() - started
            pool += [await consumer(n).start() for n in range(1, 8)]
            assert not producing.done(), "the pool must scale while messages are produced"
            await wait_for(lambda: all(c.received for c in pool), 30,
                           "every one of the 8 consumers to get messages")
            await wait_for(lambda: len(ledger.deliveries) >= 30_000, 60, "30k deliveries")
            marks["scale to 2"] = time.monotonic() - started
            leaving, pool = pool[2:], pool[:2]
            await close_all(leaving)
            assert not producing.done(), "the pool must scale while messages are produced"
            await producing
        await wait_for(lambda: ledger.ids >= set(ids), 90, "every message to be delivered",
                       interval_s=0.2)
        marks["all delivered"] = time.monotonic() - started
        # The broker's own count: nothing unacked or waiting, so nothing can come back later.
        await wait_for(lambda: group_lag(cluster.meta_url, subject, group) == (0, 1), 20,
                       "the broker to report lag 0", interval_s=0.3, in_thread=True)
    finally:
        await close_all(pool)
    print("timings (s):", {k: round(v, 1) for k, v in marks.items()},
          "deliveries per consumer:", {c: sum(1 for d in ledger.deliveries if d.consumer == c)
                                        for c in sorted({d.consumer for d in ledger.deliveries})})

    assert [r for r in receipts if r.status != "stored"] == []
    assert set(ids) - ledger.ids == set()
    assert ledger.ids - set(ids) == set()
    assert ledger.duplicates() == {}


# Issue 19: a group of this many consumers, in one client process (this one), loses half.
MANY_CONSUMERS = 1_000
MANY_MESSAGES = 4_000


def online_clients(meta_url: str, subject: str, group: str) -> int | None:
    """The MetaServer's count of online consumers of (subject, group), None if not listed."""
    for row in admin(meta_url, "groups"):
        if row["subject"] == subject and row["group"] == group:
            return row["online_clients"]
    return None


@pytest.mark.timeout(240)
async def test_a_thousand_consumers_in_one_group_lose_nothing_when_half_of_them_leave(cluster):
    meta_url = await start_cluster(cluster, "rt1")
    subject, group = "orders.many", "billing"
    ids = [f"many-{i:05d}" for i in range(MANY_MESSAGES)]
    ledger = Ledger()
    started = time.monotonic()
    marks: dict[str, float] = {}
    # Small batches spread the messages over many consumers; waits as the SDK's defaults
    # (an idle thousand must not flood the broker with polls or the MetaServer with heartbeats).
    pool = [await RunningConsumer(meta_url, group, subject, ledger, name=f"m{n:04d}",
                                  start="earliest", pull_batch=2, wait_ms=20_000,
                                  heartbeat_interval_ms=5_000).start()
            for n in range(MANY_CONSUMERS)]
    try:
        # One batched heartbeat per round names them all (sdk.presence).
        await wait_for(lambda: online_clients(meta_url, subject, group) == MANY_CONSUMERS, 90,
                       "the MetaServer to count every consumer online", interval_s=0.5,
                       in_thread=True)
        marks["all online"] = time.monotonic() - started
        async with qmq.Producer(meta_url) as producer:
            first_half = await send_all(producer, subject, ids[:MANY_MESSAGES // 2])
            await wait_for(lambda: len(ledger.ids) >= MANY_MESSAGES // 4, 90,
                           "a quarter of the messages to be delivered")
            # Every other one: the first to start got the first messages, so half of them
            # leave holding some (prefetched, unacked) that the others must get.
            leaving, pool = pool[1::2], pool[::2]
            await close_all(leaving)
            marks["half left"] = time.monotonic() - started
            second_half = await send_all(producer, subject, ids[MANY_MESSAGES // 2:])
        await wait_for(lambda: ledger.ids >= set(ids), 120, "every message to be delivered",
                       interval_s=0.2)
        marks["all delivered"] = time.monotonic() - started
        await wait_for(lambda: online_clients(meta_url, subject, group) == MANY_CONSUMERS // 2,
                       30, "the MetaServer to count the leavers offline", interval_s=0.5,
                       in_thread=True)
        await wait_for(lambda: group_lag(meta_url, subject, group) == (0, 1), 30,
                       "the broker to report lag 0", interval_s=0.5, in_thread=True)
    finally:
        await close_all(pool)
    receivers = {d.consumer for d in ledger.deliveries}
    print("timings (s):", {k: round(v, 1) for k, v in marks.items()},
          "consumers that got messages:", len(receivers))
    assert [r for r in first_half + second_half if r.status != "stored"] == []
    assert set(ids) - ledger.ids == set()
    assert ledger.ids - set(ids) == set()
    assert ledger.duplicates() == {}
    assert any(c.name in receivers for c in leaving), "the leavers must have had messages"
