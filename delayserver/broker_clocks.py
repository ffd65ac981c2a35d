"""``BrokerClocks``: how far ahead of this delay server's clock each realtime broker group's
clock runs, from the ``now_ms`` a broker puts in its ``hold`` answer (docs/PROTOCOL.md
"hold"), so that a hand-off is made visible at its due time by our clock, not by the broker's
(docs/REPLICATION.md 16, review s10 R9).

We read our clock before sending a hold (``sent_at_ms``) and again when its answer is back
(``received_at_ms``); the broker read its clock (``broker_now_ms``) as the hold arrived, in
between. So the skew lies between ``broker_now_ms - received_at_ms`` (a lower bound: the broker
read it no later than we got the answer) and ``broker_now_ms - sent_at_ms`` (an upper bound:
it read it no earlier than we sent). Per group, of the observations of the last
CLOCK_SKEW_WINDOW_MS:

- the shift (``ahead_ms``) added to a hand-off's ``visible_at_ms`` is the SMALLEST UPPER bound
  (never below the largest lower bound nor 0); the largest over the groups. A handed message
  is then never visible before its due time by our clock, and late by at most the quickest
  way there of the window (the broker reads its clock as the hold arrives, so its write and
  its slaves' wait are not in it). A midpoint estimate (tried this session) erred the other way: the
  broker's write sits in the way back, so it made every hand-off early by up to half the
  round trip, and by the whole way back when only slow trips were in the window (review s12
  rvdelay-1);
- the hand-off pauses (``surely_ahead_ms`` over HOLD_CLOCK_AHEAD_MS_MAX) only on the largest
  LOWER bound: a broker clock that is certainly that far ahead (broken). One slow round trip
  cannot pause it (its lower bound is below the skew, however slow it was), where the upper
  bound of a lone slow hold paused the hand-off for NO_HOLD_PAUSE_MS.

Not guaranteed: the hold that first shows a skew (the first of a run, or the first after a
broker's clock stepped ahead) was sent with the old shift, so its messages may be visible up
to the difference early. A pure state machine told the time; owned by the event loop.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

# A broker clock certainly further ahead than this (ms) pauses the hand-off (sent when due).
HOLD_CLOCK_AHEAD_MS_MAX = 1_000
# Observations older than this (ms) no longer bound the skew (a clock may have been stepped).
CLOCK_SKEW_WINDOW_MS = 60_000


class _Seen(NamedTuple):
    """One hold answer's view of a broker clock."""

    at_ms: int  # our clock when the answer came back
    upper_ms: int  # the broker's clock minus when we sent the hold: the skew is at most this
    lower_ms: int  # the broker's clock minus when we got the answer: the skew is at least this


class _GroupClock:
    """One group's observations in the window, as two monotone deques (sliding-window
    extremes): ``tightest``, upper bounds rising front to back (its front: the smallest), and
    ``surest``, lower bounds falling front to back (its front: the largest)."""

    def __init__(self) -> None:
        self.tightest: deque[_Seen] = deque()
        self.surest: deque[_Seen] = deque()

    def add(self, seen: _Seen) -> None:
        """Note ``seen``: an older observation it beats in both ways is no longer needed."""
        while self.tightest and self.tightest[-1].upper_ms >= seen.upper_ms:
            self.tightest.pop()
        self.tightest.append(seen)
        while self.surest and self.surest[-1].lower_ms <= seen.lower_ms:
            self.surest.pop()
        self.surest.append(seen)

    def expire(self, since_ms: int) -> bool:
        """Forget what was seen before ``since_ms``; whether anything is left."""
        for seen in (self.tightest, self.surest):
            while seen and seen[0].at_ms < since_ms:
                seen.popleft()
        return bool(self.tightest)


class BrokerClocks:
    """Per broker group, its clock seen in the hold answers of the last CLOCK_SKEW_WINDOW_MS
    (module docstring)."""

    def __init__(self) -> None:
        self._groups: dict[str, _GroupClock] = {}

    def observe(self, group: str, sent_at_ms: int, broker_now_ms: int,
                received_at_ms: int) -> None:
        """A hold sent at ``sent_at_ms`` (our clock) was read by ``group``'s broker at
        ``broker_now_ms`` (its clock), and its answer came back at ``received_at_ms``."""
        seen = _Seen(received_at_ms, broker_now_ms - sent_at_ms, broker_now_ms - received_at_ms)
        self._groups.setdefault(group, _GroupClock()).add(seen)

    def _live(self, now_ms: int) -> list[_GroupClock]:
        since_ms = now_ms - CLOCK_SKEW_WINDOW_MS + 1
        for group in [g for g, clock in self._groups.items() if not clock.expire(since_ms)]:
            del self._groups[group]
        return list(self._groups.values())

    def ahead_ms(self, now_ms: int) -> int:
        """The shift for a hand-off's ``visible_at_ms``: at most how far ahead of ours the
        broker groups' clocks run, by the smallest upper bound of each, and at least what is
        sure (0: none ahead, or nothing observed in the window)."""
        shift_ms = 0
        for clock in self._live(now_ms):
            shift_ms = max(shift_ms, clock.tightest[0].upper_ms, clock.surest[0].lower_ms)
        return shift_ms

    def surely_ahead_ms(self, now_ms: int) -> int:
        """How far ahead of ours some broker group's clock certainly runs (0: none surely)."""
        return max([0] + [clock.surest[0].lower_ms for clock in self._live(now_ms)])


__all__ = ["CLOCK_SKEW_WINDOW_MS", "HOLD_CLOCK_AHEAD_MS_MAX", "BrokerClocks"]
