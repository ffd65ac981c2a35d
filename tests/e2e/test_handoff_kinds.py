"""The hand-off with a realtime slave of the release before ``fetch.reads`` (docs/REPLICATION.md
8.2 "Record kinds a slave reads"), with real processes: a MetaServer, a realtime group of a
master and an older slave (``tests/e2e/old_release_server.py``: it says nothing of what it
reads), and a delay server handing a hot slot off (``--handoff-lead-ms``). The master refuses
every hold before writing anything, so the delay server sends the messages at their due time:
all arrive, none early, none twice, traced ``dispatched`` by the delay server and never
``handed``. Once the slave is restarted as this release, the master takes holds again."""

from __future__ import annotations

import asyncio
import sys

import pytest

import qmq
from tests.e2e import replication_support as replication
from tests.e2e.replication_support import start_leased_meta
from tests.harness import (
    _LISTEN, Arrivals, Cluster, ServerProcess, consume_into, epoch_ms, spawn, wait_for,
    wait_registered,
)
from tests.rawclient import RawClient
from tracelog.reading import read_events
from wire.message import Message, encode_message

CONSUMER_OPTIONS = {"wait_ms": 500, "heartbeat_interval_ms": 500, "reconnect_backoff_max_ms": 500,
                    "start": "earliest"}
COUNT = 1_200  # a hot slot: more than handoff_min_messages (1,000) due in one step
LEAD_MS = 3_000
AHEAD_MS = 10_000  # the due instant: more than the lead after the sends


def start_old_slave(cluster: Cluster, name: str) -> ServerProcess:
    """A realtime server of ``rt1`` on ``root/<name>`` that says nothing of what it reads."""
    data = cluster.root / name
    data.mkdir(exist_ok=True)
    return cluster.keep(spawn(f"old realtime {name}", [
        sys.executable, "-m", "tests.e2e.old_release_server", "--log-level", "warning",
        "realtime", "--meta", cluster.meta_url, "--data-dir", str(data), "--group", "rt1",
        "--port", "0", "--metrics-port", "0", "--flush", "sync"], _LISTEN))


async def held(port: int) -> bool:
    """Whether the broker at ``port`` holds a message now (a hold answered ``stored``)."""
    due_ms = epoch_ms() + 30_000
    payload = encode_message(Message.create("probe", b"x", now_ms=epoch_ms(),
                                            id=f"probe-{epoch_ms()}", deliver_at_ms=due_ms))
    client = await RawClient.connect(port)
    try:
        answer = await client.request({"op": "hold", "messages": [payload],
                                       "visible_at_ms": [due_ms]})
    finally:
        await client.close()
    return answer.get("results", [{}])[0].get("status") == "stored"


@pytest.mark.timeout(240)
async def test_an_older_slave_pauses_the_hand_off_and_every_message_still_arrives_on_time(
        cluster: Cluster):
    meta = start_leased_meta(cluster)
    master = replication.start_member(cluster, "realtime", "rt1", "a", "--flush", "sync")
    old = await asyncio.to_thread(start_old_slave, cluster, "b")
    delay = cluster.start_delay("d1", "--handoff-lead-ms", str(LEAD_MS))
    await asyncio.to_thread(wait_registered, cluster.meta_url, {("delay", "d1"): "rw"})
    await wait_for(lambda: bool(replication.group_row(meta.url, "rt1")["insync"]), 60,
                   "the older slave in sync", in_thread=True)
    assert not await held(master.port)
    subject = "handoff.kinds"
    arrivals = Arrivals()
    due_ms = epoch_ms() + AHEAD_MS
    async with qmq.Consumer(cluster.meta_url, group="g", **CONSUMER_OPTIONS) as consumer:
        consuming = asyncio.create_task(consume_into(consumer.subscribe(subject), arrivals))
        async with qmq.Producer(cluster.meta_url) as producer:
            receipts = await asyncio.gather(*(
                producer.send(subject, b"m%d" % n, deliver_at=due_ms) for n in range(COUNT)))
        await wait_for(lambda: len(arrivals.ids) >= COUNT, 90, "every message to arrive",
                       interval_s=0.2)
        consuming.cancel()
    assert arrivals.ids == {r.message_id for r in receipts}
    assert arrivals.duplicates() == {} and arrivals.early() == []
    assert "hold refused before any write" in master.text()  # the broker's log says why

    await asyncio.to_thread(old.terminate)  # upgraded: this release on the same data dir
    slave = await asyncio.to_thread(replication.start_member, cluster, "realtime", "rt1", "b",
                                    "--flush", "sync")

    async def holds_taken() -> bool:
        return await held(master.port)

    await wait_for(holds_taken, 60, "holds taken once the slave is upgraded", interval_s=0.5)
    delay.terminate()
    slave.terminate()
    events = [e for e in read_events([cluster.root / "d1" / "trace"])
              if e.get("subject") == subject]
    assert [e for e in events if e["event"] == "handed"] == []
    assert sorted(e["msg_id"] for e in events if e["event"] == "dispatched") == sorted(
        r.message_id for r in receipts)
