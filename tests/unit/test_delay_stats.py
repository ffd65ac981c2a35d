"""DispatchStats: the lateness histogram counted per batch equals counting each message."""

from __future__ import annotations

import bisect

from hypothesis import given, settings
from hypothesis import strategies as st

from delayserver.stats import LATENESS_BOUNDS_MS, DispatchStats


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(-100, 100_000), max_size=40), max_size=5))
def test_each_batch_lands_in_the_histogram_as_if_counted_one_message_at_a_time(batches):
    stats = DispatchStats()
    histogram = [0] * (len(LATENESS_BOUNDS_MS) + 1)
    values = [late for batch in batches for late in batch]
    for late in values:
        histogram[bisect.bisect_left(LATENESS_BOUNDS_MS, max(0, late))] += 1
    for batch in batches:
        stats.record(1_000, batch)
    assert stats.histogram == histogram
    assert stats.early == sum(1 for late in values if late < 0)
    assert stats.dispatched == len(values)
    assert stats.lateness_ms_sum == sum(max(0, late) for late in values)
    assert stats.lateness_ms_max == max([0, *values])  # starts at 0
