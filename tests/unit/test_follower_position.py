"""A slave's next fetch starts where its last apply left the copy (serverkit.follower,
``apply_position_io``): no separate trip to the store's thread to ask, and the position is
read from the store again once anything else moved the copy (a cut, a reset, the scrub)."""

from __future__ import annotations

from typing import Any

from logstore.epoch_history import EpochHistory
from serverkit.follower import Follower, Scrub
from serverkit.replica_log import ReplicatedLog
from wire.replication import FetchAnswer

MASTER_LOG = b"0123456789abcdefghij"


class CopyLog:
    """A slave's copy held in memory (the store API the follower's steps use)."""

    def __init__(self) -> None:
        self.data = b""

    def copy_bounds(self) -> tuple[int, int]:
        return 0, len(self.data)

    def append_copy(self, offset: int, data: bytes) -> int:
        if offset != len(self.data):
            raise ValueError(f"the copy ends at {len(self.data)}, not {offset}")
        self.data += data
        return len(self.data)


class Master:
    """Answers fetches from ``MASTER_LOG``, ``step`` bytes at a time; notes each offset."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.offsets: list[int] = []
        self.closed = False

    async def request(self, op: dict[str, Any], timeout_ms: int) -> dict[str, Any]:
        offset = op["offset"]
        self.offsets.append(offset)
        data = MASTER_LOG[offset:offset + self.step]
        return FetchAnswer(1, op["log"], offset, data, offset + len(data), 0, len(MASTER_LOG),
                           (), None).to_wire()


class Thread:
    """The store's owner thread as a runner that notes what it ran."""

    def __init__(self) -> None:
        self.ran: list[str] = []

    async def run(self, fn: Any, *args: Any) -> Any:
        self.ran.append(fn.__name__)
        return fn(*args)


def follower(tmp_path: Any, master: Master, thread: Thread) -> tuple[Follower, ReplicatedLog]:
    history = EpochHistory(str(tmp_path / "delay.epochs"))
    history.append(1, 0)
    item = ReplicatedLog("delay", CopyLog(), history, thread.run)  # type: ignore[arg-type]

    async def connect(address: str) -> Master:
        return master

    slave = Follower("d1", "slave-1", [item], connect, clock_ms=lambda: 0,
                     on_trouble=lambda: None, scrub=Scrub(0, 0))
    slave.master_address, slave.epoch = "master", 1
    return slave, item


async def test_the_next_fetch_starts_where_the_last_apply_left_the_copy(tmp_path):
    master, thread = Master(step=8), Thread()
    slave, item = follower(tmp_path, master, thread)
    for _ in range(3):
        await slave._step(item, 0)
    assert master.offsets == [0, 8, 16]
    assert thread.ran == ["position_io", "apply_position_io", "apply_position_io",
                          "apply_position_io"]
    assert item.store.data == MASTER_LOG  # type: ignore[attr-defined]


async def test_a_copy_moved_since_the_last_apply_is_asked_for_its_position_again(tmp_path):
    master, thread = Master(step=8), Thread()
    slave, item = follower(tmp_path, master, thread)
    await slave._step(item, 0)
    item.store.data = item.store.data[:5]  # type: ignore[attr-defined]  # cut (a rotten record)
    slave._moved_to("delay", 5)
    await slave._step(item, 0)
    assert master.offsets == [0, 5]
    assert thread.ran == ["position_io", "apply_position_io", "position_io",
                          "apply_position_io"]
    assert item.store.data == MASTER_LOG[:13]  # type: ignore[attr-defined]
