"""The master's side of replication (serverkit.replica_source, docs/REPLICATION.md 8.2, 8.3): a
slave's fetch at the end of a log waits until the log advances, from the moment the master
starts, and again after it stopped and started, however long nothing is written to that log
(a broker's message log while only delays arrive); a fetch continuing what this master shipped
that slave acknowledges at once, while the store's thread is still busy, and no other does."""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import pytest

from logstore.epoch_history import EpochHistory
from serverkit.replica_log import ReplicatedLog
from serverkit.replica_source import ReplicaSource
from wire.errors import NotMaster
from wire.replication import Fetch
from tests.laters import fetched

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


class Thread:
    """The store's owner thread as a runner that can be held busy (a commit and its fsync)."""

    def __init__(self) -> None:
        self.free = asyncio.Event()  # cleared: a call waits before it starts
        self.free.set()
        self.back = asyncio.Event()  # cleared: a call's result waits before it comes back
        self.back.set()
        self.calls = 0

    async def run(self, fn: Any, *args: Any) -> Any:
        await self.free.wait()
        self.calls += 1
        result = fn(*args)
        await self.back.wait()
        return result


def source(tmp_path: Any, thread: Thread | None = None,
           clock_ms: Callable[[], int] = lambda: 0) -> tuple[ReplicaSource, EmptyLog]:
    store = EmptyLog()
    history = EpochHistory(str(tmp_path / "message.epochs"))
    history.append(1, 0)
    runner = (thread or Thread()).run
    replica = ReplicaSource("g1", {"message": ReplicatedLog("message", store, history, runner)},
                            clock_ms=clock_ms, on_insync_change=lambda: None)
    return replica, store


def start(replica: ReplicaSource, end: int = 0) -> None:
    """Master of epoch 1 from ``end``, with the settings its next heartbeat answer brings."""
    replica.start(1, {"message": end}, ("slave-1",))
    replica.settings("sync", 0, ("slave-1",), ("slave-1",))


def fetch_at(offset: int) -> Fetch:
    return Fetch(1, "slave-1", 1, "message", offset, 1, 1 << 20, WAIT_MS)


async def turns() -> None:
    for _ in range(TURNS):
        await asyncio.sleep(0)


async def test_a_fetch_at_the_end_of_a_log_never_written_waits_after_the_master_starts(tmp_path):
    replica, store = source(tmp_path)
    start(replica)
    waiting = asyncio.create_task(fetched(replica, fetch_at(0)))
    await turns()
    assert not waiting.done()  # it waits for the log to advance, not in a busy loop
    store.end = 10
    replica.advanced("message", 10)
    answer = await waiting
    assert (answer["offset"], answer["next_offset"]) == (0, 10)


async def test_a_fetch_waits_again_after_the_master_stopped_and_started(tmp_path):
    replica, _store = source(tmp_path)
    start(replica)
    first = asyncio.create_task(fetched(replica, fetch_at(0)))
    await turns()
    replica.stop("stepping down")  # wakes the waiting fetch
    await asyncio.gather(first, return_exceptions=True)
    assert first.done()
    start(replica)
    second = asyncio.create_task(fetched(replica, fetch_at(0)))
    await turns()
    assert not second.done()
    replica.stop("done")
    await asyncio.gather(second, return_exceptions=True)


async def ship(replica: ReplicaSource, store: EmptyLog, end: int) -> asyncio.Task[None]:
    """The log grows to ``end`` and the slave's fetch from 0 is answered with it; returns a
    sync write of it, waiting for the slave."""
    store.end = end
    write = asyncio.create_task(replica.wait_replicated("message", end))
    answer = await fetched(replica, fetch_at(0))
    assert answer["next_offset"] == end
    await turns()
    assert not write.done()  # the slave has not said it wrote it yet
    return write


async def test_a_fetch_continuing_what_was_shipped_answers_a_sync_write_while_the_thread_is_busy(
        tmp_path):
    thread = Thread()
    replica, store = source(tmp_path, thread)
    start(replica)
    write = await ship(replica, store, 10)
    thread.free.clear()  # the store's thread commits the next batch
    next_fetch = asyncio.create_task(fetched(replica, fetch_at(10)))
    await turns()
    assert write.done() and write.exception() is None
    assert not next_fetch.done()
    replica.stop("done")
    thread.free.set()
    await asyncio.gather(next_fetch, return_exceptions=True)


async def test_a_slave_caught_up_with_what_was_shipped_waits_without_a_read_of_the_store(
        tmp_path):
    thread = Thread()
    replica, store = source(tmp_path, thread)
    start(replica)
    write = await ship(replica, store, 10)
    calls = thread.calls
    waiting = asyncio.create_task(fetched(replica, fetch_at(10)))
    await turns()
    assert write.done() and not waiting.done()
    assert thread.calls == calls  # no trip to the store's thread to find nothing
    store.end = 25
    replica.advanced("message", 25)
    answer = await waiting
    assert (answer["offset"], answer["next_offset"]) == (10, 25)


async def test_an_advance_while_the_store_is_read_is_not_missed(tmp_path):
    thread = Thread()
    replica, store = source(tmp_path, thread)
    start(replica, 10)  # the slave copied up to 10 before this run
    store.end = 10
    replica.advanced("message", 10)
    thread.back.clear()
    fetch = asyncio.create_task(fetched(replica, fetch_at(10)))  # read: nothing past 10
    await turns()
    store.end = 30  # a commit lands before the read comes back
    replica.advanced("message", 30)
    thread.back.set()
    await turns()
    assert fetch.done()  # it does not wait for an advance that already happened
    assert fetch.result()["next_offset"] == 30


async def test_a_fetch_past_what_was_shipped_acknowledges_only_once_the_thread_checked_it(
        tmp_path):
    thread = Thread()
    replica, store = source(tmp_path, thread)
    start(replica, 20)  # the master began this run with 20 (the slave may hold it all)
    write = await ship(replica, store, 10)
    store.end = 20
    later = asyncio.create_task(replica.wait_replicated("message", 20))
    thread.free.clear()
    beyond = asyncio.create_task(fetched(replica, fetch_at(20)))  # 20 was never shipped to it
    await turns()
    assert not write.done() and not later.done()  # nothing acknowledged before the check
    thread.free.set()
    await turns()
    assert write.done() and later.done()  # the owner thread's answer acknowledged 20
    replica.stop("done")
    await asyncio.gather(beyond, return_exceptions=True)


async def test_a_master_started_again_forgets_what_it_shipped(tmp_path):
    thread = Thread()
    replica, store = source(tmp_path, thread)
    start(replica)
    first = await ship(replica, store, 10)
    replica.stop("stepping down")
    await asyncio.gather(first, return_exceptions=True)
    start(replica, 10)
    write = asyncio.create_task(replica.wait_replicated("message", 10))
    thread.free.clear()
    fetch = asyncio.create_task(fetched(replica, fetch_at(10)))
    await turns()
    assert not write.done()  # shipped before the restart: checked on the thread first
    thread.free.set()
    await turns()
    assert write.done() and write.exception() is None
    replica.stop("done")
    await asyncio.gather(fetch, return_exceptions=True)


async def test_commits_no_fetch_waits_for_set_no_timer_and_a_later_fetch_still_wakes(tmp_path):
    # Without a slave every commit tells its log advanced (twice: published, then the sync
    # wait); with no fetch parked there is nothing to answer and no timer to set.
    replica, store = source(tmp_path)
    replica.start(1, {"message": 0}, ())  # slave-1 is registered, and in sync with nothing
    replica.settings("sync", 0, (), ("slave-1",))
    for end in (10, 20, 30):
        store.end = end
        replica.advanced("message", end)
        await replica.wait_replicated("message", end)  # no slave in sync yet: at once
    assert replica.parked.by_log["message"] == [] and replica.parked._timer is None
    assert replica.ends["message"] == 30
    assert (await fetched(replica, fetch_at(0)))["next_offset"] == 30  # the slave catches up
    waiting = asyncio.create_task(fetched(replica, fetch_at(30)))
    await turns()
    assert not waiting.done()
    store.end = 40
    replica.advanced("message", 40)
    answer = await waiting
    assert (answer["offset"], answer["next_offset"]) == (30, 40)


async def test_a_parked_fetch_is_answered_empty_when_its_wait_passes_on_the_one_shared_timer(
        tmp_path):
    # Two slaves wait at the log's end, the second with the shorter wait: the one timer is set
    # again for its deadline, and it is answered with nothing new then; the first waits on.
    now = [0]
    replica, store = source(tmp_path, clock_ms=lambda: now[0])
    start(replica, 10)
    store.end = 10
    replica.advanced("message", 10)
    long_wait = asyncio.create_task(fetched(replica, fetch_at(10)))
    await turns()
    short = asyncio.create_task(fetched(replica, Fetch(1, "slave-2", 1, "message", 10, 1,
                                                       1 << 20, 50)))
    await turns()
    assert not short.done()
    now[0] = 50  # the source's clock says its wait is over when the timer fires
    async with asyncio.timeout(60):  # generous: the timer is set for 50 ms
        answer = await short
    assert (answer["offset"], answer["next_offset"], answer["data"]) == (10, 10, b"")
    assert not long_wait.done()
    store.end = 20
    replica.advanced("message", 20)
    assert (await long_wait)["next_offset"] == 20


async def test_replicated_now_says_whether_a_sync_write_would_wait_and_refuses_a_former_master(
        tmp_path):
    # What a committed send asks before it steps the slaves' wait (Sends.replicated_end): no
    # slave in sync or async replication: no wait; a slave in sync that lacks it: a wait.
    replica, store = source(tmp_path)
    replica.start(1, {"message": 0}, ())
    replica.settings("sync", 0, (), ())
    store.end = 10
    assert replica.replicated_now("message", 10)  # no slave in sync: degraded, at once
    start(replica)
    assert replica.replicated_now("message", 0)
    assert not replica.replicated_now("message", 10)  # slave-1 has not fetched it
    replica.settings("async", 0, ("slave-1",), ("slave-1",))
    assert replica.replicated_now("message", 10)
    replica.stop("demoted")
    with pytest.raises(NotMaster):
        replica.replicated_now("message", 10)


async def test_a_sync_write_of_a_group_without_slaves_waits_for_nobody_and_reads_no_clock(
        tmp_path):
    # Every commit of a group with no slave asks this (Sends.replicated_end): the answer
    # needs no time, as no slave can be in sync; once one is registered, it asks the time.
    reads = []
    replica, store = source(tmp_path, clock_ms=lambda: reads.append(1) or 0)
    replica.start(1, {"message": 0}, ())
    replica.settings("sync", 0, (), ())
    store.end = 10
    reads.clear()
    assert replica.replicated_now("message", 10)
    assert reads == []
    start(replica)  # slave-1 registered and in the database's set: a write waits for it
    reads.clear()
    assert not replica.replicated_now("message", 10)
    assert reads


async def test_a_parked_sync_write_is_answered_by_the_fetch_that_reports_the_copy(tmp_path):
    # ``park_replicated``: no task; the callback hears of the slave's copy from its fetch,
    # and a write parked by a callback in that same walk waits for its own end.
    thread = Thread()
    replica, store = source(tmp_path, thread)
    start(replica)
    store.end = 20
    replica.advanced("message", 20)
    heard: list[tuple[str, BaseException | None]] = []

    def first(error: BaseException | None) -> None:
        heard.append(("10", error))
        replica.park_replicated("message", 20, lambda error: heard.append(("20", error)))

    assert not replica.replicated_now("message", 10)
    replica.park_replicated("message", 10, first)
    answer = await fetched(replica, Fetch(1, "slave-1", 1, "message", 0, 1, 10, WAIT_MS))
    assert answer["next_offset"] == 10
    await turns()
    assert heard == []  # shipped, not yet reported written
    second = asyncio.create_task(fetched(replica, fetch_at(10)))  # reports 10
    await turns()
    assert heard == [("10", None)]
    await second
    third = asyncio.create_task(fetched(replica, fetch_at(20)))  # reports 20
    await turns()
    assert heard == [("10", None), ("20", None)]
    replica.stop("done")
    await asyncio.gather(third, return_exceptions=True)


async def test_a_parked_sync_write_is_refused_when_the_master_stops(tmp_path):
    replica, store = source(tmp_path)
    start(replica)
    store.end = 10
    replica.advanced("message", 10)
    heard: list[BaseException | None] = []
    assert not replica.replicated_now("message", 10)
    replica.park_replicated("message", 10, heard.append)
    replica.park_replicated("message", 10, lambda error: 1 / 0)  # a failing answer is logged
    replica.park_replicated("message", 10, heard.append)
    replica.stop("stepping down")
    assert [type(error) for error in heard] == [NotMaster, NotMaster]
    assert "stepping down" in str(heard[0])
