"""The delay-log record: the body of one logstore record in ``<data_dir>/delaylog/``.

The logstore framing around it (``logstore.record``) carries the length, magic 0x514D, version,
attributes and a CRC-32 over the whole body, so this body has no magic or CRC of its own.
All integers are big-endian::

    Offset    | Size | Field
    ----------+------+------------------------------------------------------------------
    0         | 8    | deliver_at_ms: u64, when the message is due (ms since the epoch)
    8         | 8    | bucket_ms: u64, start of the schedule bucket the record was filed in:
              |      | the bucket of deliver_at_ms, or the done watermark if that bucket had
              |      | already been marked done when the record was appended (a late message)
    16        | 2    | message_id_length: u16 (I), bytes of the message id, >= 1
    18        | I    | message_id: UTF-8
    18+I      | 2    | subject_length: u16 (S), bytes of the subject, >= 1
    20+I      | S    | subject: UTF-8
    20+I+S    | N    | payload: the message exactly as the producer encoded it (rest of the body)

``bucket_ms`` is stored rather than recomputed so that replaying the log files a late message into
the same bucket it was filed in before the crash, whatever the watermark is at replay time.

What it does NOT guarantee: the payload is never decoded or validated here; the record is not
encrypted or compressed; ``deliver_at_ms`` is not checked against any horizon (the server does).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from logstore.record import frame_records_python
from logstore.twins import c_twin

FIXED = struct.Struct(
    ">Q"  # deliver_at_ms
    "Q"  # bucket_ms
    "H"  # message_id_length
)
SUBJECT_LENGTH = struct.Struct(">H")  # subject_length
OVERHEAD_SIZE_BYTES = FIXED.size + SUBJECT_LENGTH.size  # 20: bytes besides id, subject, payload
MESSAGE_ID_BYTES_MAX = 0xFFFF  # the u16 length field's limit
SUBJECT_BYTES_MAX = 0xFFFF
U64_MAX = (1 << 64) - 1


@dataclass(frozen=True)
class DelayedRecord:
    """A decoded delay-log record, as ``DelayStore.read`` returns it."""

    message_id: str
    subject: str
    deliver_at_ms: int
    payload: bytes
    bucket_ms: int = 0  # the bucket the record was filed in


def id_hash(message_id_bytes: bytes) -> int:
    """The 32-bit hash of a message id kept in schedule entries: CRC-32 of its UTF-8 bytes."""
    return zlib.crc32(message_id_bytes)


def subject_tail(subject_bytes: bytes) -> bytes:
    """The subject's part of a record body: its u16 length and its bytes. Raises ValueError
    when the subject is empty or longer than the u16 field holds."""
    if not 1 <= len(subject_bytes) <= SUBJECT_BYTES_MAX:
        raise ValueError(f"subject of {len(subject_bytes)} bytes is outside [1, {SUBJECT_BYTES_MAX}]")
    return SUBJECT_LENGTH.pack(len(subject_bytes)) + subject_bytes


def encode_delay_record(
    deliver_at_ms: int,
    bucket_ms: int,
    message_id_bytes: bytes,
    subject_bytes: bytes,
    payload: bytes | bytearray | memoryview,
) -> bytes:
    """Encode one record body from already-encoded id and subject (the store encodes them once to
    check their limits); the payload is copied once, never re-encoded."""
    if not 1 <= len(message_id_bytes) <= MESSAGE_ID_BYTES_MAX:
        raise ValueError(
            f"message id of {len(message_id_bytes)} bytes is outside [1, {MESSAGE_ID_BYTES_MAX}]"
        )
    tail = subject_tail(subject_bytes)
    if not (0 <= deliver_at_ms <= U64_MAX and 0 <= bucket_ms <= U64_MAX):
        raise ValueError(f"deliver_at_ms {deliver_at_ms} or bucket_ms {bucket_ms} is outside u64")
    return b"".join((
        FIXED.pack(deliver_at_ms, bucket_ms, len(message_id_bytes)),
        message_id_bytes,
        tail,
        payload,
    ))


def encode_delay_records_python(
    deliver_at_ms: list[int],
    bucket_ms: list[int],
    message_ids_bytes: list[bytes],
    subject_tails: list[bytes],
    payloads: list[bytes],
) -> list[bytes]:
    """The bodies ``encode_delay_record`` gives, for columns of already-checked values (each
    ``subject_tails[k]`` is ``subject_tail(subject)``): every step is a C-level pass (map, zip,
    join), no Python call per record. The caller checks the ranges first (``encode_delay_record``
    words the error of a bad value).

    ``encode_delay_records`` is the C twin (``delayserver/_commit_codecs.c``) when it is built,
    this one otherwise; both give the same bytes (tests/unit/test_commit_codecs.py)."""
    heads = map(FIXED.pack, deliver_at_ms, bucket_ms, map(len, message_ids_bytes))
    return list(map(b"".join, zip(heads, message_ids_bytes, subject_tails, payloads)))


encode_delay_records = (c_twin("delayserver._commit_codecs", "encode_delay_records")
                        or encode_delay_records_python)


def frame_delay_records_python(
    deliver_at_ms: list[int],
    bucket_ms: list[int],
    message_ids_bytes: list[bytes],
    subject_tails: list[bytes],
    payloads: list[bytes],
) -> tuple[bytes, list[int], list[int]]:
    """The records ``encode_delay_records`` gives, framed as logstore records back to back
    (``frame_records``: the bytes the delay log writes for them), each one's body size and the
    CRC-32 of each message id (``id_hash``): what the delay store's ``append_many`` buffers for
    its commit. Columns of already-checked values, as ``encode_delay_records`` takes.

    ``frame_delay_records`` is the C twin (``delayserver/_commit_codecs.c``: one bytes object
    written in one pass, no body per record) when it is built, this one otherwise; both give
    the same answer (tests/unit/test_commit_codecs.py)."""
    bodies = encode_delay_records_python(deliver_at_ms, bucket_ms, message_ids_bytes,
                                         subject_tails, payloads)
    return (frame_records_python(bodies), list(map(len, bodies)),
            list(map(zlib.crc32, message_ids_bytes[:len(bodies)])))


frame_delay_records = (c_twin("delayserver._commit_codecs", "frame_delay_records")
                       or frame_delay_records_python)


def decode_delay_header(body: bytes | memoryview) -> tuple[int, int, bytes, str, int]:
    """Decode everything but the payload: (deliver_at_ms, bucket_ms, message_id_bytes, subject,
    payload_offset). Raises ValueError when the body is not a valid record."""
    if len(body) < OVERHEAD_SIZE_BYTES:
        raise ValueError(f"record body of {len(body)} bytes is shorter than {OVERHEAD_SIZE_BYTES}")
    deliver_at_ms, bucket_ms, id_length = FIXED.unpack_from(body, 0)
    subject_length_at = FIXED.size + id_length
    if id_length == 0:
        raise ValueError("message id length is 0")
    if subject_length_at + SUBJECT_LENGTH.size > len(body):
        raise ValueError(f"message id length {id_length} runs past the {len(body)}-byte body")
    (subject_length,) = SUBJECT_LENGTH.unpack_from(body, subject_length_at)
    subject_at = subject_length_at + SUBJECT_LENGTH.size
    payload_at = subject_at + subject_length
    if subject_length == 0:
        raise ValueError("subject length is 0")
    if payload_at > len(body):
        raise ValueError(f"subject length {subject_length} runs past the {len(body)}-byte body")
    message_id_bytes = bytes(body[FIXED.size : subject_length_at])
    try:
        message_id_bytes.decode("utf-8")
        subject = bytes(body[subject_at:payload_at]).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"message id or subject is not UTF-8: {exc}") from exc
    return deliver_at_ms, bucket_ms, message_id_bytes, subject, payload_at


def decode_delay_record(body: bytes | memoryview) -> DelayedRecord:
    """Decode a whole record body; raises ValueError when it is not a valid record."""
    deliver_at_ms, bucket_ms, id_bytes, subject, payload_at = decode_delay_header(body)
    return DelayedRecord(id_bytes.decode("utf-8"), subject, deliver_at_ms,
                         bytes(body[payload_at:]), bucket_ms)
