"""Retention: whole old segments are deleted oldest first, never the active one, never data a
reader still needs; the log stays contiguous and reopens."""

from __future__ import annotations

import os

import pytest

from logstore import OffsetOutOfRange, SegmentedLog

NOW_MS = 1_800_000_000_123  # a fixed fake clock (2027), with a millisecond fraction
HOUR_MS = 3_600_000


def build(log_dir, config, segment_count: int) -> tuple[SegmentedLog, list[tuple[int, bytes]]]:
    """A synced log of at least ``segment_count`` segments of 100-byte records."""
    log = SegmentedLog(log_dir, config)
    written = []
    i = 0
    while len(log.segments()) < segment_count:
        body = (b"%06d" % i) * 16 + b"tail"
        written.append((log.append(body), body))
        i += 1
    log.sync()
    return log, written


def set_ages_ms(log: SegmentedLog, ages_ms: list[int]) -> None:
    """Give segment i a last-modified time ``ages_ms[i]`` before NOW_MS."""
    for info, age_ms in zip(log.segments(), ages_ms):
        ns = (NOW_MS - age_ms) * 1_000_000
        os.utime(info.path, ns=(ns, ns))


def test_only_segments_older_than_retention_are_deleted_and_first_offset_moves(
    log_dir, tiny_config
):
    log, written = build(log_dir, tiny_config, 6)
    infos = log.segments()
    set_ages_ms(log, [5 * HOUR_MS, 4 * HOUR_MS, 3 * HOUR_MS, 10_000, 10_000, 0])
    deleted = log.apply_retention(NOW_MS, 2 * HOUR_MS)
    assert [d.path for d in deleted] == [i.path for i in infos[:3]]
    assert [os.path.exists(i.path) for i in infos] == [False] * 3 + [True] * (len(infos) - 3)
    assert log.first_offset == infos[3].base_offset
    assert list(log.iterate()) == [r for r in written if r[0] >= infos[3].base_offset]
    log.close()


@pytest.mark.parametrize("age_delta_ms, deleted_count", [(-1, 0), (0, 0), (1, 1)])
def test_a_segment_exactly_retention_old_is_kept_and_one_millisecond_older_is_deleted(
    log_dir, tiny_config, age_delta_ms, deleted_count
):
    log, _ = build(log_dir, tiny_config, 3)
    set_ages_ms(log, [HOUR_MS + age_delta_ms, 0, 0])
    assert len(log.apply_retention(NOW_MS, HOUR_MS)) == deleted_count
    log.close()


def test_retention_stops_at_the_first_young_segment_even_if_older_ones_follow(
    log_dir, tiny_config
):
    log, _ = build(log_dir, tiny_config, 5)
    infos = log.segments()
    set_ages_ms(log, [5 * HOUR_MS, 0, 5 * HOUR_MS, 5 * HOUR_MS, 5 * HOUR_MS])
    deleted = log.apply_retention(NOW_MS, HOUR_MS)
    assert [d.base_offset for d in deleted] == [infos[0].base_offset]
    assert log.first_offset == infos[1].base_offset
    log.close()


def test_the_active_segment_is_never_deleted_however_old(log_dir, tiny_config):
    log, written = build(log_dir, tiny_config, 3)
    infos = log.segments()
    set_ages_ms(log, [9 * HOUR_MS] * 3)
    deleted = log.apply_retention(NOW_MS, HOUR_MS)
    assert len(deleted) == 2
    assert [i.path for i in log.segments()] == [infos[-1].path]
    assert log.first_offset == infos[-1].base_offset
    offset = log.append(b"still appendable")
    assert log.read(offset) == b"still appendable"
    log.close()


def test_a_segment_ending_after_keep_from_offset_is_kept(log_dir, tiny_config):
    log, _ = build(log_dir, tiny_config, 5)
    infos = log.segments()
    set_ages_ms(log, [9 * HOUR_MS] * 5)
    # keep_from_offset at the exact end of segment 1: segments 0 and 1 may go, 2 may not.
    deleted = log.apply_retention(NOW_MS, HOUR_MS, keep_from_offset=infos[1].end_offset)
    assert [d.base_offset for d in deleted] == [infos[0].base_offset, infos[1].base_offset]
    # One byte short of segment 2's end: segment 2 is still needed.
    assert log.apply_retention(NOW_MS, HOUR_MS, keep_from_offset=infos[2].end_offset - 1) == []
    assert log.first_offset == infos[2].base_offset
    log.close()


def test_reads_below_the_first_offset_raise_offset_out_of_range(log_dir, tiny_config):
    log, written = build(log_dir, tiny_config, 4)
    set_ages_ms(log, [9 * HOUR_MS, 9 * HOUR_MS, 0, 0])
    log.apply_retention(NOW_MS, HOUR_MS)
    gone = [o for o, _ in written if o < log.first_offset]
    assert gone
    for offset in (gone[0], gone[-1], log.first_offset - 1):
        with pytest.raises(OffsetOutOfRange) as caught:
            log.read(offset)
        assert (caught.value.offset, caught.value.first_offset) == (offset, log.first_offset)
    with pytest.raises(OffsetOutOfRange):
        next(log.iterate(gone[0]))
    log.close()


def test_a_log_reopens_after_retention_with_the_same_offsets(log_dir, tiny_config):
    log, written = build(log_dir, tiny_config, 5)
    set_ages_ms(log, [9 * HOUR_MS, 9 * HOUR_MS, 0, 0, 0])
    log.apply_retention(NOW_MS, HOUR_MS)
    first, end = log.first_offset, log.end_offset
    log.close()
    reopened = SegmentedLog(log_dir, tiny_config)
    assert reopened.recovery.truncation is None
    assert (reopened.first_offset, reopened.end_offset) == (first, end)
    assert (reopened.recovery.first_offset, reopened.recovery.end_offset) == (first, end)
    assert list(reopened.iterate()) == [r for r in written if r[0] >= first]
    assert reopened.append(b"next") == end
    reopened.close()


def test_delete_segments_before_removes_only_whole_segments_ending_at_or_before_it(
    log_dir, tiny_config
):
    log, _ = build(log_dir, tiny_config, 4)
    infos = log.segments()
    assert log.delete_segments_before(infos[1].end_offset - 1) == [infos[0]]
    assert log.delete_segments_before(infos[1].end_offset) == [infos[1]]
    assert log.delete_segments_before(10**12) == [infos[2]]
    assert len(log.segments()) == 1
    log.close()
