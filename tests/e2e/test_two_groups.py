"""Two realtime broker groups behind one MetaServer: a subject spread over both."""

from __future__ import annotations

import pytest

import qmq
from tests.e2e.support import Ledger, RunningConsumer, close_all, send_in_batches, start_cluster
from serverkit.payload_sender import PayloadSender
from tests.harness import admin, epoch_ms, group_lag, wait_for
from wire.message import Message, encode_message

BROKER_FLAGS = ("--ack-timeout-ms", "3000", "--consumer-expiry-ms", "3000")


async def two_groups(cluster) -> str:
    return await start_cluster(cluster, "rt1", "rt2", broker_flags=BROKER_FLAGS)


@pytest.mark.timeout(90)
async def test_a_subject_spread_over_two_broker_groups_is_consumed_from_both_by_one_group(cluster):
    url = await two_groups(cluster)
    subject, group = "orders.spread", "billing"
    ids = [f"spread-{i:03d}" for i in range(200)]
    ledger = Ledger()
    consumers = [await RunningConsumer(url, group, subject, ledger, name=f"c{n}",
                                       start="earliest").start() for n in range(2)]
    try:
        async with qmq.Producer(url) as producer:
            receipts = await send_in_batches(producer, subject, ids, per_batch=10)
        await wait_for(lambda: ledger.ids >= set(ids), 30, "every message from both groups")
        await wait_for(lambda: group_lag(url, subject, group) == (0, 2), 20,
                       "both brokers to report lag 0", interval_s=0.3, in_thread=True)
    finally:
        await close_all(consumers)

    stored_on = {r.message_id: r.broker_group for r in receipts}
    assert set(stored_on.values()) == {"rt1", "rt2"}
    assert ledger.ids == set(ids) and ledger.duplicates() == {}
    assert {d.id: d.broker_group for d in ledger.deliveries} == stored_on
    routed = {s["subject"]: s["groups"] for s in admin(url, "subjects")}
    assert {g["group"] for g in routed[subject]} == {"rt1", "rt2"}



@pytest.mark.timeout(90)
async def test_a_server_resending_messages_reaches_the_group_that_stored_them_so_each_is_delivered_once(
        cluster):
    # The delay server's dispatch and a broker's retry hand-off resend payloads after a crash or
    # a lost answer; with two groups a resend must land where the first copy is, or the
    # broker's de-duplication cannot see it and the consumers get the message twice.
    url = await two_groups(cluster)
    subject, group = "orders.resent", "billing"
    ids = [f"resent-{i:03d}" for i in range(100)]
    payloads = [encode_message(Message.create(subject, b"x", now_ms=epoch_ms(), id=message_id))
                for message_id in ids]
    ledger = Ledger()
    consumer = await RunningConsumer(url, group, subject, ledger, name="c0",
                                     start="earliest").start()
    sender = PayloadSender(url, kind="realtime", client_id="test-resender")
    try:
        _, first = await sender.send(subject, payloads)
        assert [(r["id"], r["status"]) for r in first] == [(i, "stored") for i in ids]
        for start in range(0, 100, 7):  # resent in other batches, as a retry would
            _, again = await sender.send(subject, payloads[start:start + 7])
            assert [r["status"] for r in again] == ["duplicate"] * len(again)
        await wait_for(lambda: ledger.ids >= set(ids), 30, "every message")
        await wait_for(lambda: group_lag(url, subject, group) == (0, 2), 20,
                       "both brokers to report lag 0", interval_s=0.3, in_thread=True)
    finally:
        await sender.close()
        await close_all([consumer])

    assert ledger.ids == set(ids) and ledger.duplicates() == {}
    assert {d.broker_group for d in ledger.deliveries} == {"rt1", "rt2"}
