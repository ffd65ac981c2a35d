"""An IoThread's call queue (serverkit.io_thread.CallQueue): the C twin (serverkit._call_queue)
and the Python twin hand items back in order, wait for a put when empty, write the loop's
eventfd before they wait, and keep the item when that write fails."""

from __future__ import annotations

import errno
import os
import select
import threading

import pytest

from serverkit.io_thread import new_call_queue_python
from tests.twins import built_twin

new_call_queue_c = built_twin("serverkit._call_queue", "new_call_queue")

TWINS = [pytest.param(new_call_queue_python, id="python"),
         pytest.param(new_call_queue_c, id="c",
                      marks=pytest.mark.skipif(new_call_queue_c is None,
                                               reason="serverkit._call_queue not built"))]
LIMIT_S = 30.0  # generous: a wait that ends early is no failure


@pytest.fixture
def wake_fd():
    fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    yield fd
    os.close(fd)


def readable(fd: int) -> bool:
    """``fd`` becomes readable within LIMIT_S."""
    return bool(select.select([fd], [], [], LIMIT_S)[0])


def taken_by_a_thread(calls, wake_fd: int) -> tuple[threading.Thread, list]:
    """A thread that takes one item with ``wake_fd``; what it took lands in the list."""
    took: list = []
    thread = threading.Thread(target=lambda: took.append(calls.take(wake_fd)), daemon=True)
    thread.start()
    return thread, took


@pytest.mark.parametrize("new_call_queue", TWINS)
def test_items_come_back_in_the_order_they_were_put(new_call_queue):
    calls = new_call_queue()
    items = [("call", n) for n in range(5)] + [None]
    for item in items:
        calls.put(item)
    assert [calls.take(-1) for _ in items] == items


@pytest.mark.parametrize("new_call_queue", TWINS)
def test_a_take_on_an_empty_queue_waits_for_the_put_and_then_for_the_rest(new_call_queue):
    calls = new_call_queue()
    thread, took = taken_by_a_thread(calls, -1)
    calls.put("first")
    calls.put("second")  # put while the taker may still wait: one wake-up is enough
    thread.join(LIMIT_S)
    assert took == ["first"]
    assert calls.take(-1) == "second"


@pytest.mark.parametrize("new_call_queue", TWINS)
def test_the_eventfd_is_written_before_the_take_waits(new_call_queue, wake_fd):
    calls = new_call_queue()
    thread, took = taken_by_a_thread(calls, wake_fd)
    assert readable(wake_fd)  # written while nothing is queued: the taker is waiting
    assert os.eventfd_read(wake_fd) == 1
    assert took == []
    calls.put("next")
    thread.join(LIMIT_S)
    assert took == ["next"]


@pytest.mark.parametrize("new_call_queue", TWINS)
def test_a_take_with_an_item_queued_writes_the_eventfd_and_returns_it(new_call_queue, wake_fd):
    calls = new_call_queue()
    calls.put("queued")
    assert calls.take(wake_fd) == "queued"
    assert os.eventfd_read(wake_fd) == 1


@pytest.mark.parametrize("queued", [True, False], ids=["queued", "empty"])
@pytest.mark.parametrize("new_call_queue", TWINS)
def test_a_failed_write_raises_and_takes_nothing(new_call_queue, queued):
    calls = new_call_queue()
    if queued:
        calls.put("kept")
    closed_fd = os.eventfd(0)
    os.close(closed_fd)
    with pytest.raises(OSError) as raised:
        calls.take(closed_fd)
    assert raised.value.errno == errno.EBADF
    if not queued:
        calls.put("kept")
    assert calls.take(-1) == "kept"


@pytest.mark.parametrize("new_call_queue", TWINS)
def test_the_taking_thread_gets_many_items_put_one_by_one_in_order(new_call_queue):
    calls = new_call_queue()
    took: list = []

    def take_all() -> None:
        while (item := calls.take(-1)) is not None:
            took.append(item)

    thread = threading.Thread(target=take_all, daemon=True)
    thread.start()
    for n in range(2000):
        calls.put(n)
    calls.put(None)
    thread.join(LIMIT_S)
    assert took == list(range(2000))
