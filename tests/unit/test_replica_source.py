"""The master's side of replication (serverkit.replica_source, docs/REPLICATION.md 8.2): a
slave's fetch at the end of a log waits until the log advances, from the moment the master
starts, and again after it stopped and started, however long nothing is written to that log
(a broker's message log while only delays arrive)."""

from __future__ import annotations

import asyncio
from typing import Any

from logstore.epoch_history import EpochHistory
from serverkit.replica_log import ReplicatedLog
from serverkit.replica_source import ReplicaSource
from wire.replication import Fetch

WAIT_MS = 600_000  # far longer than the test: only an advance can end the wait
TURNS = 20  # event-loop turns a fetch gets to (wrongly) return in


class EmptyLog:
    """A log nobody writes to until ``end`` is moved (the store API a fetch reads)."""

    def __init__(self) -> None:
        self.end = 0

    def copy_bounds(self) -> tuple[int, int]:
        return 0, self.end

    def read_copy(self, offset: int, max_bytes: int) -> bytes:
        return b"r" * min(max_bytes, self.end - offset)


async def run(fn: Any, *args: Any) -> Any:
    return fn(*args)


def source(tmp_path: Any) -> tuple[ReplicaSource, EmptyLog]:
    store = EmptyLog()
    history = EpochHistory(str(tmp_path / "message.epochs"))
    history.append(1, 0)
    replica = ReplicaSource("g1", {"message": ReplicatedLog("message", store, history, run)},
                            clock_ms=lambda: 0, on_insync_change=lambda: None)
    replica.settings("sync", 0, (), ("slave-1",))
    return replica, store


def fetch_at(offset: int) -> Fetch:
    return Fetch(1, "slave-1", 1, "message", offset, 1, 1 << 20, WAIT_MS)


async def turns() -> None:
    for _ in range(TURNS):
        await asyncio.sleep(0)


async def test_a_fetch_at_the_end_of_a_log_never_written_waits_after_the_master_starts(tmp_path):
    replica, store = source(tmp_path)
    replica.start(1, {"message": 0}, ())
    waiting = asyncio.create_task(replica.fetch(fetch_at(0)))
    await turns()
    assert not waiting.done()  # it waits for the log to advance, not in a busy loop
    store.end = 10
    replica.advanced("message", 10)
    answer = await waiting
    assert (answer["offset"], answer["next_offset"]) == (0, 10)


async def test_a_fetch_waits_again_after_the_master_stopped_and_started(tmp_path):
    replica, _store = source(tmp_path)
    replica.start(1, {"message": 0}, ())
    first = asyncio.create_task(replica.fetch(fetch_at(0)))
    await turns()
    replica.stop("stepping down")  # wakes the waiting fetch
    await asyncio.gather(first, return_exceptions=True)
    assert first.done()
    replica.start(1, {"message": 0}, ())
    second = asyncio.create_task(replica.fetch(fetch_at(0)))
    await turns()
    assert not second.done()
    replica.stop("done")
    await asyncio.gather(second, return_exceptions=True)
