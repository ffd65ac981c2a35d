"""Dispatch statistics of a delay server: lateness histogram and dispatch rate (in memory)."""

from __future__ import annotations

import bisect
import logging
from collections import deque

from serverkit.kind_gate import KindRefusals

# Upper bounds (ms, inclusive) of the lateness histogram's buckets; the last bucket is open.
LATENESS_BOUNDS_MS = (0, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 5_000, 60_000)
RATE_WINDOW_MS = 60_000  # dispatch rate is averaged over this window


class DispatchStats:
    """Counts of dispatched messages by lateness (receive-side time minus deliver_at)."""

    def __init__(self) -> None:
        self.histogram = [0] * (len(LATENESS_BOUNDS_MS) + 1)
        self.dispatched = 0
        self.handed = 0  # handed off ahead of the due time (the broker makes them visible)
        self.early = 0  # must stay 0: a dispatch before deliver_at is a bug
        # Handed and dropped records not written because a slave does not read their kind
        # (the replication kind gate): the hand-off paused, the messages went at their due
        # time; and the reason last logged (one warning per new reason).
        self.kind_refusals = KindRefusals(logging.getLogger("delayserver.cancels"))
        self.lateness_ms_max = 0
        self.lateness_ms_sum = 0  # of the values the histogram counted (early ones as 0)
        self._recent: deque[tuple[int, int]] = deque()  # (time ms, count)

    def record(self, now_ms: int, lateness_ms: list[int]) -> None:
        """Count one dispatched batch whose messages were ``lateness_ms`` late. Per batch, not
        per message: the values are sorted once and each histogram bucket is a bisection."""
        if not lateness_ms:
            return
        values = sorted(lateness_ms)
        early = bisect.bisect_left(values, 0)
        self.early += early
        below = early  # early ones count as 0 ms, in the first bucket
        for index, bound in enumerate(LATENESS_BOUNDS_MS):
            upto = bisect.bisect_right(values, bound)
            self.histogram[index] += upto - below + (early if index == 0 else 0)
            below = upto
        self.histogram[-1] += len(values) - below
        self.lateness_ms_sum += sum(values[early:])
        self.lateness_ms_max = max(self.lateness_ms_max, values[-1])
        self.dispatched += len(values)
        self._recent.append((now_ms, len(values)))
        self._trim(now_ms)

    def _trim(self, now_ms: int) -> None:
        while self._recent and self._recent[0][0] < now_ms - RATE_WINDOW_MS:
            self._recent.popleft()

    def rate_per_s(self, now_ms: int) -> float:
        """Messages dispatched per second over the last minute."""
        self._trim(now_ms)
        return sum(count for _, count in self._recent) / (RATE_WINDOW_MS / 1000)

    def percentile_ms(self, fraction: float) -> int | None:
        """Upper bound of the histogram bucket holding the given fraction (None: no data)."""
        total = sum(self.histogram)
        if not total:
            return None
        wanted = fraction * total
        seen = 0
        for index, count in enumerate(self.histogram):
            seen += count
            if seen >= wanted:
                return LATENESS_BOUNDS_MS[index] if index < len(LATENESS_BOUNDS_MS) else -1
        return -1

    def snapshot(self, now_ms: int) -> dict:
        """A JSON-able summary for heartbeats and ``qmq admin delay``."""
        labels = [f"<={b}ms" for b in LATENESS_BOUNDS_MS] + [f">{LATENESS_BOUNDS_MS[-1]}ms"]
        return {
            "dispatched": self.dispatched,
            "early": self.early,
            "dispatch_rate_per_s": round(self.rate_per_s(now_ms), 1),
            "lateness_ms_max": self.lateness_ms_max,
            "lateness_ms_p50_le": self.percentile_ms(0.5),
            "lateness_ms_p99_le": self.percentile_ms(0.99),
            "lateness_histogram": {l: c for l, c in zip(labels, self.histogram) if c},
        }
