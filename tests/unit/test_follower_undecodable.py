"""A copied record whose CRC holds but whose body the slave cannot decode (a later release's body
version; review s13 rvmends-3): the copy stops there, whole, and says so: counted apart from CRC
errors (``undecodable_records``), where and what (``undecodable_at``: log, offset, kind, body
version), one error line per place; once the copy moves past it (the master's record mended)
it no longer says it is stopped."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from logstore import UndecodableRecord
from tests.harness import wait_for
from logstore.epoch_history import EpochHistory
from serverkit.follower import Follower, Scrub
from serverkit.replica_log import ReplicatedLog
from tests.unit.test_follower_position import MASTER_LOG, CopyLog, Master, Thread

STOP_AT = 10


class StopsAt(CopyLog):
    """A copy that cannot decode the record at STOP_AT while ``stuck``."""

    def __init__(self) -> None:
        super().__init__()
        self.stuck = True
        self.tries = 0

    def append_copy(self, offset: int, data: bytes) -> int:
        if self.stuck and offset <= STOP_AT < offset + len(data):
            self.tries += 1
            raise UndecodableRecord("/data/donelog", STOP_AT, 1, 9,
                                    "copied journal record: unknown journal body version 9")
        return super().append_copy(offset, data)


class WaitingMaster(Master):
    """``Master`` whose fetch at its end waits a little, as a tail fetch does (``wait_ms``)."""

    async def request(self, op: dict[str, Any], timeout_ms: int) -> dict[str, Any]:
        if op["offset"] >= len(MASTER_LOG):
            await asyncio.sleep(0.01)
        return await super().request(op, timeout_ms)


def follower_of(tmp_path: Any, copy: CopyLog) -> tuple[Follower, ReplicatedLog]:
    """``test_follower_position.follower`` over ``copy``, fetching 8 bytes at a time."""
    history = EpochHistory(str(tmp_path / "delay.epochs"))
    history.append(1, 0)
    item = ReplicatedLog("delay", copy, history, Thread().run)  # type: ignore[arg-type]
    master = WaitingMaster(step=8)

    async def connect(address: str) -> Master:
        return master

    slave = Follower("d1", "slave-1", [item], connect, clock_ms=lambda: 0,
                     on_trouble=lambda: None, scrub=Scrub(0, 0))
    slave.master_address, slave.epoch = "master", 1
    return slave, item


async def test_a_copy_stopped_at_a_record_it_cannot_decode_says_where_and_why(tmp_path, caplog):
    copy = StopsAt()
    slave, item = follower_of(tmp_path, copy)
    caplog.set_level(logging.INFO, logger="serverkit.follower")
    task = asyncio.create_task(slave._follow(item))
    try:
        await wait_for(lambda: slave.undecodable_records >= 3, 30, "three refused fetches")
        assert copy.data == MASTER_LOG[:8], "nothing of the refused range was written"
        assert slave.crc_errors == 0, "counted as a CRC error: an operator looks at the disk"
        assert slave.undecodable_at == {
            "log": "delay", "offset": STOP_AT, "kind": 1, "version": 9,
            "reason": "kind 1, body version 9: copied journal record: unknown journal body "
                      "version 9"}
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(errors) == 1, errors  # once per place, not every fetch
        assert "offset 10" in errors[0] and "kind 1, body version 9" in errors[0] \
            and "upgrade" in errors[0]
        copy.stuck = False  # the master's record mended (or this server upgraded)
        await wait_for(lambda: copy.data == MASTER_LOG, 30, "the copy moves on")
        assert slave.undecodable_at is None
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
