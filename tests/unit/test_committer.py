"""serverkit.committer: sends queued while a commit runs share the next one, and a failed
commit is answered by what the store raised (both servers commit through it)."""

from __future__ import annotations

import asyncio
import errno
import threading

import pytest

from logstore.errors import DiskFull, LogWriteFailed, OutOfDescriptors
from serverkit.committer import GroupCommitter
from serverkit.io_thread import IoThread
from wire.errors import QmqError


class Server:
    """What a server hands a GroupCommitter: a store call and what to do with its outcome."""

    def __init__(self, raises: Exception | None = None) -> None:
        self.raises = raises
        self.commits: list[list[str]] = []
        self.answers: list[tuple[list[str], object]] = []
        self.readonly = False
        self.committer: GroupCommitter[str, int] = GroupCommitter(
            "test group t1", self.commit, self.committed, self.failed, self.go_readonly)

    async def commit(self, batch: list[str]) -> int:
        self.commits.append(batch)
        await asyncio.sleep(0)  # another send may queue meanwhile
        if self.raises is not None:
            raise self.raises
        return len(batch)

    def committed(self, batch: list[str], count: int) -> None:
        self.answers.append((batch, count))

    def failed(self, batch: list[str], error: QmqError) -> None:
        self.answers.append((batch, error))

    def go_readonly(self) -> None:
        self.readonly = True


async def test_everything_queued_before_the_committer_runs_goes_into_one_commit() -> None:
    server = Server()
    server.committer.pending.extend(["a", "b", "c"])
    server.committer.wake()
    task = asyncio.create_task(server.committer.run())
    for _ in range(10):
        await asyncio.sleep(0)
    task.cancel()
    assert server.commits == [["a", "b", "c"]]
    assert server.answers == [(["a", "b", "c"], 3)]
    assert server.committer.pending == []


async def test_a_full_disk_refuses_the_batch_as_overloaded_and_the_server_stays_writable() -> None:
    server = Server(DiskFull("/data/log", dropped_records=2))
    server.committer.pending.extend(["a", "b"])
    await server.committer.commit_pending()
    (batch, error), = server.answers
    assert batch == ["a", "b"] and isinstance(error, QmqError)
    assert error.code == "overloaded" and "test group t1 disk full" in error.message
    assert error.retriable
    assert not server.readonly


async def test_running_out_of_descriptors_refuses_the_batch_as_overloaded_and_stays_writable(
) -> None:
    server = Server(OutOfDescriptors("/data/clog/s/0.clog", OSError(errno.EMFILE, "EMFILE")))
    server.committer.pending.append("a")
    await server.committer.commit_pending()
    (batch, error), = server.answers
    assert error.code == "overloaded" and "out of file descriptors" in error.message
    assert error.retriable and not server.readonly


async def test_a_sticky_write_failure_fails_the_batch_and_makes_the_server_read_only() -> None:
    server = Server(LogWriteFailed("/data/log", "fsync", OSError(5, "EIO")))
    server.committer.pending.append("a")
    await server.committer.commit_pending()
    (batch, error), = server.answers
    assert error.code == "internal" and "test group t1 storage write failed" in error.message
    assert server.readonly


async def test_a_bug_in_the_store_call_fails_only_that_batch_and_names_the_exception() -> None:
    server = Server(KeyError("oops"))
    server.committer.pending.append("a")
    await server.committer.commit_pending()
    (batch, error), = server.answers
    assert error.code == "internal" and "KeyError" in error.message
    assert not server.readonly
    server.raises = None
    server.committer.pending.append("b")
    await server.committer.commit_pending()
    assert server.answers[-1] == (["b"], 1)


async def test_commit_pending_with_nothing_queued_makes_no_store_call() -> None:
    server = Server()
    await server.committer.commit_pending()
    assert server.commits == [] and server.answers == []


async def test_a_bug_while_publishing_a_stored_batch_answers_it_internal_and_later_commits_go_on(
        caplog) -> None:
    server = Server()
    published = server.committed

    def committed_raising_once(batch: list[str], count: int) -> None:
        if batch == ["a", "b"]:
            raise IndexError("injected publish bug")
        published(batch, count)

    server.committer._committed = committed_raising_once
    task = asyncio.create_task(server.committer.run())
    try:
        server.committer.pending.extend(["a", "b"])
        server.committer.wake()
        for _ in range(100):
            await asyncio.sleep(0)
            if server.answers:
                break
        (batch, error), = server.answers
        assert batch == ["a", "b"] and isinstance(error, QmqError)
        assert error.code == "internal" and error.retriable
        assert "IndexError: injected publish bug" in error.message
        assert "test group t1 stored the batch of 2 sends" in error.message
        assert server.committer.publish_failures == 1
        assert any("publishing it failed (IndexError: injected publish bug)" in r.getMessage()
                   and "batch of 2 sends" in r.getMessage() for r in caplog.records)
        # The committer task survived: the next send is committed and answered.
        server.committer.pending.append("c")
        server.committer.wake()
        for _ in range(100):
            await asyncio.sleep(0)
            if len(server.answers) == 2:
                break
        assert not task.done()
        assert server.answers[-1] == (["c"], 1)
        assert not server.readonly
    finally:
        task.cancel()


async def test_a_failure_answering_a_batch_whose_publishing_failed_leaves_the_committer_running(
) -> None:
    server = Server()

    def raising(*_args: object) -> None:
        raise RuntimeError("injected")

    server.committer._committed = raising
    server.committer._failed = raising
    task = asyncio.create_task(server.committer.run())
    try:
        server.committer.pending.append("a")
        server.committer.wake()
        for _ in range(100):
            await asyncio.sleep(0)
            if server.committer.publish_failures:
                break
        assert server.committer.publish_failures == 1
        for _ in range(10):
            await asyncio.sleep(0)
        assert not task.done()
    finally:
        task.cancel()


class GatedServer(Server):
    """A Server whose store calls run on an IoThread (``submit``: a cancel does not cancel
    them) and wait there for ``release``, so a test can queue sends while a commit runs."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.io = IoThread("test-commit")

    def commit(self, batch: list[str]) -> asyncio.Future[int]:  # type: ignore[override]
        self.commits.append(batch)

        def store() -> int:
            assert self.release.wait(30)
            return len(batch)

        return self.io.submit(store)


async def send(committer: GroupCommitter[str, int], item: str) -> None:
    """What a server's send path does: queue, then commit now or leave it to the next one."""
    committer.pending.append(item)
    await committer.commit_now()


async def test_a_send_to_an_idle_committer_is_committed_in_its_own_task() -> None:
    server = Server()  # no committer task at all: the sender's task commits
    await send(server.committer, "a")
    assert server.commits == [["a"]]
    assert server.answers == [(["a"], 1)]
    assert server.committer.pending == []


async def test_a_send_queued_while_a_commit_runs_is_left_to_the_committer_task_for_the_next(
) -> None:
    server = GatedServer()
    runner = asyncio.create_task(server.committer.run())
    try:
        first = asyncio.create_task(send(server.committer, "a"))
        while not server.commits:
            await asyncio.sleep(0)
        await send(server.committer, "b")  # returns at once: a commit is running
        assert server.commits == [["a"]] and server.committer.pending == ["b"]
        server.release.set()
        await first
        async with asyncio.timeout(30):  # the committer task's commit: a thread hop away
            while len(server.answers) < 2:
                await asyncio.sleep(0.001)
        assert server.commits == [["a"], ["b"]]
        assert server.answers == [(["a"], 1), (["b"], 1)]
    finally:
        runner.cancel()
        server.io.close()


async def test_commit_pending_waits_for_the_commit_running_in_a_senders_task() -> None:
    server = GatedServer()
    first = asyncio.create_task(send(server.committer, "a"))
    while not server.commits:
        await asyncio.sleep(0)
    server.committer.pending.append("b")
    stopping = asyncio.create_task(server.committer.commit_pending())
    for _ in range(10):
        await asyncio.sleep(0)
    assert server.commits == [["a"]], "a second commit started beside the running one"
    server.release.set()
    await asyncio.gather(first, stopping)
    server.io.close()
    assert server.commits == [["a"], ["b"]]
    assert server.answers == [(["a"], 1), (["b"], 1)]


async def test_a_sender_cancelled_during_its_commit_leaves_what_queued_meanwhile_to_the_committer(
) -> None:
    server = GatedServer()
    runner = asyncio.create_task(server.committer.run())
    try:
        sender = asyncio.create_task(send(server.committer, "a"))
        while not server.commits:
            await asyncio.sleep(0)
        await send(server.committer, "b")
        sender.cancel()  # a server stopping past its grace cancels its request tasks
        server.release.set()
        (cancelled,) = await asyncio.gather(sender, return_exceptions=True)
        assert isinstance(cancelled, asyncio.CancelledError)  # it still ends cancelled
        async with asyncio.timeout(30):
            while len(server.answers) < 2:
                await asyncio.sleep(0.001)
        # The cancelled sender's batch was stored (the thread ran it): it is published too.
        assert server.commits == [["a"], ["b"]]
        assert server.answers == [(["a"], 1), (["b"], 1)]
    finally:
        runner.cancel()
        server.io.close()


async def test_a_store_call_that_raises_before_returning_its_awaitable_refuses_the_batch(
) -> None:
    server = Server()

    def raising_at_once(batch: list[str]) -> asyncio.Future[int]:
        raise DiskFull("/data/log", dropped_records=1)

    server.committer._commit = raising_at_once  # type: ignore[assignment]
    server.committer.pending.append("a")
    await server.committer.commit_pending()
    (batch, error), = server.answers
    assert batch == ["a"] and error.code == "overloaded"
    assert not server.committer._running  # the next commit may run


async def _answered(server: Server, count: int) -> None:
    async with asyncio.timeout(30):  # a thread hop away
        while len(server.answers) < count:
            await asyncio.sleep(0.001)


class ThenServer(GatedServer):
    """A GatedServer whose ``commit_soon`` commits go through ``commit_then`` (no future:
    ``IoThread.submit_then``), as the realtime broker's do."""

    def __init__(self, raises: Exception | None = None) -> None:
        super().__init__()
        self.raises = raises
        self.committer = GroupCommitter("test group t1", self.commit, self.committed,
                                        self.failed, self.go_readonly,
                                        commit_then=self.commit_then)

    def commit_then(self, batch: list[str], then) -> None:
        self.commits.append(batch)

        def store() -> int:
            assert self.release.wait(30)
            if self.raises is not None:
                raise self.raises
            return len(batch)

        self.io.submit_then(then, store)


# Each commit_soon test runs twice: with the store call as a future (GatedServer) and through
# commit_then, the store call with no future (ThenServer), as both servers' commits run.
COMMIT_PATHS = pytest.mark.parametrize("server_class", [GatedServer, ThenServer],
                                       ids=["future", "commit_then"])


@COMMIT_PATHS
async def test_commit_soon_commits_with_no_task_and_starts_what_queued_meanwhile_as_it_ends(
        server_class: type[GatedServer]) -> None:
    server = server_class()  # no committer task at all, and no sender's task
    tasks_before = asyncio.all_tasks()
    try:
        server.committer.pending.append("a")
        server.committer.commit_soon()
        assert server.commits == [["a"]]  # the store call began right here
        server.committer.pending.append("b")
        server.committer.commit_soon()  # a commit runs: "b" waits for it to end
        assert server.commits == [["a"]]
        assert asyncio.all_tasks() == tasks_before
        server.release.set()
        await _answered(server, 2)
        assert server.commits == [["a"], ["b"]]
        assert server.answers == [(["a"], 1), (["b"], 1)]
        assert not server.committer._running and server.committer.pending == []
    finally:
        server.io.close()


@COMMIT_PATHS
async def test_commit_pending_waits_for_a_commit_soon_commit(
        server_class: type[GatedServer]) -> None:
    server = server_class()
    server.committer.pending.append("a")
    server.committer.commit_soon()
    server.committer.pending.append("b")
    stopping = asyncio.create_task(server.committer.commit_pending())
    for _ in range(10):
        await asyncio.sleep(0)
    assert server.commits == [["a"]], "a second commit started beside the running one"
    server.release.set()
    await stopping
    await _answered(server, 2)
    server.io.close()
    assert server.commits == [["a"], ["b"]]


async def test_a_cancelled_commit_pending_leaves_another_waiting_for_the_running_commit() -> None:
    server = GatedServer()
    server.committer.pending.append("a")
    server.committer.commit_soon()
    cancelled = asyncio.create_task(server.committer.commit_pending())
    server.committer.pending.append("b")
    stopping = asyncio.create_task(server.committer.commit_pending())
    for _ in range(10):
        await asyncio.sleep(0)
    cancelled.cancel()
    for _ in range(10):
        await asyncio.sleep(0)
    assert cancelled.cancelled() and not stopping.done()
    server.release.set()
    await stopping
    await _answered(server, 2)
    server.io.close()
    assert server.commits == [["a"], ["b"]]


async def test_commit_soon_refuses_a_batch_whose_store_call_raises_at_once_or_later() -> None:
    server = Server()

    def raising_at_once(batch: list[str]) -> asyncio.Future[int]:
        raise DiskFull("/data/log", dropped_records=1)

    server.committer._commit = raising_at_once  # type: ignore[assignment]
    server.committer.pending.append("a")
    server.committer.commit_soon()
    (batch, error), = server.answers
    assert batch == ["a"] and error.code == "overloaded"
    assert not server.committer._running
    failing = Server(LogWriteFailed("/data/log", "fsync", OSError(5, "EIO")))
    failing.committer.pending.append("b")
    failing.committer.commit_soon()  # a coroutine store call: run as a future
    await _answered(failing, 1)
    assert failing.answers[0][1].code == "internal" and failing.readonly


async def test_commit_soon_through_commit_then_refuses_a_batch_the_store_failed() -> None:
    server = ThenServer(LogWriteFailed("/data/log", "fsync", OSError(5, "EIO")))
    try:
        server.committer.pending.append("a")
        server.committer.commit_soon()
        server.release.set()
        await _answered(server, 1)
        (batch, error), = server.answers
        assert batch == ["a"] and error.code == "internal" and server.readonly
        assert not server.committer._running
    finally:
        server.io.close()
