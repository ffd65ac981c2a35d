"""The message log's control records: a message held until its visible time, the records that
make held messages visible, and those that cancel held messages (docs/FORMATS.md, "Held
messages"). They share the message log with the message records (``message_record``) and are
told apart by bytes 24-25: a message record's subject_length there is at least 1, a control
record's is 0. All integers big-endian; the logstore framing around each body carries its
length and CRC-32::

    Offset   | Size | Field
    ---------+------+-------------------------------------------------------------------
    0        | 8    | timestamp_ms: u64, when the broker wrote the record
    8        | 8    | visible_at_ms: u64 (held); subject_sequence (visible message); 0 (cancelled)
    16       | 8    | tag_bloom: u64 (held, visible message); 0 (cancelled)
    24       | 2    | marker: u16 = 0 (where a message record has its subject_length >= 1)
    26       | 1    | kind: 1 held, 3 cancelled, 4 visible message, 5 dropped (2 is retired)
    held (kind 1):
    27       | 2    | subject_length: u16 (S)
    29       | S    | subject: UTF-8
    29+S     | 2    | message_id_length: u16 (I)
    31+S     | I    | message_id: UTF-8
    31+S+I   | N    | payload: the message as the delay server sent it (rest of the body)
    visible message (kind 4): a held message made visible, a message record again
    8        | 8    | subject_sequence: u64 (in the place of visible_at_ms)
    16       | 8    | tag_bloom: u64
    27       | 8    | held_offset: u64, the held record it makes visible (no longer held)
    35       | 2    | subject_length: u16 (S)
    37       | S    | subject: UTF-8
    37+S     | 2    | message_id_length: u16 (I)
    39+S     | I    | message_id: UTF-8
    39+S+I   | N    | payload: the held record's payload, written again
    cancelled (kind 3): held records given up (unreadable at their due time)
    27       | 4    | count: u32 (C)
    31       | 8*C  | held_offset: u64, each a held record now dropped
    dropped (kind 5): held records a cancel_held dropped, with their ids (remembered)
    27       | 4    | count: u32 (C)
    31       | 8*C  | held_offset: u64, each a held record now dropped
    31+8C    | 2    | subject_length: u16 (S)
    33+8C    | S    | subject: UTF-8 (every dropped record's)
    33+8C+S  | ...  | C times: message_id_length u16 (I), message_id UTF-8 (I bytes), in the
             |      |   order of the offsets

A visible-message record is a message record in all but its marker: consumer-log entries point
at it (never at a held record), so within a subject entry offsets rise with the sequence as they
do for sent messages, and retention, a copy's cut and recovery need nothing special for it. Each
one names the held record it replaces, so it is atomic: a torn or cut write leaves each message
held or visible, never both. What it does NOT guarantee: a held record says nothing about
whether it was later made visible or cancelled; only the records after it do.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import lru_cache
from itertools import repeat
from typing import Sequence

from logstore.twins import c_twin

# The C twin of encode_visible_messages (realtime/storage/_codecs.c); optional, chosen by
# logstore.twins.
_encode_visible_records_c = c_twin("realtime.storage._codecs", "encode_visible_records")

HEAD = struct.Struct(
    ">Q"  # timestamp_ms
    "Q"  # visible_at_ms (held) / 0
    "Q"  # tag_bloom (held) / 0
    "H"  # marker: 0
    "B"  # kind
)
HEAD_SIZE_BYTES = HEAD.size  # 27
MARKER_AT = 24  # bytes 24-25: a message record's subject_length, never 0
U16 = struct.Struct(">H")
U32 = struct.Struct(">I")
OFFSET = struct.Struct(">Q")
KIND_HELD = 1
KIND_CANCELLED = 3
KIND_VISIBLE_MESSAGE = 4  # 2 was a visible record listing entries that pointed at held records
KIND_DROPPED = 5  # a cancel_held's drop: a cancelled record that also names the ids
HELD_OVERHEAD_SIZE_BYTES = HEAD_SIZE_BYTES + 4  # a held record is at least this long
# The kinds replication gates on what a slave reads (serverkit.kind_gate): every control record
# kind, all newer than the fetch's ``reads``. A new kind is added here (and to the decoder).
GATED_KINDS = frozenset((KIND_HELD, KIND_CANCELLED, KIND_VISIBLE_MESSAGE, KIND_DROPPED))


def gated_kind_at(data: bytes, body_at: int) -> int | None:
    """The control record kind of the message-log record body at ``body_at`` of ``data``
    (whole records, as a fetch ships them), or None for a message record."""
    marker = body_at + MARKER_AT
    if marker + 3 > len(data) or data[marker] or data[marker + 1]:
        return None
    return data[marker + 2]


@dataclass(frozen=True)
class HeldRecord:
    """A decoded held record (its payload apart: ``decode_held`` returns where it starts)."""

    timestamp_ms: int
    visible_at_ms: int
    tag_bloom: int
    subject: str
    message_id: str


def is_control(body: bytes | memoryview) -> bool:
    """True when ``body`` is a control record rather than a message record."""
    return len(body) >= HEAD_SIZE_BYTES and body[MARKER_AT] == 0 and body[MARKER_AT + 1] == 0


def control_kind(body: bytes | memoryview) -> int:
    """The kind byte of a control record body (``is_control`` first)."""
    return body[HEAD_SIZE_BYTES - 1]


def encode_held(timestamp_ms: int, visible_at_ms: int, tag_bloom: int, subject: str,
                message_id: str, payload: bytes) -> bytes:
    """A held record's body; ValueError when a field does not fit its width."""
    subject_bytes = subject.encode("utf-8")
    id_bytes = message_id.encode("utf-8")
    if not subject_bytes or len(subject_bytes) > 0xFFFF or len(id_bytes) > 0xFFFF:
        raise ValueError(f"subject of {len(subject_bytes)} bytes or message id of "
                         f"{len(id_bytes)} bytes is outside [1, 65535]")
    try:
        head = HEAD.pack(timestamp_ms, visible_at_ms, tag_bloom, 0, KIND_HELD)
    except (struct.error, OverflowError) as exc:  # OverflowError: an __index__ int
        raise ValueError(f"held record field out of range: {exc}") from None
    return b"".join((head, U16.pack(len(subject_bytes)), subject_bytes,
                     U16.pack(len(id_bytes)), id_bytes, payload))


def decode_held(body: bytes | memoryview) -> tuple[HeldRecord, int]:
    """(the held record, where its payload starts); ValueError when it is not one."""
    if len(body) < HELD_OVERHEAD_SIZE_BYTES or not is_control(body) \
            or control_kind(body) != KIND_HELD:
        raise ValueError(f"a {len(body)}-byte body is not a held record")
    timestamp_ms, visible_at_ms, bloom, _marker, _kind = HEAD.unpack_from(body, 0)
    subject, message_id, payload_at = _names(body, HEAD_SIZE_BYTES)
    return HeldRecord(timestamp_ms, visible_at_ms, bloom, subject, message_id), payload_at


def _names(body: bytes | memoryview, at: int) -> tuple[str, str, int]:
    """(subject, message id, where the payload starts) of the two length-prefixed names at
    ``at``; ValueError when they run past the body or are not UTF-8."""
    if at + 2 > len(body):
        raise ValueError(f"no subject length at {at} of the {len(body)}-byte body")
    (subject_length,) = U16.unpack_from(body, at)
    id_at = at + 2 + subject_length
    if id_at + 2 > len(body):
        raise ValueError(f"subject length {subject_length} runs past the {len(body)}-byte body")
    (id_length,) = U16.unpack_from(body, id_at)
    payload_at = id_at + 2 + id_length
    if payload_at > len(body):
        raise ValueError(f"message id length {id_length} runs past the {len(body)}-byte body")
    try:
        subject = bytes(body[at + 2:id_at]).decode("utf-8")
        message_id = bytes(body[id_at + 2:payload_at]).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"subject or message id is not UTF-8: {exc}") from exc
    return subject, message_id, payload_at


def encode_visible_message(timestamp_ms: int, sequence: int, tag_bloom: int, subject: str,
                           message_id: str, held_offset: int, payload: bytes) -> bytes:
    """The visible-message record making the held record at ``held_offset`` visible as
    ``sequence`` of ``subject``, its payload written again."""
    subject_bytes = subject.encode("utf-8")
    id_bytes = message_id.encode("utf-8")
    return b"".join((HEAD.pack(timestamp_ms, sequence, tag_bloom, 0, KIND_VISIBLE_MESSAGE),
                     OFFSET.pack(held_offset), U16.pack(len(subject_bytes)), subject_bytes,
                     U16.pack(len(id_bytes)), id_bytes, payload))


def encode_visible_messages(timestamp_ms: int, subject: str, sequences: Sequence[int],
                            tag_blooms: Sequence[int], held_offsets: Sequence[int],
                            message_ids_utf8: Sequence[bytes], payloads: Sequence[bytes],
                            ) -> list[bytes]:
    """``encode_visible_message`` of several held messages of one ``subject`` made visible at
    one time, given column by column (the same bytes; a hot slot makes 20k visible at once).
    With the optional C twin built (``_codecs``) and the columns given as lists (``sequences``
    may be a range), it does the work, about 5x faster; otherwise the per-record work is two
    ``map`` calls over one ``struct`` whose format holds the subject. ValueError when a field
    does not fit its width or the columns differ in length."""
    if not (len(sequences) == len(tag_blooms) == len(held_offsets) == len(message_ids_utf8)
            == len(payloads)):
        raise ValueError(f"columns of {len(sequences)} sequences, {len(tag_blooms)} blooms, "
                         f"{len(held_offsets)} held offsets, {len(message_ids_utf8)} ids and "
                         f"{len(payloads)} payloads differ in length")
    subject_bytes = subject.encode("utf-8")
    if type(sequences) is range:
        sequences = list(sequences)
    if _encode_visible_records_c is not None and type(sequences) is list and type(
            tag_blooms) is list and type(held_offsets) is list and type(
            message_ids_utf8) is list and type(payloads) is list:
        try:
            return _encode_visible_records_c(timestamp_ms, subject_bytes, sequences, tag_blooms,
                                             held_offsets, message_ids_utf8, payloads)
        except TypeError:
            pass  # a payload or id that is bytes-like but not bytes: the Python path takes it
    head = _visible_head_struct(len(subject_bytes))
    try:
        heads = list(map(head.pack, repeat(timestamp_ms), sequences, tag_blooms, repeat(0),
                         repeat(KIND_VISIBLE_MESSAGE), held_offsets,
                         repeat(len(subject_bytes)), repeat(subject_bytes),
                         map(len, message_ids_utf8)))
    except (struct.error, OverflowError) as exc:  # OverflowError: an __index__ int
        raise ValueError(f"visible-message record field out of range: {exc}") from None
    return list(map(b"".join, zip(heads, message_ids_utf8, payloads)))


@lru_cache(maxsize=256)
def _visible_head_struct(subject_length: int) -> struct.Struct:
    """A visible-message record's bytes up to its message id, for a subject of this length."""
    return struct.Struct(f">QQQHBQH{subject_length}sH")


def decode_visible_message(body: bytes | memoryview) -> tuple[HeldRecord, int, int, int]:
    """(the message as a HeldRecord whose visible_at_ms is 0, its subject_sequence, its
    held_offset, where its payload starts); ValueError when it is not one."""
    if not is_control(body) or control_kind(body) != KIND_VISIBLE_MESSAGE \
            or len(body) < HEAD_SIZE_BYTES + 8 + 4:
        raise ValueError(f"a {len(body)}-byte body is not a visible-message record")
    timestamp_ms, sequence, bloom, _marker, _kind = HEAD.unpack_from(body, 0)
    (held_offset,) = OFFSET.unpack_from(body, HEAD_SIZE_BYTES)
    subject, message_id, payload_at = _names(body, HEAD_SIZE_BYTES + 8)
    return HeldRecord(timestamp_ms, 0, bloom, subject, message_id), sequence, held_offset, \
        payload_at


def encode_cancelled(timestamp_ms: int, held_offsets: Sequence[int]) -> bytes:
    """A cancelled record's body listing ``held_offsets``."""
    return b"".join([HEAD.pack(timestamp_ms, 0, 0, 0, KIND_CANCELLED),
                     U32.pack(len(held_offsets))] + [OFFSET.pack(o) for o in held_offsets])


def decode_cancelled(body: bytes | memoryview) -> tuple[int, list[int]]:
    """(timestamp_ms, held offsets) of a cancelled record; ValueError on any defect."""
    if not is_control(body) or control_kind(body) != KIND_CANCELLED \
            or len(body) < HEAD_SIZE_BYTES + 4:
        raise ValueError(f"a {len(body)}-byte body is not a cancelled record")
    timestamp_ms = HEAD.unpack_from(body, 0)[0]
    (count,) = U32.unpack_from(body, HEAD_SIZE_BYTES)
    if len(body) != HEAD_SIZE_BYTES + 4 + 8 * count:
        raise ValueError(f"cancelled record of {len(body)} bytes does not hold {count} offsets")
    return timestamp_ms, [o for (o,) in OFFSET.iter_unpack(body[HEAD_SIZE_BYTES + 4:])]


def encode_dropped(timestamp_ms: int, subject: str, held_offsets: Sequence[int],
                   message_ids: Sequence[str]) -> bytes:
    """A dropped record's body: the held records at ``held_offsets`` of ``subject``, whose
    ids are ``message_ids`` (same order), dropped by a cancel; ValueError when a name does not
    fit its width."""
    assert len(held_offsets) == len(message_ids), (len(held_offsets), len(message_ids))
    subject_bytes = subject.encode("utf-8")
    ids = [message_id.encode("utf-8") for message_id in message_ids]
    if not subject_bytes or len(subject_bytes) > 0xFFFF or any(len(i) > 0xFFFF for i in ids):
        raise ValueError(f"subject of {len(subject_bytes)} bytes or a message id is outside "
                         "[1, 65535] bytes")
    parts = [HEAD.pack(timestamp_ms, 0, 0, 0, KIND_DROPPED), U32.pack(len(held_offsets))]
    parts += [OFFSET.pack(o) for o in held_offsets]
    parts += [U16.pack(len(subject_bytes)), subject_bytes]
    for id_bytes in ids:
        parts += [U16.pack(len(id_bytes)), id_bytes]
    return b"".join(parts)


def decode_dropped(body: bytes | memoryview) -> tuple[int, str, list[int], list[str]]:
    """(timestamp_ms, subject, held offsets, message ids) of a dropped record; ValueError on
    any defect."""
    if not is_control(body) or control_kind(body) != KIND_DROPPED \
            or len(body) < HEAD_SIZE_BYTES + 4:
        raise ValueError(f"a {len(body)}-byte body is not a dropped record")
    timestamp_ms = HEAD.unpack_from(body, 0)[0]
    (count,) = U32.unpack_from(body, HEAD_SIZE_BYTES)
    at = HEAD_SIZE_BYTES + 4 + 8 * count
    if at + 2 > len(body):
        raise ValueError(f"dropped record of {len(body)} bytes does not hold {count} offsets "
                         "and a subject")
    offsets = [o for (o,) in OFFSET.iter_unpack(body[HEAD_SIZE_BYTES + 4:at])]
    names: list[str] = []
    try:
        (length,) = U16.unpack_from(body, at)
        if at + 2 + length > len(body):
            raise ValueError(f"subject length {length} runs past the {len(body)}-byte body")
        subject = bytes(body[at + 2:at + 2 + length]).decode("utf-8")
        at += 2 + length
        for _ in range(count):
            if at + 2 > len(body):
                raise ValueError(f"dropped record of {len(body)} bytes ends before its "
                                 f"{count} ids")
            (length,) = U16.unpack_from(body, at)
            if at + 2 + length > len(body):
                raise ValueError(f"id length {length} runs past the {len(body)}-byte body")
            names.append(bytes(body[at + 2:at + 2 + length]).decode("utf-8"))
            at += 2 + length
    except UnicodeDecodeError as exc:
        raise ValueError(f"subject or message id is not UTF-8: {exc}") from exc
    if at != len(body) or not subject:
        raise ValueError(f"dropped record of {len(body)} bytes has {len(body) - at} bytes "
                         "after its ids, or an empty subject")
    return timestamp_ms, subject, offsets, names


__all__ = [
    "GATED_KINDS", "HeldRecord", "KIND_CANCELLED", "KIND_DROPPED", "decode_dropped",
    "encode_dropped", "KIND_HELD", "KIND_VISIBLE_MESSAGE", "control_kind",
    "decode_cancelled", "decode_held", "decode_visible_message", "encode_cancelled",
    "encode_held", "encode_visible_message", "encode_visible_messages", "gated_kind_at",
    "is_control",
]
