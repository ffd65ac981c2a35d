"""The long polls' wake-ups (``Committed.wake`` / ``park`` / ``notify``): one future and one
timer per parked poll instead of an ``asyncio.Event`` and an ``asyncio.timeout`` (issue 18)."""

from __future__ import annotations

import asyncio

from realtime.committed import Committed
from realtime.tail import Tail


def _committed() -> Committed:
    return Committed(Tail(1 << 20), {}, {})


async def test_a_parked_poll_wakes_true_when_its_subject_is_notified():
    committed = _committed()
    loop = asyncio.get_running_loop()
    wake = committed.wake("s")
    parked = asyncio.ensure_future(committed.park(wake, loop.time() + 60))
    await asyncio.sleep(0)
    assert not parked.done()
    committed.notify("other")
    await asyncio.sleep(0)
    assert not parked.done(), "another subject's commit does not wake it"
    committed.notify("s")
    assert await parked is True


async def test_a_notify_between_taking_the_wake_and_parking_is_not_missed():
    committed = _committed()
    wake = committed.wake("s")  # taken before the poll looks for entries
    committed.notify("s")  # a commit while it looked
    assert await committed.park(wake, asyncio.get_running_loop().time() + 60) is True
    assert committed.wake("s") is not wake, "the next poll waits for the next commit"


async def test_a_poll_past_its_deadline_answers_false_and_leaves_no_waiter_behind():
    committed = _committed()
    loop = asyncio.get_running_loop()
    wake = committed.wake("s")
    assert await committed.park(wake, loop.time() + 0.01) is False
    assert wake.waiters == []
    assert await committed.park(wake, loop.time() - 1) is False, "a deadline passed already"
    assert wake.waiters == []


async def test_a_cancelled_poll_leaves_no_waiter_behind_and_the_others_still_wake():
    committed = _committed()
    loop = asyncio.get_running_loop()
    wake = committed.wake("s")
    cancelled = asyncio.ensure_future(committed.park(wake, loop.time() + 60))
    kept = asyncio.ensure_future(committed.park(wake, loop.time() + 60))
    await asyncio.sleep(0)
    assert len(wake.waiters) == 2
    cancelled.cancel()
    await asyncio.gather(cancelled, return_exceptions=True)
    assert len(wake.waiters) == 1
    committed.notify("s")
    assert await kept is True


async def test_ending_the_long_polls_wakes_every_subjects_parked_polls():
    committed = _committed()
    loop = asyncio.get_running_loop()
    parked = [asyncio.ensure_future(committed.park(committed.wake(subject), loop.time() + 60))
              for subject in ("a", "b", "b")]
    await asyncio.sleep(0)
    committed.end_long_polls()
    assert await asyncio.gather(*parked) == [True, True, True]
    assert committed.stopping


async def test_a_deadline_that_fires_after_the_wake_resolved_the_poll_changes_nothing():
    committed = _committed()
    loop = asyncio.get_running_loop()
    wake = committed.wake("s")
    deadline = loop.time() + 0.005
    parked = asyncio.ensure_future(committed.park(wake, deadline))
    await asyncio.sleep(0)
    committed.notify("s")
    # The timer is cancelled when the poll resumes; had it run, set_result would raise in the
    # loop's exception handler.
    errors: list[dict] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    assert await parked is True
    await asyncio.sleep(0.02)
    assert errors == []
