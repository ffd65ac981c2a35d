"""The message-log record: the body of one logstore record in ``<data_dir>/messagelog/``.

The logstore framing around it (``logstore.record``) already carries the length, magic 0x514D,
version, attributes and a CRC-32 over the whole body, so this body has no magic or CRC of its own.
All integers are big-endian::

    Offset    | Size | Field
    ----------+------+------------------------------------------------------------------
    0         | 8    | timestamp_ms: u64, when the broker accepted the message (ms since epoch)
    8         | 8    | subject_sequence: u64, dense per subject, starting at 0
    16        | 8    | tag_bloom: u64, bit (h % 64) set for every 32-bit tag hash h; 0 = no tags
    24        | 2    | subject_length: u16 (S), bytes of the subject
    26        | S    | subject: UTF-8
    26+S      | 2    | message_id_length: u16 (I), bytes of the message id
    28+S      | I    | message_id: UTF-8
    28+S+I    | N    | payload: the message exactly as the producer encoded it (rest of the body)

What it does NOT guarantee: the tag bloom is a pre-filter (two tags can share a bit), so exact tag
matching needs the payload; the payload is never decoded or validated here; the record is not
encrypted or compressed.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from itertools import repeat
from operator import add, getitem, itemgetter, le
from typing import Sequence

from logstore.twins import c_twin

# The C twin of encode_subject_records (realtime/storage/_codecs.c); optional, chosen by
# logstore.twins.
_encode_subject_records_c = c_twin("realtime.storage._codecs", "encode_subject_records")
# The C twin of decode_message_headers (the same module): a slave decodes every copied commit.
_decode_message_headers_c = c_twin("realtime.storage._codecs", "decode_message_headers")

FIXED = struct.Struct(
    ">Q"  # timestamp_ms
    "Q"  # subject_sequence
    "Q"  # tag_bloom
    "H"  # subject_length
)
ID_LENGTH = struct.Struct(">H")  # message_id_length
FIXED_SIZE_BYTES = FIXED.size  # 26
OVERHEAD_SIZE_BYTES = FIXED.size + ID_LENGTH.size  # 28: a record is at least this long
SUBJECT_BYTES_MAX = 0xFFFF  # the u16 length field's limit; the store applies a smaller one
MESSAGE_ID_BYTES_MAX = 0xFFFF
U64_MAX = (1 << 64) - 1


@dataclass(frozen=True)
class MessageRecord:
    """A decoded message-log record."""

    timestamp_ms: int
    subject_sequence: int
    tag_bloom: int
    subject: str
    message_id: str
    payload: bytes


def record_size_bytes(subject_bytes: int, message_id_bytes: int, payload_bytes: int) -> int:
    """The encoded body size of a record with fields of these sizes."""
    return OVERHEAD_SIZE_BYTES + subject_bytes + message_id_bytes + payload_bytes


def encode_message_record(
    timestamp_ms: int,
    subject_sequence: int,
    tag_bloom: int,
    subject: str,
    message_id: str,
    payload: bytes | bytearray | memoryview,
) -> bytes:
    """Encode one record body; the payload is copied once, never re-encoded."""
    subject_bytes = subject.encode("utf-8")
    id_bytes = message_id.encode("utf-8")
    if len(subject_bytes) > SUBJECT_BYTES_MAX:
        raise ValueError(f"subject of {len(subject_bytes)} bytes exceeds {SUBJECT_BYTES_MAX}")
    if len(id_bytes) > MESSAGE_ID_BYTES_MAX:
        raise ValueError(f"message id of {len(id_bytes)} bytes exceeds {MESSAGE_ID_BYTES_MAX}")
    for name, value in (("timestamp_ms", timestamp_ms), ("subject_sequence", subject_sequence),
                        ("tag_bloom", tag_bloom)):
        if not 0 <= value <= U64_MAX:
            raise ValueError(f"{name} {value} is outside u64 [0, {U64_MAX}]")
    return b"".join((
        FIXED.pack(timestamp_ms, subject_sequence, tag_bloom, len(subject_bytes)),
        subject_bytes,
        ID_LENGTH.pack(len(id_bytes)),
        id_bytes,
        payload,
    ))


@functools.lru_cache(maxsize=256)
def _head_struct(subject_length: int) -> struct.Struct:
    """FIXED, then a subject of ``subject_length`` bytes (exact: no padding), then
    message_id_length: a record's bytes up to its message id, in one ``pack``."""
    return struct.Struct(f">QQQH{subject_length}sH")


def _check_columns(subject_sequences: Sequence[int], tag_blooms: Sequence[int],
                   message_ids_utf8: Sequence[bytes], payloads: Sequence[bytes]) -> None:
    """ValueError naming the lengths when ``encode_subject_records``' columns differ in length."""
    if not (len(subject_sequences) == len(tag_blooms) == len(message_ids_utf8)
            == len(payloads)):
        raise ValueError(f"columns of {len(subject_sequences)} sequences, {len(tag_blooms)} "
                         f"blooms, {len(message_ids_utf8)} ids and {len(payloads)} payloads "
                         f"differ in length")


def encode_subject_records(
    timestamp_ms: int,
    subject: str,
    subject_sequences: Sequence[int],
    tag_blooms: Sequence[int],
    message_ids_utf8: Sequence[bytes],
    payloads: Sequence[bytes],
) -> list[bytes]:
    """Encode the record bodies of several messages of one ``subject`` stored at one time,
    given column by column: the same bytes as ``encode_message_record`` per message.

    A batch is the broker's hot path: with the optional C twin built (``_codecs``) and the
    columns given as lists of ints and bytes, it does the work; otherwise the per-record work
    runs in C anyway (``map`` over one ``struct`` whose format holds this subject). Raises
    ValueError when a field does not fit its width or the columns differ in length.
    """
    subject_bytes = subject.encode("utf-8")
    if len(subject_bytes) > SUBJECT_BYTES_MAX:
        raise ValueError(f"subject of {len(subject_bytes)} bytes exceeds {SUBJECT_BYTES_MAX}")
    if _encode_subject_records_c is not None and type(subject_sequences) is list and type(
            tag_blooms) is list and type(message_ids_utf8) is list and type(payloads) is list:
        try:
            return _encode_subject_records_c(timestamp_ms, subject_bytes, subject_sequences,
                                             tag_blooms, message_ids_utf8, payloads)
        except TypeError:
            pass  # a payload or id that is bytes-like but not bytes: the Python path takes it
        except ValueError:
            # The C twin checks the columns' lengths too (a commit's path: no len() here);
            # a mismatch is worded with the lengths, a field out of range as C words it.
            _check_columns(subject_sequences, tag_blooms, message_ids_utf8, payloads)
            raise
    _check_columns(subject_sequences, tag_blooms, message_ids_utf8, payloads)
    head = _head_struct(len(subject_bytes))
    try:
        heads = list(map(head.pack, repeat(timestamp_ms), subject_sequences, tag_blooms,
                         repeat(len(subject_bytes)), repeat(subject_bytes),
                         map(len, message_ids_utf8)))
    except (struct.error, OverflowError) as exc:  # OverflowError: an __index__ int
        # Q and H refuse what does not fit u64 / u16: a timestamp, sequence or bloom outside
        # [0, U64_MAX], or a message id over MESSAGE_ID_BYTES_MAX bytes.
        raise ValueError(f"message record field out of range: {exc}") from None
    return list(map(b"".join, zip(heads, message_ids_utf8, payloads)))


def decode_message_header(body: bytes | memoryview) -> tuple[int, int, int, str, str, int]:
    """Decode everything but the payload: (timestamp_ms, subject_sequence, tag_bloom, subject,
    message_id, payload_offset). Raises ValueError when the body is not a valid record."""
    if len(body) < OVERHEAD_SIZE_BYTES:
        raise ValueError(f"record body of {len(body)} bytes is shorter than {OVERHEAD_SIZE_BYTES}")
    timestamp_ms, sequence, bloom, subject_length = FIXED.unpack_from(body, 0)
    id_at = FIXED_SIZE_BYTES + subject_length
    if id_at + ID_LENGTH.size > len(body):
        raise ValueError(f"subject length {subject_length} runs past the {len(body)}-byte body")
    (id_length,) = ID_LENGTH.unpack_from(body, id_at)
    payload_at = id_at + ID_LENGTH.size + id_length
    if payload_at > len(body):
        raise ValueError(f"message id length {id_length} runs past the {len(body)}-byte body")
    try:
        subject = bytes(body[FIXED_SIZE_BYTES:id_at]).decode("utf-8")
        message_id = bytes(body[id_at + ID_LENGTH.size : payload_at]).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"subject or message id is not UTF-8: {exc}") from exc
    return timestamp_ms, sequence, bloom, subject, message_id, payload_at


def decode_message_headers(bodies: list[bytes],
                           ) -> tuple[list[int], list[int], list[int], list[str], list[str]] | None:
    """``decode_message_header`` of every body, column by column: (timestamps_ms, sequences,
    tag_blooms, subjects, message_ids); None, naming nothing, when one of them is not a valid
    message record (a control record included): the caller decodes them one by one, which names
    it. A slave's copy of a commit is the path: the C twin (``_codecs``) does it when built
    (this Python twin was ~35% of a copied commit's CPU); here the per-record work runs in C
    (``map`` over the ``struct`` unpacks, slices and decodes), each distinct subject decoded
    once."""
    if _decode_message_headers_c is not None:
        return _decode_message_headers_c(bodies)
    return _decode_message_headers_py(bodies)


def _decode_message_headers_py(bodies: list[bytes],
                               ) -> tuple[list[int], list[int], list[int], list[str],
                                          list[str]] | None:
    """``decode_message_headers``' Python twin."""
    if type(bodies) is not list or not bodies or set(map(type, bodies)) != {bytes}:
        return None
    try:
        if min(map(len, bodies)) < OVERHEAD_SIZE_BYTES:
            return None
        timestamps, sequences, blooms, subject_lengths = map(
            list, zip(*map(FIXED.unpack_from, bodies)))
        if not all(subject_lengths):  # 0 there marks a control record (is_control)
            return None
        id_ats = list(map(add, subject_lengths, repeat(FIXED_SIZE_BYTES)))
        id_lengths = list(map(itemgetter(0), map(ID_LENGTH.unpack_from, bodies, id_ats)))
        id_starts = list(map(add, id_ats, repeat(ID_LENGTH.size)))
        payload_ats = list(map(add, id_starts, id_lengths))
        if not all(map(le, payload_ats, map(len, bodies))):
            return None
        raw_subjects = list(map(getitem, bodies, map(slice, repeat(FIXED_SIZE_BYTES), id_ats)))
        names = {raw: raw.decode("utf-8") for raw in set(raw_subjects)}
        subjects = list(map(names.__getitem__, raw_subjects))
        message_ids = list(map(bytes.decode, map(getitem, bodies,
                                                 map(slice, id_starts, payload_ats))))
    except (struct.error, UnicodeDecodeError):  # struct.error: an id length past the body
        return None
    return timestamps, sequences, blooms, subjects, message_ids


def decode_message_record(body: bytes | memoryview) -> MessageRecord:
    """Decode a whole record body; raises ValueError when it is not a valid record."""
    timestamp_ms, sequence, bloom, subject, message_id, payload_at = decode_message_header(body)
    return MessageRecord(timestamp_ms, sequence, bloom, subject, message_id,
                         bytes(body[payload_at:]))


def tag_bloom(tag_hashes) -> int:
    """The 64-bit mask with bit (h % 64) set for each 32-bit tag hash; 0 for no tags."""
    mask = 0
    for h in tag_hashes:
        mask |= 1 << (h % 64)
    return mask
