"""The C twins of the delay store's commit encoders (delayserver/_commit_codecs.c) give the bytes
of their Python twins, on any valid columns, and refuse what the Python twins refuse."""

from __future__ import annotations

import struct
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from delayserver.storage.delay_record import (
    U64_MAX,
    decode_delay_header,
    encode_delay_records_python,
    frame_delay_records_python,
    subject_tail,
)
from logstore.record import HEADER_SIZE_BYTES, frame_records_python
from delayserver.storage.schedule_entry import (
    decode_schedule_entry,
    encode_schedule_entries_python,
)
from tests.twins import built_twin

encode_delay_records_c = built_twin("delayserver._commit_codecs", "encode_delay_records")
frame_delay_records_c = built_twin("delayserver._commit_codecs", "frame_delay_records")
encode_schedule_entries_c = built_twin("delayserver._commit_codecs", "encode_schedule_entries")
needs_c = pytest.mark.skipif(encode_delay_records_c is None,
                             reason="delayserver._commit_codecs was not built")

U32_MAX = (1 << 32) - 1
u64 = st.integers(0, U64_MAX)
u32 = st.integers(0, U32_MAX)
texts = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=100).map(
    str.encode)  # UTF-8, as the store's ids and subjects are
ids = texts
tails = texts.map(subject_tail)
# The server hands the store bytes; a memoryview or bytearray payload must encode the same.
payloads = st.one_of(st.binary(max_size=2_000), st.binary(max_size=50).map(bytearray),
                     st.binary(max_size=50).map(memoryview))


@needs_c
@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(u64, u64, ids, tails, payloads), max_size=40))
def test_the_c_delay_records_are_the_python_ones_byte_for_byte(rows):
    columns = [list(column) for column in zip(*rows)] or [[], [], [], [], []]
    got = encode_delay_records_c(*columns)
    assert got == encode_delay_records_python(*columns)
    assert all(type(body) is bytes for body in got)
    for body, (due, bucket, message_id, _, payload) in zip(got, rows):
        due_got, bucket_got, id_got, _, payload_at = decode_delay_header(body)
        assert (due_got, bucket_got, id_got, body[payload_at:]) == (
            due, bucket, message_id, bytes(payload))


@needs_c
@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(u64, u64, ids, tails, payloads), max_size=40))
def test_the_c_framed_delay_records_are_the_python_ones_byte_for_byte(rows):
    columns = [list(column) for column in zip(*rows)] or [[], [], [], [], []]
    framed, sizes, hashes = frame_delay_records_c(*columns)
    assert type(framed) is bytes
    assert (framed, sizes, hashes) == frame_delay_records_python(*columns)
    # What the delay log writes of the bodies: the records framed one after the other.
    bodies = encode_delay_records_python(*columns)
    assert framed == frame_records_python(bodies)
    assert sizes == [len(body) for body in bodies]
    assert hashes == [zlib.crc32(message_id) for message_id in columns[2]]
    assert len(framed) == sum(sizes) + HEADER_SIZE_BYTES * len(rows)


@needs_c
@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(u64, u64, u32, u32), max_size=40))
def test_the_c_schedule_entries_are_the_python_ones_byte_for_byte(rows):
    columns = [list(column) for column in zip(*rows)] or [[], [], [], []]
    got = encode_schedule_entries_c(*columns)
    assert got == encode_schedule_entries_python(*columns)
    assert [tuple(decode_schedule_entry(entry)) for entry in got] == rows


@needs_c
def test_columns_of_different_lengths_give_as_many_rows_as_the_shortest_in_both_twins():
    columns = [[1, 2, 3], [4, 5], [b"a", b"b", b"c"], [subject_tail(b"s")] * 3, [b""] * 3]
    assert encode_delay_records_c(*columns) == encode_delay_records_python(*columns)
    assert len(encode_delay_records_c(*columns)) == 2
    assert frame_delay_records_c(*columns) == frame_delay_records_python(*columns)
    assert len(frame_delay_records_c(*columns)[1]) == 2
    entries = [[1, 2], [3, 4, 5], [6, 7], [8]]
    assert encode_schedule_entries_c(*entries) == encode_schedule_entries_python(*entries)


@needs_c
@pytest.mark.parametrize("column, value", [
    (0, -1), (0, U64_MAX + 1), (1, -1), (1, U64_MAX + 1), (0, 1.5), (2, b"x" * 0x10000),
])
def test_a_value_outside_its_delay_record_field_is_refused_by_both_twins(column, value):
    columns = [[5], [0], [b"id"], [subject_tail(b"s")], [b"p"]]
    columns[column] = [value]
    with pytest.raises(struct.error):
        encode_delay_records_python(*columns)
    with pytest.raises((OverflowError, TypeError), match="row 0"):
        encode_delay_records_c(*columns)
    with pytest.raises(struct.error):
        frame_delay_records_python(*columns)
    with pytest.raises((OverflowError, TypeError), match="row 0"):
        frame_delay_records_c(*columns)


@needs_c
@pytest.mark.parametrize("column, value", [
    (0, -1), (0, U64_MAX + 1), (1, U64_MAX + 1), (2, U32_MAX + 1), (3, U32_MAX + 1), (3, "1"),
])
def test_a_value_outside_its_schedule_entry_field_is_refused_by_both_twins(column, value):
    columns = [[5], [0], [1], [2]]
    columns[column] = [value]
    with pytest.raises(struct.error):
        encode_schedule_entries_python(*columns)
    with pytest.raises((OverflowError, TypeError), match="row 0"):
        encode_schedule_entries_c(*columns)
