"""The write buffer behind SegmentedLog.append: appends keep bodies in memory and flush() frames
them in one batch. What a user can notice: offsets, bytes on disk, reads before a flush, what a
crash loses, torn batch writes, append_many, and bodies changed by the caller after append."""

from __future__ import annotations

import os
import tempfile
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from logstore import LogConfig, LogWriteFailed, RecordTooLarge, SegmentedLog
from logstore.faults import FaultPlan
from logstore.record import HEADER_SIZE_BYTES, encode_record

TINY = LogConfig(segment_size_bytes_max=4096, record_size_bytes_max=2048,
                 write_buffer_bytes_max=1024)


def files_of(directory: str) -> dict[str, bytes]:
    """Every segment file's name and bytes."""
    out = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            out[name] = f.read()
    return out


def crash(plan: FaultPlan) -> None:
    """Close every file the log opened without flushing: its write buffer is never written."""
    for handle in plan.files:
        handle.close()


@settings(max_examples=60, deadline=None)
@given(batches=st.lists(st.lists(st.binary(max_size=1500), max_size=12), max_size=8))
def test_append_many_gives_the_offsets_and_files_of_appending_one_by_one(batches):
    with tempfile.TemporaryDirectory() as one_dir, tempfile.TemporaryDirectory() as many_dir:
        one, many = SegmentedLog(one_dir, TINY), SegmentedLog(many_dir, TINY)
        for batch in batches:
            assert many.append_many(batch) == [one.append(body) for body in batch]
            assert many.end_offset == one.end_offset
        one.close()
        many.close()
        assert files_of(many_dir) == files_of(one_dir)


def test_the_bytes_on_disk_are_the_documented_record_framing_of_each_body(log_dir):
    bodies = [b"", b"a", b"x" * 100, bytes(range(256)) * 3]
    log = SegmentedLog(log_dir, LogConfig())
    log.append_many(bodies[:2])
    for body in bodies[2:]:
        log.append(body)
    log.close()
    assert list(files_of(log_dir).values()) == [b"".join(encode_record(b) for b in bodies)]


def test_records_taken_by_append_many_are_readable_before_any_flush(log_dir):
    log = SegmentedLog(log_dir, LogConfig(write_buffer_bytes_max=1 << 20))
    offsets = log.append_many([b"first", b"second", b"third"])
    assert offsets == [0, HEADER_SIZE_BYTES + 5, 2 * HEADER_SIZE_BYTES + 11]
    assert os.path.getsize(os.path.join(log_dir, "0" * 20 + ".log")) == 0  # nothing written yet
    assert log.read(offsets[1]) == b"second"
    assert list(log.iterate()) == list(zip(offsets, [b"first", b"second", b"third"]))
    log.close()


def test_append_many_takes_any_iterable_of_bodies_a_generator_included(log_dir):
    log = SegmentedLog(log_dir, LogConfig())
    offsets = log.append_many(b"gen %d" % i for i in range(3))
    assert list(log.iterate()) == list(zip(offsets, [b"gen 0", b"gen 1", b"gen 2"]))
    log.close()


def test_append_many_stops_at_a_body_over_the_limit_and_keeps_the_ones_before_it(log_dir):
    log = SegmentedLog(log_dir, TINY)
    with pytest.raises(RecordTooLarge) as caught:
        log.append_many([b"kept", b"x" * 2049, b"never"])
    assert (caught.value.size_bytes, caught.value.limit_bytes) == (2049, 2048)
    assert list(log.iterate()) == [(0, b"kept")]
    log.close()


@pytest.mark.parametrize("write_buffer_bytes_max", [1024, 1 << 20])
@pytest.mark.parametrize("delta", [-1, 0, 1])
def test_the_record_limit_holds_at_max_minus_one_max_and_max_plus_one_whatever_the_buffer_size(
    log_dir, write_buffer_bytes_max, delta
):
    # A write buffer larger than the record limit must not let a too-large body slip through.
    config = LogConfig(segment_size_bytes_max=1 << 20, record_size_bytes_max=2048,
                       write_buffer_bytes_max=write_buffer_bytes_max)
    log = SegmentedLog(log_dir, config)
    log.append(b"x" * 10)  # the buffer is not empty: the check must not rely on that
    body = b"y" * (2048 + delta)
    if delta > 0:
        with pytest.raises(RecordTooLarge):
            log.append(body)
        with pytest.raises(RecordTooLarge):
            log.append_many([body])
        assert log.end_offset == HEADER_SIZE_BYTES + 10
    else:
        offset = log.append(body)
        assert log.read(offset) == body
    log.close()


@pytest.mark.parametrize("kind", [bytearray, memoryview])
def test_a_body_the_caller_changes_after_append_is_stored_as_it_was_at_append(log_dir, kind):
    log = SegmentedLog(log_dir, LogConfig(write_buffer_bytes_max=1 << 20))
    backing = bytearray(b"original")
    body = backing if kind is bytearray else memoryview(backing)
    offset = log.append(body)
    [many_offset] = log.append_many([body])
    backing[:] = b"CHANGED!"
    log.close()
    reopened = SegmentedLog(log_dir, LogConfig())
    assert reopened.recovery.truncation is None
    assert reopened.read(offset) == reopened.read(many_offset) == b"original"
    reopened.close()


def test_a_memoryview_of_wide_items_is_stored_as_its_bytes(log_dir):
    wide = memoryview(array("I", [1, 2, 3]))  # len() is 3 items; the record holds 12 bytes
    log = SegmentedLog(log_dir, LogConfig())
    offset = log.append(wide)
    after = log.append(b"next")
    assert after == offset + HEADER_SIZE_BYTES + 12
    assert log.read(offset) == wide.tobytes()
    assert log.read(after) == b"next"
    log.close()


def test_in_async_mode_a_crash_loses_exactly_the_appends_made_since_the_last_tick(log_dir):
    plan = FaultPlan()
    config = LogConfig(flush_mode="async", flush_interval_ms=100, write_buffer_bytes_max=1 << 20)
    log = SegmentedLog(log_dir, config, opener=plan.opener)
    written = [(log.append(b"ticked %d" % i), b"ticked %d" % i) for i in range(50)]
    log.tick(now_ms=0)  # writes the buffer to the OS; no fsync yet (interval not passed)
    assert log.durable_offset == 0
    log.append_many([b"lost %d" % i for i in range(20)])
    crash(plan)
    reopened = SegmentedLog(log_dir, config)
    # A process crash keeps what reached the OS; only a power cut could take unsynced bytes too.
    assert list(reopened.iterate()) == written
    assert reopened.recovery.truncation is None
    reopened.close()


def test_a_torn_write_of_a_large_buffer_keeps_every_whole_record_before_the_tear(log_dir):
    plan = FaultPlan()
    config = LogConfig(write_buffer_bytes_max=1 << 20)
    log = SegmentedLog(log_dir, config, opener=plan.opener)
    bodies = [b"record %04d " % i + b"z" * (i % 37) for i in range(1999)]
    offsets = log.append_many(bodies)
    framed_bytes = log.end_offset
    half = framed_bytes // 2
    assert half not in offsets  # the tear falls inside a record, not between two
    plan.short_write_at = plan.writes + 1  # the one write of the whole buffer writes half
    with pytest.raises(LogWriteFailed):
        log.flush()
    log.close()
    reopened = SegmentedLog(log_dir, config)
    whole = [(o, b) for o, b in zip(offsets, bodies) if o + HEADER_SIZE_BYTES + len(b) <= half]
    assert 0 < len(whole) < len(bodies)
    assert list(reopened.iterate()) == whole
    truncation = reopened.recovery.truncation
    assert truncation.offset == offsets[len(whole)]
    assert truncation.reason.startswith("torn")
    assert reopened.end_offset == offsets[len(whole)]
    reopened.close()


def test_a_failed_log_refuses_appends_and_batches_even_when_the_buffer_has_room(log_dir):
    plan = FaultPlan()
    log = SegmentedLog(log_dir, LogConfig(write_buffer_bytes_max=1 << 20), opener=plan.opener)
    log.append(b"before")
    plan.fail_sync_at = plan.syncs + 1
    with pytest.raises(LogWriteFailed) as caught:
        log.sync()
    for use in (lambda: log.append(b"x"), lambda: log.append_many([b"x", b"y"])):
        with pytest.raises(LogWriteFailed) as again:
            use()
        assert again.value is caught.value
    log.close()
