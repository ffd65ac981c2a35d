"""``BrokerClocks``: how far ahead of this delay server's clock each realtime broker group's
clock runs, from the ``now_ms`` a broker puts in its ``hold`` answer (docs/PROTOCOL.md
"hold"), so that a hand-off is never made visible before its due time by our clock
(docs/REPLICATION.md 16, review s10 R9).

A broker reads its clock as the hold arrives, after we read ours before sending it, so each
observation ``broker_now_ms - sent_at_ms`` is the skew plus the time on the way: never below
the skew. The smallest observation of the last CLOCK_SKEW_WINDOW_MS is therefore the
tightest bound we have; a hand-off's ``visible_at_ms`` is its due time plus that bound (the
largest over the groups), and a bound above HOLD_CLOCK_AHEAD_MS_MAX pauses the hand-off (a
clock that far off is broken; messages are then sent at their due time). Not guaranteed: the
hold that first shows a skew (the first of a run, or the first after a broker's clock stepped
ahead) was sent with the old bound, so its messages may be visible up to the difference early.
A pure state machine told the time; owned by the event loop.
"""

from __future__ import annotations

from collections import deque

# A broker clock further ahead than this (ms) pauses the hand-off (sent at the due time).
HOLD_CLOCK_AHEAD_MS_MAX = 1_000
# Observations older than this (ms) no longer bound the skew (a clock may have been stepped).
CLOCK_SKEW_WINDOW_MS = 60_000


class BrokerClocks:
    """Per broker group, the observations of its clock's lead over ours in the last
    CLOCK_SKEW_WINDOW_MS, as a deque whose leads rise front to back (its front is the
    smallest: a sliding-window minimum)."""

    def __init__(self) -> None:
        self._seen: dict[str, deque[tuple[int, int]]] = {}

    def observe(self, group: str, sent_at_ms: int, broker_now_ms: int, now_ms: int) -> None:
        """A hold sent at ``sent_at_ms`` (our clock) arrived at ``group``'s broker at
        ``broker_now_ms`` (its clock); ``now_ms``: our clock now."""
        lead_ms = broker_now_ms - sent_at_ms
        seen = self._seen.setdefault(group, deque())
        while seen and seen[-1][1] >= lead_ms:
            seen.pop()  # a smaller, newer bound makes it useless
        seen.append((now_ms, lead_ms))

    def ahead_ms(self, now_ms: int) -> int:
        """The bound on how far ahead of ours any broker group's clock is (0: none ahead, or
        nothing observed in the window)."""
        bound = 0
        for seen in self._seen.values():
            while len(seen) > 1 and seen[0][0] <= now_ms - CLOCK_SKEW_WINDOW_MS:
                seen.popleft()
            if seen[0][0] > now_ms - CLOCK_SKEW_WINDOW_MS:
                bound = max(bound, seen[0][1])
        return bound


__all__ = ["CLOCK_SKEW_WINDOW_MS", "HOLD_CLOCK_AHEAD_MS_MAX", "BrokerClocks"]
