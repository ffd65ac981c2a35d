"""``BrokerClocks``: how far ahead of this delay server's clock each realtime broker group's
clock runs, from the ``now_ms`` a broker puts in its ``hold`` answer (docs/PROTOCOL.md
"hold"), so that a hand-off is made visible at its due time by our clock, not by the broker's
(docs/REPLICATION.md 16, review s10 R9).

We read our clock before sending a hold (``sent_at_ms``) and again when its answer is back
(``received_at_ms``); the broker read its clock (``broker_now_ms``) in between. So the skew
lies between ``broker_now_ms - received_at_ms`` (a lower bound: the broker read it no later
than we got the answer) and ``broker_now_ms - sent_at_ms`` (an upper bound), and the round
trip's midpoint is within half the round trip of it. Per group, of the observations of the
last CLOCK_SKEW_WINDOW_MS:

- the shift (``ahead_ms``) added to a hand-off's ``visible_at_ms`` is the midpoint estimate of
  the observation with the shortest round trip (the tightest; a slow trip, an outlier, is
  never chosen over a quicker one) when that round trip is at most TRUSTED_ROUND_TRIP_MS, and
  never below the largest lower bound nor 0; the largest over the groups. It errs by at most
  half that round trip (less the broker's own time in it), where the upper bound alone added
  a whole one-way trip to every handed message; with only slow round trips in the window
  (a lone hold on a busy loop) it is the lower bound alone, so one slow trip cannot make every
  later hand-off late by half of it;
- the hand-off pauses (``surely_ahead_ms`` over HOLD_CLOCK_AHEAD_MS_MAX) only on the largest
  LOWER bound: a broker clock that is certainly that far ahead (broken). One slow round trip
  cannot pause it (its lower bound is below the skew, however slow it was), where the upper
  bound of a lone slow hold paused the hand-off for NO_HOLD_PAUSE_MS.

Not guaranteed: the hold that first shows a skew (the first of a run, or the first after a
broker's clock stepped ahead) was sent with the old shift, so its messages may be visible up
to the difference early; a way there much slower than the way back in the quickest round trip
makes the estimate low by up to half of it. A pure state machine told the time; owned by the
event loop.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

# A broker clock certainly further ahead than this (ms) pauses the hand-off (sent when due).
HOLD_CLOCK_AHEAD_MS_MAX = 1_000
# Observations older than this (ms) no longer bound the skew (a clock may have been stepped).
CLOCK_SKEW_WINDOW_MS = 60_000
# A round trip longer than this (ms) is too vague for its midpoint to shift hand-offs by.
TRUSTED_ROUND_TRIP_MS = 100


class _Seen(NamedTuple):
    """One hold answer's view of a broker clock."""

    at_ms: int  # our clock when the answer came back
    round_trip_ms: int
    estimate_ms: int  # the broker's clock minus the round trip's midpoint (rounded up)
    lower_ms: int  # the broker's clock minus when we got the answer: the skew is at least this


class _GroupClock:
    """One group's observations in the window, as two monotone deques (sliding-window
    extremes): ``quickest``, round trips rising front to back (its front: the quickest), and
    ``surest``, lower bounds falling front to back (its front: the largest)."""

    def __init__(self) -> None:
        self.quickest: deque[_Seen] = deque()
        self.surest: deque[_Seen] = deque()

    def add(self, seen: _Seen) -> None:
        """Note ``seen``: an older observation it beats in both ways is no longer needed."""
        while self.quickest and self.quickest[-1].round_trip_ms >= seen.round_trip_ms:
            self.quickest.pop()
        self.quickest.append(seen)
        while self.surest and self.surest[-1].lower_ms <= seen.lower_ms:
            self.surest.pop()
        self.surest.append(seen)

    def expire(self, since_ms: int) -> bool:
        """Forget what was seen before ``since_ms``; whether anything is left."""
        for seen in (self.quickest, self.surest):
            while seen and seen[0].at_ms < since_ms:
                seen.popleft()
        return bool(self.quickest)


class BrokerClocks:
    """Per broker group, its clock seen in the hold answers of the last CLOCK_SKEW_WINDOW_MS
    (module docstring)."""

    def __init__(self) -> None:
        self._groups: dict[str, _GroupClock] = {}

    def observe(self, group: str, sent_at_ms: int, broker_now_ms: int,
                received_at_ms: int) -> None:
        """A hold sent at ``sent_at_ms`` (our clock) was read by ``group``'s broker at
        ``broker_now_ms`` (its clock), and its answer came back at ``received_at_ms``."""
        round_trip_ms = max(0, received_at_ms - sent_at_ms)
        estimate_ms = broker_now_ms - (sent_at_ms + received_at_ms) // 2
        seen = _Seen(received_at_ms, round_trip_ms, estimate_ms, broker_now_ms - received_at_ms)
        self._groups.setdefault(group, _GroupClock()).add(seen)

    def _live(self, now_ms: int) -> list[_GroupClock]:
        since_ms = now_ms - CLOCK_SKEW_WINDOW_MS + 1
        for group in [g for g, clock in self._groups.items() if not clock.expire(since_ms)]:
            del self._groups[group]
        return list(self._groups.values())

    def ahead_ms(self, now_ms: int) -> int:
        """The shift for a hand-off's ``visible_at_ms``: how far ahead of ours the broker
        groups' clocks run, by the quickest round trip of each when it is trusted, and at
        least what is sure (0: none ahead, or nothing observed in the window)."""
        shift_ms = 0
        for clock in self._live(now_ms):
            quickest, surest = clock.quickest[0], clock.surest[0]
            shift_ms = max(shift_ms, surest.lower_ms)
            if quickest.round_trip_ms <= TRUSTED_ROUND_TRIP_MS:
                shift_ms = max(shift_ms, quickest.estimate_ms)
        return shift_ms

    def surely_ahead_ms(self, now_ms: int) -> int:
        """How far ahead of ours some broker group's clock certainly runs (0: none surely)."""
        return max([0] + [clock.surest[0].lower_ms for clock in self._live(now_ms)])


__all__ = ["CLOCK_SKEW_WINDOW_MS", "HOLD_CLOCK_AHEAD_MS_MAX", "TRUSTED_ROUND_TRIP_MS",
           "BrokerClocks"]
