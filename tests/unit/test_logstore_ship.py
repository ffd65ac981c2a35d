"""``SegmentedLog.on_written`` (``sync_then``'s ``ship``, docs/REPLICATION.md 8.3 "The
overlap"): a sync's records are told once written and before their fsync, only when the caller
asks, only when nothing in the run can cut them any more: never before the write, never when
the write meets a full disk, never when the caller's ``then`` write failed, never for a batch
flushed part-way; a failed fsync after the tell is sticky (nothing cut)."""

from __future__ import annotations

import errno

import pytest

from logstore import DiskFull, LogConfig, LogWriteFailed, OsFile, SegmentedLog
from logstore.faults import FaultPlan
from logstore.record import HEADER_SIZE_BYTES, frame_records

BODY = b"b" * 100


class Told:
    """An ``on_written`` noting each tell with the log's fsync count at that moment."""

    def __init__(self, plan: FaultPlan) -> None:
        self.plan = plan
        self.calls: list[tuple[int, bytes, int]] = []

    def __call__(self, start: int, framed: bytes) -> None:
        self.calls.append((start, framed, self.plan.syncs))


def shipping_log(log_dir: str, plan: FaultPlan, **config: int) -> tuple[SegmentedLog, Told]:
    log = SegmentedLog(log_dir, LogConfig(**config), opener=plan.opener)
    told = Told(plan)
    log.on_written = told
    return log, told


def test_a_shipped_sync_tells_its_records_once_written_and_before_their_fsync(log_dir):
    plan = FaultPlan()
    log, told = shipping_log(log_dir, plan)
    log.append(BODY)
    log.sync()
    assert told.calls == []  # not asked to ship
    start = log.end_offset
    log.append_many([BODY, BODY])
    syncs = plan.syncs
    log.sync(ship=True)
    assert told.calls == [(start, frame_records([BODY, BODY]), syncs)]  # before the fsync
    assert plan.syncs > syncs and log.durable_offset == log.end_offset
    assert log.read(start) == BODY


def test_a_full_disk_at_the_write_tells_nothing(log_dir):
    plan = FaultPlan(allocate_unsupported=True)
    log, told = shipping_log(log_dir, plan)
    log.append(BODY)
    log.sync(ship=True)
    end = log.end_offset
    plan.disk_capacity_bytes = plan.bytes_written + 10
    log.append(b"x" * 20_000)
    with pytest.raises(DiskFull):
        log.sync(ship=True)
    assert log.end_offset == end
    assert [call[0] for call in told.calls] == [0]


def test_a_failed_then_write_tells_nothing_and_the_owner_may_cut(log_dir, tmp_path):
    plan = FaultPlan()
    log, told = shipping_log(log_dir, plan)
    index = plan.opener(str(tmp_path / "index"))
    plan.fail_write_at = plan.writes + 2  # the records' write succeeds, the index's fails
    offsets, error = log.append_durably_then([BODY], lambda offsets: (index, b"entry"))
    assert error is not None and error.errno == errno.EIO
    assert told.calls == []
    log.cut_back(offsets[0])
    offsets, error = log.append_durably_then([BODY], lambda offsets: (index, b"entry"))
    assert error is None and [call[0] for call in told.calls] == offsets


def test_records_indexed_after_the_sync_are_not_told(log_dir):
    plan = FaultPlan()
    log, told = shipping_log(log_dir, plan)
    log.append_durably_then([BODY], lambda offsets: None)  # no then: the owner indexes after
    assert told.calls == []


def test_a_batch_flushed_part_way_is_not_told(log_dir):
    plan = FaultPlan()
    log, told = shipping_log(log_dir, plan, write_buffer_bytes_max=4 * (HEADER_SIZE_BYTES + 100))
    log.append_many([BODY] * 6)  # fills the write buffer: flushed part-way
    log.sync(ship=True)
    assert told.calls == []
    log.append_many([BODY])
    log.sync(ship=True)
    assert len(told.calls) == 1


def test_a_failed_fsync_after_the_tell_is_sticky_and_cuts_nothing(log_dir):
    plan = FaultPlan()
    log, told = shipping_log(log_dir, plan)
    log.append(BODY)
    plan.fail_sync_at = plan.syncs + 1
    with pytest.raises(LogWriteFailed):
        log.sync(ship=True)
    assert told.calls and log.flushed_offset == told.calls[0][0] + len(told.calls[0][1])
    with pytest.raises(LogWriteFailed):
        log.append_durably_then([BODY], lambda offsets: None)
    log.close()
    reopened = SegmentedLog(log_dir, LogConfig(), opener=OsFile)
    assert [record for _offset, record in reopened.iterate()] == [BODY]
    reopened.close()


def test_the_framed_commit_tells_its_records_when_shipped(log_dir):
    plan = FaultPlan()
    log, told = shipping_log(log_dir, plan)
    log.append(BODY)
    log.sync()  # the new segment and directory fsynced: the log takes framed records
    start, _room = log.framed_room()
    framed = frame_records([BODY, BODY])
    assert log.append_framed_durably(framed, None, ship=True) is None
    assert told.calls == [(start, framed, told.calls[0][2])]
    assert log.durable_offset == start + len(framed)
    log.append_framed_durably(frame_records([BODY]), None)  # a copy's write: not asked
    assert len(told.calls) == 1
