"""serverkit.committer with ``submit`` (the realtime broker's group commit): the store call's
outcome comes back through IoThread.submit's callback, with no committer task wake-up, and the
batching, the stop and the failure rules stay those of the awaited commit."""

from __future__ import annotations

import asyncio
import threading

from logstore.errors import DiskFull
from serverkit.committer import GroupCommitter
from serverkit.io_thread import IoThread
from wire.errors import QmqError


class Server:
    """A server whose store call runs on a real IoThread; the thread can be held."""

    def __init__(self, raises: Exception | None = None) -> None:
        self.io = IoThread("test-store")
        self.raises = raises
        self.gate = threading.Event()
        self.gate.set()
        self.commits: list[list[str]] = []
        self.answers: list[tuple[list[str], object]] = []
        self.answer_threads: set[str] = set()
        self.committer: GroupCommitter[str, int] = GroupCommitter(
            "test group t1", None, self.committed, self.failed, lambda: None,
            submit=self.submit)

    def submit(self, batch: list[str], done) -> None:  # type: ignore[no-untyped-def]
        self.io.submit(self.store_io, (batch,), done)

    def store_io(self, batch: list[str]) -> int:
        self.gate.wait(30)
        self.commits.append(list(batch))
        if self.raises is not None:
            raise self.raises
        return len(batch)

    def committed(self, batch: list[str], count: int) -> None:
        self.answer_threads.add(threading.current_thread().name)
        self.answers.append((batch, count))

    def failed(self, batch: list[str], error: QmqError) -> None:
        self.answers.append((batch, error))


async def _until(condition, what: str) -> None:  # type: ignore[no-untyped-def]
    for _ in range(3000):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not reached within 30 s: {what}")


async def test_sends_queued_in_one_loop_turn_share_one_commit_answered_on_the_event_loop():
    server = Server()
    runner = asyncio.create_task(server.committer.run())
    await asyncio.sleep(0)
    for item in ("a", "b", "c"):
        server.committer.pending.append(item)
        server.committer.wake()
    await _until(lambda: server.answers, "the commit answered")
    assert server.commits == [["a", "b", "c"]]
    assert server.answers == [(["a", "b", "c"], 3)]
    assert server.answer_threads == {threading.current_thread().name}
    runner.cancel()
    await asyncio.gather(runner, return_exceptions=True)
    server.io.close()


async def test_what_queues_during_a_commit_is_committed_next_without_another_wake_up():
    server = Server()
    runner = asyncio.create_task(server.committer.run())
    await asyncio.sleep(0)
    server.gate.clear()  # the first commit is held on the store thread
    server.committer.pending.append("a")
    server.committer.wake()
    await asyncio.sleep(0.05)
    server.committer.pending.extend(["b", "c"])  # queued while "a" is out, not woken
    server.gate.set()
    await _until(lambda: len(server.answers) == 2, "both commits answered")
    assert server.commits == [["a"], ["b", "c"]]
    runner.cancel()
    await asyncio.gather(runner, return_exceptions=True)
    server.io.close()


async def test_a_stop_answers_the_commit_out_then_commits_what_is_queued_after_it():
    server = Server()
    runner = asyncio.create_task(server.committer.run())
    await asyncio.sleep(0)
    server.gate.clear()
    server.committer.pending.append("a")
    server.committer.wake()
    await asyncio.sleep(0.05)
    runner.cancel()  # the stop: the commit of "a" is out on the store thread
    await asyncio.gather(runner, return_exceptions=True)
    server.committer.pending.append("b")
    server.committer.wake()  # no committer running: nothing starts by itself
    stopping = asyncio.create_task(server.committer.commit_pending())
    await asyncio.sleep(0.05)
    assert not stopping.done()  # waits for the commit out
    server.gate.set()
    await stopping
    assert server.commits == [["a"], ["b"]]
    assert server.answers == [(["a"], 1), (["b"], 1)]
    server.io.close()


async def test_a_full_disk_refuses_a_submitted_batch_as_overloaded():
    server = Server(DiskFull("/data/log", dropped_records=1))
    server.committer.pending.append("a")
    await server.committer.commit_pending()
    (batch, error), = server.answers
    assert batch == ["a"] and isinstance(error, QmqError) and error.code == "overloaded"
    server.io.close()


async def test_an_answer_that_raises_is_logged_and_the_next_commit_still_runs(caplog):
    server = Server()
    calls = []

    def committed(batch: list[str], count: int) -> None:
        calls.append(batch)
        if len(calls) == 1:
            raise RuntimeError("a bug in the answer")
    server.committer._committed = committed  # type: ignore[assignment]
    runner = asyncio.create_task(server.committer.run())
    await asyncio.sleep(0)
    server.committer.pending.append("a")
    server.committer.wake()
    await _until(lambda: calls, "the first answer")
    server.committer.pending.append("b")
    server.committer.wake()
    await _until(lambda: len(calls) == 2, "the second answer")
    assert "answering a commit failed" in caplog.text
    runner.cancel()
    await asyncio.gather(runner, return_exceptions=True)
    server.io.close()


async def test_io_thread_submit_hands_back_results_and_errors_in_order_with_calls():
    io = IoThread("test-io")
    seen: list[object] = []
    io.submit(lambda: 1, (), lambda result, error: seen.append(("ok", result, error)))
    io.submit(lambda: 1 / 0, (), lambda result, error: seen.append(("err", result,
                                                                     type(error).__name__)))
    assert await io.call(lambda: 3) == 3  # after both submits: their callbacks ran first
    assert seen == [("ok", 1, None), ("err", None, "ZeroDivisionError")]
    assert io.idle()
    io.close()
