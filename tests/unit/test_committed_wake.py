"""The long polls' wake-ups (``Committed.wake`` / ``park`` / ``notify``): one future per parked
poll and one loop timer for every deadline slot, instead of an ``asyncio.Event`` and an
``asyncio.timeout`` per poll (issue 18)."""

from __future__ import annotations

import asyncio

from realtime.committed import PARK_DEADLINE_SLOT_S, Committed, Wake
from realtime.tail import Tail


def _committed() -> Committed:
    return Committed(Tail(1 << 20), {}, {})


def _loop_errors(loop: asyncio.AbstractEventLoop) -> list[dict]:
    """What the loop's exception handler is given from now on (a callback's error...)."""
    errors: list[dict] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    return errors


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
    assert not any(committed._deadline_slots.values())


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
    errors = _loop_errors(loop)
    assert await parked is True
    await asyncio.sleep(0.02)
    assert errors == []


async def test_polls_never_end_before_their_deadlines_and_polls_of_one_slot_share_a_timer(
        monkeypatch):
    committed = _committed()
    loop = asyncio.get_running_loop()
    timers = []
    call_at = loop.call_at

    def counting_call_at(when, callback, *args):
        timers.append(when)
        return call_at(when, callback, *args)

    monkeypatch.setattr(loop, "call_at", counting_call_at)
    base = (loop.time() // PARK_DEADLINE_SLOT_S + 2) * PARK_DEADLINE_SLOT_S  # a slot's start
    deadlines = [base + PARK_DEADLINE_SLOT_S * f for f in (0.1, 0.5, 0.9)]  # one slot
    deadlines.append(base + PARK_DEADLINE_SLOT_S * 1.5)  # the next

    async def poll(deadline: float) -> tuple[bool, float]:
        woken = await committed.park(committed.wake("s"), deadline)
        return woken, loop.time()

    ended = await asyncio.gather(*(poll(d) for d in deadlines))
    assert [woken for woken, _ in ended] == [False] * 4
    for deadline, (_, at) in zip(deadlines, ended):
        assert at >= deadline
    assert len(timers) == 2, timers
    assert committed._deadline_slots == {}


async def test_a_poll_woken_before_its_slot_passes_leaves_its_slot_and_the_others_still_end():
    committed = _committed()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 0.02
    woken = asyncio.ensure_future(committed.park(committed.wake("a"), deadline))
    waiting = asyncio.ensure_future(committed.park(committed.wake("b"), deadline))
    await asyncio.sleep(0)
    committed.notify("a")
    assert await woken is True
    assert sum(map(len, committed._deadline_slots.values())) == 1
    assert await waiting is False


async def test_polls_parked_in_many_deadline_slots_keep_one_loop_timer_at_a_time(monkeypatch):
    # A timer per slot kept up to a wait's worth of slots (20 s / 50 ms = 400) on the loop's
    # heap, each push and pop comparing TimerHandles in Python (issue 18).
    committed = _committed()
    loop = asyncio.get_running_loop()
    scheduled = []
    call_at = loop.call_at

    def counting_call_at(when, callback, *args):
        handle = call_at(when, callback, *args)
        scheduled.append(handle)
        return handle

    monkeypatch.setattr(loop, "call_at", counting_call_at)
    base = (loop.time() // PARK_DEADLINE_SLOT_S + 2) * PARK_DEADLINE_SLOT_S
    # Out of order: a later slot first, then earlier ones.
    deadlines = [base + PARK_DEADLINE_SLOT_S * f for f in (4.5, 0.5, 2.5, 1.5, 0.7)]
    wake = committed.wake("s")
    polls = [asyncio.ensure_future(committed.park(wake, d)) for d in deadlines]
    await asyncio.sleep(0)
    live = [handle for handle in scheduled if not handle.cancelled()]
    assert len(live) == 1, live
    # The earliest slot's end: not before the earliest deadline, before the next slot's.
    assert min(deadlines) <= live[0].when() < min(deadlines) + PARK_DEADLINE_SLOT_S

    async def ended_at(poll: asyncio.Future[bool]) -> tuple[bool, float]:
        return await poll, loop.time()

    ended = await asyncio.gather(*(ended_at(p) for p in polls))
    assert [woken for woken, _ in ended] == [False] * 5
    for deadline, (_, at) in zip(deadlines, ended):
        assert at >= deadline
    assert committed._deadline_slots == {}
    assert [h for h in scheduled if not h.cancelled() and h.when() > loop.time()] == []


class _FailingWaiter:
    """A waiter whose outcome cannot be told (a bug): its ``set_result`` raises."""

    def done(self) -> bool:
        return False

    def set_result(self, result: bool) -> None:
        raise RuntimeError("a waiter that fails when told")


async def test_a_waiter_that_fails_when_its_slot_passes_does_not_keep_the_later_slots_from_ending():
    committed = _committed()
    loop = asyncio.get_running_loop()
    errors = _loop_errors(loop)
    base = (loop.time() // PARK_DEADLINE_SLOT_S + 1) * PARK_DEADLINE_SLOT_S
    committed.park_direct(committed.wake("a"), base + PARK_DEADLINE_SLOT_S * 0.5,
                          _FailingWaiter())
    later = asyncio.ensure_future(
        committed.park(committed.wake("b"), base + PARK_DEADLINE_SLOT_S * 2.5))
    async with asyncio.timeout(10):
        assert await later is False
    assert [type(c.get("exception")) for c in errors] == [RuntimeError]


class _FailingFirstWaiter(_FailingWaiter):
    """A failing waiter that a set iterates first: hash 0 takes a fresh set's slot 0."""

    def __hash__(self) -> int:
        return 0


async def test_a_waiter_that_fails_when_its_slot_passes_does_not_keep_its_slot_mates_waiting():
    committed = _committed()
    loop = asyncio.get_running_loop()
    errors = _loop_errors(loop)
    deadline = (loop.time() // PARK_DEADLINE_SLOT_S + 1.5) * PARK_DEADLINE_SLOT_S
    committed.park_direct(committed.wake("a"), deadline, _FailingFirstWaiter())
    mates = [asyncio.ensure_future(committed.park(committed.wake(s), deadline))
             for s in ("b", "c", "d")]
    async with asyncio.timeout(10):
        assert await asyncio.gather(*mates) == [False] * 3
    assert [type(c.get("exception")) for c in errors] == [RuntimeError]
    assert committed._deadline_slots == {}


async def test_a_waiter_that_fails_when_its_subject_is_notified_does_not_keep_the_others_parked():
    committed = _committed()
    loop = asyncio.get_running_loop()
    errors = _loop_errors(loop)
    wake = committed.wake("s")
    committed.park_direct(wake, loop.time() + 60, _FailingWaiter())
    others = [asyncio.ensure_future(committed.park(wake, loop.time() + 60)) for _ in range(3)]
    await asyncio.sleep(0)
    committed.notify("s")
    async with asyncio.timeout(10):
        assert await asyncio.gather(*others) == [True] * 3
    assert [type(c.get("exception")) for c in errors] == [RuntimeError]


class _Told:
    """A waiter parked with no task that records how it was told."""

    def __init__(self) -> None:
        self.results: list[bool] = []

    def done(self) -> bool:
        return bool(self.results)

    def set_result(self, result: bool) -> None:
        self.results.append(result)


async def test_a_commit_hands_its_polls_parked_with_no_task_over_in_one_call_and_wakes_its_futures():
    committed = _committed()
    loop = asyncio.get_running_loop()
    calls: list[tuple[list, bool]] = []
    committed.tell_direct = lambda polls, woken: calls.append((list(polls), woken))
    wake = committed.wake("s")
    polls = [_Told() for _ in range(3)]
    for poll in polls:
        committed.park_direct(wake, loop.time() + 60, poll)
    future = asyncio.ensure_future(committed.park(wake, loop.time() + 60))
    await asyncio.sleep(0)
    committed.notify("s")
    assert calls == [(polls, True)], "one call for all of them, in the order they parked"
    assert all(poll.results == [] for poll in polls), "none told one by one"
    assert await future is True


def test_a_commits_wake_has_every_field_a_new_wake_has_and_the_same_values():
    # Committed.wake makes its Wake without calling __init__ (issue 18): a field added to Wake
    # must be set there too, or every commit's wake lacks it (review rv22-L2).
    made = _committed().wake("s")
    fresh = Wake()
    assert type(made) is Wake
    assert {slot: getattr(made, slot) for slot in Wake.__slots__} == {
        slot: getattr(fresh, slot) for slot in Wake.__slots__}
    assert made.waiters is not _committed().wake("s").waiters  # a list of its own per wake
