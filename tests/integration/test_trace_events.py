"""The trace a scenario leaves behind: every server's events, read back as the audit reads them."""

from __future__ import annotations

import time

from delayserver.config import DelayConfig
from delayserver.server import DelayServer
from metaserver.app import start_metaserver
from metaserver.config import MetaConfig, sqlite_url
from realtime.config import RealtimeConfig
from realtime.server import RealtimeServer
from wire.message import Message, decode_message
from wire.protocol import pull_columns
from tracelog.reading import read_events
from tests.rawclient import RawClient


def now_ms() -> int:
    return time.time_ns() // 1_000_000


async def pull_until(client: RawClient, subject: str, count: int, timeout_s: float = 10):
    """(pull_seq, payload) of at least ``count`` messages of ``subject``, pulled as they come."""
    got: list[tuple[int, bytes]] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        response = await client.pull(subject, "billing", "c1", start="earliest", wait_ms=500)
        pull_seqs, payloads, _redelivered = pull_columns(response)
        got.extend(zip(pull_seqs, payloads))
    assert len(got) >= count, f"{len(got)} of {count} arrived on {subject}"
    return got


def history(events, msg_id):
    return [e["event"] for e in sorted(events, key=lambda e: e["ts_ms"]) if e["msg_id"] == msg_id]


def kinds(events, msg_id):
    """The events of one message as a sorted list: events of different servers in the same
    millisecond have no order, so only what happened is compared, and causality separately."""
    return sorted(history(events, msg_id))


def at(events, msg_id, kind):
    return next(e["ts_ms"] for e in events if e["msg_id"] == msg_id and e["event"] == kind)


async def test_each_servers_events_tell_what_happened_to_each_message(tmp_path):
    async with start_metaserver(MetaConfig(db_url=sqlite_url(tmp_path / "m.db"), port=0)) as meta:
        realtime = RealtimeServer(RealtimeConfig(
            data_dir=str(tmp_path / "rt"), meta_url=meta.url, group="rt-1", port=0,
            retry_backoff_ms=(100,), heartbeat_interval_ms=200))
        await realtime.start()
        delay = DelayServer(DelayConfig(data_dir=str(tmp_path / "dl"), meta_url=meta.url,
                                        group="dl-1", port=0, bucket_ms=1000,
                                        heartbeat_interval_ms=200))
        await delay.start()
        client = await RawClient.connect(realtime.port)
        delayed_client = await RawClient.connect(delay.port)
        try:
            plain = Message.create("orders", b"plain", now_ms=now_ms())
            retried = Message.create("orders", b"fails once", now_ms=now_ms())
            stale = Message.create("orders", b"stale", now_ms=now_ms(), expire_at_ms=now_ms() + 1)
            await client.send(plain, retried, stale)
            delayed = Message.create("orders", b"later", now_ms=now_ms(),
                                     deliver_at_ms=now_ms() + 300)
            cancelled = Message.create("orders", b"never", now_ms=now_ms(),
                                       deliver_at_ms=now_ms() + 60_000)
            await delayed_client.send(delayed, cancelled)
            await delayed_client.request({"op": "cancel", "ids": [cancelled.id],
                                          "deliver_at_ms": [cancelled.deliver_at_ms]})
            time.sleep(0.01)  # let the stale message's expiry pass (1 ms)
            first = await pull_until(client, "orders", 2)
            for pull_seq, payload in first:
                if decode_message(payload).id == retried.id:
                    await client.request({"op": "nack", "subject": "orders", "group": "billing",
                                          "consumer_id": "c1", "pull_seqs": [pull_seq]})
                else:
                    await client.ack("orders", "billing", "c1", [[pull_seq, pull_seq]])
            for pull_seq, _payload in await pull_until(client, "orders", 1):  # the delayed one
                await client.ack("orders", "billing", "c1", [[pull_seq] * 2])
            copy_seq, _payload = (await pull_until(client, "%retry%orders%billing", 1))[0]
            await client.ack("%retry%orders%billing", "billing", "c1", [[copy_seq] * 2])
        finally:
            await client.close()
            await delayed_client.close()
            await delay.stop()
            await realtime.stop()
    events = read_events([tmp_path / "rt" / "trace", tmp_path / "dl" / "trace"])
    assert history(events, plain.id) == ["produced", "stored", "pulled", "acked"]
    assert history(events, stale.id) == ["produced", "stored", "expired"]
    assert history(events, retried.id) == ["produced", "stored", "pulled", "nacked"]
    copy_id = f"{retried.id}.r1"
    assert kinds(events, copy_id) == sorted(
        ["retried", "scheduled", "dispatched", "stored", "pulled", "acked"])
    # The broker's own events are in order. The delay server traces "dispatched" when the
    # broker's answer reaches it, which can be after a consumer already pulled the copy, so only
    # "scheduled" is known to come before them.
    assert at(events, copy_id, "scheduled") <= at(events, copy_id, "stored") <= at(
        events, copy_id, "pulled") <= at(events, copy_id, "acked")
    copy_events = [e for e in events if e["msg_id"] == f"{retried.id}.r1"]
    assert {e["subject"] for e in copy_events} == {"orders"}
    assert {e.get("origin_id") for e in copy_events} == {retried.id}
    assert kinds(events, delayed.id) == sorted(
        ["produced", "scheduled", "dispatched", "stored", "pulled", "acked"])
    assert at(events, delayed.id, "pulled") >= delayed.deliver_at_ms
    dispatched = next(e for e in events if e["msg_id"] == delayed.id and e["event"] == "dispatched")
    assert dispatched["lateness_ms"] >= 0
    assert history(events, cancelled.id) == ["produced", "scheduled", "cancelled"]
    pulled = next(e for e in events if e["msg_id"] == plain.id and e["event"] == "pulled")
    assert (pulled["group"], pulled["consumer"], pulled["server"]) == ("billing", "c1", "realtime:rt-1")


async def test_tracing_can_be_switched_off(tmp_path):
    realtime = RealtimeServer(RealtimeConfig(data_dir=str(tmp_path / "rt"), port=0, trace=False))
    await realtime.start()
    client = await RawClient.connect(realtime.port)
    await client.send(Message.create("orders", b"x", now_ms=now_ms()))
    await client.close()
    await realtime.stop()
    assert not (tmp_path / "rt" / "trace").exists()


async def test_each_broadcast_consumer_is_traced_as_a_group_of_its_own(tmp_path):
    realtime = RealtimeServer(RealtimeConfig(data_dir=str(tmp_path / "rt"), port=0))
    await realtime.start()
    client = await RawClient.connect(realtime.port)
    try:
        for consumer in ("a", "b"):
            await client.pull("news", "all", consumer, broadcast=True)
        news = Message.create("news", b"n1", now_ms=now_ms())
        await client.send(news)
        for consumer in ("a", "b"):
            pulled = await client.pull("news", "all", consumer, broadcast=True)
            seq = pulled["pull_seqs"][0]
            await client.ack("news", "all", consumer, [[seq, seq]])
    finally:
        await client.close()
        await realtime.stop()
    events = read_events([tmp_path / "rt" / "trace"])
    pulls = sorted((e["group"], e["consumer"]) for e in events
                   if e["msg_id"] == news.id and e["event"] == "pulled")
    acks = sorted(e["group"] for e in events if e["msg_id"] == news.id and e["event"] == "acked")
    assert pulls == [("all#a", "a"), ("all#b", "b")]
    assert acks == ["all#a", "all#b"]
