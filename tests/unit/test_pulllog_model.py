"""Random operation sequences against PullLogStore: the hand-out invariant and reopen equality."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from pulllog import PullLogConfig, PullLogStore

S, G = "orders", "billing"
START = 5
CONSUMERS = st.sampled_from(["c1", "c2", "c3"])
TINY = PullLogConfig(segment_size_bytes_max=4096, checkpoint_every_actions=10)


class PullLogMachine(RuleBasedStateMachine):
    """The model keeps only ``done`` (acked or passed over); the store must account for the rest."""

    def __init__(self) -> None:
        super().__init__()
        self.directory = tempfile.mkdtemp(prefix="pulllog-model-")
        self.store = PullLogStore(self.directory, TINY)
        self.store.ensure_group(S, G, START, 0)
        self.store.sync()  # a crash may tear only what was never fsynced
        self.now_ms = 0
        self.done: set[int] = set()

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    def held(self) -> dict[str, dict[int, int]]:
        return {c.consumer: {e.pull_seq: e.consumer_log_seq
                             for e in self.store.unacked(S, G, c.consumer)}
                for c in self.store.consumers(S, G)}

    @rule(step_ms=st.integers(0, 40))
    def advance(self, step_ms):
        self.now_ms += step_ms

    @rule(consumer=CONSUMERS, from_queue=st.integers(0, 3),
          pattern=st.lists(st.booleans(), max_size=5))
    def pull(self, consumer, from_queue, pattern):
        queued = self.store.take_redeliveries(S, G, from_queue)
        cursor = self.store.cursor(S, G)
        new = [cursor + i for i, take in enumerate(pattern) if take]
        previous = {c.consumer: c.next_pull_seq for c in self.store.consumers(S, G)}
        got = self.store.record_pull(S, G, consumer, queued + new, cursor + len(pattern),
                                     self.now_ms)
        self.done.update(cursor + i for i, take in enumerate(pattern) if not take)
        assert [e.consumer_log_seq for e in got] == queued + new
        assert all(e.redelivered >= 1 for e in got[: len(queued)])
        assert all(e.redelivered == 0 for e in got[len(queued):])
        if got:
            first = previous.get(consumer, self.store.epoch << 32)
            assert [e.pull_seq for e in got] == list(range(first, first + len(got)))

    @rule(consumer=CONSUMERS, ranges=st.lists(st.tuples(st.integers(0, 20), st.integers(0, 4)),
                                              max_size=3))
    def ack(self, consumer, ranges):
        before = self.held().get(consumer, {})
        count = self.store.record_ack(S, G, consumer, [(lo, lo + w) for lo, w in ranges],
                                      self.now_ms)
        after = self.held().get(consumer, {})
        acked = {before[p] for p in set(before) - set(after)}
        assert count == len(acked)
        assert all(any(lo <= p <= lo + w for lo, w in ranges) for p in set(before) - set(after))
        self.done |= acked

    @rule(ack_timeout_ms=st.integers(0, 60))
    def release_expired(self, ack_timeout_ms):
        cutoff = self.now_ms - ack_timeout_ms
        expected = sorted(e.consumer_log_seq for _, e in self.store.pulled_before(S, G, cutoff))
        released = self.store.release_expired(S, G, ack_timeout_ms, self.now_ms)
        assert sorted(released) == expected
        assert self.store.pulled_before(S, G, cutoff) == []

    @rule(consumer=CONSUMERS)
    def remove_consumer(self, consumer):
        held = sorted(self.held().get(consumer, {}).values())
        assert sorted(self.store.remove_consumer(S, G, consumer, self.now_ms)) == held
        assert consumer not in self.held()

    @rule(with_checkpoint=st.booleans())
    def reopen(self, with_checkpoint):
        if with_checkpoint:
            self.store.checkpoint()
        before = self.store.export_state()
        self.store.close()
        self.store = PullLogStore(self.directory, TINY)
        assert self.store.recovery.clean_shutdown
        assert self.store.export_state() == before
        if with_checkpoint:
            assert self.store.recovery.actions_replayed == 1  # only the CLOSED marker

    @rule(cut_bytes=st.integers(0, 80))
    def crash_and_reopen(self, cut_bytes):
        """The process dies after a flush, tearing up to ``cut_bytes`` of what was not fsynced."""
        self.store.flush()
        log = self.store._log
        unsynced_bytes = log.end_offset - log.durable_offset
        log.close()  # only to release the files: the buffer is empty, nothing is added
        segment = log.segments()[-1]
        cut = min(cut_bytes, unsynced_bytes, segment.size_bytes)
        os.truncate(segment.path, segment.size_bytes - cut)
        epoch = self.store.epoch
        self.store = PullLogStore(self.directory, TINY)
        assert not self.store.recovery.clean_shutdown
        assert self.store.epoch == epoch + 1
        cursor = self.store.cursor(S, G)
        count: Counter = Counter()
        for seqs in self.held().values():
            count.update(seqs.values())
        count.update(self.store.take_redeliveries(S, G, 1 << 30))
        assert all(n == 1 for n in count.values()), count
        assert set(count) <= set(range(START, cursor))
        # Nothing lost: whatever is not held or queued was acked or passed over before the crash.
        assert set(count) | self.done >= set(range(START, cursor))
        # A torn ACK or PULL is forgotten: its entries are held or handed out again.
        self.done = {s for s in self.done - set(count) if s < cursor}

    @invariant()
    def every_seq_below_the_cursor_is_acked_held_or_queued_exactly_once(self):
        count: Counter = Counter()
        for seqs in self.held().values():
            count.update(seqs.values())
        count.update(self.store.take_redeliveries(S, G, 1 << 30))
        count.update(self.done)
        assert all(n == 1 for n in count.values()), count
        assert set(count) == set(range(START, self.store.cursor(S, G)))

    @invariant()
    def counts_and_lowest_needed_sequence_agree_with_the_entries(self):
        held = [s for seqs in self.held().values() for s in seqs.values()]
        queued = self.store.take_redeliveries(S, G, 1 << 30)
        assert self.store.held_count(S, G) == len(held)
        assert self.store.redelivery_count(S, G) == len(queued)
        assert self.store.lowest_needed_sequence(S, G) == min(
            held + queued + [self.store.cursor(S, G)])
        for state in self.store.consumers(S, G):
            pulls = sorted(self.held()[state.consumer])
            expected = pulls[0] - 1 if pulls else state.next_pull_seq - 1
            assert state.ack_sequence == expected
            assert state.unacked_count == len(pulls)


PullLogMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_random_operations_keep_every_entry_accounted_for_across_reopens = PullLogMachine.TestCase
