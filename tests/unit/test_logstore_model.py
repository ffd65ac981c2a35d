"""A Hypothesis state machine drives SegmentedLog through appends, flushes, syncs, ticks, full
disks, clean reopens and crashes, and checks it against a plain list of records after every step.

A crash closes the files without flushing (the write buffer is lost) and may also lose unsynced
bytes from the tail, as a power cut can: everything below ``durable_offset`` must survive, and
the reopened log must hold exactly the whole records below the cut.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from logstore import DiskFull, LogConfig, SegmentedLog
from logstore.faults import FaultPlan
from logstore.record import HEADER_SIZE_BYTES

CONFIG = LogConfig(segment_size_bytes_max=4096, record_size_bytes_max=2048,
                   write_buffer_bytes_max=1024)


class LogModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.directory = tempfile.mkdtemp(prefix="logstore-model-")
        self.records: list[tuple[int, bytes]] = []  # every accepted record, in order
        self.durable_offset = 0
        self.now_ms = 0
        self._open()

    def _open(self) -> None:
        self.plan = FaultPlan()
        self.log = SegmentedLog(self.directory, CONFIG, opener=self.plan.opener)

    def _end_offset(self) -> int:
        last = self.records[-1] if self.records else None
        return last[0] + HEADER_SIZE_BYTES + len(last[1]) if last else 0

    def _on_disk_full(self) -> None:
        # The unflushed appends were dropped: the model forgets those at or past the new end.
        self.records = [r for r in self.records if r[0] < self.log.end_offset]
        assert self._end_offset() == self.log.end_offset

    def _writing(self, operation):
        try:
            return operation()
        except DiskFull:
            self._on_disk_full()
            return None

    @rule(body=st.binary(max_size=2048))
    def append(self, body):
        offset = self._writing(lambda: self.log.append(body))
        if offset is not None:
            assert offset == self._end_offset()
            self.records.append((offset, body))

    @rule(bodies=st.lists(st.binary(max_size=700), max_size=8))
    def append_many(self, bodies):
        start = self._end_offset()
        try:
            offsets = self.log.append_many(bodies)
        except DiskFull:
            # Records of the batch that a flush inside it wrote before the disk filled survive,
            # like any other written record; the model learns them, then forgets the dropped.
            position = start
            for body in bodies:
                if position + HEADER_SIZE_BYTES + len(body) > self.log.end_offset:
                    break
                self.records.append((position, body))
                position += HEADER_SIZE_BYTES + len(body)
            self._on_disk_full()
            return
        assert offsets == [start + sum(HEADER_SIZE_BYTES + len(b) for b in bodies[:i])
                           for i in range(len(bodies))]
        self.records.extend(zip(offsets, bodies))

    @rule()
    def flush(self):
        self._writing(self.log.flush)

    @rule()
    def sync(self):
        if self._writing(self.log.sync) is not None:
            self.durable_offset = self._end_offset()

    @rule(elapsed_ms=st.integers(0, 150))
    def tick(self, elapsed_ms):
        self.now_ms += elapsed_ms
        if self._writing(lambda: self.log.tick(self.now_ms)):
            self.durable_offset = self._end_offset()

    @rule(room_bytes=st.integers(0, 3000))
    def fill_the_disk(self, room_bytes):
        self.plan.disk_capacity_bytes = self.plan.bytes_written + room_bytes

    @rule()
    def free_the_disk(self):
        self.plan.disk_capacity_bytes = None

    @precondition(lambda self: self.records)
    @rule(data=st.data())
    def read_any_record(self, data):
        offset, body = data.draw(st.sampled_from(self.records))
        # Reading a buffered record flushes it first, so a read can meet a full disk too.
        read = self._writing(lambda: self.log.read(offset))
        assert read == body or (read is None and offset >= self.log.end_offset)

    @precondition(lambda self: self.records)
    @rule(data=st.data())
    def iterate_from_any_record(self, data):
        index = data.draw(st.integers(0, len(self.records) - 1))
        offset = self.records[index][0]
        records = self._writing(lambda: list(self.log.iterate(offset)))
        if records is not None:
            assert records == self.records[index:]

    @rule()
    def close_and_reopen(self):
        try:
            self.log.close()
        except DiskFull:
            self._on_disk_full()
        self.durable_offset = self._end_offset()
        self._open()
        assert self.log.recovery.truncation is None

    @rule(data=st.data())
    def crash_and_reopen(self, data):
        for handle in self.plan.files:
            handle.close()  # the buffer is never written
        segments = {int(n[:20]): os.path.join(self.directory, n)
                    for n in os.listdir(self.directory) if n.endswith(".log")}
        flushed_end = max(base + os.path.getsize(path) for base, path in segments.items())
        assert flushed_end >= self.durable_offset
        cut = data.draw(st.integers(self.durable_offset, flushed_end))
        for base, path in segments.items():
            if base > cut or (base == cut and base > 0):
                os.unlink(path)  # a segment created after the last fsync may vanish
            elif base + os.path.getsize(path) > cut:
                os.truncate(path, cut - base)
        survivors = [r for r in self.records if r[0] + HEADER_SIZE_BYTES + len(r[1]) <= cut]
        self._open()
        assert list(self.log.iterate()) == survivors
        self.records = survivors
        assert self.log.end_offset == self._end_offset()
        truncation = self.log.recovery.truncation
        assert (truncation is None) == (cut == self._end_offset())
        if truncation is not None:
            assert (truncation.offset, truncation.bytes_cut) == (self._end_offset(),
                                                                cut - self._end_offset())
        self.durable_offset = self._end_offset()

    @invariant()
    def offsets_agree_with_the_model(self):
        assert self.log.end_offset == self._end_offset()
        assert self.log.durable_offset >= self.durable_offset
        assert self.log.durable_offset <= self.log.end_offset
        infos = self.log.segments()
        assert infos[0].base_offset == self.log.first_offset == 0
        for previous, current in zip(infos, infos[1:]):
            assert current.base_offset == previous.end_offset
        assert infos[-1].end_offset == self.log.end_offset

    def teardown(self):
        try:
            self.log.close()
        except DiskFull:
            pass
        shutil.rmtree(self.directory, ignore_errors=True)


LogModel.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_the_log_matches_a_list_of_records_through_faults_crashes_and_reopens = LogModel.TestCase
