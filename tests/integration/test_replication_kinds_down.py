"""A registered slave that is DOWN (crashed: still listed, offline) when its master restarts,
or fails over, does not keep the group's gated record kinds unwritten for its whole outage
(review rvdelay-2; docs/REPLICATION.md 8.2): a cancel of ids the broker does not hold writes
nothing and is answered at once, and once ``UNHEARD_GRACE_MS`` passed without a fetch from it
the slave is taken to be down: holds and cancels of held messages work again. The same after a
failover (the dead old master is the slave not heard from), and on a delay group: a delay master restarted while its slave is down writes the gated done-journal
kinds again after the grace. A real MetaServer, servers in one process."""

from __future__ import annotations

from typing import Any

import pytest

from delayserver.storage import done_journal
from metaserver import MetaConfig, sqlite_url, start_metaserver
from serverkit import kind_gate
from tests.harness import wait_for
from tests.integration import test_replication_kinds_delay as delay
from tests.integration.test_replication_kinds import (
    LEASE_MS, MASTER, SLAVE, hold, realtime_server, replica, request)

GRACE_MS = 1_500  # the grace, short for the test (the default is 15 s)


async def crash(server: Any) -> None:
    """Stop without deregistering: the MetaServer keeps the server listed, as after kill -9."""
    real = server.registration.stop

    async def no_deregister(deregister: bool = True) -> bool:
        return await real(deregister=False)
    server.registration.stop = no_deregister
    await server.stop()


async def cancel(port: int, ids: list[str]) -> dict[str, Any]:
    return await request(port, {"op": "cancel_held", "subject": "orders", "ids": ids})


async def a_pair_holding_three(tmp_path: Any, meta_url: str) -> tuple[Any, Any]:
    """A realtime master and its in-sync slave, which reads every kind, the master holding
    h-0, h-1 and h-2 (both stopped again when that fails)."""
    master = realtime_server(tmp_path, meta_url, MASTER)
    slave = realtime_server(tmp_path, meta_url, SLAVE)
    await master.start()
    await slave.start()
    try:
        source = replica(master).source
        await wait_for(lambda: SLAVE in master.role.insync
                       and source.kind_refusal("message", 5) is None, 30, "slave reads")
        held = await hold(master.port, "h")
        assert [r["status"] for r in held["results"]] == ["stored"] * 3, held
    except BaseException:
        await master.stop()
        await slave.stop()
        raise
    return master, slave


@pytest.mark.timeout(180)
async def test_a_crashed_slave_does_not_block_cancels_and_holds_after_the_master_restarts(
        tmp_path, monkeypatch):
    monkeypatch.setattr(kind_gate, "UNHEARD_GRACE_MS", GRACE_MS)
    config = MetaConfig(db_url=sqlite_url(tmp_path / "m.db"), port=0, lease_ms=LEASE_MS)
    async with start_metaserver(config) as meta:
        master, slave = await a_pair_holding_three(tmp_path, meta.url)
        try:
            await crash(slave)
            await crash(master)
            master = realtime_server(tmp_path, meta.url, MASTER)  # restarted (a deploy)
            await master.start()
            await wait_for(lambda: master.role.role == "master" and master.role.active, 60,
                           "master again")
            source = replica(master).source
            assert SLAVE in (source.kind_refusal("message", 5) or ""), "within the grace"
            # Ids it does not hold write nothing: answered at once, even within the grace.
            answer = await cancel(master.port, ["never-held"])
            assert answer.get("cancelled") == [False], answer
            await wait_for(lambda: source.kind_refusal("message", 5) is None, 60,
                           "the down slave no longer counts")
            answer = await cancel(master.port, ["h-0"])
            assert answer.get("cancelled") == [True], answer
            held = await hold(master.port, "again")
            assert [r["status"] for r in held["results"]] == ["stored"] * 3, held
        finally:
            await master.stop()


@pytest.mark.timeout(180)
async def test_after_a_failover_the_dead_old_master_does_not_block_cancels_and_holds(
        tmp_path, monkeypatch):
    """The promoted slave heard from nobody: the old master, dead but still listed, is a slave
    it has never heard from."""
    monkeypatch.setattr(kind_gate, "UNHEARD_GRACE_MS", GRACE_MS)
    config = MetaConfig(db_url=sqlite_url(tmp_path / "m.db"), port=0, lease_ms=LEASE_MS)
    async with start_metaserver(config) as meta:
        master, slave = await a_pair_holding_three(tmp_path, meta.url)
        try:
            source = replica(master).source
            await wait_for(lambda: source.tracker.acked(SLAVE, "message")
                           >= source.ends["message"], 30, "the slave has the held records")
            await crash(master)
            await wait_for(lambda: slave.role.role == "master" and slave.role.active, 60,
                           "the slave promoted")
            answer = await cancel(slave.port, ["never-held"])
            assert answer.get("cancelled") == [False], answer
            promoted = replica(slave).source
            await wait_for(lambda: promoted.kind_refusal("message", 5) is None, 60,
                           "the dead old master no longer counts")
            answer = await cancel(slave.port, ["h-0"])
            assert answer.get("cancelled") == [True], answer
            held = await hold(slave.port, "again")
            assert [r["status"] for r in held["results"]] == ["stored"] * 3, held
        finally:
            await slave.stop()


@pytest.mark.timeout(180)
async def test_a_delay_master_restarted_while_its_slave_is_down_writes_the_gated_kinds_again(
        tmp_path, monkeypatch):
    monkeypatch.setattr(kind_gate, "UNHEARD_GRACE_MS", GRACE_MS)
    config = MetaConfig(db_url=sqlite_url(tmp_path / "m.db"), port=0, lease_ms=LEASE_MS)
    async with start_metaserver(config) as meta:
        master = delay.delay_server(tmp_path, meta.url, delay.MASTER)
        slave = delay.delay_server(tmp_path, meta.url, delay.SLAVE)
        await master.start()
        await slave.start()
        try:
            kinds = sorted(done_journal.GATED_KINDS)

            def writable(server: Any) -> bool:
                return all(delay.replica(server).kind_refusal("done", k) is None
                           for k in kinds)
            await wait_for(lambda: writable(master), 30, "slave reads")
            await crash(slave)
            await crash(master)
            master = delay.delay_server(tmp_path, meta.url, delay.MASTER)
            await master.start()
            await wait_for(lambda: master.role.role == "master" and master.role.active, 60,
                           "master again")
            assert delay.SLAVE in (delay.replica(master).kind_refusal("done", kinds[0]) or "")
            await wait_for(lambda: writable(master), 60, "the down slave no longer counts")
        finally:
            await master.stop()
