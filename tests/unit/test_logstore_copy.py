"""SegmentedLog's copying API (replication): read_raw, append_raw, truncate and reset, and
record.split_records, the check every copied byte goes through."""

from __future__ import annotations

import os
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataclasses import replace

from logstore import CorruptRecord, DiskFull, OffsetOutOfRange, SegmentedLog
from logstore.faults import FaultPlan, flip_bit
from logstore.record import HEADER_SIZE_BYTES, encode_record, split_records


def copy_all(source: SegmentedLog, target: SegmentedLog, max_bytes: int) -> int:
    """Copy ``source`` into ``target`` chunk by chunk as a follower would; returns the chunks."""
    chunks = 0
    offset = target.end_offset
    while True:
        data = source.read_raw(offset, max_bytes)
        if not data:
            return chunks
        target.append_raw(offset, data)
        offset = target.end_offset
        chunks += 1


def bodies_of(log: SegmentedLog) -> list[tuple[int, bytes]]:
    return list(log.iterate())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bodies=st.lists(st.binary(max_size=2048), max_size=30),
       max_bytes=st.integers(1, 6000))
def test_a_log_copied_chunk_by_chunk_holds_the_same_records_at_the_same_offsets(
        tiny_config, bodies, max_bytes):
    with tempfile.TemporaryDirectory() as directory:
        source = SegmentedLog(os.path.join(directory, "a"), tiny_config)
        source.append_many(bodies)
        source.sync()
        target = SegmentedLog(os.path.join(directory, "b"), tiny_config)
        copy_all(source, target, max_bytes)
        target.sync()
        assert target.end_offset == source.end_offset
        assert bodies_of(target) == bodies_of(source)
        target.close()
        reopened = SegmentedLog(os.path.join(directory, "b"), tiny_config)
        assert bodies_of(reopened) == bodies_of(source)


@pytest.mark.parametrize("flush_mode", ["sync", "async"])
def test_a_durable_copy_holds_the_sources_bytes_whether_written_as_they_came_or_framed_again(
        tmp_path, tiny_config, flush_mode):
    # A chunk within the active segment (sync mode) is written as the source's bytes, however
    # large; one crossing a segment, and every async one, take append_many's path: same bytes.
    config = replace(tiny_config, flush_mode=flush_mode)
    source = SegmentedLog(str(tmp_path / "a"), config)
    source.append_many([bytes([i]) * (40 + 37 * i) for i in range(40)])
    source.sync()
    target = SegmentedLog(str(tmp_path / "b"), config)
    written_as_they_came = []
    framed_durably = target.append_framed_durably
    target.append_framed_durably = lambda framed, then: (
        written_as_they_came.append(len(framed)) or framed_durably(framed, then))
    offset = 0
    for max_bytes in [100, 900, 3000, 5000] * 15:
        data = source.read_raw(offset, max_bytes)
        if not data:
            break
        bodies = target.append_raw_durably(offset, data)
        assert [type(body) for body in bodies] == [bytes] * len(bodies)
        assert b"".join(map(encode_record, bodies)) == data
        offset += len(data)
        assert target.end_offset == offset
        assert target.flushed_offset == offset
        if flush_mode == "sync":
            assert target.durable_offset == offset
    target.sync()
    assert offset == source.end_offset and len(target.segments()) > 2
    if flush_mode == "sync":
        assert written_as_they_came and max(written_as_they_came) > config.write_buffer_bytes_max
        assert sum(written_as_they_came) < offset, "both paths taken"
    else:
        assert not written_as_they_came
    for segment_a, segment_b in zip(source.segments(), target.segments(), strict=True):
        with open(segment_a.path, "rb") as a, open(segment_b.path, "rb") as b:
            assert a.read() == b.read()


def test_a_durable_copy_that_fills_the_disk_leaves_nothing_of_it_and_a_bad_one_writes_nothing(
        tmp_path, tiny_config):
    source = SegmentedLog(str(tmp_path / "a"), tiny_config)
    source.append_many([b"r" * 100] * 6)
    source.sync()
    plan = FaultPlan()
    target = SegmentedLog(str(tmp_path / "b"), tiny_config, opener=plan.opener)
    first = source.read_raw(0, 2 * (HEADER_SIZE_BYTES + 100))
    target.append_raw_durably(0, first)
    data = source.read_raw(len(first), 2 * (HEADER_SIZE_BYTES + 100))  # within the room
    plan.disk_capacity_bytes = plan.bytes_written + 50
    with pytest.raises(DiskFull):
        target.append_raw_durably(len(first), data)
    assert target.end_offset == target.flushed_offset == len(first)
    bad = bytearray(data)
    bad[-1] ^= 1
    plan.free_space(1 << 20)
    with pytest.raises(CorruptRecord, match="crc mismatch"):
        target.append_raw_durably(len(first), bytes(bad))
    assert target.end_offset == len(first)
    target.append_raw_durably(len(first), data)
    assert bodies_of(target) == bodies_of(source)[:4]


def test_read_raw_returns_a_record_larger_than_max_bytes_whole(log_dir, tiny_config):
    log = SegmentedLog(log_dir, tiny_config)
    log.append(b"x" * 1500)
    log.sync()
    data = log.read_raw(0, 10)
    assert data == encode_record(b"x" * 1500)


def test_read_raw_stops_at_the_flushed_end_and_at_end_offset(log_dir, tiny_config):
    log = SegmentedLog(log_dir, tiny_config)
    first = log.append(b"one")
    second = log.append(b"two")
    assert log.read_raw(0, 4096) == b""  # still in the write buffer
    log.flush()
    assert log.read_raw(0, 4096, end_offset=second) == encode_record(b"one")
    assert log.read_raw(first, 4096) == encode_record(b"one") + encode_record(b"two")
    assert log.read_raw(log.end_offset, 4096) == b""


def test_read_raw_outside_the_log_raises_offset_out_of_range(log_dir, tiny_config):
    log = SegmentedLog(log_dir, tiny_config)
    log.append(b"one")
    log.sync()
    with pytest.raises(OffsetOutOfRange):
        log.read_raw(log.end_offset + 1, 4096)


def test_read_raw_raises_corrupt_record_on_a_flipped_byte(log_dir, tiny_config):
    log = SegmentedLog(log_dir, tiny_config)
    log.append(b"a" * 100)
    log.append(b"b" * 100)
    log.sync()
    flip_bit(log.segments()[0].path, HEADER_SIZE_BYTES * 2 + 100 + 5)
    with pytest.raises(CorruptRecord) as caught:
        log.read_raw(0, 4096)
    assert caught.value.offset == HEADER_SIZE_BYTES + 100


def test_append_raw_refuses_a_flipped_byte_and_appends_nothing(log_dir, tiny_config):
    data = bytearray(encode_record(b"a" * 10) + encode_record(b"b" * 10))
    data[-3] ^= 0x10
    log = SegmentedLog(log_dir, tiny_config)
    with pytest.raises(CorruptRecord) as caught:
        log.append_raw(0, bytes(data))
    assert caught.value.offset == HEADER_SIZE_BYTES + 10
    assert log.end_offset == 0


def test_append_raw_refuses_a_partial_record_and_a_wrong_offset(log_dir, tiny_config):
    log = SegmentedLog(log_dir, tiny_config)
    with pytest.raises(CorruptRecord, match="partial record"):
        log.append_raw(0, encode_record(b"abc")[:-1])
    with pytest.raises(ValueError, match="start at offset 5"):
        log.append_raw(5, encode_record(b"abc"))


def test_split_records_refuses_nonzero_attributes_and_stops_quietly_at_a_partial_record():
    record = bytearray(encode_record(b"abc"))
    good = bytes(record)
    bodies, used, problem = split_records(good + good[:7], 2048)
    assert [bytes(b) for b in bodies] == [b"abc"] and used == len(good) and problem is None
    record[11] = 1
    _bodies, used, problem = split_records(bytes(record), 2048)
    assert used == 0 and "attributes" in problem


def test_truncate_cuts_the_tail_across_segments_and_survives_reopen(log_dir, tiny_config):
    log = SegmentedLog(log_dir, tiny_config)
    offsets = log.append_many([bytes([i]) * 1000 for i in range(10)])
    log.sync()
    assert len(log.segments()) > 2
    end = log.end_offset
    assert log.truncate(offsets[4]) == end - offsets[4]
    assert log.end_offset == offsets[4]
    assert log.append(b"new") == offsets[4]
    log.close()
    reopened = SegmentedLog(log_dir, tiny_config)
    assert [body for _o, body in reopened.iterate()] == [bytes([i]) * 1000 for i in range(4)] + [
        b"new"]


def test_truncate_at_a_segment_base_and_at_the_end(log_dir, tiny_config):
    log = SegmentedLog(log_dir, tiny_config)
    log.append_many([bytes([i]) * 1000 for i in range(8)])
    log.sync()
    base = log.segments()[1].base_offset
    assert log.truncate(log.end_offset) == 0
    log.truncate(base)
    assert log.end_offset == base
    assert [s.base_offset for s in log.segments()][-1] == base
    with pytest.raises(OffsetOutOfRange):
        log.truncate(base + 1)


def test_reset_starts_an_empty_log_at_any_offset_that_reopens_there(log_dir, tiny_config):
    log = SegmentedLog(log_dir, tiny_config)
    log.append_many([b"x" * 500] * 5)
    log.sync()
    log.reset(123_456)
    assert (log.first_offset, log.end_offset) == (123_456, 123_456)
    log.append_raw(123_456, encode_record(b"copied"))
    log.close()
    reopened = SegmentedLog(log_dir, tiny_config)
    assert list(reopened.iterate()) == [(123_456, b"copied")]


def test_verify_walks_the_log_in_steps_and_names_the_first_rotten_record(log_dir, tiny_config):
    log = SegmentedLog(log_dir, tiny_config)
    offsets = log.append_many([bytes([i]) * 700 for i in range(12)])
    log.sync()
    position, steps = 0, 0
    while position < log.end_offset:
        position, problem = log.verify(position, 2000)
        assert problem is None
        steps += 1
    assert steps > 2
    flip_bit(log.segments()[1].path, 40)
    position, problem = 0, None
    while problem is None:
        position, problem = log.verify(position, 2000)
    bad = max(o for o in offsets if o <= log.segments()[1].base_offset + 40)
    assert problem.offset == position == bad
    log.truncate(bad)
    assert log.verify(0, 1 << 20) == (bad, None)
