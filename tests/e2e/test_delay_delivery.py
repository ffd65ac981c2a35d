"""Delayed messages against real processes (``qmq metaserver``, ``qmq realtime``, ``qmq delay``):
delivered on time and never early, the two-year horizon, cancel through the SDK and the CLI."""

from __future__ import annotations

import asyncio
import random
from datetime import timedelta

import pytest

import qmq
from wire.limits import MAX_DELAY_MS
from wire.message import Message
from tests.harness import (
    Arrivals, consume_into, epoch_ms, run_qmq, start_delay_cluster, wait_for,
)
from tests.rawclient import RawClient

# Long polls and heartbeats well inside the brokers' timeouts; a reconnect never waits long.
CONSUMER_OPTIONS = {"wait_ms": 500, "heartbeat_interval_ms": 500, "reconnect_backoff_max_ms": 500,
                    "start": "earliest"}
DAY_MS = 86_400_000


@pytest.mark.timeout(120)
async def test_ten_thousand_random_delays_arrive_each_once_and_none_before_its_time(cluster):
    await asyncio.to_thread(start_delay_cluster, cluster, delay_flags=("--bucket-ms", "1000"))
    subject, count, spread_ms = "orders.timeout", 10_000, 10_000
    rng = random.Random(20261122)
    delays_ms = [rng.randrange(spread_ms + 1) for _ in range(count)]
    arrivals = Arrivals()
    async with qmq.Consumer(cluster.meta_url, group="billing", **CONSUMER_OPTIONS) as consumer:
        consuming = asyncio.create_task(consume_into(consumer.subscribe(subject), arrivals))
        async with qmq.Producer(cluster.meta_url) as producer:
            receipts: list[qmq.Receipt] = []
            for first in range(0, count, 1_000):
                receipts += await asyncio.gather(*(
                    producer.send(subject, f"order {n}".encode(), delay=delays_ms[n])
                    for n in range(first, first + 1_000)
                ))
        sent = {r.message_id: r for r in receipts}
        bodies = {r.message_id: f"order {n}".encode() for n, r in enumerate(receipts)}
        assert len(sent) == count
        assert {r.broker_group for r in receipts} == {"d1"}
        assert all(r.status == "stored" and r.delayed for r in receipts)
        # Before the first due time nothing can have arrived early yet: by now some could.
        await wait_for(lambda: len(arrivals.ids) >= count, spread_ms / 1000 + 30,
                       "every delayed message to arrive", interval_s=0.2)
        await asyncio.sleep(0.5)  # room for a duplicate to show up before the check
        consuming.cancel()

    print(arrivals.lateness_summary())
    assert arrivals.ids == set(sent)
    assert arrivals.duplicates() == {}
    assert arrivals.early() == []
    for arrival in arrivals.items:
        assert arrival.deliver_at_ms == sent[arrival.id].deliver_at_ms
        assert arrival.body == bodies[arrival.id]


@pytest.mark.timeout(60)
async def test_a_message_beyond_the_two_year_horizon_is_refused_by_the_sdk_and_by_the_server(
        cluster):
    _realtime, delay = await asyncio.to_thread(start_delay_cluster, cluster)
    subject = "reminders"
    async with qmq.Producer(cluster.meta_url) as producer:
        with pytest.raises(qmq.DelayOutOfRange) as refused:
            await producer.send(subject, b"too far", delay=timedelta(days=731))
        assert not refused.value.retriable
        assert str(MAX_DELAY_MS) in refused.value.message
        with pytest.raises(qmq.DelayOutOfRange):
            await producer.send(subject, b"too far", deliver_at=epoch_ms() + MAX_DELAY_MS + DAY_MS)

    # A client that skips the SDK's check meets the delay server's own.
    client = await RawClient.connect(delay.port)
    try:
        now_ms = epoch_ms()
        beyond = Message.create(subject, b"raw, too far", now_ms=now_ms,
                                deliver_at_ms=now_ms + MAX_DELAY_MS + DAY_MS)
        inside = Message.create(subject, b"raw, a minute inside", now_ms=now_ms,
                                deliver_at_ms=now_ms + MAX_DELAY_MS - 60_000)
        answer = await client.send(beyond, inside)
        [refused_result, stored_result] = answer["results"]
        assert refused_result["id"] == beyond.id
        assert refused_result["error"]["code"] == "delay_out_of_range"
        assert str(MAX_DELAY_MS) in refused_result["error"]["message"]
        assert stored_result == {"id": inside.id, "status": "stored",
                                 "deliver_at_ms": inside.deliver_at_ms}
        cancelled = await client.request({"op": "cancel", "ids": [beyond.id, inside.id],
                                          "deliver_at_ms": [beyond.deliver_at_ms,
                                                            inside.deliver_at_ms]})
        assert [r["status"] for r in cancelled["results"]] == ["unknown", "cancelled"]
    finally:
        await client.close()
    assert delay.running


async def _cli(*args: str) -> str:
    result = await asyncio.to_thread(run_qmq, *args)
    assert result.returncode in (0, 1), f"exit {result.returncode}: {result.stderr[-2000:]}"
    return result.stdout


def _receipt_line(stdout: str) -> dict[str, str]:
    """``stored id=X subject=S group=G deliver_at_ms=N`` as a dict."""
    [line] = stdout.splitlines()
    status, *pairs = line.split()
    return {"status": status, **dict(pair.split("=", 1) for pair in pairs)}


@pytest.mark.timeout(90)
async def test_a_cancelled_message_is_never_delivered_and_a_late_or_unknown_cancel_says_so(
        cluster):
    # Default (1 minute) buckets: a dispatched message's bucket is retired once the done
    # watermark passes it, and from then on a cancel answers "already_past"
    # (tests/integration/test_delay_server.py proves that with a fake clock).
    await asyncio.to_thread(start_delay_cluster, cluster)
    subject = "orders.unpaid"
    arrivals = Arrivals()
    async with qmq.Consumer(cluster.meta_url, group="billing", **CONSUMER_OPTIONS) as consumer, \
            qmq.Producer(cluster.meta_url) as producer:
        consuming = asyncio.create_task(consume_into(consumer.subscribe(subject), arrivals))

        # Through the SDK: cancel well before the time, then a later message shows the
        # cancelled one's time has passed (plus a margin) without it.
        # 4 s: the cancel must reach the delay server before the message is due, on a
        # loaded machine too.
        doomed = await producer.send(subject, b"cancel me", delay=4_000)
        assert await producer.cancel(doomed) == "cancelled"
        assert await producer.cancel(doomed) == "already_cancelled"
        witness = await producer.send(subject, b"witness",
                                      deliver_at=doomed.deliver_at_ms + 1_500)
        early = await producer.send(subject, b"delivered first", delay=200)
        await wait_for(lambda: early.message_id in arrivals.ids, 15, "the short delay to arrive")
        assert await producer.cancel(early) == "already_dispatched"
        unknown = qmq.Receipt("no-such-message", subject, early.broker_group, "stored",
                              early.deliver_at_ms)
        assert await producer.cancel(unknown) == "unknown"
        await wait_for(lambda: witness.message_id in arrivals.ids, 20, "the witness to arrive")
        assert epoch_ms() >= doomed.deliver_at_ms + 1_000
        assert doomed.message_id not in arrivals.ids

        # Through the CLI: qmq send --delay-ms prints what qmq cancel needs. The delay is long
        # (each CLI call is a process start, seconds on a loaded machine); that a cancelled
        # message is never delivered is shown above, so here the second cancel proves the first
        # took effect without waiting for the due time.
        meta = ("--meta", cluster.meta_url)
        sent = _receipt_line(await _cli("send", subject, "cli: cancel me", "--delay-ms", "600000",
                                        *meta))
        assert sent["status"] == "stored" and sent["group"] == "d1"
        cancel = ("cancel", subject, sent["id"], "--group", sent["group"],
                  "--deliver-at-ms", sent["deliver_at_ms"], *meta)
        assert (await _cli(*cancel)).split() == ["cancelled", f"id={sent['id']}"]
        assert (await _cli(*cancel)).split() == ["already_cancelled", f"id={sent['id']}"]
        consuming.cancel()

    assert {a.body for a in arrivals.items} == {b"delivered first", b"witness"}
    assert arrivals.duplicates() == {}
    assert arrivals.early() == []
