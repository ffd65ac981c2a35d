"""The fsync observer hook of ``SegmentedLog`` (what servers turn into an fsync latency metric)."""

from __future__ import annotations

import pytest

from logstore import LogConfig, SegmentedLog
from logstore.errors import LogWriteFailed
from logstore.faults import FaultPlan


def test_each_sync_that_fsyncs_reports_its_duration_once(tmp_path):
    log = SegmentedLog(str(tmp_path / "log"))
    seen: list[float] = []
    log.on_fsync = seen.append
    log.append(b"a")
    log.append(b"b")
    log.sync()
    log.append(b"c")
    log.sync()
    assert len(seen) == 2
    assert all(isinstance(s, float) and 0 <= s < 60 for s in seen)
    log.close()


def test_a_sync_with_nothing_to_fsync_reports_nothing(tmp_path):
    log = SegmentedLog(str(tmp_path / "log"))
    log.append(b"a")
    log.sync()
    seen: list[float] = []
    log.on_fsync = seen.append
    log.sync()
    assert seen == []
    log.close()


def test_a_segment_roll_is_one_report_covering_both_segments(tmp_path):
    log = SegmentedLog(str(tmp_path / "log"), LogConfig(segment_size_bytes_max=64))
    seen: list[float] = []
    log.on_fsync = seen.append
    for _ in range(5):  # several records of 20+ bytes: rolls at least once before the sync
        log.append(b"x" * 20)
    log.sync()
    assert len(log.segments()) > 1
    assert len(seen) == 1
    log.close()


def test_a_failed_fsync_is_not_reported_as_a_latency(tmp_path):
    plan = FaultPlan(fail_sync_at=1)
    log = SegmentedLog(str(tmp_path / "log"), opener=plan.opener)
    seen: list[float] = []
    log.on_fsync = seen.append
    log.append(b"a")
    with pytest.raises(LogWriteFailed):
        log.sync()
    assert seen == []
