"""A MetaServer with nothing to change costs no SQL (issue 18): broker heartbeats that repeat
what is stored are answered from memory and their times written by the expiry check; the
failover check skips its read while every group is a lone master. On SQLite and PostgreSQL,
with one fake clock for the wall and the monotonic clock (metaserver/broker_liveness.py).
"""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import update

from metaserver.broker_liveness import FULL_HEARTBEAT_MS
from metaserver.models import BrokerGroup
from metaserver.replication import FAILOVER_QUIET_MS_MAX
from tests.integration.test_metaserver import (  # noqa: F401  (fixtures)
    Api, FakeClock, clock, db_url, serve,
)
from tests.integration.test_metaserver_replication import (
    ADDR, LEASE_MS, M, MARGIN_MS, QUIET, S1, beat, group_row, register,
)

BEAT_MS = 750  # a server's heartbeat interval with the default lease


@pytest.fixture
async def api(db_url: str, clock: FakeClock):
    async with serve(db_url, clock, **QUIET) as client:
        yield client


async def broker_row(api: Api, server: str) -> dict[str, Any]:
    brokers = (await api.ok("GET", "/api/admin/brokers"))["brokers"]
    return next(b for b in brokers if b["server_id"] == server)


async def test_a_lone_masters_repeated_heartbeats_write_nothing_until_the_expiry_check_writes_the_last(
    api: Api, clock: FakeClock
) -> None:
    registry = api.server.registry
    await register(api, M)
    first = await beat(api, M, position=10)
    writes = registry.write_transactions
    for i in range(1, 6):
        clock.advance(BEAT_MS)
        assert await beat(api, M, position=10 + i) == first
    assert registry.write_transactions == writes  # answered from memory
    assert registry.broker_liveness.answered == 5 and registry.broker_liveness.pending == 1
    shown = await broker_row(api, M)  # the admin view shows the noted time and figures
    assert shown["last_heartbeat_ms"] == clock.now_ms and shown["position"] == 15
    await api.expire()  # writes them in its own transaction
    assert registry.broker_liveness.pending == 0
    shown = await broker_row(api, M)
    assert shown["last_heartbeat_ms"] == clock.now_ms and shown["position"] == 15


async def test_a_write_that_changes_the_group_makes_the_next_heartbeat_a_full_one(
    api: Api, clock: FakeClock
) -> None:
    await register(api, M)
    await beat(api, M)
    await beat(api, M)
    await api.ok("POST", "/api/admin/brokers/readonly", {"group": "rt1", "readonly": True})
    assert (await beat(api, M))["state"] == "readonly"
    await register(api, S1)  # a slave joins: the master is told at once
    assert (await beat(api, M))["slaves"] == [S1]


async def test_a_heartbeat_that_says_something_new_is_written_at_once(
    api: Api, clock: FakeClock
) -> None:
    registry = api.server.registry
    await register(api, M)
    await register(api, S1)
    await beat(api, M, insync=[])
    writes = registry.write_transactions
    await beat(api, M, insync=[])
    assert registry.write_transactions == writes
    answer = await beat(api, M, insync=[S1])  # a new in-sync proposal
    assert answer["insync"] == [S1] and answer["lease_required"]
    assert registry.write_transactions == writes + 1


async def test_heartbeats_are_written_in_full_at_least_every_full_heartbeat_interval(
    api: Api, clock: FakeClock
) -> None:
    registry = api.server.registry
    await register(api, M)
    await beat(api, M)
    writes = registry.write_transactions
    beats = FULL_HEARTBEAT_MS // BEAT_MS + 1
    for _ in range(beats):
        clock.advance(BEAT_MS)
        await beat(api, M)
    assert registry.write_transactions == writes + 1


async def test_a_master_with_an_in_sync_slave_writes_every_renewal(
    api: Api, clock: FakeClock
) -> None:
    await register(api, M)
    await register(api, S1)
    await beat(api, M, insync=[S1])
    renewals = (await group_row(api))["lease_renewals"]
    for _ in range(3):
        await beat(api, M, insync=[S1])
    assert (await group_row(api))["lease_renewals"] == renewals + 3


async def test_heartbeat_times_noted_before_a_clean_stop_are_there_after_the_restart(
    db_url: str, clock: FakeClock
) -> None:
    async with serve(db_url, clock, **QUIET) as api:
        await register(api, M)
        await beat(api, M, position=6)
        clock.advance(BEAT_MS)
        await beat(api, M, position=7)
        assert api.server.registry.broker_liveness.pending == 1
    async with serve(db_url, clock, **QUIET) as api:
        shown = await broker_row(api, M)
        assert shown["last_heartbeat_ms"] == clock.now_ms and shown["position"] == 7
        assert api.server.registry.broker_liveness.answered == 0
        await beat(api, M)  # nothing remembered: written in full, as a first heartbeat
        assert api.server.registry.broker_liveness.pending == 0


async def test_the_failover_check_skips_its_read_while_every_group_is_a_lone_master(
    api: Api, clock: FakeClock
) -> None:
    replication = api.server.registry.replication
    await register(api, M)
    await api.server.failover_now()
    await api.server.failover_now()
    assert replication.skipped == 1
    clock.advance(FAILOVER_QUIET_MS_MAX)  # reads again at least this often
    await beat(api, M)
    await api.server.failover_now()
    assert replication.skipped == 1
    await register(api, S1)  # a server joins: the next check reads
    await api.server.failover_now()
    await api.server.failover_now()
    assert replication.skipped == 1


async def test_a_master_that_joins_a_slave_after_a_quiet_spell_still_fails_over(
    api: Api, clock: FakeClock
) -> None:
    await register(api, M)
    for _ in range(3):
        await beat(api, M)
        await api.server.failover_now()
    await register(api, S1)
    await beat(api, M, insync=[S1])
    await beat(api, S1)
    assert await api.server.failover_now() == []  # the lease watch starts
    clock.advance(LEASE_MS + MARGIN_MS)
    await beat(api, S1)
    [promotion] = await api.server.failover_now()
    assert promotion.to_id == S1 and (await group_row(api))["master_id"] == S1
    status, _ = await api.heartbeat("rt1", ADDR[M], server_id=M, epoch=1)
    assert status == 200 and (await beat(api, M, epoch=1))["role"] == "slave"


async def test_a_slave_in_a_group_with_a_lease_is_answered_from_memory_while_its_master_writes_every_renewal(
    api: Api, clock: FakeClock
) -> None:
    registry = api.server.registry
    await register(api, M)
    await register(api, S1)
    await beat(api, M, insync=[S1])
    first = await beat(api, S1, position=5)  # written in full: its answer is remembered
    assert first["role"] == "slave" and first["lease_required"]
    renewals = (await group_row(api))["lease_renewals"]
    writes = registry.write_transactions
    for i in range(1, 4):
        clock.advance(BEAT_MS)
        assert await beat(api, S1, position=5 + i) == first
        await beat(api, M, insync=[S1])  # a renewal: always a write
    assert registry.write_transactions == writes + 3
    assert (await group_row(api))["lease_renewals"] == renewals + 3
    assert (await broker_row(api, S1))["position"] == 8  # noted, shown at once
    await api.expire()
    shown = await broker_row(api, S1)
    assert shown["last_heartbeat_ms"] == clock.now_ms and shown["position"] == 8


async def test_another_metaservers_promotion_reaches_a_remembered_answer_at_the_next_failover_check(
    api: Api, clock: FakeClock
) -> None:
    registry = api.server.registry
    await register(api, M)
    await register(api, S1)
    await beat(api, M, insync=[S1])
    await beat(api, S1)
    await api.server.failover_now()  # reads the rows the answers come from
    assert (await beat(api, S1))["role"] == "slave"
    answered = registry.broker_liveness.answered
    assert answered >= 1
    # Another MetaServer over the same database promotes S1 (no write of this one).
    assert registry.engine is not None
    async with registry.engine.begin() as connection:
        await connection.execute(update(BrokerGroup).where(BrokerGroup.name == "rt1")
                                 .values(master_id=S1, epoch=BrokerGroup.epoch + 1))
    assert (await beat(api, S1))["role"] == "slave"  # still from memory: not read yet
    await api.server.failover_now()
    answer = await beat(api, S1)
    assert answer["role"] == "master" and answer["epoch"] == 2
    assert registry.broker_liveness.answered == answered + 1
