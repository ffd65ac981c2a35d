"""The MetaServer's side of replication over HTTP, on SQLite and PostgreSQL: roles, epochs,
lease watches, promotion, switchover, settings (docs/REPLICATION.md 3-9).

One fake clock drives both the MetaServer's wall clock and its monotonic clock; the background
failover loop is slowed right down, so the tests run the check themselves (``failover_now``).
"""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
from typing import Any

import pytest

from metaserver import MetaConfig, sqlite_url
from metaserver.db import migrations_dir
from tests.integration.test_metaserver import (  # noqa: F401  (fixtures)
    EXPIRY_MS, Api, FakeClock, clock, db_url, serve,
)

LEASE_MS, MARGIN_MS = 3000, 500
QUIET = {"failover_check_interval_ms": 3_600_000, "expiry_check_interval_ms": 3_600_000}
M, S1, S2 = "aaaa000000000001", "bbbb000000000002", "cccc000000000003"
ADDR = {M: "10.0.0.1:20881", S1: "10.0.0.2:20881", S2: "10.0.0.3:20881"}


@pytest.fixture
async def api(db_url: str, clock: FakeClock):
    async with serve(db_url, clock, **QUIET) as client:
        yield client


async def register(api: Api, server: str, group: str = "rt1", **extra: Any) -> dict[str, Any]:
    return await api.register(group, ADDR[server], server_id=server, **extra)


async def beat(api: Api, server: str, group: str = "rt1", *, epoch: int = 1,
               insync: list[str] | None = None, **replica: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"server_id": server, "epoch": epoch}
    if insync is not None or replica:
        body["replica"] = {"insync": insync or [], **replica}
    status, answer = await api.heartbeat(group, ADDR[server], **body)
    assert status == 200, answer
    return answer


async def replicated_group(api: Api) -> None:
    """rt1: master M, slaves S1 and S2, both proposed and recorded in sync."""
    for server in (M, S1, S2):
        await register(api, server)
    answer = await beat(api, M, insync=[S1, S2])
    assert answer["insync"] == [S1, S2] and answer["lease_required"]


async def group_row(api: Api, group: str = "rt1") -> dict[str, Any]:
    rows = (await api.ok("GET", "/api/admin/replication"))["replication"]
    return next(r for r in rows if r["group"] == group)


async def test_the_first_server_is_master_and_the_next_ones_are_slaves_not_in_sync(api: Api):
    first = await register(api, M)
    second = await register(api, S1)
    assert (first["role"], first["epoch"], first["lease_required"]) == ("master", 1, False)
    assert (second["role"], second["master"]) == ("slave", {"server_id": M, "address": ADDR[M]})
    assert second["insync"] == [] and second["lease_ms"] == LEASE_MS
    assert second["replication"] == {"mode": "sync", "min_insync": 0}
    assert second["auth"] is False
    rows = {r["server_id"]: r for r in (await api.ok("GET", "/api/admin/brokers"))["brokers"]}
    assert (rows[M]["role"], rows[S1]["role"], rows[S1]["in_sync"]) == ("master", "slave", False)


async def test_only_the_master_at_the_current_epoch_changes_the_in_sync_set(api: Api):
    for server in (M, S1):
        await register(api, server)
    await beat(api, S1, insync=[S1])  # a slave's proposal counts for nothing
    assert (await group_row(api))["insync"] == []
    await beat(api, M, epoch=0, insync=[S1])  # nor a master's from an older epoch
    assert (await group_row(api))["insync"] == []
    answer = await beat(api, M, insync=[S1])
    assert answer["insync"] == [S1] and answer["lease_required"] is True
    assert (await beat(api, S1))["lease_required"] is True
    assert (await beat(api, M, insync=[]))["lease_required"] is False


async def test_a_master_whose_lease_surely_expired_is_replaced_by_the_most_caught_up_slave(
        api: Api, clock: FakeClock):
    await replicated_group(api)
    await beat(api, S1, position=900)
    await beat(api, S2, position=1000)
    _, before = await api.route("orders")
    await api.server.failover_now()  # first look: the watch starts
    clock.advance(LEASE_MS + MARGIN_MS - 1)
    await beat(api, S1, position=900)
    await beat(api, S2, position=1000)
    assert await api.server.failover_now() == []
    clock.advance(1)
    [promotion] = await api.server.failover_now()
    assert (promotion.from_id, promotion.to_id, promotion.reason) == (M, S2, "lease expired")
    row = await group_row(api)
    assert (row["epoch"], row["master_id"], row["insync"]) == (2, S2, [S1])
    _, after = await api.route("orders")
    assert after["groups"][0]["addresses"] == [ADDR[S2]] and after["groups"][0]["epoch"] == 2
    assert after["version"] == before["version"] + 1
    # The old master learns it is a slave of epoch 2 and gets no lease.
    old = await beat(api, M, insync=[S1, S2])
    assert (old["role"], old["epoch"], old["master"]["server_id"]) == ("slave", 2, S2)
    assert (await group_row(api))["insync"] == [S1], "an old master's proposal is ignored"
    async with api.session.get(api.server.url + "/metrics") as response:
        scraped = await response.text()
    assert 'qmq_meta_failovers_total{reason="lease expired"} 1.0' in scraped
    assert 'qmq_meta_group_epoch{group="rt1"} 2.0' in scraped
    assert 'qmq_meta_group_insync_slaves{group="rt1"} 1.0' in scraped


async def test_renewals_keep_a_master_in_place_however_long_it_lives(api: Api, clock: FakeClock):
    await replicated_group(api)
    for _ in range(10):
        await api.server.failover_now()
        clock.advance(LEASE_MS // 2)
        await beat(api, M, insync=[S1, S2])
        await beat(api, S1)
        await beat(api, S2)
    assert await api.server.failover_now() == []
    assert (await group_row(api))["epoch"] == 1


async def test_a_solo_group_is_never_failed_over(api: Api, clock: FakeClock):
    for server in (M, S1):
        await register(api, server)
    await api.server.failover_now()
    clock.advance(10 * LEASE_MS)
    await beat(api, S1)
    assert await api.server.failover_now() == []
    assert (await group_row(api))["master_id"] == M


async def test_an_offline_slave_is_not_promoted(api: Api, clock: FakeClock):
    await replicated_group(api)
    await api.server.failover_now()
    clock.advance(EXPIRY_MS + 1)  # nobody heartbeats: the slaves are no longer online
    assert await api.server.failover_now() == []
    await beat(api, S1)
    [promotion] = await api.server.failover_now()
    assert promotion.to_id == S1


async def test_a_planned_switchover_hands_over_once_the_master_reports_the_target_ready(
        api: Api):
    await replicated_group(api)
    started = await api.ok("POST", "/api/admin/switchover", {"group": "rt1", "to": S1})
    assert (started["from"], started["to"], started["state"]) == (M, S1, "requested")
    answer = await beat(api, M, insync=[S1, S2])
    assert answer["switchover_to"] == S1 and answer["role"] == "master"
    answer = await beat(api, M, insync=[S1, S2], handover_ready=S1)
    assert (answer["role"], answer["epoch"], answer["switchover_to"]) == ("slave", 2, None)
    row = await group_row(api)
    assert (row["master_id"], row["epoch"]) == (S1, 2)
    assert sorted(row["insync"]) == [M, S2], "the old master holds what the new one holds"
    assert (await beat(api, S1, epoch=1))["role"] == "master"


async def test_a_switchover_to_a_slave_not_in_sync_is_refused_with_409(api: Api):
    for server in (M, S1):
        await register(api, server)
    status, out = await api.post("/api/admin/switchover", {"group": "rt1", "to": S1})
    assert (status, out["error"]["code"]) == (409, "conflict")
    assert "not in sync" in out["error"]["message"]
    status, out = await api.post("/api/admin/switchover", {"group": "nope"})
    assert status == 404


async def test_a_switchover_not_done_by_its_deadline_is_cancelled(api: Api, clock: FakeClock):
    await replicated_group(api)
    await api.ok("POST", "/api/admin/switchover", {"group": "rt1"})
    assert (await group_row(api))["switchover_to"] == S1
    clock.advance(MetaConfig.switchover_timeout_ms + 1)
    for server in (M, S1, S2):
        await beat(api, server, insync=[S1, S2] if server == M else None)
    await api.server.failover_now()
    assert (await group_row(api))["switchover_to"] is None
    assert (await beat(api, M, insync=[S1, S2]))["switchover_to"] is None


async def test_a_master_that_shuts_down_hands_over_to_an_in_sync_slave_at_once(api: Api):
    await replicated_group(api)
    await api.ok("POST", "/api/brokers/deregister",
                 {"group": "rt1", "address": ADDR[M], "server_id": M})
    row = await group_row(api)
    assert row["epoch"] == 2 and row["master_id"] in (S1, S2)


async def test_an_unclean_promotion_waits_for_the_lease_and_takes_a_slave_out_of_sync(
        api: Api, clock: FakeClock):
    for server in (M, S1):
        await register(api, server)
    body = {"group": "rt1", "to": S1, "unclean": True}
    status, out = await api.post("/api/admin/switchover", body)
    assert (status, out["error"]["code"]) == (409, "conflict")
    assert "is online" in out["error"]["message"]


async def test_an_unclean_promotion_needs_a_whole_lease_of_silence_seen_by_this_metaserver(
        api: Api, clock: FakeClock):
    for server in (M, S1):
        await register(api, server)
    clock.advance(EXPIRY_MS + 1)  # the master is gone, but this MetaServer never watched it
    await beat(api, S1)
    body = {"group": "rt1", "to": S1, "unclean": True}
    status, out = await api.post("/api/admin/switchover", body)
    assert status == 409 and "not surely expired" in out["error"]["message"]
    clock.advance(LEASE_MS + MARGIN_MS)
    await beat(api, S1)
    done = await api.ok("POST", "/api/admin/switchover", body)
    assert (done["to"], done["epoch"], done["state"]) == (S1, 2, "done")


async def test_a_group_whose_master_refuses_writes_is_left_out_of_producer_routes(api: Api):
    for server in (M, S1):
        await register(api, server)
    await register(api, S2, group="rt2")
    _, producer = await api.route("pay", role="producer")
    assert sorted(g["group"] for g in producer["groups"]) == ["rt1", "rt2"]
    await beat(api, M, insync=[], writable=False)
    _, producer = await api.route("pay", role="producer")
    _, consumer = await api.route("pay", role="consumer")
    assert [g["group"] for g in producer["groups"]] == ["rt2"]
    assert sorted(g["group"] for g in consumer["groups"]) == ["rt1", "rt2"]


async def test_a_new_group_row_continues_the_epoch_and_trusts_a_slave_about_its_master(api: Api):
    # The database was lost: the slave comes back first and says whom it followed.
    answer = await register(api, S1, epoch=7, role="slave", master_id=M)
    assert (answer["role"], answer["epoch"], answer["master"]["server_id"]) == ("slave", 8, M)
    answer = await register(api, M, epoch=7, role="master")
    assert (answer["role"], answer["epoch"]) == ("master", 8)


async def test_explicit_settings_of_a_server_and_the_admin_api_change_the_group(api: Api):
    await register(api, M, replication={"mode": "async"})
    assert (await group_row(api))["replication"] == "async"
    out = await api.ok("POST", "/api/admin/replication", {"group": "rt1", "min_insync": 1})
    assert out == {"group": "rt1", "replication": "async", "min_insync": 1}
    assert (await beat(api, M))["replication"] == {"mode": "async", "min_insync": 1}
    status, out = await api.post("/api/admin/replication", {"group": "rt1", "min_insync": 17})
    assert status == 400 and "MIN_INSYNC_MAX 16" in out["error"]["message"]


async def test_a_server_id_belongs_to_one_group_and_an_address_to_one_server(api: Api):
    await register(api, M)
    status, out = await api.post("/api/brokers/register", {
        "group": "rt2", "kind": "realtime", "address": "10.0.0.9:1", "server_id": M})
    assert status == 400 and "belongs to group 'rt1'" in out["error"]["message"]
    # A wiped data dir restarted on the same address is a new server; the old row goes offline.
    await api.register("rt1", ADDR[M], server_id="dddd000000000004")
    rows = {r["server_id"]: r["state"] for r in
            (await api.ok("GET", "/api/admin/brokers"))["brokers"]}
    assert rows == {M: "offline", "dddd000000000004": "rw"}


# Several MetaServers share PostgreSQL only; SQLite is for one MetaServer.
@pytest.mark.parametrize("db_url", [pytest.param("postgresql", marks=pytest.mark.postgres)],
                         indirect=True)
async def test_two_metaservers_over_one_postgresql_promote_one_master(db_url: str,
                                                                      clock: FakeClock):
    async with serve(db_url, clock, **QUIET) as a, serve(db_url, clock, **QUIET) as b:
        await replicated_group(a)
        await asyncio.gather(a.server.failover_now(), b.server.failover_now())
        clock.advance(LEASE_MS + MARGIN_MS)
        await beat(a, S1)
        await beat(b, S2)
        results = await asyncio.gather(*(x.server.failover_now() for x in (a, b, a, b)))
        assert sum(len(r) for r in results) == 1, results
        assert (await group_row(b))["epoch"] == 2


def test_migration_0004_gives_existing_brokers_an_id_and_keeps_their_rows(tmp_path) -> None:
    db = tmp_path / "old.db"
    alembic = [sys.executable, "-m", "alembic", "-c", str(migrations_dir() / "alembic.ini"),
               "-x", f"db_url={sqlite_url(db)}"]
    for target in ("0003_schedules", "head"):
        if target == "head":
            with sqlite3.connect(db) as connection:
                connection.execute("INSERT INTO broker_groups VALUES ('rt1', 'realtime', 0, 1)")
                connection.execute(
                    "INSERT INTO brokers (group_name, kind, address, reported_state, state, "
                    "last_heartbeat_ms, registered_at_ms) VALUES "
                    "('rt1', 'realtime', 'h:1', 'rw', 'rw', 1, 1)")
        result = subprocess.run([*alembic, "upgrade", target], capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0, result.stderr
    with sqlite3.connect(db) as connection:
        row = connection.execute("SELECT server_id, role, in_sync FROM brokers").fetchone()
        group = connection.execute("SELECT epoch, master_id, replication FROM broker_groups"
                                   ).fetchone()
    assert row == ("addr:rt1/h:1", "slave", 0)
    assert group == (0, None, "sync")


async def test_a_slave_stopped_at_a_record_it_cannot_decode_shows_in_its_group_row_until_it_is_not(
        api: Api):
    # `qmq admin replication` showed nothing of it (GET /replication on the slave alone did).
    await register(api, M)
    answer = await register(api, S1)
    assert "undecodable_at" in answer["replica_fields"], "a server would never send it"
    at = {"log": "done", "offset": 10, "kind": 1, "version": 9,
          "reason": "kind 1, body version 9: unknown journal body version 9"}
    await beat(api, S1, undecodable_at=at)
    assert (await group_row(api))["undecodable"] == {S1: at}
    await beat(api, S1, insync=[])  # moved past it (upgraded): noted, maybe not written yet
    assert (await group_row(api))["undecodable"] == {}
    await beat(api, S1, undecodable_at={**at, "kind": None, "version": None})
    assert (await group_row(api))["undecodable"] == {S1: {**at, "kind": None, "version": None}}


@pytest.mark.parametrize("bad", [{"log": "done", "offset": -1, "kind": 1, "version": 9,
                                  "reason": ""},
                                 {"log": "Done!", "offset": 1, "kind": 1, "version": 9,
                                  "reason": ""},
                                 {"log": "done", "offset": 1, "kind": 1, "version": 9,
                                  "reason": "x" * 401},
                                 {"log": "done", "offset": 1, "reason": "", "extra": 1}],
                         ids=["negative_offset", "bad_log", "long_reason", "unknown_field"])
async def test_a_bad_undecodable_at_is_refused_400(api: Api, bad: dict[str, Any]):
    await register(api, M)
    await register(api, S1)
    status, answer = await api.heartbeat("rt1", ADDR[S1], server_id=S1, epoch=1,
                                         replica={"undecodable_at": bad})
    assert status == 400 and "undecodable_at" in answer["error"]["message"], answer


async def test_a_slave_stopped_at_a_record_it_cannot_decode_shows_it_in_its_brokers_row(
        api: Api):
    # `qmq admin brokers` lists servers: a slave's row says where its copy stopped, as the
    # group's row of `qmq admin replication` does (it showed nothing of it before session 16).
    await register(api, M)
    await register(api, S1)
    at = {"log": "done", "offset": 10, "kind": 1, "version": 9,
          "reason": "kind 1, body version 9: unknown journal body version 9"}

    async def rows() -> dict[str, Any]:
        return {r["server_id"]: r for r in (await api.ok("GET", "/api/admin/brokers"))["brokers"]}

    assert [row["undecodable_at"] for row in (await rows()).values()] == [None, None]
    await beat(api, S1, undecodable_at=at)
    assert (await rows())[S1]["undecodable_at"] == at
    assert (await rows())[M]["undecodable_at"] is None
    await beat(api, S1, insync=[])  # moved past it: noted, maybe not written yet
    assert (await rows())[S1]["undecodable_at"] is None
    await beat(api, S1, undecodable_at=at)
    await api.expire()  # what was noted in memory is written: the row has it from the table
    assert (await rows())[S1]["undecodable_at"] == at
