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
