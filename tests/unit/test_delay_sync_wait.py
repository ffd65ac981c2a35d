"""A delayed send under ``sync`` replication is answered only once the slaves have its commit
(docs/REPLICATION.md 5): the commit's answers wait parked with the replication, one wait per
commit (``AcceptingMixin._park_answers``), and a refused wait (this server stopped being
master) refuses the send."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.rawclient import FakeClock, message
from tests.unit.delay_handoff_support import HoldingBroker, started
from wire.errors import NotMaster
from wire.message import encode_message


class SlaveBehind:
    """A master's replication whose one sync slave lacks every commit until told."""

    replicating = True

    def __init__(self, now: bool | Exception = False) -> None:
        self.now = now  # replicated_now's answer, or what it raises
        self.parked: list[tuple[str, int, Any]] = []
        self.waited: list[int] = []

    def check_writable(self) -> None:
        pass

    def advanced(self, name: str, end: int) -> None:
        pass

    def wrote_io(self, name: str) -> None:
        pass

    def replicated_now(self, name: str, end: int) -> bool:
        if isinstance(self.now, Exception):
            raise self.now
        return self.now

    def park_replicated(self, name: str, end: int, done: Any) -> None:
        self.parked.append((name, end, done))

    async def wait_replicated(self, name: str, end: int) -> None:
        self.waited.append(end)
        if isinstance(self.now, Exception):
            raise self.now


async def scheduling(tmp_path, replica: SlaveBehind):
    clock = FakeClock()
    scheduler = await started(tmp_path, clock, HoldingBroker(clock))
    scheduler.replica = replica
    payload = encode_message(message("s", b"x", clock, deliver_at_ms=clock() + 3_600_000))
    return scheduler, asyncio.create_task(scheduler.schedule([payload]))


async def parked(replica: SlaveBehind) -> tuple[str, int, Any]:
    for _ in range(10_000):
        if replica.parked:
            return replica.parked[0]
        await asyncio.sleep(0.001)
    raise AssertionError("the commit's answers were never parked")


@pytest.mark.parametrize("error", [None, NotMaster("group d: stepping down; resend")])
async def test_a_delayed_send_waits_parked_until_its_slaves_have_the_commit(tmp_path, error):
    replica = SlaveBehind()
    scheduler, sending = await scheduling(tmp_path, replica)
    try:
        name, end, done = await parked(replica)
        assert name == "delay" and end > 0
        for _ in range(20):
            await asyncio.sleep(0)
        assert not sending.done()  # committed, not answered: the slave lacks it
        done(error)
        if error is None:
            assert [a["status"] for a in await sending] == ["stored"]
        else:
            with pytest.raises(NotMaster):
                await sending
        assert replica.waited == []  # one wait for the commit, none per send
    finally:
        await scheduler.stop()


async def test_a_delayed_send_its_slaves_have_already_is_answered_without_a_wait(tmp_path):
    replica = SlaveBehind(now=True)
    scheduler, sending = await scheduling(tmp_path, replica)
    try:
        assert [a["status"] for a in await sending] == ["stored"]
        assert replica.parked == [] and replica.waited == []
    finally:
        await scheduler.stop()


async def test_a_delayed_send_committed_by_a_master_that_stopped_is_refused(tmp_path):
    replica = SlaveBehind(now=NotMaster("group d: this server stopped being master"))
    scheduler, sending = await scheduling(tmp_path, replica)
    try:
        with pytest.raises(NotMaster):
            await sending
        assert replica.parked == [] and len(replica.waited) == 1
    finally:
        await scheduler.stop()
