"""A master's fence for one run (serverkit.replica_source, docs/REPLICATION.md 8.3): a slave
holding records of the current epoch past the end the master began this run with, which this
run never shipped it (the master lost them before their fsync, then restarted in the same
epoch), is told to cut them there, even once the master wrote past them; a slave that copied
past that end from this run, or was told by it to start again further on, is never cut."""

from __future__ import annotations

import asyncio
from typing import Any

from logstore.epoch_history import EpochHistory
from serverkit.replica_log import ReplicatedLog
from serverkit.replica_source import ReplicaSource
from wire.replication import Fetch
from tests.laters import fetched

WAIT_MS = 600_000  # far longer than the test: only an advance can end a wait


class Log:
    """A log whose records are bytes named by their offset, from ``start`` to ``end``."""

    def __init__(self, end: int) -> None:
        self.start = 0
        self.end = end

    def copy_bounds(self) -> tuple[int, int]:
        return self.start, self.end

    def read_copy(self, offset: int, max_bytes: int) -> bytes:
        return b"n" * min(max_bytes, self.end - offset)


async def run(fn: Any, *args: Any) -> Any:
    return fn(*args)


def restarted_master(tmp_path: Any, end: int) -> tuple[ReplicaSource, Log, EpochHistory]:
    """The master of epoch 2 (begun at offset 0) started again with its log ending at
    ``end``; slave-1 is in sync."""
    store = Log(end)
    history = EpochHistory(str(tmp_path / "message.epochs"))
    history.append(2, 0)
    replica = ReplicaSource("g1", {"message": ReplicatedLog("message", store, history, run)},
                            clock_ms=lambda: 0, on_insync_change=lambda: None)
    replica.start(2, {"message": end}, ("slave-1",))
    replica.settings("sync", 0, ("slave-1",), ("slave-1",))
    return replica, store, history


def fetch_at(offset: int, server_id: str = "slave-1", last_epoch: int = 2,
             wait_ms: int = 0) -> Fetch:
    return Fetch(1, server_id, 2, "message", offset, last_epoch, 1 << 20, wait_ms)


def diverging(answer: dict) -> tuple[int, int] | None:
    found = answer["diverging"]
    return None if found is None else (found["epoch"], found["end_offset"])


async def test_a_slave_holding_records_the_restarted_master_lost_is_told_to_cut_them(tmp_path):
    # The slave copied up to 150; the master kept 100 of it and wrote on to 300 since.
    replica, store, _history = restarted_master(tmp_path, 100)
    store.end = 300
    replica.advanced("message", 300)
    answer = await fetched(replica, fetch_at(150))
    assert diverging(answer) == (2, 100)
    assert answer["data"] == b""
    assert replica.fence.fenced == 1
    write = asyncio.create_task(replica.wait_replicated("message", 120))
    await asyncio.sleep(0)
    assert not write.done()  # the fetch at 150 acknowledged nothing
    again = await fetched(replica, fetch_at(100))  # the slave cut at 100
    assert (again["offset"], again["next_offset"]) == (100, 300)
    assert again["diverging"] is None
    await fetched(replica, fetch_at(300))
    for _ in range(5):
        await asyncio.sleep(0)
    assert write.done() and write.exception() is None


async def test_an_older_epochs_tail_is_cut_where_the_history_says_it_ended(tmp_path):
    replica, _store, history = restarted_master(tmp_path, 100)
    assert history.entries[0].epoch == 2
    answer = await fetched(replica, fetch_at(150, last_epoch=1))
    assert diverging(answer) == (0, 0)  # epoch 1 is not in this history: nothing of it kept


async def test_a_slave_that_copied_past_the_fence_from_this_run_is_never_cut(tmp_path):
    replica, store, _history = restarted_master(tmp_path, 100)
    store.end = 200
    replica.advanced("message", 200)
    first = await fetched(replica, fetch_at(80))
    assert first["next_offset"] == 200
    store.end = 260
    replica.advanced("message", 260)
    then = await fetched(replica, fetch_at(200))
    assert (then["diverging"], then["next_offset"]) == (None, 260)
    # A fetcher the master does not count (not yet named a slave) is served the same way.
    stranger = await fetched(replica, fetch_at(100, server_id="new-slave"))
    assert stranger["next_offset"] == 260
    assert (await fetched(replica, fetch_at(260, server_id="new-slave")))["diverging"] is None
    assert replica.fence.fenced == 0


async def test_a_slave_told_to_start_again_at_the_log_start_past_the_fence_is_not_cut(tmp_path):
    replica, store, _history = restarted_master(tmp_path, 100)
    store.start, store.end = 150, 200  # retention deleted everything below 150 meanwhile
    answer = await fetched(replica, fetch_at(40))
    assert (answer["log_start"], answer["data"]) == (150, b"")
    then = await fetched(replica, fetch_at(150))
    assert (then["diverging"], then["next_offset"]) == (None, 200)


async def test_a_master_started_again_fences_at_its_new_end(tmp_path):
    replica, store, _history = restarted_master(tmp_path, 100)
    store.end = 200
    await fetched(replica, fetch_at(100))  # shipped up to 200 in the first run
    replica.stop("stepping down")
    store.end = 180  # lost 20 bytes before their fsync, then started again
    replica.start(2, {"message": 180}, ("slave-1",))
    store.end = 250  # and wrote past what the slave holds before it fetched
    replica.advanced("message", 250)
    answer = await fetched(replica, fetch_at(200))
    assert diverging(answer) == (2, 180)
