"""Round-trips and malformed input for every delay-store codec: delay record, schedule entry,
dispatch/cancel record, touched record, checkpoint payload."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from delayserver.storage import delay_record, done_record, schedule_entry, touched_record
from delayserver.storage.delay_checkpoint import (
    DelayCheckpoint,
    decode_delay_checkpoint,
    encode_delay_checkpoint,
)
from delayserver.storage.delay_record import (
    MESSAGE_ID_BYTES_MAX,
    SUBJECT_BYTES_MAX,
    decode_delay_header,
    decode_delay_record,
    encode_delay_record,
)
from delayserver.storage.done_record import (
    KIND_CANCELLED,
    KIND_DISPATCHED,
    RECORD_SIZE_BYTES,
    DoneRecord,
    decode_done_record,
    decode_done_records,
    encode_done_record,
)
from delayserver.storage.schedule_entry import (
    ENTRY_SIZE_BYTES,
    RawEntry,
    decode_schedule_entry,
    encode_schedule_entry,
    iter_schedule_entries,
)

u64 = st.integers(0, (1 << 64) - 1)
u32 = st.integers(0, (1 << 32) - 1)
names = st.text(min_size=1, max_size=40).filter(lambda s: len(s.encode("utf-8")) <= 200)


# ---------------------------------------------------------------------- delay record


@settings(max_examples=200)
@given(u64, u64, names, names, st.binary(max_size=300))
def test_a_delay_record_round_trips_with_its_payload_verbatim(deliver_at, bucket, message_id,
                                                              subject, payload):
    body = encode_delay_record(deliver_at, bucket, message_id.encode(), subject.encode(), payload)
    record = decode_delay_record(body)
    assert record == delay_record.DelayedRecord(message_id, subject, deliver_at, payload, bucket)
    assert body.endswith(payload)
    assert decode_delay_header(body)[:4] == (deliver_at, bucket, message_id.encode(), subject)


@pytest.mark.parametrize("id_bytes,ok", [
    (b"", False), (b"x" * (MESSAGE_ID_BYTES_MAX - 1), True), (b"x" * MESSAGE_ID_BYTES_MAX, True),
    (b"x" * (MESSAGE_ID_BYTES_MAX + 1), False),
])
def test_a_message_id_must_be_1_to_65535_bytes(id_bytes, ok):
    if ok:
        assert decode_delay_record(encode_delay_record(1, 0, id_bytes, b"s", b"")).message_id
    else:
        with pytest.raises(ValueError, match="message id"):
            encode_delay_record(1, 0, id_bytes, b"s", b"")


@pytest.mark.parametrize("size,ok", [
    (0, False), (SUBJECT_BYTES_MAX - 1, True), (SUBJECT_BYTES_MAX, True),
    (SUBJECT_BYTES_MAX + 1, False),
])
def test_a_subject_must_be_1_to_65535_bytes(size, ok):
    if ok:
        assert len(decode_delay_record(encode_delay_record(1, 0, b"i", b"s" * size, b"")).subject) == size
    else:
        with pytest.raises(ValueError, match="subject"):
            encode_delay_record(1, 0, b"i", b"s" * size, b"")


def test_a_time_outside_u64_is_refused():
    with pytest.raises(ValueError, match="u64"):
        encode_delay_record(1 << 64, 0, b"i", b"s", b"")
    with pytest.raises(ValueError, match="u64"):
        encode_delay_record(-1, 0, b"i", b"s", b"")


@settings(max_examples=200)
@given(st.binary(max_size=60))
def test_arbitrary_bytes_decode_as_a_record_or_raise_value_error(data):
    try:
        record = decode_delay_record(data)
    except ValueError:
        return
    assert encode_delay_record(record.deliver_at_ms, record.bucket_ms,
                               record.message_id.encode(), record.subject.encode(),
                               record.payload) == data


def test_lengths_that_run_past_the_body_are_refused():
    body = encode_delay_record(5, 0, b"id", b"subj", b"")
    with pytest.raises(ValueError, match="subject length"):
        decode_delay_record(body[:-1])
    with pytest.raises(ValueError, match="message id length"):
        decode_delay_record(body[:18] + b"\xff\xff")
    with pytest.raises(ValueError, match="shorter"):
        decode_delay_record(body[:19])


# ---------------------------------------------------------------------- schedule entry


@settings(max_examples=200)
@given(u64, u64, u32, u32)
def test_a_schedule_entry_round_trips_in_32_bytes(deliver_at, offset, size, hashed):
    data = encode_schedule_entry(deliver_at, offset, size, hashed)
    assert len(data) == ENTRY_SIZE_BYTES == 32
    assert decode_schedule_entry(data) == RawEntry(deliver_at, offset, size, hashed)


@settings(max_examples=100)
@given(st.integers(0, ENTRY_SIZE_BYTES * 8 - 1))
def test_any_flipped_bit_of_a_schedule_entry_is_detected(bit):
    data = bytearray(encode_schedule_entry(1_700_000_000_000, 123, 300, 0xDEADBEEF))
    data[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(ValueError):
        decode_schedule_entry(bytes(data))


def test_iterating_a_file_marks_the_bad_entry_and_ignores_a_torn_tail():
    good = [encode_schedule_entry(i, i * 10, 5, i) for i in range(3)]
    bad = bytearray(good[1])
    bad[0] ^= 1
    data = good[0] + bytes(bad) + good[2] + b"\x00" * 7
    decoded = list(iter_schedule_entries(data))
    assert [index for index, _ in decoded] == [0, 1, 2]
    assert decoded[0][1] == RawEntry(0, 0, 5, 0)
    assert decoded[1][1] is None
    assert decoded[2][1] == RawEntry(2, 20, 5, 2)


def test_a_schedule_entry_of_the_wrong_size_is_refused():
    with pytest.raises(ValueError, match="32"):
        decode_schedule_entry(encode_schedule_entry(1, 2, 3, 4)[:-1])


# ---------------------------------------------------------------------- dispatch/cancel record


done_records = st.builds(DoneRecord, u64, u32, u32, u32,
                         st.sampled_from([KIND_DISPATCHED, KIND_CANCELLED]))


@settings(max_examples=200)
@given(done_records)
def test_a_dispatch_or_cancel_record_round_trips_in_28_bytes(record):
    data = encode_done_record(record)
    assert len(data) == RECORD_SIZE_BYTES == 28
    assert decode_done_record(data) == record


@settings(max_examples=100)
@given(st.lists(done_records.map(lambda r: r._replace(kind=KIND_DISPATCHED)), max_size=10),
       st.integers(1, RECORD_SIZE_BYTES - 1))
def test_a_torn_tail_of_a_dispatch_file_is_reported_and_the_prefix_kept(records, torn):
    whole = b"".join(encode_done_record(r) for r in records)
    extra = encode_done_record(DoneRecord(1, 2, 3, 4, KIND_DISPATCHED))[:torn]
    decoded, good, problem = decode_done_records(whole + extra, KIND_DISPATCHED)
    assert decoded == records
    assert good == len(whole)
    assert "torn" in problem


def test_a_cancel_record_in_a_dispatch_file_ends_the_valid_prefix():
    data = (encode_done_record(DoneRecord(1, 2, 3, 4, KIND_DISPATCHED))
            + encode_done_record(DoneRecord(5, 6, 7, 8, KIND_CANCELLED)))
    decoded, good, problem = decode_done_records(data, KIND_DISPATCHED)
    assert len(decoded) == 1 and good == RECORD_SIZE_BYTES and "kind" in problem


@pytest.mark.parametrize("field,value", [("index", 1 << 32), ("epoch", -1), ("kind", 3)])
def test_a_done_record_field_out_of_range_is_refused(field, value):
    with pytest.raises(ValueError, match=field):
        encode_done_record(DoneRecord(1, 2, 3, 4, KIND_DISPATCHED)._replace(**{field: value}))


# ---------------------------------------------------------------------- touched record


@settings(max_examples=100)
@given(st.lists(u64, max_size=20), st.integers(0, touched_record.RECORD_SIZE_BYTES - 1))
def test_touched_records_round_trip_and_a_torn_tail_is_reported(buckets, torn):
    data = b"".join(touched_record.encode_touched(b) for b in buckets)
    tail = touched_record.encode_touched(7)[:torn]
    decoded, good, problem = touched_record.decode_touched(data + tail)
    assert decoded == buckets
    assert good == len(data)
    assert bool(problem) == bool(torn)


# ---------------------------------------------------------------------- checkpoint payload


pairs = st.dictionaries(u64, u64, max_size=10)


@settings(max_examples=200)
@given(st.integers(1, (1 << 64) - 1), st.integers(1, (1 << 64) - 1), u64, u64, pairs,
       st.dictionaries(names, u64, max_size=10), pairs, pairs)
def test_a_checkpoint_payload_round_trips(bucket_ms, chunk, offset, done_before, hours, subjects,
                                          days, chunks):
    checkpoint = DelayCheckpoint(bucket_ms, chunk, offset, done_before, hours, subjects, days,
                                 chunks)
    assert decode_delay_checkpoint(encode_delay_checkpoint(checkpoint)) == checkpoint


def test_a_checkpoint_payload_cut_anywhere_or_extended_is_refused():
    payload = encode_delay_checkpoint(DelayCheckpoint(1000, 4096, 10, 0, {0: 3}, {"s": 3},
                                                      {0: 3}, {0: 1000}))
    for size in range(len(payload)):
        with pytest.raises(ValueError):
            decode_delay_checkpoint(payload[:size])
    with pytest.raises(ValueError, match="unexpected bytes"):
        decode_delay_checkpoint(payload + b"\x00")
    with pytest.raises(ValueError, match="version"):
        decode_delay_checkpoint(struct.pack(">B", 9) + payload[1:])


def test_a_batch_of_done_records_encodes_to_the_same_bytes_as_one_record_at_a_time():
    from delayserver.storage.done_record import (
        KIND_CANCELLED, KIND_DISPATCHED, DoneRecord, encode_done_record, encode_done_records,
    )

    offsets, hashes, indexes = [0, 77, (1 << 64) - 1], [0, 12345, (1 << 32) - 1], [0, 1, 9]
    for kind in (KIND_DISPATCHED, KIND_CANCELLED):
        assert encode_done_records(offsets, hashes, indexes, 7, kind) == b"".join(
            encode_done_record(DoneRecord(o, h, i, 7, kind))
            for o, h, i in zip(offsets, hashes, indexes))
    assert encode_done_records([], [], [], 0, KIND_DISPATCHED) == b""
    with pytest.raises(ValueError):
        encode_done_records([1], [1 << 32], [0], 0, KIND_DISPATCHED)
    with pytest.raises(ValueError):
        encode_done_records([1], [1], [0], 0, 3)
