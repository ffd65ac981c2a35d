"""Messages handed to a realtime broker ahead of their due time (``hold``) with real ``qmq
realtime`` processes: a kill -9 between the hand-off and the due time loses none and shows
none early, and a slave promoted before the due time makes them visible on time, once."""

from __future__ import annotations

import asyncio

import pytest

from tests.e2e import replication_support as replication
from tests.e2e.replication_support import start_leased_meta
from tests.harness import Cluster, epoch_ms, free_port, wait_for
from tests.rawclient import RawClient
from wire.message import Message, decode_message, encode_message

BROKER_FLAGS = ("--flush", "sync")
HELD = 40


async def hand_off(port: int, subject: str, due_ms: int) -> None:
    """Hold HELD messages due at ``due_ms`` on the broker at ``port``."""
    client = await RawClient.connect(port)
    try:
        messages = [encode_message(Message.create(subject, b"x%d" % n, now_ms=epoch_ms(),
                                                  id=f"h-{n}", deliver_at_ms=due_ms))
                    for n in range(HELD)]
        answer = await client.request({"op": "hold", "messages": messages,
                                       "visible_at_ms": [due_ms] * HELD})
    finally:
        await client.close()
    assert [r["status"] for r in answer["results"]] == ["stored"] * HELD, answer


async def receive_all(port: int, subject: str, due_ms: int) -> list[str]:
    """Long-poll ``subject`` until HELD messages came; every one pulled at or after
    ``due_ms`` (the broker's clock is this host's)."""
    client = await RawClient.connect(port)
    ids: list[str] = []
    try:
        for _ in range(200):
            answer = await client.pull(subject, "g", "c1", wait_ms=1_000, start="earliest")
            if answer.get("error", {}).get("code") == "not_master":
                await asyncio.sleep(0.2)  # a promoted slave learns its role from a heartbeat
                continue
            assert "error" not in answer, answer
            if answer["payloads"]:
                assert epoch_ms() >= due_ms, "a held message was visible before its due time"
                ids += [decode_message(p).id for p in answer["payloads"]]
            if len(ids) >= HELD:
                break
    finally:
        await client.close()
    return ids


@pytest.mark.timeout(120)
async def test_held_messages_survive_a_kill_9_before_their_due_time(cluster: Cluster):
    cluster.start_meta()
    port = free_port()
    broker = cluster.start_broker("rt1", *BROKER_FLAGS, port=port)
    due_ms = epoch_ms() + 6_000
    await hand_off(broker.port, "orders", due_ms)
    await asyncio.to_thread(broker.kill9)
    broker = await asyncio.to_thread(cluster.start_broker, "rt1", *BROKER_FLAGS, port=port)
    ids = await receive_all(broker.port, "orders", due_ms)
    assert sorted(ids) == sorted(f"h-{n}" for n in range(HELD))


@pytest.mark.timeout(180)
async def test_a_slave_promoted_before_the_due_time_makes_the_held_messages_visible(
        cluster: Cluster):
    meta = start_leased_meta(cluster)
    master = replication.start_member(cluster, "realtime", "rt1", "a", *BROKER_FLAGS)
    slave = replication.start_member(cluster, "realtime", "rt1", "b", *BROKER_FLAGS)
    await wait_for(lambda: bool(replication.group_row(meta.url, "rt1")["insync"]), 60,
                   "the slave in sync", in_thread=True)
    epoch = replication.group_row(meta.url, "rt1")["epoch"]
    due_ms = epoch_ms() + 12_000
    await hand_off(master.port, "orders", due_ms)  # answered once the slave has them
    await asyncio.to_thread(master.kill9)
    await wait_for(lambda: replication.group_row(meta.url, "rt1")["epoch"] > epoch, 60,
                   "the promotion", in_thread=True)
    print(f"promoted {due_ms - epoch_ms()} ms before the due time")
    ids = await receive_all(slave.port, "orders", due_ms)
    assert sorted(ids) == sorted(f"h-{n}" for n in range(HELD))
