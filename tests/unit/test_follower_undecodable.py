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
from wire.errors import ConnectionLost
from wire.replication import FetchAnswer

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

    async def close(self) -> None:
        self.closed = True


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


class Cuttable(StopsAt):
    """``StopsAt`` that the follower can cut (a diverging answer)."""

    def truncate_copy(self, offset: int) -> None:
        self.data = self.data[:offset]


class CutsThenGoesDown(WaitingMaster):
    """``WaitingMaster`` that, once ``cut_at`` is set, answers the next fetch ``diverging``
    (epoch 1 ended at ``cut_at`` here: the copy is cut there) and is unreachable after it."""

    def __init__(self) -> None:
        super().__init__(step=8)
        self.cut_at: int | None = None
        self.down = False

    async def request(self, op: dict[str, Any], timeout_ms: int) -> dict[str, Any]:
        if self.down:
            raise ConnectionLost("master unreachable")
        if self.cut_at is not None:
            self.down = True
            return FetchAnswer(1, op["log"], op["offset"], b"", op["offset"], 0,
                               self.cut_at, (), (1, self.cut_at)).to_wire()
        return await super().request(op, timeout_ms)


async def test_a_copy_cut_below_the_place_it_stopped_at_no_longer_says_it_is_stopped_there(
        tmp_path):
    # review s14 rva (LOW): after a cut, a reset or a failover that put the copy below that
    # offset, undecodable_at kept showing the old place until the copy passed it.
    copy = Cuttable()
    slave, item = follower_of(tmp_path, copy)
    master = CutsThenGoesDown()

    async def connect(address: str) -> CutsThenGoesDown:
        return master

    slave._connect = connect  # type: ignore[assignment]
    task = asyncio.create_task(slave._follow(item))
    try:
        await wait_for(lambda: slave.undecodable_at is not None, 30, "stopped at the record")
        master.cut_at = 4
        await wait_for(lambda: master.down and copy.data == MASTER_LOG[:4], 30, "cut at 4")
        await wait_for(lambda: slave.undecodable_at is None, 30,
                       "the copy at 4 still says it is stopped at 10")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_follower_started_again_with_a_new_master_no_longer_says_where_the_old_copy_stopped(
        tmp_path):
    copy = StopsAt()
    slave, item = follower_of(tmp_path, copy)
    slave.running = False
    slave.start("master", 1)
    try:
        await wait_for(lambda: slave.undecodable_at is not None, 30, "stopped at the record")
        await slave.stop()
        copy.stuck = False  # the new master's record at 10 is one this server decodes
        slave.start("master-2", 2)
        assert slave.undecodable_at is None, "shows the old master's place"
    finally:
        await slave.stop()
