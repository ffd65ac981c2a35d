"""The message store's checkpoint payload, written through ``logstore.CheckpointStore`` as
``<data_dir>/checkpoint/consumerlogs.<20-digit sequence>.ckpt`` (that file adds its own magic,
version, sequence, length and CRC-32). Payload, big-endian::

    Offset | Size | Field
    -------+------+------------------------------------------------------------------
    0      | 1    | version: 3 (1: without held_from_offset; 2: without the held set)
    1      | 8    | message_log_offset: u64; every consumer log indexes every record below it
    9      | 8    | held_from_offset: u64 (version 2 and 3); the lowest offset of a held record
           |      |   neither made visible nor cancelled at message_log_offset, or
           |      |   message_log_offset when none was (recovery replays from the lower one)
    17     | 4    | subject_count: u32 (K)
    21     | ...  | K times: subject_length u16 (S), subject UTF-8 (S bytes),
           |      |          end_sequence u64 (the subject's end sequence at that offset)
    version 3 only, after the subjects:
    +0     | 4    | held_count: u32 (H), the held set at message_log_offset
    +4     | ...  | H times: held_offset u64, size_bytes u32, visible_at_ms u64, tag_bloom u64,
           |      |          subject_length u16 (S), subject UTF-8, message_id_length u16 (I),
           |      |          message_id UTF-8

Version 1 and 2 payloads still decode (held_from_offset = message_log_offset for version 1;
the held set unknown, None, for both). A checkpoint without a known held set is encoded as
version 2.

A checkpoint is written only after every consumer log has been fsynced and the message log is
durable up to ``message_log_offset``. What it does NOT guarantee: it is a starting point for
replay, not proof; recovery still checks each consumer log against it and against the message
log. The held set it carries names held records, not their payloads: a held record that rotted
is still given up when it falls due (``held_unreadable``). A broker older than version 3 finds
such a checkpoint unusable and rebuilds its indexes from the whole log.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

from logstore.twins import c_twin

HEADER = struct.Struct(
    ">B"  # version
    "Q"  # message_log_offset
    "Q"  # held_from_offset
    "I"  # subject_count
)
HEADER_V1 = struct.Struct(">BQI")  # version 1: no held_from_offset
SUBJECT_LENGTH = struct.Struct(">H")  # subject_length
END_SEQUENCE = struct.Struct(">Q")  # end_sequence
HELD_COUNT = struct.Struct(">I")  # held_count (version 3)
HELD_HEAD = struct.Struct(
    ">Q"  # held_offset
    "I"  # size_bytes
    "Q"  # visible_at_ms
    "Q"  # tag_bloom
)
NAME_LENGTH = struct.Struct(">H")  # subject_length, message_id_length of a held entry
VERSION = 3
VERSION_WITHOUT_HELD = 2
CHECKPOINT_NAME = "consumerlogs"
# (held_offset, size_bytes, visible_at_ms, tag_bloom, subject, message_id): a held record as
# ``realtime.storage.held.Held`` has it (a Held compares equal to its tuple)
HeldEntry = tuple[int, int, int, int, str, str]
# The C twin of encode_held_entries (realtime/storage/_codecs.c); optional, chosen by
# logstore.twins.
_encode_held_entries_c = c_twin("realtime.storage._codecs", "encode_held_entries")


@dataclass(frozen=True)
class StoreCheckpoint:
    """A decoded checkpoint payload."""

    message_log_offset: int
    end_sequences: dict[str, int]
    held_from_offset: int | None = None  # None: message_log_offset (nothing held)
    # The held set at message_log_offset (version 3), by offset; None: not known (versions 1
    # and 2), recovery rebuilds it from the records
    held: tuple[HeldEntry, ...] | None = None

    @property
    def replay_from_offset(self) -> int:
        """Where a replay must start to see every record not yet indexed and every held record
        still pending."""
        held = self.held_from_offset
        return self.message_log_offset if held is None else min(held, self.message_log_offset)


def encode_store_checkpoint(checkpoint: StoreCheckpoint) -> bytes:
    """The payload bytes of ``checkpoint``."""
    held_from = checkpoint.held_from_offset
    held = checkpoint.held
    parts = [HEADER.pack(VERSION_WITHOUT_HELD if held is None else VERSION,
                         checkpoint.message_log_offset,
                         checkpoint.message_log_offset if held_from is None else held_from,
                         len(checkpoint.end_sequences))]
    for subject, end in sorted(checkpoint.end_sequences.items()):
        raw = subject.encode("utf-8")
        parts += [SUBJECT_LENGTH.pack(len(raw)), raw, END_SEQUENCE.pack(end)]
    if held is not None:
        parts += [HELD_COUNT.pack(len(held)), encode_held_entries(held)]
    return b"".join(parts)


def encode_held_entries(held: Sequence[HeldEntry]) -> bytes:
    """The held entries of a version 3 payload, one after the other (without their count).

    The whole held set is encoded at every checkpoint, on the store thread that sends wait
    for: with the optional C twin built (``_codecs``) it does the work (200,000 entries in
    ~10 ms rather than ~190). Raises ValueError when a field does not fit its width."""
    if _encode_held_entries_c is not None:
        try:
            return _encode_held_entries_c(held)
        except TypeError:
            pass  # not tuples with str names: the Python twin words the error
    subjects: dict[str, bytes] = {}  # a hot slot's held messages share one subject
    parts = []
    try:
        for offset, size_bytes, visible_at_ms, bloom, subject, message_id in held:
            subject_raw = subjects.get(subject)
            if subject_raw is None:
                subject_raw = subjects[subject] = subject.encode("utf-8")
            id_raw = message_id.encode("utf-8")
            parts.append(_held_entry(len(subject_raw), len(id_raw)).pack(
                offset, size_bytes, visible_at_ms, bloom, len(subject_raw), subject_raw,
                len(id_raw), id_raw))
    except (struct.error, OverflowError) as exc:  # OverflowError: an __index__ int
        raise ValueError(f"held entry field out of range: {exc}") from None
    return b"".join(parts)


@lru_cache(maxsize=1024)
def _held_entry(subject_length: int, id_length: int) -> struct.Struct:
    """One held entry's bytes (HELD_HEAD, then the two length-prefixed names) in one struct:
    one ``pack`` per held message instead of five (20,000 of them in a hot slot's
    checkpoint)."""
    return struct.Struct(f"{HELD_HEAD.format}H{subject_length}sH{id_length}s")


def _decode_held(payload: bytes, at: int) -> tuple[tuple[HeldEntry, ...], int]:
    """The held entries of a version 3 payload from ``at``, and where they end."""
    if at + HELD_COUNT.size > len(payload):
        raise ValueError("checkpoint payload ends before its held count")
    (count,) = HELD_COUNT.unpack_from(payload, at)
    at += HELD_COUNT.size
    held: list[HeldEntry] = []
    for _ in range(count):
        if at + HELD_HEAD.size > len(payload):
            raise ValueError("checkpoint payload ends inside a held entry")
        offset, size_bytes, visible_at_ms, bloom = HELD_HEAD.unpack_from(payload, at)
        at += HELD_HEAD.size
        names = []
        for _name in range(2):
            if at + NAME_LENGTH.size > len(payload):
                raise ValueError("checkpoint payload ends inside a held entry's name length")
            (length,) = NAME_LENGTH.unpack_from(payload, at)
            at += NAME_LENGTH.size
            if at + length > len(payload):
                raise ValueError("checkpoint payload ends inside a held entry's name")
            names.append(payload[at:at + length].decode("utf-8"))
            at += length
        held.append((offset, size_bytes, visible_at_ms, bloom, names[0], names[1]))
    return tuple(held), at


def checkpoint_offset(payload: bytes) -> int:
    """The message_log_offset of a payload of any version without decoding the rest (a slave
    cutting its copy looks at every kept checkpoint, some 13 MB with a full held set)."""
    if len(payload) < HEADER_V1.size:
        raise ValueError(f"checkpoint payload of {len(payload)} bytes is shorter than the header")
    return END_SEQUENCE.unpack_from(payload, 1)[0]  # a u64 at byte 1 in every version


def decode_store_checkpoint(payload: bytes) -> StoreCheckpoint:
    """Decode payload bytes; raises ValueError on any defect."""
    if len(payload) < HEADER_V1.size:
        raise ValueError(f"checkpoint payload of {len(payload)} bytes is shorter than the header")
    if payload[0] == 1:
        version, offset, count = HEADER_V1.unpack_from(payload, 0)
        held_from, at = offset, HEADER_V1.size
    elif payload[0] in (VERSION_WITHOUT_HELD, VERSION) and len(payload) >= HEADER.size:
        version, offset, held_from, count = HEADER.unpack_from(payload, 0)
        at = HEADER.size
    else:
        raise ValueError(f"unknown checkpoint payload version {payload[0]} or a payload of "
                         f"{len(payload)} bytes shorter than its header")
    ends: dict[str, int] = {}
    for _ in range(count):
        if at + SUBJECT_LENGTH.size > len(payload):
            raise ValueError("checkpoint payload ends inside a subject length")
        (length,) = SUBJECT_LENGTH.unpack_from(payload, at)
        at += SUBJECT_LENGTH.size
        if at + length + END_SEQUENCE.size > len(payload):
            raise ValueError("checkpoint payload ends inside a subject entry")
        subject = payload[at : at + length].decode("utf-8")
        at += length
        (ends[subject],) = END_SEQUENCE.unpack_from(payload, at)
        at += END_SEQUENCE.size
    held: tuple[HeldEntry, ...] | None = None
    if version == VERSION:
        held, at = _decode_held(payload, at)
        beyond = [entry[0] for entry in held if entry[0] >= offset]
        if beyond:
            raise ValueError(f"held record at {beyond[0]} is not below the checkpoint's "
                             f"message_log_offset {offset}")
    if at != len(payload):
        raise ValueError(f"{len(payload) - at} unexpected bytes after the last subject")
    # Nothing held below the offset decodes as None, the same as a version 1 payload.
    return StoreCheckpoint(offset, ends, held_from if held_from < offset else None, held)
