"""Record kinds a delay slave reads (docs/REPLICATION.md 8.2, serverkit.kind_gate), with a real
MetaServer, a realtime broker and a delay group of two in one process, the hand-off on. While
the delay slave is of the release before ``fetch.reads`` (simulated: its done journal is built
without the gated kinds, so its fetches say nothing), the delay master writes no handed record:
the hand-off pauses and every message is delivered at its due time, none early, none lost,
each traced ``dispatched`` (not ``handed``). Once the slave is restarted announcing what it
reads, messages are handed off again and the slave copies the handed records. Such a slave
joining a journal that holds handed records already copies it up to the first of them, and its
store opens again as it was."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import aiohttp
import pytest

import delayserver.handoff
import delayserver.server
from delayserver.config import DelayConfig
from delayserver.server import DelayServer
from delayserver.storage import done_journal
from metaserver import MetaConfig, sqlite_url, start_metaserver
from qmq.admin_commands import _ADMIN_COLUMNS, admin_command, admin_replication_command
from realtime.config import RealtimeConfig
from realtime.server import RealtimeServer
from serverkit import server_id
from serverkit.kind_gate import first_unread
from serverkit.replica import Replica
from tests.harness import wait_for
from tests.rawclient import RawClient
from tracelog.reading import read_events
from wire.message import Message, decode_message

MASTER, SLAVE, BROKER = "00000000000000d1", "00000000000000d2", "00000000000000e1"
LEASE_MS = 2_000
LEAD_MS = 1_500
COUNT = 20


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def data_dir(tmp_path: Any, me: str) -> str:
    data = tmp_path / me
    data.mkdir(exist_ok=True)
    server_id.write(str(data), bytes.fromhex(me))
    return str(data)


def delay_server(tmp_path: Any, meta_url: str, me: str, **settings: Any) -> DelayServer:
    return DelayServer(DelayConfig(data_dir=data_dir(tmp_path, me), meta_url=meta_url,
                                   group="d1", port=0, bucket_ms=1_000,
                                   heartbeat_interval_ms=200, handoff_lead_ms=LEAD_MS,
                                   handoff_min_messages=1, **settings))


async def start_old(server: DelayServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Start ``server`` as a delay slave of the release before ``fetch.reads``."""
    with monkeypatch.context() as patch:
        patch.setattr(delayserver.server, "DONE_KINDS", None)
        await server.start()


def replica(server: DelayServer) -> Replica:
    assert isinstance(server.replication, Replica)
    return server.replication


def journal(server: DelayServer) -> bytes:
    directory = os.path.join(server.config.data_dir, done_journal.DIRECTORY)
    return b"".join(open(os.path.join(directory, name), "rb").read()
                    for name in sorted(os.listdir(directory)) if name.endswith(".log"))


def handed_records_in(data: bytes) -> bool:
    return first_unread(data, frozenset(), done_journal.gated_kind_at) is not None


async def send_due(port: int, prefix: str, due_ms: int) -> None:
    client = await RawClient.connect(port)
    try:
        answer = await client.send(*(Message.create("orders", b"x", now_ms=now_ms(),
                                                    id=f"{prefix}-{n}", deliver_at_ms=due_ms)
                                     for n in range(COUNT)))
    finally:
        await client.close()
    assert "error" not in answer, answer


async def receive(port: int, prefix: str, due_ms: int) -> list[str]:
    """Long-poll until COUNT messages of ``prefix`` came, each pulled at or after ``due_ms``."""
    client = await RawClient.connect(port)
    ids: list[str] = []
    try:
        for _ in range(100):
            answer = await client.pull("orders", "g", "c1", wait_ms=500, max_count=100)
            assert "error" not in answer, answer
            if answer["payloads"]:
                assert now_ms() >= due_ms, "a message was visible before its due time"
                ids += [decode_message(p).id for p in answer["payloads"]]
            if len([i for i in ids if i.startswith(prefix)]) >= COUNT:
                break
    finally:
        await client.close()
    return sorted(i for i in ids if i.startswith(prefix))


@pytest.mark.timeout(180)
async def test_a_delay_group_with_a_slave_that_says_nothing_delivers_on_time_without_hand_off(
        tmp_path, monkeypatch):
    # The hand-off pauses for at least twice the lead after a refusal, not 30 s (test time).
    monkeypatch.setattr(delayserver.handoff, "NO_HOLD_PAUSE_MS", 0)
    config = MetaConfig(db_url=sqlite_url(tmp_path / "m.db"), port=0, lease_ms=LEASE_MS)
    async with start_metaserver(config) as meta:
        broker = RealtimeServer(RealtimeConfig(data_dir=data_dir(tmp_path, BROKER),
                                               meta_url=meta.url, group="rt1", port=0,
                                               trace=False, heartbeat_interval_ms=200))
        master = delay_server(tmp_path, meta.url, MASTER)
        slave = delay_server(tmp_path, meta.url, SLAVE)
        await broker.start()
        await master.start()
        await start_old(slave, monkeypatch)
        try:
            await wait_for(lambda: SLAVE in master.role.insync, 30, "the old slave in sync")
            due_ms = now_ms() + 2 * LEAD_MS + 1_000
            await send_due(master.port, "old", due_ms)
            expected = sorted(f"old-{n}" for n in range(COUNT))
            assert await receive(broker.port, "old", due_ms) == expected
            scheduler = master.scheduler
            assert scheduler.stats.handed == 0
            assert scheduler.stats.kind_refusals.count >= 1
            assert SLAVE in (scheduler.stats.kind_refusals.why or "")
            assert not handed_records_in(journal(master))
            trace = os.path.join(master.config.data_dir, "trace")

            def traced(event: str) -> list[str]:
                return sorted(e["msg_id"] for e in read_events([trace])
                              if e["event"] == event and e["msg_id"] in expected)

            await wait_for(lambda: traced("dispatched") == expected, 30,
                           "every message traced dispatched (the trace writer flushes)")
            assert traced("handed") == []

            await slave.stop()  # upgraded: restarted saying what it reads
            slave = delay_server(tmp_path, meta.url, SLAVE)
            await slave.start()
            source = replica(master).source
            assert source is not None
            await wait_for(lambda: source.kind_refusal("done", done_journal.KIND_HANDED) is None,
                           30, "the upgraded slave said it reads handed records")
            due_ms = now_ms() + 2 * LEAD_MS + 1_000
            await send_due(master.port, "new", due_ms)
            assert await receive(broker.port, "new", due_ms) == sorted(
                f"new-{n}" for n in range(COUNT))
            assert scheduler.stats.handed == COUNT
            await wait_for(lambda: handed_records_in(journal(slave)), 30,
                           "the slave copied the handed record")
        finally:
            await slave.stop()
            await master.stop()
            await broker.stop()


@pytest.mark.timeout(180)
async def test_a_delay_slave_that_says_nothing_copies_a_journal_up_to_its_first_handed_record(
        tmp_path, monkeypatch):
    config = MetaConfig(db_url=sqlite_url(tmp_path / "m.db"), port=0, lease_ms=LEASE_MS)
    async with start_metaserver(config) as meta:
        broker = RealtimeServer(RealtimeConfig(data_dir=data_dir(tmp_path, BROKER),
                                               meta_url=meta.url, group="rt1", port=0,
                                               trace=False, heartbeat_interval_ms=200))
        master = delay_server(tmp_path, meta.url, MASTER)
        await broker.start()
        await master.start()
        slave = None
        try:
            due_ms = now_ms() + 2 * LEAD_MS + 1_000
            await send_due(master.port, "solo", due_ms)  # no slave: nobody to be unable to read
            assert await receive(broker.port, "solo", due_ms) == sorted(
                f"solo-{n}" for n in range(COUNT))
            assert master.scheduler.stats.handed == COUNT
            written = journal(master)
            stop_at = first_unread(written, frozenset(), done_journal.gated_kind_at)
            assert stop_at is not None
            slave = delay_server(tmp_path, meta.url, SLAVE)
            await start_old(slave, monkeypatch)
            follower = replica(slave).follower
            assert follower is not None
            await wait_for(lambda: follower.unreadable_records >= 2, 30,
                           "the old slave's fetches refused at the first handed record")
            assert journal(slave) == written[:stop_at[0]]  # whole records, none it cannot read
            await slave.stop()
            slave = delay_server(tmp_path, meta.url, SLAVE)
            await start_old(slave, monkeypatch)  # its store opens again, as it was
            assert journal(slave) == written[:stop_at[0]]
            await slave.stop()
            slave = delay_server(tmp_path, meta.url, SLAVE)
            await slave.start()  # upgraded
            await wait_for(lambda: journal(slave) == journal(master), 30,
                           "the upgraded slave copied the rest of the journal")
        finally:
            if slave is not None:
                await slave.stop()
            await master.stop()
            await broker.stop()


@pytest.mark.timeout(180)
async def test_a_delay_slave_stopped_at_a_journal_record_it_cannot_decode_says_where_and_why(
        tmp_path, capsys):
    # review s13 rvmends-3: such a record (a later release's body version, here written into
    # the master's journal as its bug would) stopped the copy for good, counted and logged as
    # a CRC error every few seconds.
    from prometheus_client import generate_latest
    from tests.metricsclient import Scrape

    config = MetaConfig(db_url=sqlite_url(tmp_path / "m.db"), port=0, lease_ms=LEASE_MS)
    async with start_metaserver(config) as meta:
        master = delay_server(tmp_path, meta.url, MASTER)
        slave = delay_server(tmp_path, meta.url, SLAVE, metrics_port=0)
        await master.start()
        await slave.start()
        try:
            await wait_for(lambda: SLAVE in master.role.insync, 30, "the slave in sync")
            body = bytearray(done_journal.encode_journal_record(
                done_journal.KIND_DISPATCHED, 1_000, [1], [2], [3], {}))
            body[1] = done_journal.BODY_VERSION + 1  # a later release's

            def write_it(store: Any) -> int:
                log = store._journal.log
                at = log.end_offset
                log.append_many([bytes(body)])
                log.sync()
                return at

            at = await master.scheduler.on_io(write_it, master.scheduler.store)
            follower = replica(slave).follower
            assert follower is not None
            await wait_for(lambda: follower.undecodable_records >= 2, 30,
                           "the slave's copy stopped at the record")
            assert follower.ends["done"] == at, "the copy stops exactly at the record"
            assert follower.crc_errors == 0
            metrics = Scrape(generate_latest(slave.metrics.registry).decode())
            assert metrics["qmq_replication_undecodable_records_total"] >= 2
            assert metrics["qmq_replication_crc_errors_total"] == 0
            assert slave.metrics_listener is not None
            url = f"http://127.0.0.1:{slave.metrics_listener.port}/replication"
            async with aiohttp.ClientSession() as session:
                async with session.get(url) as response:
                    shown = (await response.json())["undecodable_at"]
            assert {k: shown[k] for k in ("log", "offset", "kind", "version")} == {
                "log": "done", "offset": at, "kind": done_journal.KIND_DISPATCHED,
                "version": done_journal.BODY_VERSION + 1}
            # ... and the MetaServer's admin view, so `qmq admin replication` (review s14)
            await wait_for_row(meta.url, lambda row: row["undecodable"] == {SLAVE: shown},
                               "the slave's place in the admin view")
            assert await admin_replication_command(meta.url, [], mode=None,
                                                   min_insync=None) == 0
            table = capsys.readouterr().out
            assert f"{SLAVE}:done@{at}" in table, table
            # ... and the slave's own row of `qmq admin brokers` (session 16)
            assert await admin_command(meta.url, "brokers", False, []) == 0
            rows = [line for line in capsys.readouterr().out.splitlines() if SLAVE in line]
            version = done_journal.BODY_VERSION + 1
            assert len(rows) == 1 and f"done@{at}/v{version}" in rows[0], rows
            # One word per cell: the row splits into the header's columns (for awk and cut).
            header = _ADMIN_COLUMNS["brokers"]
            cells = dict(zip(header, rows[0].split()))
            assert len(rows[0].split()) == len(header), rows
            assert cells["undecodable"] == f"done@{at}/v{version}", cells
        finally:
            await slave.stop()
            await master.stop()


async def wait_for_row(meta_url: str, check: Any, what: str) -> None:
    """Wait until GET /api/admin/replication's row of group d1 passes ``check``."""
    from qmq.commands import admin_request

    async def row() -> dict[str, Any]:
        rows = (await admin_request(meta_url, "GET", "/api/admin/replication"))["replication"]
        return next(r for r in rows if r["group"] == "d1")

    deadline = time.monotonic() + 30
    while not check(await row()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {await row()}"
        await asyncio.sleep(0.1)
