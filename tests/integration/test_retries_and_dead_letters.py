"""Nack -> retry through the delay server on the group's backoff -> dead letter, with a real
MetaServer, realtime broker and delay server in-process on port 0."""

from __future__ import annotations

import asyncio
import time

import pytest

from delayserver.config import DelayConfig
from delayserver.server import DelayServer
from metaserver.app import start_metaserver
from metaserver.config import MetaConfig, sqlite_url
from realtime.config import RealtimeConfig
from realtime.server import RealtimeServer
from wire.message import Message, decode_message
from tests.rawclient import RawClient

BACKOFF_MS = (150, 300)


@pytest.fixture
async def cluster(tmp_path):
    meta_config = MetaConfig(db_url=sqlite_url(tmp_path / "meta.db"), port=0)
    async with start_metaserver(meta_config) as meta:
        realtime = RealtimeServer(RealtimeConfig(
            data_dir=str(tmp_path / "rt"), meta_url=meta.url, group="rt-1", port=0,
            retry_backoff_ms=BACKOFF_MS, retries_max=2, heartbeat_interval_ms=200,
        ))
        await realtime.start()
        delay = DelayServer(DelayConfig(data_dir=str(tmp_path / "delay"), meta_url=meta.url,
                                        group="delay-1", port=0, bucket_ms=1000,
                                        heartbeat_interval_ms=200))
        await delay.start()
        client = await RawClient.connect(realtime.port)
        try:
            yield realtime, delay, client
        finally:
            await client.close()
            await delay.stop()
            await realtime.stop()


async def pull_one(client: RawClient, subject: str, group: str, timeout_s: float = 10):
    """Long-poll until one message of ``subject`` arrives; returns (pull_seq, Message, seen at)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        response = await client.pull(subject, group, "c1", start="earliest", wait_ms=1000,
                                     max_count=1)
        if response.get("payloads"):
            return (response["pull_seqs"][0], decode_message(response["payloads"][0]),
                    time.monotonic())
    raise AssertionError(f"nothing arrived on {subject} within {timeout_s} s")


async def nack(client: RawClient, subject: str, group: str, pull_seq: int, **fields):
    return await client.request({"op": "nack", "subject": subject, "group": group,
                                 "consumer_id": "c1", "pull_seqs": [pull_seq], **fields})


async def test_a_message_nacked_every_time_is_retried_on_the_schedule_then_dead(cluster):
    _realtime, _delay, client = cluster
    original = Message.create("orders", b"pay 42", now_ms=int(time.time() * 1000))
    await client.send(original)
    seq, msg, seen = await pull_one(client, "orders", "billing")
    nacked_at = time.monotonic()  # the broker stamps deliver_at after this
    answer = await nack(client, "orders", "billing", seq)
    assert answer["nacked"] == 1

    retry_subject = "%retry%orders%billing"
    gaps = []
    for expected_retries in (1, 2):
        seq, msg, seen = await pull_one(client, retry_subject, "billing")
        assert time.time() * 1000 >= msg.deliver_at_ms
        gaps.append((seen - nacked_at) * 1000)
        assert msg.retries == expected_retries
        assert msg.body == b"pay 42"
        assert msg.properties["qmq-origin-id"] == original.id
        nacked_at = time.monotonic()
        await nack(client, retry_subject, "billing", seq)
    # Never early: each retry arrived no sooner than its step of the schedule.
    assert all(gap >= step for gap, step in zip(gaps, BACKOFF_MS)), gaps

    seq, dead, _ = await pull_one(client, "%dead%orders%billing", "inspector")
    assert dead.retries == 3 and dead.body == b"pay 42"
    # Nothing is left behind on the retry subject or the original.
    assert (await client.pull(retry_subject, "billing", "c1", wait_ms=300))["payloads"] == []
    assert (await client.pull("orders", "billing", "c1"))["payloads"] == []


async def test_an_explicit_retry_delay_overrides_the_schedule(cluster):
    _realtime, _delay, client = cluster
    await client.send(Message.create("orders", b"x", now_ms=int(time.time() * 1000)))
    seq, _msg, _ = await pull_one(client, "orders", "billing")
    nacked_at = time.monotonic()
    await nack(client, "orders", "billing", seq, retry_after_ms=800)
    _seq, retry, seen = await pull_one(client, "%retry%orders%billing", "billing")
    assert retry.retries == 1
    assert (seen - nacked_at) * 1000 >= 800


async def test_a_nack_while_no_delay_server_is_up_fails_and_the_message_stays_unacked(cluster):
    realtime, delay, client = cluster
    await delay.stop()  # deregisters: the MetaServer stops routing retries to it
    await client.send(Message.create("orders", b"x", now_ms=int(time.time() * 1000)))
    seq, _msg, _ = await pull_one(client, "orders", "billing")
    deadline = time.monotonic() + 20
    answer = await nack(client, "orders", "billing", seq)
    while "error" not in answer and time.monotonic() < deadline:  # until the MetaServer expires it
        await asyncio.sleep(0.1)
        answer = await nack(client, "orders", "billing", seq)
    assert answer["error"]["code"] == "overloaded"
    assert "no delay server reachable" in answer["error"]["message"]
    # Still held by c1, so it comes back after the ack timeout rather than being lost.
    held = await realtime.broker.on_pulllog_thread(realtime.broker.pulllog.unacked, "orders", "billing", "c1")
    assert [e.pull_seq for e in held] == [seq]
