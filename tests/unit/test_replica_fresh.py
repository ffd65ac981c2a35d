"""A master hands a tailing slave each commit's bytes from memory (serverkit.replica_source
``wrote_io``, docs/REPLICATION.md 8.3): the fetch a commit wakes is answered with the bytes the
store wrote, while the store's thread is busy with the next commit; nothing is kept while no
slave tails the log, nor shipped to a fetch that does not continue what this master shipped it
in this epoch, nor kept from before a stop, and what a slave does not take is bounded."""

from __future__ import annotations

import asyncio
from typing import Any

from logstore.epoch_history import EpochHistory
from serverkit.replica_log import ReplicatedLog
from serverkit.fresh_commits import FRESH_CHUNKS_MAX, FRESH_TAIL_MS
from serverkit.replica_source import ReplicaSource
from wire.replication import Fetch
from tests.laters import fetched

WAIT_MS = 600_000  # far longer than the test: only an advance can end the wait
TURNS = 20  # event-loop turns a fetch gets to (wrongly) return in


def pattern(offset: int, size: int) -> bytes:
    """The log's byte at each offset (distinct enough to tell a wrong range apart)."""
    return bytes((i * 7 + 3) % 251 for i in range(offset, offset + size))


class Log:
    """A log the test writes to (``end``), counting its reads."""

    def __init__(self) -> None:
        self.end = 0
        self.reads = 0

    def copy_bounds(self) -> tuple[int, int]:
        return 0, self.end

    def read_copy(self, offset: int, max_bytes: int) -> bytes:
        self.reads += 1
        return pattern(offset, min(max_bytes, self.end - offset))


class Thread:
    """The store's owner thread as a runner that can be held busy (a commit and its fsync)."""

    def __init__(self) -> None:
        self.free = asyncio.Event()
        self.free.set()
        self.calls = 0

    async def run(self, fn: Any, *args: Any) -> Any:
        await self.free.wait()
        self.calls += 1
        return fn(*args)


class Clock:
    def __init__(self) -> None:
        self.ms = 0

    def __call__(self) -> int:
        return self.ms


def master(tmp_path: Any) -> tuple[ReplicaSource, Log, Thread, Clock]:
    store, thread, clock = Log(), Thread(), Clock()
    history = EpochHistory(str(tmp_path / "message.epochs"))
    history.append(1, 0)
    replica = ReplicaSource("g1", {"message": ReplicatedLog("message", store, history,
                                                            thread.run)},
                            clock_ms=clock, on_insync_change=lambda: None)
    replica.start(1, {"message": 0}, ("slave-1",))
    replica.settings("sync", 0, ("slave-1",), ("slave-1",))
    return replica, store, thread, clock


def fetch_at(offset: int, max_bytes: int = 1 << 20) -> Fetch:
    return Fetch(1, "slave-1", 1, "message", offset, 1, max_bytes, WAIT_MS)


async def turns() -> None:
    for _ in range(TURNS):
        await asyncio.sleep(0)


def commit(replica: ReplicaSource, store: Log, end: int) -> None:
    """A commit to ``end``: the store thread's part (``wrote_io``), then the loop's."""
    store.end = end
    replica.wrote_io("message")
    replica.advanced("message", end)


async def tailing(replica: ReplicaSource, store: Log, end: int) -> asyncio.Task[dict]:
    """The slave copied [0, end) and tails: its fetch at ``end`` waits there."""
    commit(replica, store, end)
    answer = await fetched(replica, fetch_at(0))
    assert answer["next_offset"] == end
    waiting = asyncio.create_task(fetched(replica, fetch_at(end)))
    await turns()
    assert not waiting.done()
    return waiting


async def test_the_fetch_a_commit_wakes_ships_its_bytes_while_the_store_thread_is_busy(tmp_path):
    replica, store, thread, _clock = master(tmp_path)
    first = await tailing(replica, store, 10)
    commit(replica, store, 25)  # the first commit seen tailing marks where the next begins
    assert (await first)["data"] == pattern(10, 15)
    waiting = asyncio.create_task(fetched(replica, fetch_at(25)))
    await turns()
    thread.free.clear()  # the store's thread commits the next batch and fsyncs it
    calls, reads = thread.calls, store.reads
    commit(replica, store, 40)
    async with asyncio.timeout(30):  # a read queued behind the busy thread would never come
        answer = await waiting
    assert (answer["offset"], answer["next_offset"], answer["data"]) == (25, 40, pattern(25, 15))
    assert answer["log_end"] == 40 and answer["epochs"] == [[1, 0]]
    assert thread.calls == calls  # no trip to the busy thread
    assert store.reads == reads + 1  # the commit's own read, on its thread
    assert replica.fresh_answers["message"] == 1
    replica.stop("done")


async def test_a_commit_reads_nothing_while_no_slave_tails_the_log(tmp_path):
    replica, store, _thread, _clock = master(tmp_path)
    for end in (10, 20, 30):
        commit(replica, store, end)
    assert store.reads == 0 and not replica._fresh["message"]
    replica.stop("done")


async def test_a_fetch_that_does_not_continue_what_was_shipped_reads_the_store(tmp_path):
    replica, store, thread, _clock = master(tmp_path)
    first = await tailing(replica, store, 10)
    commit(replica, store, 20)
    await first
    commit(replica, store, 30)  # kept: [20, 30)
    calls = thread.calls
    answer = await fetched(replica, fetch_at(15))  # a slave that cut its copy, say
    assert (answer["offset"], answer["next_offset"]) == (15, 30)
    assert thread.calls == calls + 1 and replica.fresh_answers["message"] == 0
    replica.stop("done")


async def test_what_was_kept_before_a_stop_is_never_shipped_after_a_start(tmp_path):
    replica, store, thread, _clock = master(tmp_path)
    first = await tailing(replica, store, 10)
    commit(replica, store, 20)
    await first
    commit(replica, store, 30)  # kept: [20, 30)
    replica.stop("stepping down")
    replica.start(2, {"message": 30}, ("slave-1",))
    replica.settings("sync", 0, ("slave-1",), ("slave-1",))
    assert not replica._fresh["message"] and not replica.fresh_wanted["message"]
    # The same slave fetches on from 20 under the new epoch: checked on the thread.
    calls = thread.calls
    answer = await fetched(replica, Fetch(1, "slave-1", 2, "message", 20, 1, 1 << 20, 0))
    assert answer["next_offset"] == 30 and thread.calls == calls + 1
    assert replica.fresh_answers["message"] == 0
    replica.stop("done")


async def test_a_chunk_kept_by_a_commit_racing_a_stop_is_never_shipped(tmp_path):
    replica, store, _thread, _clock = master(tmp_path)
    old_generation = replica._generation
    replica.stop("stepping down")
    replica.start(2, {"message": 0}, ("slave-1",))
    replica.settings("sync", 0, ("slave-1",), ("slave-1",))
    store.end = 30
    replica.advanced("message", 30)
    assert (await fetched(replica, Fetch(1, "slave-1", 2, "message", 0, 1, 1 << 20, 0))
            )["next_offset"] == 30
    # The old master's commit, on its thread, read the wish to keep before the stop and kept
    # its bytes after it (the log may have been cut and written again since).
    replica._fresh["message"].append((old_generation, 30, b"x" * 10))
    store.end = 40
    replica.advanced("message", 40)
    answer = await fetched(replica, Fetch(1, "slave-1", 2, "message", 30, 1, 1 << 20, 0))
    assert answer["data"] == pattern(30, 10)
    replica.stop("done")


async def test_a_log_no_slave_fetched_at_its_end_for_a_while_keeps_nothing_more(tmp_path):
    replica, store, _thread, clock = master(tmp_path)
    first = await tailing(replica, store, 10)
    commit(replica, store, 20)
    await first  # the slave stops fetching
    commit(replica, store, 30)
    clock.ms += FRESH_TAIL_MS + 1
    replica.tick()
    assert not replica.fresh_wanted["message"] and not replica._fresh["message"]
    reads = store.reads
    commit(replica, store, 40)
    assert store.reads == reads
    replica.stop("done")


async def test_a_slave_that_does_not_take_the_commits_holds_at_most_the_bound(tmp_path):
    replica, store, _thread, _clock = master(tmp_path)
    first = await tailing(replica, store, 10)
    commit(replica, store, 20)
    await first
    for end in range(30, 30 + 10 * (FRESH_CHUNKS_MAX + 5), 10):
        commit(replica, store, end)
    assert len(replica._fresh["message"]) == FRESH_CHUNKS_MAX
    # The slave comes back from 20: what is kept in a row from there ships, up to max_bytes.
    async with asyncio.timeout(30):
        answer = await fetched(replica, fetch_at(20, max_bytes=35))
    assert (answer["next_offset"], answer["data"]) == (50, pattern(20, 30))
    replica.stop("done")


class SegmentedLog(Log):
    """A log whose reads stop at each 16-byte segment's end, as ``SegmentedLog.read_raw``."""

    def read_copy(self, offset: int, max_bytes: int) -> bytes:
        self.reads += 1
        stop = min(self.end, offset + max_bytes, (offset // 16 + 1) * 16)
        return pattern(offset, stop - offset)


async def test_a_commit_that_rolled_the_log_over_is_kept_whole(tmp_path):
    replica, _store, _thread, _clock = master(tmp_path)
    store = SegmentedLog()
    replica.logs["message"] = ReplicatedLog("message", store, replica.logs["message"].history,
                                            _thread.run)
    first = await tailing(replica, store, 10)
    commit(replica, store, 12)
    await first
    waiting = asyncio.create_task(fetched(replica, fetch_at(12)))
    await turns()
    commit(replica, store, 40)  # [12, 40) lies in three segments
    async with asyncio.timeout(30):
        answer = await waiting
    assert (answer["next_offset"], answer["data"]) == (40, pattern(12, 28))
    assert replica.fresh_answers["message"] == 1
    replica.stop("done")


class FailingLog(Log):
    """A log whose read-back fails (an I/O error, a rotten record)."""

    def read_copy(self, offset: int, max_bytes: int) -> bytes:
        if offset >= 10:
            raise OSError(5, "Input/output error")
        return super().read_copy(offset, max_bytes)


async def test_a_read_back_that_fails_never_fails_the_commit_and_the_fetch_reads_the_store(
        tmp_path):
    replica, _store, thread, _clock = master(tmp_path)
    store = FailingLog()
    replica.logs["message"] = ReplicatedLog("message", store, replica.logs["message"].history,
                                            thread.run)
    first = await tailing(replica, store, 10)
    commit(replica, store, 20)  # the first commit seen: nothing read back yet
    commit(replica, store, 30)  # read back [20, 30): fails, and wrote_io returns all the same
    assert replica.fresh_failures == 1 and not replica._fresh["message"]
    replica.stop("done")
    await asyncio.gather(first, return_exceptions=True)  # its store read failed as well


class _SizedReads(Log):
    """A Log noting the size of each read."""

    def __init__(self) -> None:
        super().__init__()
        self.read_sizes: list[int] = []

    def read_copy(self, offset: int, max_bytes: int) -> bytes:
        self.read_sizes.append(max_bytes)
        return super().read_copy(offset, max_bytes)


async def test_a_slave_tailing_again_makes_a_commit_read_back_no_more_than_itself(tmp_path):
    # review s14 rvb-3: through Replica.wrote_io (the servers' path) the commits nobody tailed
    # never reached the source, so the first commit seen tailing again read back all of them.
    from serverkit.replica import Replica
    source, _store, thread, clock = master(tmp_path)
    store = _SizedReads()
    source.logs["message"] = ReplicatedLog("message", store, source.logs["message"].history,
                                           thread.run)
    replica = Replica("g1", str(tmp_path), ("message",), connect=None)  # type: ignore[arg-type]
    replica.source = source

    def commit_through_replica(end: int) -> None:
        store.end = end
        replica.wrote_io("message")
        source.advanced("message", end)

    commit_through_replica(10)
    assert (await fetched(source, fetch_at(0)))["next_offset"] == 10
    waiting = asyncio.create_task(fetched(source, fetch_at(10)))
    await turns()
    commit_through_replica(20)
    await waiting
    clock.ms += FRESH_TAIL_MS + 1
    source.tick()  # no slave tails any more
    for end in range(30, 100_030, 10_000):  # 100 kB of commits nobody tails
        commit_through_replica(end)
    assert (await fetched(source, fetch_at(20)))["next_offset"] == 90_030
    waiting = asyncio.create_task(fetched(source, fetch_at(90_030)))  # tails again
    await turns()
    store.read_sizes.clear()
    commit_through_replica(90_040)
    await waiting
    # The fetch's own store read asks for up to its max_bytes; any other read is a read-back.
    read_backs = [size for size in store.read_sizes if size != 1 << 20]
    assert read_backs in ([], [10]), f"a commit of 10 bytes read back {read_backs}"
    source.stop("done")
