"""The delay server's hand-off ahead of the due time against real processes (``qmq
metaserver``, ``qmq realtime``, ``qmq delay --handoff-lead-ms 8000``): a hot slot is
handed to the broker before its due instant and received at or after it, each message once;
the trace has one ``dispatched`` per message, from the broker, with its lateness; a cancel
within the lead reaches the broker and the message is never delivered."""

from __future__ import annotations

import asyncio

import pytest

import qmq
from tests.harness import Arrivals, consume_into, epoch_ms, start_delay_cluster, wait_for
from tracelog.reading import read_events

CONSUMER_OPTIONS = {"wait_ms": 500, "heartbeat_interval_ms": 500, "reconnect_backoff_max_ms": 500,
                    "start": "earliest"}
COUNT = 1_200  # a hot slot: more than handoff_min_messages (1,000) due in one step
AHEAD_MS = 12_000  # the due instant: more than the 8 s lead after the sends


@pytest.mark.timeout(120)
async def test_a_hot_slot_handed_off_ahead_arrives_once_on_time_with_one_dispatch_each(cluster):
    # A long lead, so a loaded machine has handed the cancelled one off well before the cancel.
    realtime, delay = await asyncio.to_thread(start_delay_cluster, cluster,
                                              delay_flags=("--handoff-lead-ms", "8000"))
    subject = "handoff.hot"
    arrivals = Arrivals()
    due_ms = epoch_ms() + AHEAD_MS
    async with qmq.Consumer(cluster.meta_url, group="g", **CONSUMER_OPTIONS) as consumer:
        consuming = asyncio.create_task(consume_into(consumer.subscribe(subject), arrivals))
        async with qmq.Producer(cluster.meta_url) as producer:
            receipts = await asyncio.gather(*(
                producer.send(subject, b"m%d" % n, deliver_at=due_ms) for n in range(COUNT)))
            doomed = await producer.send(subject, b"doomed", deliver_at=due_ms)
            # Within the lead (handed off already, not visible yet): the broker drops it.
            await wait_for(lambda: epoch_ms() >= due_ms - 3_000, 15, "the lead to pass in part")
            assert await producer.cancel(doomed) == "cancelled"
            assert await producer.cancel(doomed) == "already_cancelled"
        await wait_for(lambda: len(arrivals.ids) >= COUNT, 60, "every message to arrive",
                       interval_s=0.2)
        await asyncio.sleep(0.5)  # room for a duplicate or the cancelled one to show up
        consuming.cancel()
    assert arrivals.ids == {r.message_id for r in receipts}
    assert arrivals.duplicates() == {} and arrivals.early() == []
    realtime.terminate()
    delay.terminate()
    events = [e for e in read_events([cluster.root / "rt1" / "trace", cluster.root / "d1" / "trace"])
              if e.get("subject") == subject]
    dispatched = [e for e in events if e["event"] == "dispatched"]
    assert sorted(e["msg_id"] for e in dispatched) == sorted(r.message_id for r in receipts)
    assert {e["server"].split(":")[0] for e in dispatched} == {"realtime"}
    assert min(e["lateness_ms"] for e in dispatched) >= 0
    handed = [e for e in events if e["event"] == "handed"]
    # Every message of the hot step is handed off; the doomed one, sent after them, is too
    # unless it reached the delay server after its step was counted (then it waits in the
    # schedule, where the cancel dropped it: docs/REPLICATION.md 16).
    handed_ids = {e["msg_id"] for e in handed}
    assert {r.message_id for r in receipts} <= handed_ids
    assert handed_ids <= {r.message_id for r in [*receipts, doomed]}
    assert {e["reason"] for e in handed} == {e["server"] for e in dispatched}, \
        "handed names the group that holds the message (the audit's holder)"
    assert {e["server"].split(":")[0] for e in handed} == {"delay"}
    doomed_events = [e["event"] for e in events if e["msg_id"] == doomed.message_id]
    # The delay server traces the cancel; the broker traces its drop too when it held it.
    cancels = sorted((e["server"].split(":")[0], e.get("reason")) for e in events
                     if e["msg_id"] == doomed.message_id and e["event"] == "cancelled")
    if doomed.message_id in handed_ids:
        assert cancels == [("delay", None), ("realtime", "held_cancelled")], cancels
    else:
        assert cancels == [("delay", None)], cancels
    assert not {"stored", "dispatched", "pulled"} & set(doomed_events), doomed_events


@pytest.mark.timeout(120)
async def test_a_hot_slot_past_the_brokers_held_messages_max_still_arrives_once_none_early(
        cluster):
    # The broker holds at most 300 of the 1,200; it refuses the rest (too_large) and the
    # delay server sends those at their due time (review R10, broker side).
    config = cluster.root / "rt-held.toml"
    config.write_text("[realtime]\nheld_messages_max = 300\n")
    realtime, delay = await asyncio.to_thread(
        start_delay_cluster, cluster, realtime_flags=("--config", str(config)),
        delay_flags=("--handoff-lead-ms", "8000"))
    subject = "handoff.full"
    arrivals = Arrivals()
    due_ms = epoch_ms() + AHEAD_MS
    async with qmq.Consumer(cluster.meta_url, group="g", **CONSUMER_OPTIONS) as consumer:
        consuming = asyncio.create_task(consume_into(consumer.subscribe(subject), arrivals))
        async with qmq.Producer(cluster.meta_url) as producer:
            receipts = await asyncio.gather(*(
                producer.send(subject, b"m%d" % n, deliver_at=due_ms) for n in range(COUNT)))
        await wait_for(lambda: len(arrivals.ids) >= COUNT, 60, "every message to arrive",
                       interval_s=0.2)
        await asyncio.sleep(0.5)  # room for a duplicate to show up
        consuming.cancel()
    assert arrivals.ids == {r.message_id for r in receipts}
    assert arrivals.duplicates() == {} and arrivals.early() == []
    realtime.terminate()
    delay.terminate()
    events = [e for e in read_events([cluster.root / "rt1" / "trace",
                                      cluster.root / "d1" / "trace"])
              if e.get("subject") == subject]
    handed = {e["msg_id"] for e in events if e["event"] == "handed"}
    dispatched = [e for e in events if e["event"] == "dispatched"]
    assert 0 < len(handed) <= 300, len(handed)
    assert sorted(e["msg_id"] for e in dispatched) == sorted(r.message_id for r in receipts)
    by_broker = {e["msg_id"] for e in dispatched if e["server"].startswith("realtime")}
    assert by_broker == handed, "the held ones made visible by the broker, the rest sent"
    assert min(e["lateness_ms"] for e in dispatched) >= 0
    assert not [e for e in events if e["event"] == "gave_up"]
