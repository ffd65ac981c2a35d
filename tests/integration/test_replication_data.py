"""The data plane of a realtime group, in one process with a real MetaServer: a slave copies
the master's message log and pull-log actions, a ``sync`` write waits for it, ``min_insync``
refuses writes while no slave is in sync, and a promoted slave serves what it copied
(docs/REPLICATION.md 7, 8)."""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import Any

import aiohttp

from metaserver import MetaConfig, sqlite_url, start_metaserver
from pulllog import PullLogConfig
from pulllog.config import SEGMENT_SIZE_BYTES_MIN
from realtime.config import RealtimeConfig
from realtime.server import RealtimeServer
from serverkit import server_id
from serverkit.replica import Replica
from tests.harness import wait_for
from tests.rawclient import RawClient
from tests.segment_files import read_segment_data
from wire.message import Message, decode_message, encode_message

FIRST, SECOND = "00000000000000a1", "00000000000000b2"
LEASE_MS = 2_000


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def realtime(tmp_path: Any, meta_url: str, me: str, **settings: Any) -> RealtimeServer:
    data = tmp_path / me
    data.mkdir(exist_ok=True)
    server_id.write(str(data), bytes.fromhex(me))
    return RealtimeServer(RealtimeConfig(data_dir=str(data), meta_url=meta_url, group="rt1",
                                         port=0, trace=False, heartbeat_interval_ms=200,
                                         **settings))


async def send(port: int, ids: list[str]) -> list[dict[str, Any]]:
    client = await RawClient.connect(port)
    try:
        payloads = [encode_message(Message.create("orders", b"x", now_ms=now_ms(), id=i))
                    for i in ids]
        answer = await client.request({"op": "send", "messages": payloads})
    finally:
        await client.close()
    if "error" in answer:
        return [answer["error"]]
    return answer["results"]


async def wait_accepted(port: int, what: str) -> None:
    """Send until the master at ``port`` stores a message (min_insync met again)."""

    async def accepted() -> bool:
        return (await send(port, ["b"]))[0].get("status") == "stored"

    await wait_for(accepted, 30, what)


async def admin(url: str, method: str, path: str, body: Any = None) -> Any:
    async with aiohttp.ClientSession() as session:
        async with session.request(method, url + path, json=body) as response:
            return await response.json()


def replica(server: RealtimeServer) -> Replica:
    assert isinstance(server.replication, Replica)
    return server.replication


async def test_a_slave_copies_the_master_and_serves_what_it_copied_once_switched_over(tmp_path):
    config = MetaConfig(db_url=sqlite_url(tmp_path / "m.db"), port=0, lease_ms=LEASE_MS)
    async with start_metaserver(config) as meta:
        first = realtime(tmp_path, meta.url, FIRST)
        second = realtime(tmp_path, meta.url, SECOND)
        await first.start()
        await second.start()
        try:
            assert (first.role.role, second.role.role) == ("master", "slave")
            stored = await send(first.port, [f"m-{n}" for n in range(20)])
            assert [r["status"] for r in stored] == ["stored"] * 20
            client = await RawClient.connect(first.port)
            pulled = await client.pull("orders", "g", "c1", max_count=5, start="earliest")
            assert len(pulled["pull_seqs"]) == 5
            acked = await client.ack("orders", "g", "c1", [[pulled["pull_seqs"][0],
                                                            pulled["pull_seqs"][-1]]])
            assert acked["acked"] == 5
            await client.close()
            await wait_for(lambda: SECOND in first.role.insync, 20, "the slave in sync")
            # Under sync, a send is answered once the in-sync slave has it.
            more = await send(first.port, [f"m-{n}" for n in range(20, 30)])
            assert [r["status"] for r in more] == ["stored"] * 10
            source = replica(first).source
            assert source is not None
            assert source.tracker.acked(SECOND, "message") >= source.ends["message"]
            started = await admin(meta.url, "POST", "/api/admin/switchover",
                                  {"group": "rt1", "to": SECOND})
            assert started["state"] == "requested", started
            await wait_for(lambda: second.role.role == "master" and second.role.active, 30,
                           "the slave promoted")
            resent = await send(second.port, ["m-3", "m-30"])
            assert [r["status"] for r in resent] == ["duplicate", "stored"]
            client = await RawClient.connect(second.port)
            pulled = await client.pull("orders", "g", "c1", max_count=100)
            await client.close()
            # The five acked are not handed out again; the rest are, and the new one.
            ids = [decode_message(p).id for p in pulled["payloads"]]
            assert ids == [f"m-{n}" for n in range(5, 31)], ids
        finally:
            await second.stop()
            await first.stop()


async def test_min_insync_refuses_sends_while_no_slave_is_in_sync_and_accepts_them_after(
        tmp_path):
    config = MetaConfig(db_url=sqlite_url(tmp_path / "m.db"), port=0, lease_ms=LEASE_MS)
    async with start_metaserver(config) as meta:
        first = realtime(tmp_path, meta.url, FIRST, min_insync=1)
        await first.start()
        second = None
        try:
            refused = await send(first.port, ["a"])
            assert refused[0]["code"] == "not_enough_replicas", refused
            second = realtime(tmp_path, meta.url, SECOND)
            await second.start()
            await wait_accepted(first.port, "a send accepted with the slave in sync")
        finally:
            if second is not None:
                await second.stop()
            await first.stop()


async def pull_ids(port: int, group: str) -> list[str]:
    client = await RawClient.connect(port)
    try:
        pulled = await client.pull("orders", group, "c1", max_count=100, start="earliest")
    finally:
        await client.close()
    return [decode_message(p).id for p in pulled["payloads"]]


async def test_an_old_master_rejoins_as_a_slave_cutting_the_tail_the_new_master_lacks(
        tmp_path, caplog):
    config = MetaConfig(db_url=sqlite_url(tmp_path / "m.db"), port=0, lease_ms=LEASE_MS)
    async with start_metaserver(config) as meta:
        first = realtime(tmp_path, meta.url, FIRST)
        second = realtime(tmp_path, meta.url, SECOND)
        await first.start()
        await second.start()
        await wait_for(lambda: SECOND in first.role.insync, 20, "the slave in sync")
        await send(first.port, [f"both-{n}" for n in range(10)])
        await second.stop()
        await wait_for(lambda: first.role.insync == (), 30, "the slave out of the in-sync set")
        # A tail only the old master has: acknowledged by it alone (min_insync 0, degraded).
        tail = await send(first.port, [f"tail-{n}" for n in range(5)])
        assert [r["status"] for r in tail] == ["stored"] * 5
        await first.stop()
        second = realtime(tmp_path, meta.url, SECOND)
        await second.start()

        async def promoted() -> bool:
            answer = await admin(meta.url, "POST", "/api/admin/switchover",
                                 {"group": "rt1", "to": SECOND, "unclean": True})
            return answer.get("state") == "done" or second.role.role == "master"

        await wait_for(promoted, 30, "an unclean promotion once the old lease expired",
                       interval_s=0.5)
        await wait_for(lambda: second.role.role == "master" and second.role.active, 30,
                       "the new master serving")
        await send(second.port, [f"new-{n}" for n in range(3)])
        first = realtime(tmp_path, meta.url, FIRST)
        await first.start()
        try:
            assert first.role.role == "slave"
            await wait_for(lambda: FIRST in second.role.insync, 30, "the old master in sync")
            assert any("diverged" in r.getMessage() for r in caplog.records)
            started = await admin(meta.url, "POST", "/api/admin/switchover",
                                  {"group": "rt1", "to": FIRST})
            assert started["state"] == "requested", started
            await wait_for(lambda: first.role.role == "master" and first.role.active, 30,
                           "the old master promoted back")
            ids = await pull_ids(first.port, "fresh")
            assert ids == [f"both-{n}" for n in range(10)] + [f"new-{n}" for n in range(3)]
        finally:
            await first.stop()
            await second.stop()


def message_log_bytes(server: RealtimeServer) -> bytes:
    directory = os.path.join(server.config.data_dir, "messagelog")
    return b"".join(read_segment_data(os.path.join(directory, name))
                    for name in sorted(os.listdir(directory)) if name.endswith(".log"))


async def test_a_byte_rotting_in_a_running_slaves_copy_is_found_by_the_scrub_and_fetched_again(
        tmp_path):
    config = MetaConfig(db_url=sqlite_url(tmp_path / "m.db"), port=0, lease_ms=LEASE_MS)
    async with start_metaserver(config) as meta:
        first = realtime(tmp_path, meta.url, FIRST)
        # Passes 100 ms apart (an hour by default), at the default pace.
        second = realtime(tmp_path, meta.url, SECOND, scrub_pause_ms=100)
        await first.start()
        await second.start()
        try:
            await wait_for(lambda: SECOND in first.role.insync, 20, "the slave in sync")
            await send(first.port, [f"m-{n}" for n in range(200)])
            await wait_for(lambda: message_log_bytes(second) == message_log_bytes(first), 20,
                           "the copy complete")
            directory = os.path.join(second.config.data_dir, "messagelog")
            segment = os.path.join(directory, sorted(os.listdir(directory))[0])
            with open(segment, "r+b") as f:
                f.seek(1_000)
                byte = f.read(1)
                f.seek(1_000)
                f.write(bytes([byte[0] ^ 0x01]))
            follower = replica(second).follower
            assert follower is not None
            passes = follower.scrub_passes
            await wait_for(lambda: follower.scrub_repairs >= 1, 30, "the scrub to find it")
            await wait_for(lambda: follower.scrub_passes > passes, 30, "passes to go on")
            await wait_for(lambda: message_log_bytes(second) == message_log_bytes(first), 30,
                           "the rotten record fetched again")
        finally:
            await second.stop()
            await first.stop()


async def test_a_fetcher_that_is_no_slave_of_the_group_never_lets_min_insync_writes_through(
        tmp_path, caplog):
    # An admin token may fetch, but only the group's registered slaves count as holding a
    # write: a stranger that fetches every log to its end does not make a min_insync 1 master
    # accept sends, and a real slave then does.
    caplog.set_level(logging.INFO, logger="serverkit.replica_source")
    config = MetaConfig(db_url=sqlite_url(tmp_path / "m.db"), port=0, lease_ms=LEASE_MS)
    stranger = "00000000000000c3"
    async with start_metaserver(config) as meta:
        first = realtime(tmp_path, meta.url, FIRST, min_insync=1)
        await first.start()
        second = None
        client = await RawClient.connect(first.port)
        try:
            for _ in range(20):  # a few rounds at the end of both logs, 50 ms apart
                for name in ("message", "actions"):
                    answer = await client.request({
                        "op": "fetch", "server_id": stranger, "epoch": first.role.epoch,
                        "log": name, "offset": 0, "last_epoch": 0, "max_bytes": 1 << 20,
                        "wait_ms": 50})
                    assert "error" not in answer, answer  # served: the token is an admin one
            source = replica(first).source
            assert source is not None
            assert source.tracker.acked(stranger, "message") == 0
            assert stranger not in source.tracker.slaves
            refused = await send(first.port, ["a"])
            assert refused[0]["code"] == "not_enough_replicas", refused
            assert any(f"{stranger} fetches with an admin token but is not (yet) a registered"
                       in r.getMessage() for r in caplog.records)
            second = realtime(tmp_path, meta.url, SECOND)
            await second.start()
            await wait_accepted(first.port, "a send accepted with a real slave in sync")
        finally:
            await client.close()
            if second is not None:
                await second.stop()
            await first.stop()


def action_segments(server: RealtimeServer) -> list[str]:
    directory = os.path.join(server.config.data_dir, "pulllog", "actions")
    return sorted(name for name in os.listdir(directory) if name.endswith(".log"))


async def test_a_slave_joining_after_the_masters_actions_were_retired_installs_a_snapshot(
        tmp_path, monkeypatch, caplog):
    # Small action segments, a checkpoint every 50 actions and one kept: the master retires
    # its oldest actions quickly, so a slave that joins late cannot copy them from offset 0.
    monkeypatch.setattr("realtime.broker.PullLogConfig", functools.partial(
        PullLogConfig, segment_size_bytes_max=SEGMENT_SIZE_BYTES_MIN, checkpoint_every_actions=50,
        checkpoints_kept=1))
    config = MetaConfig(db_url=sqlite_url(tmp_path / "m.db"), port=0, lease_ms=LEASE_MS)
    async with start_metaserver(config) as meta:
        first = realtime(tmp_path, meta.url, FIRST)
        await first.start()
        second = None
        try:
            stored = (await send(first.port, [f"old-{n}" for n in range(150)])
                      + await send(first.port, [f"old-{n}" for n in range(150, 300)]))
            assert [r.get("status") for r in stored] == ["stored"] * 300, stored[:2]
            client = await RawClient.connect(first.port)
            try:
                for _ in range(300):  # one pull and one ack per message: 600 actions
                    pulled = await client.pull("orders", "g", "c1", max_count=1,
                                               start="earliest")
                    if not pulled["pull_seqs"]:
                        break
                    seq = pulled["pull_seqs"][0]
                    assert (await client.ack("orders", "g", "c1", [[seq, seq]]))["acked"] == 1
                await send(first.port, [f"new-{n}" for n in range(20)])
                pulled = await client.pull("orders", "g", "c1", max_count=5)
                seqs = pulled["pull_seqs"]
                assert [decode_message(p).id for p in pulled["payloads"]] == \
                    [f"new-{n}" for n in range(5)]
                assert (await client.ack("orders", "g", "c1", [[seqs[0], seqs[-1]]]))["acked"] \
                    == 5
            finally:
                await client.close()
            # The master's first action segment is gone: offset 0 is past its retention.
            assert action_segments(first)[0] != "00000000000000000000.log", action_segments(first)

            second = realtime(tmp_path, meta.url, SECOND)
            await second.start()
            await wait_for(lambda: SECOND in first.role.insync, 30, "the late slave in sync")
            assert any("installed the master's checkpoint" in r.getMessage()
                       for r in caplog.records), "no snapshot was installed"
            # It tails after the snapshot: an ack made now reaches it too.
            client = await RawClient.connect(first.port)
            try:
                pulled = await client.pull("orders", "g", "c1", max_count=5)
                seqs = pulled["pull_seqs"]
                assert (await client.ack("orders", "g", "c1", [[seqs[0], seqs[-1]]]))["acked"] \
                    == 5
            finally:
                await client.close()
            started = await admin(meta.url, "POST", "/api/admin/switchover",
                                  {"group": "rt1", "to": SECOND})
            assert started["state"] == "requested", started
            await wait_for(lambda: second.role.role == "master" and second.role.active, 30,
                           "the late slave promoted")
            client = await RawClient.connect(second.port)
            try:
                pulled = await client.pull("orders", "g", "c1", max_count=100)
            finally:
                await client.close()
            # Nothing acknowledged comes back (no old-*, none of new-0..9), nothing is lost.
            ids = [decode_message(p).id for p in pulled["payloads"]]
            assert ids == [f"new-{n}" for n in range(10, 20)], ids
        finally:
            if second is not None:
                await second.stop()
            await first.stop()


async def send_to(port: int, subject: str, ids: list[str]) -> list[dict[str, Any]]:
    client = await RawClient.connect(port)
    try:
        payloads = [encode_message(Message.create(subject, b"x", now_ms=now_ms(), id=i))
                    for i in ids]
        answer = await client.request({"op": "send", "messages": payloads})
    finally:
        await client.close()
    return [answer["error"]] if "error" in answer else answer["results"]


async def consume(port: int, subject: str, count: int, max_count: int) -> list[str]:
    """Pull and ack up to ``count`` messages of ``subject`` for group g, ``max_count`` a pull."""
    ids: list[str] = []
    client = await RawClient.connect(port)
    try:
        for _ in range(count):
            if len(ids) >= count:
                break
            pulled = await client.pull(subject, "g", "c1", max_count=min(max_count, count - len(ids)),
                                       start="earliest")
            seqs = pulled["pull_seqs"]
            if not seqs:
                break
            ids += [decode_message(p).id for p in pulled["payloads"]]
            assert (await client.ack(subject, "g", "c1", [[seqs[0], seqs[-1]]]))["acked"] \
                == len(seqs)
    finally:
        await client.close()
    return ids


def log_segments(server: RealtimeServer, *parts: str) -> list[str]:
    directory = os.path.join(server.config.data_dir, *parts)
    return sorted(name for name in os.listdir(directory) if name.endswith(".log"))


async def test_a_slave_joining_after_the_masters_oldest_message_segments_were_deleted_copies_the_rest(
        tmp_path, monkeypatch, caplog):
    # Small message and action segments and a retention that deletes every consumed segment at
    # once: a slave that joins late can copy neither log from offset 0. Subject "early" lives
    # only in deleted segments, so the slave never sees one of its records.
    caplog.set_level(logging.WARNING)
    monkeypatch.setattr("realtime.broker.PullLogConfig", functools.partial(
        PullLogConfig, segment_size_bytes_max=SEGMENT_SIZE_BYTES_MIN, checkpoint_every_actions=50,
        checkpoints_kept=1))
    settings = {"segment_size_bytes_max": 2048, "retention_ms": 1,
                "retention_check_interval_ms": 100}
    config = MetaConfig(db_url=sqlite_url(tmp_path / "m.db"), port=0, lease_ms=LEASE_MS)
    async with start_metaserver(config) as meta:
        first = realtime(tmp_path, meta.url, FIRST, **settings)
        await first.start()
        second = None
        try:
            for subject in ("early", "orders"):  # group g exists: retention keeps its backlog
                assert await consume(first.port, subject, 1, 1) == []
            early = [f"early-{n}" for n in range(60)]
            old = [f"old-{n}" for n in range(200)]
            for subject, ids in (("early", early), ("orders", old)):
                for at in range(0, len(ids), 100):
                    stored = await send_to(first.port, subject, ids[at:at + 100])
                    assert {r.get("status") for r in stored} == {"stored"}, stored[:2]
            assert await consume(first.port, "early", 60, 3) == early
            assert await consume(first.port, "orders", 200, 3) == old
            await send(first.port, [f"new-{n}" for n in range(20)])
            assert await consume(first.port, "orders", 5, 5) == [f"new-{n}" for n in range(5)]

            def retired() -> bool:
                return (log_segments(first, "messagelog")[0] != "00000000000000000000.log"
                        and log_segments(first, "pulllog", "actions")[0]
                        != "00000000000000000000.log")

            await wait_for(retired, 30, "the oldest message and action segments deleted")
            # Retention spares the segment with new-*: every deleted one held only consumed
            # records, among them every "early" one.
            second = realtime(tmp_path, meta.url, SECOND, **settings)
            await second.start()
            await wait_for(lambda: SECOND in first.role.insync, 30, "the late slave in sync")
            messages = [r.getMessage() for r in caplog.records]
            assert any("message copy installed the master's checkpoint" in m
                       for m in messages), messages
            assert any("installed the master's checkpoint" in m for m in messages), messages
            assert await consume(first.port, "orders", 5, 5) == [f"new-{n}" for n in range(5, 10)]
            started = await admin(meta.url, "POST", "/api/admin/switchover",
                                  {"group": "rt1", "to": SECOND})
            assert started["state"] == "requested", started
            await wait_for(lambda: second.role.role == "master" and second.role.active, 30,
                           "the late slave promoted")
            # Nothing acknowledged comes back, nothing is lost ...
            assert await consume(second.port, "orders", 100, 100) == \
                [f"new-{n}" for n in range(10, 20)]
            # ... and a subject whose every record was deleted before the slave joined goes on
            # from the master's sequence: group g, past all 60, gets the next one.
            assert {r.get("status") for r in await send_to(second.port, "early",
                                                           ["early-60"])} == {"stored"}
            assert await consume(second.port, "early", 100, 100) == ["early-60"]
        finally:
            if second is not None:
                await second.stop()
            await first.stop()
