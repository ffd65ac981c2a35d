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


@pytest.mark.slow  # as above, with a slave of each group in the same qmq up
def test_with_a_sync_slave_every_step_of_every_message_is_timed_once_the_slave_is_in_sync():
    figures = latency_steps.one_run(rate=100, seconds=1.0, tmpfs=True, replicas=2)
    assert figures["received"] == figures["count"] == 100
    for what, (seen, p50, _p90, p99) in figures["steps"].items():
        assert seen == 100, what
        assert 0 <= p50 <= p99, what


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


def test_each_of_the_slowest_messages_is_put_behind_the_longest_stall_it_was_in_flight_during():
    ms = 1_000_000
    seen = {seq: {"send": seq * ms, "received": seq * ms + ms // 2} for seq in range(200)}
    seen[50]["received"] = 58 * ms  # in flight 50-58 ms: over the gc pass and the expiry step
    seen[150]["received"] = 160 * ms  # 150-160 ms: over nothing noted
    noted = [("gc gen 0", 52 * ms, 4 * ms, 4 * ms), ("task expiry", 51 * ms, 2 * ms, 2 * ms),
             ("IoThread._deliver", 120 * ms, 3 * ms, ms // 10),  # long in wall only
             ("task start", 500 * ms, 9 * ms, 9 * ms)]  # after the traffic: not counted
    long = latency_steps._long_callbacks({"noted": noted, "callbacks": 1_000}, seen)
    assert long["slowest_behind"] == {"gc gen 0": 1, "none": 1}
    assert long["by_name"] == {"gc gen 0": (1, 1, 4.0, 4.0, 4.0, 4.0),
                               "task expiry": (1, 1, 2.0, 2.0, 2.0, 2.0),
                               "IoThread._deliver": (1, 0, 3.0, 3.0, 0.1, 0.1)}
