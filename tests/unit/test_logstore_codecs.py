"""Round-trips and defects of the two pure codecs: record framing and checkpoint files."""

from __future__ import annotations

import struct
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from logstore.checkpoint import (
    HEADER_SIZE_BYTES as CHECKPOINT_HEADER_SIZE_BYTES,
    PAYLOAD_SIZE_BYTES_MAX,
    decode_checkpoint,
    encode_checkpoint,
)
from logstore.record import (
    HEADER_SIZE_BYTES,
    MAGIC,
    VERSION,
    check_header,
    decode_record,
    encode_record,
    encode_record_into,
    frame_records_python,
    record_crc,
    split_records_python,
)
from tests.twins import built_twin

frame_records_c = built_twin("logstore._framing", "frame_records")
split_records_c = built_twin("logstore._framing", "split_records")

RECORD_LIMIT_BYTES = 1 << 16
bodies = st.binary(max_size=4096)


@settings(max_examples=300)
@given(body=bodies, trailing=st.binary(max_size=64))
def test_every_body_survives_encode_then_decode_even_with_bytes_after_it(body, trailing):
    framed = encode_record(body)
    decoded, size = decode_record(framed + trailing, RECORD_LIMIT_BYTES)
    assert decoded == body
    assert size == len(framed) == HEADER_SIZE_BYTES + len(body)


@given(body=bodies, prefix=st.binary(max_size=32))
def test_encode_record_into_appends_the_same_bytes_as_encode_record(body, prefix):
    out = bytearray(prefix)
    size = encode_record_into(out, body)
    assert bytes(out) == prefix + encode_record(body)
    assert size == HEADER_SIZE_BYTES + len(body)


def zlib_framed(body: bytes) -> bytes:
    """The documented framing built from zlib itself: the oracle for the fast framing paths."""
    length = struct.pack(">I", len(body))
    tail = struct.pack(">HBB", MAGIC, VERSION, 0)
    return length + struct.pack(">I", zlib.crc32(length + tail + body)) + tail + body


@settings(max_examples=300)
@given(body=bodies)
def test_every_record_carries_zlibs_crc32_of_its_length_header_tail_and_body(body):
    assert encode_record(body) == zlib_framed(body)


@given(body=bodies, attributes=st.integers(0, 255), prefix=st.binary(max_size=16))
def test_the_record_crc_covers_length_magic_version_attributes_and_body_wherever_it_starts(
        body, attributes, prefix):
    framed = bytearray(encode_record(body))
    framed[11] = attributes
    data = prefix + bytes(framed)
    expected = zlib.crc32(bytes(framed[0:4]) + bytes(framed[8:12]) + body)
    assert record_crc(data, len(prefix), body) == expected
    assert record_crc(memoryview(data), len(prefix), memoryview(body)) == expected
    if attributes == 0:
        assert struct.unpack_from(">I", framed, 4)[0] == expected


FRAMERS = [
    pytest.param(frame_records_python, id="python"),
    pytest.param(frame_records_c, id="c", marks=pytest.mark.skipif(
        frame_records_c is None, reason="logstore._framing (optional C extension) not built")),
]


@pytest.mark.parametrize("frame_records", FRAMERS)
@settings(max_examples=200)
@given(batch=st.lists(bodies, max_size=20))
def test_framing_a_batch_gives_the_same_bytes_as_framing_each_body(frame_records, batch):
    assert frame_records(batch) == b"".join(zlib_framed(body) for body in batch)


@pytest.mark.parametrize("frame_records", FRAMERS)
def test_framing_an_empty_batch_gives_no_bytes_and_a_large_body_keeps_every_byte(frame_records):
    assert frame_records([]) == b""
    large = bytes(range(256)) * 4099 + b"tail"  # crosses many 8-byte steps, ends unaligned
    assert frame_records([large, b""]) == zlib_framed(large) + zlib_framed(b"")


@pytest.mark.skipif(frame_records_c is None, reason="logstore._framing not built")
def test_the_c_framing_refuses_a_body_that_is_not_bytes_naming_its_index():
    with pytest.raises(TypeError, match="body 1 is bytearray, not bytes"):
        frame_records_c([b"ok", bytearray(b"mutable")])


SPLITTERS = [
    pytest.param(split_records_python, id="python"),
    pytest.param(split_records_c, id="c", marks=pytest.mark.skipif(
        split_records_c is None, reason="logstore._framing (optional C extension) not built")),
]


@pytest.mark.parametrize("split_records", SPLITTERS)
@settings(max_examples=200)
@given(batch=st.lists(bodies, max_size=12), cut=st.integers(0, 40), data=st.data())
def test_split_records_gives_zlibs_records_back_and_names_any_defect_as_the_python_twin_does(
        split_records, batch, cut, data):
    framed = bytearray(b"".join(zlib_framed(body) for body in batch))
    bodies_, used, problem = split_records(bytes(framed), RECORD_LIMIT_BYTES)
    assert [bytes(body) for body in bodies_] == batch
    assert (used, problem) == (len(framed), None)
    # Damaged: a flipped byte anywhere, a cut tail, a limit under the largest body.
    if framed and data.draw(st.booleans()):
        at = data.draw(st.integers(0, len(framed) - 1))
        framed[at] ^= data.draw(st.integers(1, 255))
    damaged = bytes(framed[:max(0, len(framed) - cut)])
    limit = data.draw(st.sampled_from([RECORD_LIMIT_BYTES, 0, 100]))
    expected = split_records_python(damaged, limit)
    got = split_records(memoryview(damaged), limit)
    assert ([bytes(body) for body in got[0]], got[1], got[2]) == (
        [bytes(body) for body in expected[0]], expected[1], expected[2])


@pytest.mark.skipif(split_records_c is None, reason="logstore._framing not built")
def test_the_c_split_names_each_header_defect_in_the_python_twins_words():
    good = zlib_framed(b"x" * 40)
    for at, value in ((8, 0x01), (9, 0x00), (10, 2), (11, 1), (20, 0xFF)):
        bad = bytearray(good)
        bad[at] = value
        assert split_records_c(bytes(bad), 1 << 16) == split_records_python(bytes(bad), 1 << 16)
    assert split_records_c(good, 39)[1:] == (0, "stored length 40 exceeds "
                                             "record_size_bytes_max 39")
    body_list, used, problem = split_records_c(good + good[:5], 1 << 16)
    assert body_list == [b"x" * 40] and type(body_list[0]) is bytes
    assert (used, problem) == (len(good), None)


def test_framing_stays_correct_and_memory_bounded_past_the_crc_seed_cache_capacity(monkeypatch):
    from logstore import record

    fresh_sizes = [n for n in range(5000, 6000) if n not in record._CRC_SEEDS][:10]
    monkeypatch.setattr(record, "CRC_SEED_CACHE_ENTRIES_MAX", len(record._CRC_SEEDS) + 2)
    batch = [b"s" * size for size in fresh_sizes]
    assert frame_records_python(batch) == b"".join(zlib_framed(body) for body in batch)
    assert frame_records_python(batch) == b"".join(zlib_framed(body) for body in batch)  # cached
    assert len(record._CRC_SEEDS) == record.CRC_SEED_CACHE_ENTRIES_MAX


def test_the_record_header_layout_matches_the_documented_table():
    body = b"hello"
    framed = encode_record(body)
    body_length, crc, magic, version, attributes = struct.unpack(">IIHBB", framed[:12])
    assert (body_length, magic, version, attributes) == (5, 0x514D, 1, 0)
    assert framed[8:10] == b"QM"
    assert crc == zlib.crc32(framed[0:4] + framed[8:])
    assert framed[12:] == body


@settings(max_examples=200)
@given(body=st.binary(min_size=1, max_size=256), data=st.data())
def test_any_single_flipped_bit_in_a_record_is_rejected(body, data):
    framed = bytearray(encode_record(body))
    bit = data.draw(st.integers(0, len(framed) * 8 - 1))
    framed[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(ValueError):
        decode_record(bytes(framed), RECORD_LIMIT_BYTES)


@given(body=st.binary(min_size=1, max_size=256), data=st.data())
def test_a_record_cut_short_anywhere_is_rejected(body, data):
    framed = encode_record(body)
    cut = data.draw(st.integers(0, len(framed) - 1))
    with pytest.raises(ValueError):
        decode_record(framed[:cut], RECORD_LIMIT_BYTES)


@pytest.mark.parametrize("delta, accepted", [(-1, True), (0, True), (1, False)])
def test_decode_accepts_a_body_up_to_the_limit_and_rejects_one_byte_more(delta, accepted):
    limit = 100
    framed = encode_record(b"x" * (limit + delta))
    if accepted:
        assert decode_record(framed, limit)[0] == b"x" * (limit + delta)
    else:
        with pytest.raises(ValueError, match=f"stored length {limit + 1} exceeds"):
            decode_record(framed, limit)


def test_a_header_claiming_four_gibibytes_is_a_problem_not_an_allocation():
    header = struct.pack(">IIHBB", 0xFFFFFFFF, 0, MAGIC, VERSION, 0)
    body_length, _crc, problem = check_header(header, RECORD_LIMIT_BYTES)
    assert body_length == 0xFFFFFFFF
    assert problem == f"stored length {0xFFFFFFFF} exceeds record_size_bytes_max {RECORD_LIMIT_BYTES}"


def test_an_unknown_magic_or_version_is_named_in_the_problem():
    good = encode_record(b"abc")
    bad_magic = good[:8] + b"XX" + good[10:]
    bad_version = good[:10] + b"\x02" + good[11:]
    assert check_header(bad_magic[:12], RECORD_LIMIT_BYTES)[2] == "bad magic 0x5858"
    assert check_header(bad_version[:12], RECORD_LIMIT_BYTES)[2] == "unknown version 2"


@settings(max_examples=300)
@given(sequence=st.integers(0, 2**64 - 1), payload=st.binary(max_size=4096))
def test_every_checkpoint_survives_encode_then_decode(sequence, payload):
    data = encode_checkpoint(sequence, payload)
    assert len(data) == CHECKPOINT_HEADER_SIZE_BYTES + len(payload)
    assert decode_checkpoint(data) == (sequence, payload)


def test_the_checkpoint_header_layout_matches_the_documented_table():
    data = encode_checkpoint(7, b"state")
    magic, version, reserved, sequence, length, crc = struct.unpack(">IB3sQII", data[:24])
    assert (magic, version, reserved, sequence, length) == (0x51434B50, 1, b"\0\0\0", 7, 5)
    assert data[:4] == b"QCKP"
    assert crc == zlib.crc32(data[:20] + data[24:])
    assert data[24:] == b"state"


@settings(max_examples=200)
@given(payload=st.binary(max_size=128), data=st.data())
def test_a_checkpoint_with_any_flipped_bit_or_cut_is_rejected(payload, data):
    encoded = bytearray(encode_checkpoint(3, payload))
    if data.draw(st.booleans()):
        bit = data.draw(st.integers(0, len(encoded) * 8 - 1))
        encoded[bit // 8] ^= 1 << (bit % 8)
        # Bits 40..63 are the reserved bytes, which the CRC covers too.
    else:
        encoded = encoded[: data.draw(st.integers(0, len(encoded) - 1))]
    with pytest.raises(ValueError):
        decode_checkpoint(bytes(encoded))


def test_a_checkpoint_length_above_the_payload_limit_is_rejected_before_reading_it():
    header = struct.pack(">IB3xQI", 0x51434B50, 1, 1, PAYLOAD_SIZE_BYTES_MAX + 1)
    with pytest.raises(ValueError, match=f"payload length {PAYLOAD_SIZE_BYTES_MAX + 1}"):
        decode_checkpoint(header + b"\0\0\0\0")
