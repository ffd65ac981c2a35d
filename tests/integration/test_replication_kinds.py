"""Record kinds a slave reads (docs/REPLICATION.md 8.2, serverkit.kind_gate), on a realtime
group in one process with a real MetaServer. A slave of the release before ``fetch.reads``
says nothing in its fetches (simulated: its message log is built without the gated kinds, so
its fetches carry no ``reads``): while it is in the group the master refuses ``hold`` (and a
``cancel_held`` of a held message) before writing anything, and serves it no held record; once
it is restarted announcing what it reads, holds work and it copies everything."""

from __future__ import annotations

import os
import time
from typing import Any

import aiohttp
import pytest
from prometheus_client import generate_latest

import realtime.server
from metaserver import MetaConfig, sqlite_url, start_metaserver
from realtime.config import RealtimeConfig
from realtime.server import RealtimeServer
from realtime.storage import control_record
from serverkit import server_id
from serverkit.kind_gate import first_unread
from serverkit.replica import Replica
from tests.harness import wait_for
from tests.metricsclient import Scrape
from tests.rawclient import RawClient
from tests.segment_files import read_segment_data
from wire.message import Message, encode_message

MASTER, SLAVE = "00000000000000a1", "00000000000000b2"
LEASE_MS = 2_000
NOTHING: frozenset[int] = frozenset()


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def realtime_server(tmp_path: Any, meta_url: str, me: str) -> RealtimeServer:
    data = tmp_path / me
    data.mkdir(exist_ok=True)
    server_id.write(str(data), bytes.fromhex(me))
    return RealtimeServer(RealtimeConfig(data_dir=str(data), meta_url=meta_url, group="rt1",
                                         port=0, trace=False, heartbeat_interval_ms=200,
                                         metrics_port=0))


async def start_old(server: RealtimeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Start ``server`` as a slave of the release before ``fetch.reads``: its fetches say
    nothing of what it reads."""
    with monkeypatch.context() as patch:
        patch.setattr(realtime.server, "MESSAGE_KINDS", None)
        await server.start()


def replica(server: RealtimeServer) -> Replica:
    assert isinstance(server.replication, Replica)
    return server.replication


async def request(port: int, op: dict[str, Any]) -> dict[str, Any]:
    client = await RawClient.connect(port)
    try:
        return await client.request(op)
    finally:
        await client.close()


def messages(prefix: str, count: int, due_ms: int | None = None) -> list[bytes]:
    return [encode_message(Message.create("orders", b"x", now_ms=now_ms(), id=f"{prefix}-{n}",
                                          deliver_at_ms=due_ms)) for n in range(count)]


async def hold(port: int, prefix: str, count: int = 3) -> dict[str, Any]:
    due_ms = now_ms() + 60_000
    return await request(port, {"op": "hold", "messages": messages(prefix, count, due_ms),
                                "visible_at_ms": [due_ms] * count})


async def send(port: int, prefix: str, count: int = 3) -> None:
    answer = await request(port, {"op": "send", "messages": messages(prefix, count)})
    assert [r["status"] for r in answer["results"]] == ["stored"] * count, answer


def message_log(server: RealtimeServer) -> bytes:
    directory = os.path.join(server.config.data_dir, "messagelog")
    return b"".join(read_segment_data(os.path.join(directory, name))
                    for name in sorted(os.listdir(directory)) if name.endswith(".log"))


def scrape(server: RealtimeServer) -> Scrape:
    return Scrape(generate_latest(server.metrics.registry).decode())


async def status(server: RealtimeServer) -> dict[str, Any]:
    """``GET /replication`` on the server's metrics port."""
    assert server.metrics_listener is not None
    url = f"http://127.0.0.1:{server.metrics_listener.port}/replication"
    async with aiohttp.ClientSession() as session:
        async with session.get(url) as response:
            return await response.json()


def held_records_in(data: bytes) -> bool:
    return first_unread(data, NOTHING, control_record.gated_kind_at) is not None


async def test_a_group_with_a_slave_that_says_nothing_refuses_holds_until_it_is_upgraded(
        tmp_path, monkeypatch):
    config = MetaConfig(db_url=sqlite_url(tmp_path / "m.db"), port=0, lease_ms=LEASE_MS)
    async with start_metaserver(config) as meta:
        master = realtime_server(tmp_path, meta.url, MASTER)
        slave = realtime_server(tmp_path, meta.url, SLAVE)
        await master.start()
        await start_old(slave, monkeypatch)
        try:
            await wait_for(lambda: SLAVE in master.role.insync, 30, "the old slave in sync")
            refused = await hold(master.port, "h")
            assert refused["error"]["code"] == "not_supported", refused
            assert "hold refused before any write" in refused["error"]["message"]
            assert SLAVE in refused["error"]["message"]
            cancel = await request(master.port, {"op": "cancel_held", "subject": "orders",
                                                 "ids": ["h-0"]})
            # Nothing of it is held, so nothing would be written: answered, not refused.
            assert cancel["cancelled"] == [False], cancel
            await send(master.port, "plain")  # plain sends go on
            assert not held_records_in(message_log(master))  # nothing held was written
            assert replica(master).kinds_view()[SLAVE]["message"]["reads"] == []
            assert master.broker.handoffs.kind_refusals.count == 1
            figures = scrape(master)
            assert figures["qmq_replication_slave_reads_kind",
                           {"slave": SLAVE, "log": "message", "kind": "1"}] == 0
            assert figures["qmq_replication_kind_writable", {"log": "message", "kind": "1"}] == 0
            assert figures["qmq_realtime_holds_refused_kinds_total"] == 1
            view = await status(master)
            assert view["slaves"][SLAVE]["message"]["reads"] == []
            assert SLAVE in view["kinds"]["message"]["1"]  # why holds are refused

            await slave.stop()  # upgraded: restarted saying what it reads
            slave = realtime_server(tmp_path, meta.url, SLAVE)
            await slave.start()
            source = replica(master).source
            assert source is not None
            await wait_for(lambda: source.kind_refusal("message", 1) is None, 30,
                           "the upgraded slave said it reads held records")
            held = await hold(master.port, "h")
            assert [r["status"] for r in held["results"]] == ["stored"] * 3, held
            assert replica(master).kinds_view()[SLAVE]["message"]["reads"] == sorted(
                control_record.GATED_KINDS)
            figures = scrape(master)
            assert figures["qmq_replication_slave_reads_kind",
                           {"slave": SLAVE, "log": "message", "kind": "5"}] == 1
            assert figures["qmq_replication_kind_writable", {"log": "message", "kind": "5"}] == 1
            assert (await status(master))["kinds"]["message"] == {"1": None, "3": None,
                                                                  "4": None, "5": None}
            assert (await status(slave))["reads"] == {"message": [1, 3, 4, 5]}
            await wait_for(lambda: message_log(slave) == message_log(master), 30,
                           "the upgraded slave copied the held records")
        finally:
            await slave.stop()
            await master.stop()


async def test_a_slave_that_says_nothing_joining_a_log_with_held_records_copies_up_to_them(
        tmp_path, monkeypatch):
    config = MetaConfig(db_url=sqlite_url(tmp_path / "m.db"), port=0, lease_ms=LEASE_MS)
    async with start_metaserver(config) as meta:
        master = realtime_server(tmp_path, meta.url, MASTER)
        await master.start()
        slave = None
        try:
            await send(master.port, "before")
            held = await hold(master.port, "h")  # no slave yet: nobody to be unable to read it
            assert [r["status"] for r in held["results"]] == ["stored"] * 3, held
            await send(master.port, "after")
            log = message_log(master)
            stop_at = first_unread(log, NOTHING, control_record.gated_kind_at)
            assert stop_at is not None
            slave = realtime_server(tmp_path, meta.url, SLAVE)
            await start_old(slave, monkeypatch)
            follower = replica(slave).follower
            assert follower is not None
            await wait_for(lambda: follower.unreadable_records >= 2, 30,
                           "the old slave's fetches refused at the held record")
            assert message_log(slave) == log[:stop_at[0]]  # whole records, none held
            assert scrape(slave)["qmq_replication_unreadable_records_total"] >= 2
            assert "kind 1" in (await status(slave))["unreadable_why"]
            assert "hold refused" in (await hold(master.port, "h2"))["error"]["message"]
            await slave.stop()
            slave = realtime_server(tmp_path, meta.url, SLAVE)
            await start_old(slave, monkeypatch)  # its store opens again, as it was
            assert message_log(slave)[:stop_at[0]] == log[:stop_at[0]]
            await slave.stop()
            slave = realtime_server(tmp_path, meta.url, SLAVE)
            await slave.start()  # upgraded
            await wait_for(lambda: message_log(slave) == message_log(master), 30,
                           "the upgraded slave copied the rest")
            await wait_for(lambda: SLAVE in master.role.insync, 30, "the slave in sync")
        finally:
            if slave is not None:
                await slave.stop()
            await master.stop()


async def test_a_slave_that_says_nothing_after_copying_held_records_stops_at_their_visible_records(
        tmp_path, monkeypatch):
    # The one upgrade cost left (docs/REPLICATION.md 16): a slave of the release before
    # ``reads`` holds the held records already (copied from its old master); the upgraded master
    # makes them visible at their due time (not gated), and that slave is not served those
    # records: its copy stops there, whole, until it is upgraded.
    config = MetaConfig(db_url=sqlite_url(tmp_path / "m.db"), port=0, lease_ms=LEASE_MS)
    async with start_metaserver(config) as meta:
        master = realtime_server(tmp_path, meta.url, MASTER)
        slave = realtime_server(tmp_path, meta.url, SLAVE)
        await master.start()
        await slave.start()
        try:
            source = replica(master).source
            assert source is not None
            await wait_for(lambda: source.kind_refusal("message", 1) is None, 30,
                           "the slave said it reads held records")
            due_ms = now_ms() + 3_000
            held = await request(master.port, {
                "op": "hold", "messages": messages("h", 3, due_ms), "visible_at_ms": [due_ms] * 3})
            assert [r["status"] for r in held["results"]] == ["stored"] * 3, held
            await wait_for(lambda: message_log(slave) == message_log(master), 30,
                           "the slave copied the held records")
            copied = message_log(slave)
            await slave.stop()
            slave = realtime_server(tmp_path, meta.url, SLAVE)
            await start_old(slave, monkeypatch)
            await wait_for(lambda: master.broker.handoffs.made_visible == 3, 30,
                           "the held messages made visible on the master at their due time")
            follower = replica(slave).follower
            assert follower is not None
            await wait_for(lambda: follower.unreadable_records >= 1, 30,
                           "the slave's fetch refused at the first visible-message record")
            assert message_log(slave) == copied  # nothing past the held records, whole
            stopped = first_unread(message_log(master)[len(copied):], NOTHING,
                                   control_record.gated_kind_at)
            assert stopped is not None and stopped[1] == control_record.KIND_VISIBLE_MESSAGE
        finally:
            await slave.stop()
            await master.stop()
