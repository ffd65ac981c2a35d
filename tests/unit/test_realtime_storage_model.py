"""A model-based test: random appends, commits, full disks, closes and crashes against a dict."""

from __future__ import annotations

import dataclasses

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from logstore import DiskFull
from logstore.faults import FaultPlan
from realtime.storage import MessageStore, StoreConfig

TINY = StoreConfig(
    segment_size_bytes_max=4096,
    record_size_bytes_max=2048,
    consumer_log_entries_per_file=4,
    write_buffer_bytes_max=512,
    checkpoint_interval_bytes=1500,
)
T0 = 1_700_000_000_000
SUBJECTS = ["a", "%retry%a%g", "b.c"]


class StoreModel(RuleBasedStateMachine):
    """The store must hold exactly what the model committed, except that records of a batch
    whose commit failed may reappear after a reopen (a prefix per subject, never over a later
    committed batch), and retention moves each subject's first sequence.

    Several failed batches in a row all claim the same sequences (the store hands sequence n
    again after a failed commit); which of them a record at such a position comes from is the
    store's choice: a message-log write may have succeeded in one failed commit (its
    consumer-log write failing) and not in a later one."""

    config = TINY

    @initialize()
    def open(self):
        import tempfile

        self.data_dir = tempfile.mkdtemp(prefix="rtmodel")
        self.plan = FaultPlan()
        self.store = MessageStore(self.data_dir, self.config, now_ms=T0,
                                  opener=self.plan.opener)
        self.first = {s: 0 for s in SUBJECTS}
        self.committed: dict[str, list[tuple[str, bytes]]] = {s: [] for s in SUBJECTS}
        self.ids: dict[tuple[str, str], int] = {}
        self.batch: list[tuple[str, str, bytes]] = []
        # Per subject, the failed batches since its last committed one, oldest first.
        self.maybe_extra: dict[str, list[list[tuple[str, bytes]]]] = {s: [] for s in SUBJECTS}
        self.abandoned: list[MessageStore] = []

    def teardown(self):
        import shutil

        self.store.close()
        shutil.rmtree(self.data_dir, ignore_errors=True)

    @rule(subject=st.sampled_from(SUBJECTS), number=st.integers(0, 12),
          size=st.integers(0, 700))
    def append(self, subject, number, size):
        message_id = f"m{number}"
        payload = bytes([number]) * size
        result = self.store.append(subject, message_id, [number], T0, payload)
        in_batch = any(s == subject and i == message_id for s, i, _ in self.batch)
        if in_batch:
            assert (result.sequence, result.duplicate) == (None, True)
        elif (subject, message_id) in self.ids:
            assert (result.sequence, result.duplicate) == (self.ids[subject, message_id], True)
        else:
            pending = sum(1 for s, _, _ in self.batch if s == subject)
            assert result.sequence == len(self.committed[subject]) + pending
            assert not result.duplicate
            self.batch.append((subject, message_id, payload))

    def _committed_batch(self):
        for subject, message_id, payload in self.batch:
            self.ids[subject, message_id] = len(self.committed[subject])
            self.committed[subject].append((message_id, payload))
            self.maybe_extra[subject] = []
        self.batch = []

    @rule()
    def commit(self):
        self.store.commit()
        self._committed_batch()

    @rule(room=st.integers(0, 3000))
    def commit_on_a_nearly_full_disk(self, room):
        self.plan.disk_capacity_bytes = self.plan.bytes_written + room
        try:
            self.store.commit()
        except DiskFull:
            dropped = {s: [] for s in SUBJECTS}
            for subject, message_id, payload in self.batch:
                dropped[subject].append((message_id, payload))
            for subject, items in dropped.items():
                if items:
                    self.maybe_extra[subject].append(items)
            self.batch = []
        else:
            self._committed_batch()
        finally:
            self.plan.disk_capacity_bytes = None

    def _reopen(self):
        self.store = MessageStore(self.data_dir, self.config, now_ms=T0, opener=self.plan.opener)
        self.batch = []
        for (subject, message_id), sequence in list(self.ids.items()):
            if sequence < self.first[subject]:
                del self.ids[subject, message_id]  # deleted records leave the rebuilt dedup index
        for subject in SUBJECTS:
            failed = self.maybe_extra[subject]
            base = len(self.committed[subject])
            extra = self.store.end_sequence(subject) - base
            assert 0 <= extra <= max((len(b) for b in failed), default=0), (subject, extra)
            if extra:
                messages, _ = self.store.scan(subject, base, extra)
                assert len(messages) == extra, (subject, extra, messages)
                for index, message in enumerate(messages):
                    got = (message.message_id, message.payload)
                    # Each reappearing record is one of a failed batch's, at its own position.
                    assert any(index < len(b) and b[index] == got for b in failed), (subject, got)
                    self.ids[subject, message.message_id] = base + index
                    self.committed[subject].append(got)
            self.maybe_extra[subject] = []

    @rule()
    def close_and_reopen(self):
        self.store.close()
        self._reopen()

    @rule()
    def crash_and_reopen(self):
        self.abandoned.append(self.store)  # never closed: its files stay as a kill -9 left them
        self._reopen()

    @rule(keep=st.dictionaries(st.sampled_from(SUBJECTS), st.integers(0, 40), max_size=3))
    def retention(self, keep):
        self.store.apply_retention(T0 + 73 * 3600_000, keep)
        for subject in SUBJECTS:
            first = self.store.first_sequence(subject)
            assert first >= self.first[subject]
            if subject in keep and keep[subject] < len(self.committed[subject]):
                assert first <= max(keep[subject], self.first[subject])
            self.first[subject] = first

    @invariant()
    def every_committed_message_reads_back(self):
        if not hasattr(self, "store"):
            return
        assert {s: self.store.end_sequence(s) for s in SUBJECTS} == {
            s: len(items) for s, items in self.committed.items()}
        for subject, items in self.committed.items():
            first = self.store.first_sequence(subject)
            assert first == self.first[subject]
            messages, next_sequence = self.store.scan(subject, first, 1000)
            assert next_sequence == len(items)
            assert [(m.message_id, m.payload) for m in messages] == items[first:]


class AsyncStoreModel(StoreModel):
    """The same in flush_mode="async" (a crash here keeps what reached the OS)."""

    config = dataclasses.replace(TINY, flush_mode="async")


StoreModel.TestCase.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)
AsyncStoreModel.TestCase.settings = settings(max_examples=10, stateful_step_count=30,
                                             deadline=None)
test_the_store_agrees_with_a_model_through_full_disks_crashes_and_retention = StoreModel.TestCase
test_an_async_store_agrees_with_the_model_too = AsyncStoreModel.TestCase


def test_a_record_of_an_earlier_failed_commit_may_reappear_after_two_failed_commits_in_a_row():
    """Found by the model: the first commit's message-log write succeeded and its consumer-log
    write hit the full disk; the second, of the same id and sequence, failed in the message log.
    After a reopen the first version is there (rebuilt from the message log), and the model must
    accept it as one of the failed batches' records at that position."""
    state = StoreModel()
    state.open()
    try:
        state.append(subject="a", number=0, size=1)
        state.commit_on_a_nearly_full_disk(room=44)
        state.append(subject="a", number=0, size=0)
        state.commit_on_a_nearly_full_disk(room=0)
        state.close_and_reopen()
        state.every_committed_message_reads_back()
        assert state.committed["a"] in ([], [("m0", b"\x00")], [("m0", b"")])
    finally:
        state.teardown()
