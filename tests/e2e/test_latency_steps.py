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
    # The store thread sleeps between commits (its queue), so each commit counts a switch.
    assert figures["store_switches_per_commit"][0] > 0
    slow = figures["slowest"]
    assert slow["count"] == 1  # the slowest 1% of 100 messages
    assert slow["windows"] == 1 and len(slow["busiest_s"]) == 1
    assert sum(slow["blamed"].values()) == 1
    assert set(slow["blamed"]) <= {what for _, _, what in latency_steps.STEPS}


def test_the_slowest_messages_are_placed_in_the_windows_they_were_sent_in():
    ms = 1_000_000
    steps = ("send", "batch_sent", "arrived", "handled", "commit_begun", "commit_ended",
             "published", "pulled", "pull_written", "pull_read", "received")
    seen = {}
    for seq in range(200):
        start = seq * ms  # one message a ms; every 50th is held 40 ms before the broker reads it
        times = {step: start + n * 10_000 for n, step in enumerate(steps)}
        if seq % 50 == 7:
            for step in steps[2:]:
                times[step] += 40 * ms
        seen[seq] = times
    slow = latency_steps._slowest(seen, share=0.02)
    assert slow["count"] == 4
    assert slow["busiest_s"] == [0.0, 0.05, 0.1, 0.15]
    assert slow["blamed"] == {"to the broker (wire, its read)": 4}
