"""``IoThread`` hands results back through an eventfd of its own (serverkit/io_thread.py):
every result reaches its caller, in order, and the eventfd is closed once the thread ends,
whoever sees its end last (the loop, or the thread when no loop reads it)."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from serverkit.io_thread import IoThread

pytestmark = pytest.mark.skipif(not hasattr(os, "eventfd"), reason="eventfd is Linux only")


def open_fds() -> set[int]:
    """The file descriptors this process holds now."""
    return {int(name) for name in os.listdir("/proc/self/fd")}


def wait_until(condition, limit_s: float = 30.0) -> bool:
    """Poll ``condition`` until it holds (True) or ``limit_s`` passed (False)."""
    deadline = time.monotonic() + limit_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


async def test_a_burst_of_calls_gets_every_result_and_error_in_submission_order():
    io = IoThread("test-burst")
    try:
        order: list[int] = []

        def note(n: int) -> int:
            order.append(n)
            if n % 7 == 3:
                raise ValueError(f"call {n}")
            return n * 2

        outcomes = await asyncio.gather(*(io.call(note, n) for n in range(500)),
                                        return_exceptions=True)
        assert order == list(range(500))
        for n, outcome in enumerate(outcomes):
            if n % 7 == 3:
                assert isinstance(outcome, ValueError) and str(outcome) == f"call {n}"
            else:
                assert outcome == n * 2
        assert await io.submit(lambda: "after the burst") == "after the burst"
    finally:
        io.close()


async def test_a_closed_io_thread_leaves_no_file_descriptor_open():
    before = open_fds()
    for _ in range(5):
        io = IoThread("test-fds")
        assert await io.call(lambda: 1) == 1
        io.close()
    assert open_fds() == before


async def test_close_hands_back_results_finished_while_it_waited_for_the_thread():
    io = IoThread("test-close")
    release = threading.Event()
    running = asyncio.ensure_future(io.call(release.wait, 30))
    queued = io.submit(lambda: "queued before close")
    await asyncio.sleep(0)
    threading.Timer(0.05, release.set).start()
    io.close()  # waits for both calls: their results are handed back without a loop turn
    assert queued.done() and queued.result() == "queued before close"
    assert await running is True


async def test_an_io_thread_closed_without_waiting_closes_its_eventfd_once_its_call_ends():
    before = open_fds()
    io = IoThread("test-nowait")
    release = threading.Event()
    running = asyncio.ensure_future(io.call(release.wait, 30))
    await asyncio.sleep(0)
    io.close(wait=False)
    assert open_fds() != before, "the thread still runs a call: its eventfd stays open"
    release.set()
    assert await running is True  # the result still comes back through the eventfd
    for _ in range(1000):  # the loop reads the thread's last write, then closes the eventfd
        if open_fds() == before:
            break
        await asyncio.sleep(0.01)
    assert open_fds() == before


def test_an_io_thread_no_loop_ever_called_closes_its_own_eventfd():
    before = open_fds()
    io = IoThread("test-unbound")
    io.close(wait=False)
    assert wait_until(lambda: open_fds() == before)


def _closed_without_waiting_on(loop: asyncio.AbstractEventLoop, release: threading.Event
                               ) -> IoThread:
    """On ``loop``: an IoThread whose call waits for ``release``, closed with
    ``close(wait=False)`` while that call runs (Scheduler.open cancelled or failing)."""

    async def start() -> IoThread:
        io = IoThread("test-stopped")
        asyncio.ensure_future(io.call(release.wait, 30))
        await asyncio.sleep(0)
        io.close(wait=False)
        return io

    return loop.run_until_complete(start())


def test_an_io_thread_whose_call_ends_while_its_loop_is_stopped_closes_its_eventfd_with_the_loop():
    # review s13 rvperf-4: the thread wrote its last wake-up for a loop that never ran again.
    before = open_fds()
    loop = asyncio.new_event_loop()
    release = threading.Event()
    io = _closed_without_waiting_on(loop, release)
    release.set()
    io._thread.join(30)
    assert not io._thread.is_alive()
    loop.close()
    assert wait_until(lambda: open_fds() == before), "the eventfd stayed open"


def test_an_io_thread_whose_call_ends_after_its_loop_closed_closes_its_eventfd():
    before = open_fds()
    loop = asyncio.new_event_loop()
    release = threading.Event()
    io = _closed_without_waiting_on(loop, release)
    loop.close()
    release.set()
    io._thread.join(30)
    assert wait_until(lambda: open_fds() == before), "the eventfd stayed open"


def test_an_io_thread_whose_call_ends_while_its_loop_is_stopped_leaves_the_loop_usable():
    """The loop runs again after the thread ended: nothing of the eventfd is left in its
    selector (a descriptor number reused by a new reader works)."""
    before = open_fds()
    loop = asyncio.new_event_loop()
    try:
        release = threading.Event()
        io = _closed_without_waiting_on(loop, release)
        release.set()
        io._thread.join(30)
        assert wait_until(lambda: not [fd for fd in open_fds() - before if _is_eventfd(fd)])

        async def a_new_reader() -> bytes:
            reading, writing = os.pipe()
            got: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
            asyncio.get_running_loop().add_reader(reading, lambda: got.set_result(
                os.read(reading, 10)))
            os.write(writing, b"ok")
            try:
                return await got
            finally:
                asyncio.get_running_loop().remove_reader(reading)
                os.close(reading)
                os.close(writing)

        assert loop.run_until_complete(a_new_reader()) == b"ok"
    finally:
        loop.close()
    assert wait_until(lambda: open_fds() == before)


def test_a_server_open_cancelled_under_asyncio_run_leaves_no_descriptor_open(monkeypatch,
                                                                            tmp_path):
    """The delay server's start cancelled while its store opens (Scheduler.open closes its
    IoThread without waiting; asyncio.run then closes the loop) and the open ending later."""
    import delayserver.scheduler as scheduler_module
    from delayserver.config import DelayConfig

    release, entered = threading.Event(), threading.Event()
    real_open = scheduler_module.open_store_on_io

    def slow_open(*args):
        entered.set()
        release.wait(30)
        return real_open(*args)

    monkeypatch.setattr(scheduler_module, "open_store_on_io", slow_open)
    config = DelayConfig(data_dir=str(tmp_path / "delay"), port=0, trace=False)

    async def main() -> None:
        opening = asyncio.ensure_future(scheduler_module.Scheduler.open(
            config, lambda: 1_000, lambda *_: None))
        while not entered.is_set():
            await asyncio.sleep(0.001)
        opening.cancel()
        with pytest.raises(asyncio.CancelledError):
            await opening

    before = open_fds()
    asyncio.run(main())
    release.set()
    assert wait_until(lambda: not [t for t in threading.enumerate() if t.name == "delay-io"])
    # Neither the eventfd nor the files of the store the open made after its cancel
    assert wait_until(lambda: open_fds() == before), [_target(fd) for fd in open_fds() - before]


def _target(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "(closed)"


def test_calls_queued_behind_a_close_without_waiting_still_run_after_the_loop_closed():
    """Scheduler.open queues the close of the store its cancelled open makes behind it."""
    loop = asyncio.new_event_loop()
    release, ran = threading.Event(), threading.Event()

    async def start() -> IoThread:
        io = IoThread("test-queued")
        asyncio.ensure_future(io.call(release.wait, 30))
        await asyncio.sleep(0)
        io.submit(ran.set)
        io.close(wait=False)
        return io

    io = loop.run_until_complete(start())
    loop.close()
    release.set()
    io._thread.join(30)
    assert ran.is_set(), "the call queued behind the running one never ran"


def _is_eventfd(fd: int) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[eventfd]"
    except OSError:
        return False


async def test_a_submitted_calls_then_runs_in_the_hand_back_itself_with_no_loop_turn():
    io = IoThread("test-then")
    try:
        events: list[str] = []
        deliver = io._deliver

        def watched_deliver() -> None:
            events.append("hand-back")
            deliver()
            events.append("hand-back ended")

        io._deliver = watched_deliver  # type: ignore[method-assign]  # the eventfd's reader
        seen = asyncio.get_running_loop().create_future()
        io.submit(lambda: 7).then(lambda done: (events.append(f"then {done.result()}"),
                                                seen.set_result(None)))
        async with asyncio.timeout(30):
            await seen
        assert events[:3] == ["hand-back", "then 7", "hand-back ended"]
    finally:
        io.close()


def queue_with_then(io: IoThread, how: str, call, then) -> None:
    """Queue ``call`` on ``io`` with ``then()`` run in its hand-back, the way ``how`` names:
    ``IoThread.submit(...).then`` or ``IoThread.submit_then`` (the same ordering rule)."""
    if how == "submit_then":
        io.submit_then(lambda result, error: then(), call)
    else:
        io.submit(call).then(lambda done: then())


THEN_PATHS = pytest.mark.parametrize("how", ["submit().then", "submit_then"])


@THEN_PATHS
async def test_a_then_waits_for_a_task_resumed_by_a_result_handed_back_before_it(how: str):
    io = IoThread("test-then-order")
    try:
        order: list[str] = []
        gate = threading.Event()
        io.submit(gate.wait, 30)  # holds the thread while the two calls below queue up

        async def round_before() -> None:
            await io.call(lambda: "round")
            order.append("task resumed by the round handed back first")

        task = asyncio.create_task(round_before())
        await asyncio.sleep(0)  # the task's call is queued now
        queue_with_then(io, how, lambda: "commit", lambda: order.append("then"))
        gate.set()
        # Block the loop until the thread finished all three: they come back in one bunch.
        assert wait_until(lambda: io.idle())
        await task
        while len(order) < 2:
            await asyncio.sleep(0)
        assert order == ["task resumed by the round handed back first", "then"]
    finally:
        io.close()


@THEN_PATHS
async def test_a_then_that_raises_is_reported_and_the_bunchs_other_results_still_arrive(how: str):
    io = IoThread("test-then-raises")
    loop = asyncio.get_running_loop()
    reported: list[dict] = []
    loop.set_exception_handler(lambda _, context: reported.append(context))
    try:
        gate = threading.Event()
        queue_with_then(io, how, lambda: gate.wait(30), lambda: 1 / 0)
        after = io.submit(lambda: "after")
        gate.set()
        assert await after == "after"
        assert isinstance(reported[0]["exception"], ZeroDivisionError)
    finally:
        loop.set_exception_handler(None)
        io.close()


async def test_a_submit_then_call_tells_its_then_the_result_or_the_error_in_the_hand_back():
    io = IoThread("test-submit-then")
    try:
        events: list[object] = []
        deliver = io._deliver

        def watched_deliver() -> None:
            events.append("hand-back")
            deliver()
            events.append("hand-back ended")

        io._deliver = watched_deliver  # type: ignore[method-assign]  # the eventfd's reader
        seen = asyncio.get_running_loop().create_future()
        io.submit_then(lambda result, error: (events.append(("then", result, error)),
                                              seen.set_result(None)), lambda: 7)
        async with asyncio.timeout(30):
            await seen
        assert events[:3] == ["hand-back", ("then", 7, None), "hand-back ended"]
        failed = asyncio.get_running_loop().create_future()
        io.submit_then(lambda result, error: failed.set_result((result, error)),
                       lambda: 1 / 0)
        async with asyncio.timeout(30):
            result, error = await failed
        assert result is None and isinstance(error, ZeroDivisionError)
    finally:
        io.close()
