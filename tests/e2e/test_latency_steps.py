"""bench.latency_steps measures every step of every message at a small rate: its probes still
find the methods they wrap, and each step is seen for each message."""

from __future__ import annotations

import pytest

from bench import latency_steps


@pytest.mark.slow  # a probed qmq up and two client processes: 10-30 s by the machine's load
def test_every_step_of_every_message_is_timed_with_a_p50_no_larger_than_its_p99():
    figures = latency_steps.one_run(rate=100, seconds=1.0, tmpfs=True)
    assert figures["received"] == figures["count"] == 100
    for what, (seen, p50, _p90, p99) in figures["steps"].items():
        assert seen == 100, what  # a probe that no longer fires leaves its step unseen
        assert 0 <= p50 <= p99, what
    assert figures["commits"] >= 1
    assert figures["cpu_us_by_thread"]["main"] > 0
