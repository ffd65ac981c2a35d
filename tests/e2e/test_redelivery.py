"""Unacked messages come back: after the ack timeout, and at once when their consumer dies."""

from __future__ import annotations

import asyncio
import time

import pytest

import qmq
from tests.e2e.support import Ledger, RunningConsumer, close_all, send_all, start_cluster
from tests.harness import group_lag, wait_for

ACK_TIMEOUT_MS = 1_500


@pytest.mark.timeout(90)
async def test_messages_held_by_a_consumer_killed_with_kill_9_reach_the_other_consumers(cluster):
    # A 60 s ack timeout: anything that comes back within the test came back through expiry.
    await start_cluster(cluster, "rt1",
                        broker_flags=("--ack-timeout-ms", "60000", "--consumer-expiry-ms", "2000"))
    subject, group = "orders.kill9", "billing"
    first = [f"k9-a-{i:03d}" for i in range(300)]
    second = [f"k9-b-{i:03d}" for i in range(200)]
    async with qmq.Producer(cluster.meta_url) as producer:
        await send_all(producer, subject, first)
        worker = await asyncio.to_thread(cluster.start_consumer_worker, group, subject, "doomed",
                                         "--hold", "--pull-batch", "64")
        await wait_for(lambda: {r["id"] for r in worker.records()} >= set(first), 30,
                       "the doomed consumer to hold the first 300 messages")
        ledger = Ledger()
        survivors = [await RunningConsumer(cluster.meta_url, group, subject, ledger,
                                           name=f"survivor-{n}").start() for n in range(2)]
        try:
            await send_all(producer, subject, second)
            await wait_for(lambda: len(ledger.ids | {r["id"] for r in worker.records()}) >= 500,
                           30, "the second 200 messages to be handed out")
            held = {r["id"] for r in worker.records()}
            assert ledger.ids & held == set(), "a live consumer's messages went to another"
            worker.kill9()
            killed_at = time.monotonic()
            await wait_for(lambda: ledger.ids >= set(first + second), 30,
                           "the dead consumer's messages to reach the survivors")
            recovered_after_s = time.monotonic() - killed_at
            await wait_for(lambda: group_lag(cluster.meta_url, subject, group) == (0, 1), 20,
                           "the broker to report lag 0", interval_s=0.3, in_thread=True)
        finally:
            await close_all(survivors)

    assert ledger.ids == set(first + second)
    assert held >= set(first)
    redelivered = {d.id for d in ledger.deliveries if d.redelivered >= 1}
    assert held - redelivered == set(), "held messages must come back marked redelivered"
    assert recovered_after_s < 20, f"took {recovered_after_s:.1f} s: not consumer expiry"
    assert ledger.duplicates() == {}


@pytest.mark.timeout(60)
async def test_a_message_not_acked_within_the_ack_timeout_is_delivered_again(cluster):
    await start_cluster(cluster, "rt1", broker_flags=("--ack-timeout-ms", str(ACK_TIMEOUT_MS),
                                                      "--consumer-expiry-ms", "30000"))
    subject, group = "orders.acktimeout", "billing"
    ids = [f"late-{i}" for i in range(5)]
    ledger = Ledger()

    def ack_only_redeliveries(msg: qmq.ReceivedMessage) -> bool:
        return msg.redelivered >= 1

    consumers = [await RunningConsumer(cluster.meta_url, group, subject, ledger, name=f"c{n}",
                                       start="earliest", should_ack=ack_only_redeliveries).start()
                 for n in range(2)]
    try:
        async with qmq.Producer(cluster.meta_url) as producer:
            await send_all(producer, subject, ids)
        await wait_for(lambda: all(any(d.redelivered for d in ledger.of(i)) for i in ids), 20,
                       "every unacked message to be delivered again")
        await wait_for(lambda: group_lag(cluster.meta_url, subject, group) == (0, 1), 20,
                       "the broker to report lag 0 once the redeliveries are acked",
                       interval_s=0.3, in_thread=True)
    finally:
        await close_all(consumers)

    for message_id in ids:
        first, *again = ledger.of(message_id)
        assert first.redelivered == 0
        assert len(again) == 1, f"{message_id}: acked redelivery came back {len(again)} times"
        assert again[0].redelivered >= 1
        waited_s = again[0].at - first.at
        # The broker stamps the pull a moment before the client sees it: allow 0.2 s of that.
        assert waited_s >= ACK_TIMEOUT_MS / 1000 - 0.2, f"{message_id} back after {waited_s:.2f} s"


@pytest.mark.timeout(90)
async def test_messages_a_closing_consumer_still_holds_go_to_the_others_at_once(cluster):
    # Ack timeout and consumer expiry of 10 minutes: what comes back within the test came back
    # because the closing consumer left.
    await start_cluster(cluster, "rt1", broker_flags=("--ack-timeout-ms", "600000",
                                                      "--consumer-expiry-ms", "600000"))
    subject, group = "orders.leave", "billing"
    ids = [f"leave-{i:03d}" for i in range(100)]
    async with qmq.Producer(cluster.meta_url) as producer:
        await send_all(producer, subject, ids)

    async with qmq.Consumer(cluster.meta_url, group=group, start="earliest") as closing:
        async for msg in closing.subscribe(subject):
            handled = msg.id
            await msg.ack()
            break  # the rest of its pull stays prefetched, never handed to the application

    ledger = Ledger()
    staying = await RunningConsumer(cluster.meta_url, group, subject, ledger,
                                    name="staying").start()
    try:
        await wait_for(lambda: ledger.ids >= set(ids) - {handled}, 30,
                       "the closing consumer's prefetched messages to reach the other")
    finally:
        await close_all([staying])
    assert ledger.ids == set(ids) - {handled}
    assert ledger.duplicates() == {}
