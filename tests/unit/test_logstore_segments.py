"""SegmentedLog: append/read/iterate round-trips, segment rollover and the record size limit."""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from logstore import LogClosed, LogConfig, OffsetOutOfRange, RecordTooLarge, SegmentedLog
from logstore.record import HEADER_SIZE_BYTES
from logstore.segment_log import _SCAN_CHUNK_BYTES

SEGMENT_NAME = re.compile(r"\d{20}\.log")


def fill(log: SegmentedLog, count: int, size: int = 100) -> list[tuple[int, bytes]]:
    """Append ``count`` distinct bodies of ``size`` bytes; returns (offset, body) pairs."""
    written = []
    for i in range(count):
        body = (b"%08d" % i * (size // 8 + 1))[:size]
        written.append((log.append(body), body))
    return written


def segment_files(directory: str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.endswith(".log"))


# Bodies up to 2 KiB into 4 KiB segments: a few records per segment, so every example rolls.
body_lists = st.lists(st.binary(max_size=2048), max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bodies=body_lists, sync_every=st.integers(1, 10))
def test_any_list_of_bodies_reads_back_by_offset_and_by_iteration_before_and_after_reopen(
    tiny_config, bodies, sync_every
):
    with tempfile.TemporaryDirectory() as directory:
        log = SegmentedLog(directory, tiny_config)
        offsets = []
        for i, body in enumerate(bodies):
            offsets.append(log.append(body))
            if i % sync_every == 0:
                log.sync()
        assert [log.read(o) for o in offsets] == bodies
        assert list(log.iterate()) == list(zip(offsets, bodies))
        end = log.end_offset
        log.close()

        reopened = SegmentedLog(directory, tiny_config)
        try:
            assert reopened.recovery.truncation is None
            assert reopened.recovery.records_verified == len(bodies)
            assert reopened.end_offset == end == sum(HEADER_SIZE_BYTES + len(b) for b in bodies)
            assert list(reopened.iterate()) == list(zip(offsets, bodies))
            assert [reopened.read(o) for o in offsets] == bodies
        finally:
            reopened.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bodies=body_lists.filter(bool), pick=st.data())
def test_read_bodies_returns_what_read_returns_across_segments_and_buffered_appends(
    tiny_config, bodies, pick
):
    with tempfile.TemporaryDirectory() as directory:
        log = SegmentedLog(directory, tiny_config)
        try:
            offsets = [log.append(body) for body in bodies]  # some still buffered
            chosen = sorted(pick.draw(st.sets(st.integers(0, len(bodies) - 1))))
            got = log.read_bodies([offsets[i] for i in chosen], [len(bodies[i]) for i in chosen])
            assert [bytes(body) for body in got] == [bodies[i] for i in chosen]
        finally:
            log.close()


def test_read_bodies_gives_none_for_a_wrong_size_a_corrupt_record_or_an_offset_outside(
    log_dir, tiny_config
):
    log = SegmentedLog(log_dir, tiny_config)
    written = fill(log, 5, size=64)
    log.sync()
    offsets = [o for o, _ in written]
    sizes = [len(b) for _, b in written]
    assert [bytes(b) for b in log.read_bodies(offsets, sizes)] == [b for _, b in written]
    wrong_size = log.read_bodies(offsets, sizes[:1] + [63] + sizes[2:])
    assert wrong_size[1] is None and bytes(wrong_size[2]) == written[2][1]
    outside = log.read_bodies([offsets[0], log.end_offset + 10], [sizes[0], 64])
    assert bytes(outside[0]) == written[0][1] and outside[1] is None
    not_a_record = log.read_bodies([offsets[1] + 1], [64])
    assert not_a_record == [None]
    # Flip one body byte of the third record on disk: only that record reads as None.
    path = os.path.join(log_dir, segment_files(log_dir)[0])
    with open(path, "r+b") as f:
        f.seek(offsets[2] + HEADER_SIZE_BYTES + 3)
        byte = f.read(1)
        f.seek(offsets[2] + HEADER_SIZE_BYTES + 3)
        f.write(bytes([byte[0] ^ 0xFF]))
    try:
        got = log.read_bodies(offsets[:4], sizes[:4])
        assert got[2] is None
        assert [bytes(got[i]) for i in (0, 1, 3)] == [written[i][1] for i in (0, 1, 3)]
    finally:
        log.close()


def test_segments_are_named_by_20_digit_base_offsets_each_equal_to_the_previous_end(
    log_dir, tiny_config
):
    log = SegmentedLog(log_dir, tiny_config)
    written = fill(log, 200)
    log.sync()
    infos = log.segments()
    assert len(infos) >= 5
    names = segment_files(log_dir)
    assert names == [os.path.basename(i.path) for i in infos]
    assert all(SEGMENT_NAME.fullmatch(n) for n in names)
    assert [int(n[:20]) for n in names] == [i.base_offset for i in infos]
    assert infos[0].base_offset == 0
    for previous, current in zip(infos, infos[1:]):
        assert current.base_offset == previous.end_offset
        assert os.path.getsize(previous.path) == previous.size_bytes
        assert previous.size_bytes <= tiny_config.segment_size_bytes_max
    assert infos[-1].end_offset == log.end_offset == written[-1][0] + HEADER_SIZE_BYTES + 100
    log.close()


def test_a_record_is_never_split_across_segments(log_dir, tiny_config):
    log = SegmentedLog(log_dir, tiny_config)
    written = fill(log, 100, size=700)
    log.sync()
    bases = [i.base_offset for i in log.segments()]
    for offset, _body in written:
        base = max(b for b in bases if b <= offset)
        assert offset + HEADER_SIZE_BYTES + 700 <= base + tiny_config.segment_size_bytes_max
    log.close()


def test_reads_by_offset_cross_segment_boundaries_and_return_the_next_offset(log_dir, tiny_config):
    log = SegmentedLog(log_dir, tiny_config)
    written = fill(log, 120)
    log.sync()
    bases = {i.base_offset for i in log.segments()}
    boundary_records = [i for i, (o, _) in enumerate(written) if o in bases and i > 0]
    assert boundary_records, "the fixture must roll"
    for i in boundary_records:
        body, next_offset = log.read_with_next(written[i - 1][0])
        assert body == written[i - 1][1]
        assert next_offset == written[i][0]
        assert log.read(next_offset) == written[i][1]
    log.close()


def test_iteration_from_the_middle_of_a_middle_segment_yields_exactly_the_rest(
    log_dir, tiny_config
):
    log = SegmentedLog(log_dir, tiny_config)
    written = fill(log, 150)
    log.sync()
    infos = log.segments()
    middle = infos[len(infos) // 2]
    inside = [i for i, (o, _) in enumerate(written) if middle.base_offset < o < middle.end_offset]
    start = inside[len(inside) // 2]
    assert list(log.iterate(written[start][0])) == written[start:]
    log.close()


def test_iterating_from_the_end_offset_yields_nothing_and_past_it_is_out_of_range(
    log_dir, tiny_config
):
    log = SegmentedLog(log_dir, tiny_config)
    fill(log, 50)
    assert list(log.iterate(log.end_offset)) == []
    with pytest.raises(OffsetOutOfRange):
        next(log.iterate(log.end_offset + 1))
    with pytest.raises(OffsetOutOfRange) as caught:
        log.read(log.end_offset)
    assert (caught.value.offset, caught.value.end_offset) == (log.end_offset, log.end_offset)
    log.close()


def test_buffered_appends_are_readable_before_any_flush(log_dir):
    log = SegmentedLog(log_dir, LogConfig(segment_size_bytes_max=4096, write_buffer_bytes_max=1 << 20))
    offsets = [log.append(b"buffered %03d" % i) for i in range(200)]  # rolls; never flushed
    assert len(log.segments()) >= 2
    assert log.read(offsets[-1]) == b"buffered 199"
    assert [b for _, b in log.iterate(offsets[150])] == [b"buffered %03d" % i for i in range(150, 200)]
    log.close()


def test_a_record_larger_than_the_scan_chunk_reads_back_by_offset_iteration_and_recovery(log_dir):
    config = LogConfig(segment_size_bytes_max=4096, record_size_bytes_max=3 << 20)
    big = bytes(range(256)) * ((_SCAN_CHUNK_BYTES + 12345) // 256)
    assert len(big) > _SCAN_CHUNK_BYTES
    log = SegmentedLog(log_dir, config)
    before = log.append(b"small before")
    at = log.append(big)
    after = log.append(b"small after")
    log.sync()
    assert log.read(at) == big
    expected = [(before, b"small before"), (at, big), (after, b"small after")]
    assert list(log.iterate()) == expected
    log.close()
    reopened = SegmentedLog(log_dir, config)
    assert reopened.recovery.truncation is None
    assert reopened.recovery.records_verified == 3
    assert list(reopened.iterate()) == expected
    reopened.close()


def test_iteration_resumes_correctly_when_a_chunk_ends_inside_a_record(log_dir):
    # 300 KiB records into 2 MiB segments: the 1 MiB scan chunk ends mid-record every time.
    config = LogConfig(segment_size_bytes_max=2 << 20, record_size_bytes_max=1 << 20)
    log = SegmentedLog(log_dir, config)
    bodies = [bytes([i]) * (300 << 10) for i in range(12)]
    offsets = [log.append(b) for b in bodies]
    log.sync()
    assert list(log.iterate()) == list(zip(offsets, bodies))
    log.close()


@pytest.mark.parametrize("delta", [-1, 0])
def test_a_body_of_the_record_limit_or_one_byte_less_is_stored(log_dir, tiny_config, delta):
    size = tiny_config.record_size_bytes_max + delta
    log = SegmentedLog(log_dir, tiny_config)
    fill(log, 40)  # rolls first
    offset = log.append(b"z" * size)
    log.close()
    reopened = SegmentedLog(log_dir, tiny_config)
    assert reopened.recovery.truncation is None
    assert reopened.read(offset) == b"z" * size
    reopened.close()


def test_a_body_one_byte_over_the_record_limit_is_refused_naming_both_sizes(log_dir, tiny_config):
    limit = tiny_config.record_size_bytes_max
    log = SegmentedLog(log_dir, tiny_config)
    fill(log, 40)
    end = log.end_offset
    with pytest.raises(RecordTooLarge) as caught:
        log.append(b"z" * (limit + 1))
    assert (caught.value.size_bytes, caught.value.limit_bytes) == (limit + 1, limit)
    assert f"{limit + 1} bytes" in str(caught.value)
    assert f"record_size_bytes_max {limit}" in str(caught.value)
    assert not caught.value.retriable
    assert log.end_offset == end
    assert log.append(b"after") == end
    log.close()


def test_a_record_bigger_than_a_whole_segment_gets_a_segment_of_its_own(log_dir):
    config = LogConfig(segment_size_bytes_max=4096, record_size_bytes_max=10_000)
    log = SegmentedLog(log_dir, config)
    log.append(b"a" * 100)
    big_at = log.append(b"b" * 9000)
    after = log.append(b"c" * 100)
    log.sync()
    infos = log.segments()
    assert [i.base_offset for i in infos] == [0, big_at, after]
    assert log.read(big_at) == b"b" * 9000
    log.close()


def test_segment_size_max_is_reached_exactly_but_never_passed(log_dir):
    # Bodies of 1012 bytes frame to 1024: four fill a 4096-byte segment exactly.
    config = LogConfig(segment_size_bytes_max=4096, record_size_bytes_max=2048)
    log = SegmentedLog(log_dir, config)
    offsets = [log.append(b"q" * 1012) for _ in range(5)]
    assert offsets == [0, 1024, 2048, 3072, 4096]
    log.sync()
    assert [i.size_bytes for i in log.segments()] == [4096, 1024]
    log.close()


def test_using_a_closed_log_raises_log_closed(log_dir, tiny_config):
    log = SegmentedLog(log_dir, tiny_config)
    offset = fill(log, 40)[-1][0]
    log.close()
    log.close()  # idempotent
    for use in (lambda: log.append(b"y"), log.sync, log.flush, lambda: log.read(offset),
                lambda: list(log.iterate()), lambda: log.tick(0)):
        with pytest.raises(LogClosed):
            use()


def test_bad_config_values_fail_naming_the_value():
    with pytest.raises(ValueError, match="'fast'"):
        LogConfig(flush_mode="fast")
    with pytest.raises(ValueError, match="segment_size_bytes_max 12 "):
        LogConfig(segment_size_bytes_max=12)
    assert LogConfig(segment_size_bytes_max=13).segment_size_bytes_max == 13
    with pytest.raises(ValueError, match="record_size_bytes_max 0 "):
        LogConfig(record_size_bytes_max=0)
    with pytest.raises(ValueError, match="flush_interval_ms 0 "):
        LogConfig(flush_interval_ms=0)
    with pytest.raises(ValueError, match="write_buffer_bytes_max -1 "):
        replace(LogConfig(), write_buffer_bytes_max=-1)


def test_iteration_never_skips_records_appended_and_rolled_while_it_is_paused(
    log_dir, tiny_config
):
    log = SegmentedLog(log_dir, tiny_config)
    written = fill(log, 30)  # 30 records of 112 bytes: one segment, partly filled
    log.flush()
    records = log.iterate()
    seen = [next(records) for _ in range(3)]
    late = [b"late %04d" % i * 11 for i in range(40)]  # 36 fit in a segment: this rolls
    written += [(log.append(b), b) for b in late]
    log.flush()
    seen += list(records)
    assert seen == written
    log.close()
