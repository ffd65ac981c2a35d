"""``Committed``: the event loop's view of what the message store has committed, and the
wake-ups of the long polls waiting for more.

The send path adds each commit's runs (``add``); retention moves the first sequences up
(``retained``); the pull path reads the ends and firsts, takes fresh messages from the tail and
waits on a subject's event. Keeping this on the loop means a pull of a caught-up group asks no
I/O thread at all.
"""

from __future__ import annotations

import asyncio
import heapq
from typing import Callable, Iterable, Protocol

from realtime.tail import Tail


class Waiter(Protocol):
    """What a parked long poll waits with: an ``asyncio.Future[bool]`` (``Committed.park``), or
    a pull parked with no task (``realtime.pulls.ParkedPull``, ``Committed.park_direct``), told
    its outcome the same way."""

    def done(self) -> bool: ...

    def set_result(self, result: bool) -> None: ...


class Wake:
    """The next commit (or release, or leave) of one subject, as the long polls wait for it:
    ``woken`` once ``Committed.notify`` ran, the futures of the polls parked on it, each
    resolved True then, and the pulls parked on it with no task (``direct``), handed over
    together then (``Committed.tell_direct``). A poll takes it before it looks for entries, so a commit that happens
    while it looks is not missed. Cheaper than an ``asyncio.Event`` plus an ``asyncio.timeout``
    per parked poll (issue 18: a long poll parks and wakes about once per commit at 2,000
    msg/s): a parked poll's deadline resolves its future False (``Committed.park``)."""

    __slots__ = ("woken", "waiters", "direct")

    def __init__(self) -> None:
        self.woken = False
        self.waiters: list[Waiter] = []  # futures (``park``)
        self.direct: list[Waiter] = []  # pulls parked with no task (``park_direct``)


# A Wake with no fields set yet (``Committed.wake`` sets the three ``__init__`` sets).
_new_wake = object.__new__


# A parked long poll ends at most this long after its deadline: the polls whose deadlines fall
# in one such slot end together. A timer per poll cost a call_at (a TimerHandle pushed on the
# loop's heap, its comparisons in Python) and a cancel per park and wake: 6.6% of a woken pull's
# loop CPU (issue 18, bench.pull_wake). Small against a poll's wait (the SDK's: 20 s) and
# against the slack a client gives it (5 s). One loop timer serves every slot: it is set for the
# earliest slot in use and, when it fires, for the next (a timer per slot kept a wait's worth
# of them, 400, on the loop's heap).
PARK_DEADLINE_SLOT_S = 0.05


def _nothing() -> None:
    """No parked pulls to go on with (a ``Committed`` no ``Pulls`` uses)."""


def _tell(waiters: Iterable[Waiter], result: bool) -> None:
    """Tell every waiter not yet done ``result``. One whose ``set_result`` raises (a bug) is
    reported to the loop's exception handler, as a callback's error is, and the others are
    still told: an error must not leave the rest of a slot or a wake parked."""
    for waiter in waiters:
        if not waiter.done():
            try:
                waiter.set_result(result)
            except Exception as exc:
                asyncio.get_running_loop().call_exception_handler(
                    {"message": f"a parked poll's waiter raised when told {result}",
                     "exception": exc, "waiter": waiter})


class Committed:
    """Committed ends and first sequences per subject, the tail of recent messages, and the
    events long polls wait on.

    Owner: the event loop, for every field (``tail``, ``ends``, ``firsts``, ``stopping``, the
    wakes). The store thread never sees it: what it reports comes back through the loop.
    """

    def __init__(self, tail: Tail, ends: dict[str, int], firsts: dict[str, int]) -> None:
        self.tail = tail
        self.ends = ends  # subject -> sequence after its last committed message
        self.firsts = firsts  # subject -> its first sequence retention kept
        self.stopping = False  # end_long_polls() was called: waiting pulls answer at once
        self._wakes: dict[str, Wake] = {}  # subject -> its next commit's, while someone looks
        # Deadline slot (loop time // PARK_DEADLINE_SLOT_S, rounded up) -> the polls parked
        # until it, and the slots in use as a heap (floats holding ints: compared in C).
        self._deadline_slots: dict[float, set[Waiter]] = {}
        self._slot_heap: list[float] = []
        # The one loop timer, set for the earliest slot in use (_timer_slot); None: no slot.
        self._timer: asyncio.TimerHandle | None = None
        self._timer_slot = 0.0
        # Goes on now with the parked pulls woken so far (``Pulls`` sets it): a publishing step
        # calls it once it has answered its senders, so their polls answer in the same step.
        self.answer_woken: Callable[[], None] = _nothing
        # True while a publishing step runs that calls ``answer_woken`` itself before it ends
        # (``Sends``, when every sender of the commit is answered by callback): the polls it
        # wakes then schedule no loop callback (issue 18: it found nothing, an empty loop turn
        # per commit). A step that fails first calls ``answer_woken_soon`` instead.
        self.answering_woken = False
        # Schedules the loop callback that goes on with the parked pulls woken so far, if any
        # (``Pulls`` sets it).
        self.answer_woken_soon: Callable[[], None] = _nothing
        # Tells a woken wake's pulls parked with no task (``Wake.direct``) True, all in one
        # call (``Pulls`` sets it: issue 18, a ``done``, a ``set_result`` and a queue call
        # per woken poll before); by default each through its ``set_result``.
        self.tell_direct: Callable[[list[Waiter], bool], None] = _tell

    def restart(self, ends: dict[str, int], firsts: dict[str, int]) -> None:
        """A copy became the master: what is committed is what its store says now; the tail
        starts empty (pulls of older messages read the store)."""
        self.tail = Tail(self.tail.bytes_max)
        self.ends = ends
        self.firsts = firsts
        self.stopping = False

    def add(self, subject: str, first: int, payloads: list[bytes],
            tags: Iterable[tuple[str, ...]], expiries: Iterable[int | None],
            size_bytes: int) -> None:
        """A committed run of ``subject`` (sequences from ``first``): into the tail, as columns
        (``Tail.add``)."""
        self.tail.add(subject, first, payloads, tags, expiries, size_bytes)
        end = first + len(payloads)
        if end > self.ends.get(subject, 0):
            self.ends[subject] = end
        self.firsts.setdefault(subject, first)

    def retained(self, firsts: dict[str, int]) -> None:
        """Retention deleted what lies below these first sequences."""
        for subject, first in firsts.items():
            self.firsts[subject] = first
            self.tail.drop_below(subject, first)

    def wake(self, subject: str) -> Wake:
        """What the next ``notify(subject)`` wakes: a long poll takes it before it looks."""
        wake = self._wakes.get(subject)
        if wake is None:
            # ``Wake()``'s fields set here: a wake is made per commit a poll waits for, and
            # this is no Python ``__init__`` call for it (issue 18).
            wake = self._wakes[subject] = _new_wake(Wake)
            wake.woken = False
            wake.waiters = []
            wake.direct = []
        return wake

    async def park(self, wake: Wake, deadline: float) -> bool:
        """Wait until ``wake`` is woken (True, at once if it was already) or the loop's clock
        has passed ``deadline`` (False: never before it, at most PARK_DEADLINE_SLOT_S after).
        One future; the timer is its deadline slot's. A poll that ends, however it ends,
        leaves nothing behind in ``wake`` or its slot."""
        if wake.woken:
            return True
        waiter: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        wake.waiters.append(waiter)
        parked = self._deadline_slot(deadline)
        parked.add(waiter)
        try:
            return await waiter
        finally:
            parked.discard(waiter)
            if not wake.woken:
                wake.waiters.remove(waiter)

    def park_direct(self, wake: Wake, deadline: float, waiter: Waiter) -> set[Waiter]:
        """``park`` for a waiter that is not awaited (a pull parked with no task): it is told
        True when ``wake`` is woken (at once if it was already) or False once ``deadline`` has
        passed, through its ``set_result`` (or, woken, as ``tell_direct`` tells it). Returns
        its deadline slot's set, for ``unpark``."""
        # ``_deadline_slot``'s usual case, written out: the slot is in use already (a pull
        # parks about once a message, and polls parked within PARK_DEADLINE_SLOT_S share one).
        slot = -(-deadline // PARK_DEADLINE_SLOT_S)
        if slot * PARK_DEADLINE_SLOT_S < deadline:
            slot += 1
        parked = self._deadline_slots.get(slot)
        if parked is None:
            parked = self._deadline_slot(deadline)
        if wake.woken:
            waiter.set_result(True)
            return parked
        wake.direct.append(waiter)
        parked.add(waiter)
        return parked

    @staticmethod
    def unpark(wake: Wake, parked: set[Waiter], waiter: Waiter) -> None:
        """A waiter of ``park_direct`` was told its outcome: nothing of it stays behind in
        ``wake`` or in its deadline slot's set ``parked``."""
        parked.discard(waiter)
        if not wake.woken and waiter in wake.direct:
            wake.direct.remove(waiter)

    def _deadline_slot(self, deadline: float) -> set[Waiter]:
        """The set of the polls parked until ``deadline``'s slot (on first use the slot joins
        the heap, and the timer moves to it if it is the earliest)."""
        slot = -(-deadline // PARK_DEADLINE_SLOT_S)  # rounded up: a float holding an int
        if slot * PARK_DEADLINE_SLOT_S < deadline:
            slot += 1  # the float product fell short of the deadline
        parked = self._deadline_slots.get(slot)
        if parked is None:
            parked = self._deadline_slots[slot] = set()
            heapq.heappush(self._slot_heap, slot)
            if self._timer is None or slot < self._timer_slot:
                self._set_timer(slot)
        return parked

    def _set_timer(self, slot: float) -> None:
        """The loop timer fires at the end of ``slot`` (the earliest in use), not before."""
        if self._timer is not None:
            self._timer.cancel()  # set for a later slot: that one is still in the heap
        self._timer_slot = slot
        self._timer = asyncio.get_running_loop().call_at(slot * PARK_DEADLINE_SLOT_S,
                                                         self._slot_passed)

    def _slot_passed(self) -> None:
        """The timer: the earliest slot has passed, its polls still parked end with False;
        then the timer is set for the next slot in use."""
        self._timer = None
        heap, slots = self._slot_heap, self._deadline_slots
        while heap and heap[0] <= self._timer_slot:
            _tell(slots.pop(heapq.heappop(heap)), False)
        if heap:
            self._set_timer(heap[0])

    def notify(self, subject: str) -> None:
        """Wake every long poll of ``subject`` (something was committed or released)."""
        wake = self._wakes.pop(subject, None)
        if wake is not None:
            wake.woken = True
            if wake.waiters:
                _tell(wake.waiters, True)
            if wake.direct:
                self.tell_direct(wake.direct, True)

    def end_long_polls(self) -> None:
        """Answer every waiting long poll now, and every later one at once (shutdown)."""
        self.stopping = True
        for subject in list(self._wakes):
            self.notify(subject)


__all__ = ["Committed", "PARK_DEADLINE_SLOT_S", "Wake", "Waiter"]
