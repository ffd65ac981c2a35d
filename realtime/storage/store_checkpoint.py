"""The message store's checkpoint payload, written through ``logstore.CheckpointStore`` as
``<data_dir>/checkpoint/consumerlogs.<20-digit sequence>.ckpt`` (that file adds its own magic,
version, sequence, length and CRC-32). Payload, big-endian::

    Offset | Size | Field
    -------+------+------------------------------------------------------------------
    0      | 1    | version: 2 (1: without held_from_offset)
    1      | 8    | message_log_offset: u64; every consumer log indexes every record below it
    9      | 8    | held_from_offset: u64 (version 2 only); the lowest offset of a held record
           |      |   neither made visible nor cancelled at message_log_offset, or
           |      |   message_log_offset when none was (recovery replays from the lower one)
    17     | 4    | subject_count: u32 (K)
    21     | ...  | K times: subject_length u16 (S), subject UTF-8 (S bytes),
           |      |          end_sequence u64 (the subject's end sequence at that offset)

Version 1 payloads (before held messages) still decode, held_from_offset = message_log_offset.

A checkpoint is written only after every consumer log has been fsynced and the message log is
durable up to ``message_log_offset``. What it does NOT guarantee: it is a starting point for
replay, not proof; recovery still checks each consumer log against it and against the message log.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

HEADER = struct.Struct(
    ">B"  # version
    "Q"  # message_log_offset
    "Q"  # held_from_offset
    "I"  # subject_count
)
HEADER_V1 = struct.Struct(">BQI")  # version 1: no held_from_offset
SUBJECT_LENGTH = struct.Struct(">H")  # subject_length
END_SEQUENCE = struct.Struct(">Q")  # end_sequence
VERSION = 2
CHECKPOINT_NAME = "consumerlogs"


@dataclass(frozen=True)
class StoreCheckpoint:
    """A decoded checkpoint payload."""

    message_log_offset: int
    end_sequences: dict[str, int]
    held_from_offset: int | None = None  # None: message_log_offset (nothing held)

    @property
    def replay_from_offset(self) -> int:
        """Where a replay must start to see every record not yet indexed and every held record
        still pending."""
        held = self.held_from_offset
        return self.message_log_offset if held is None else min(held, self.message_log_offset)


def encode_store_checkpoint(checkpoint: StoreCheckpoint) -> bytes:
    """The payload bytes of ``checkpoint``."""
    held_from = checkpoint.held_from_offset
    parts = [HEADER.pack(VERSION, checkpoint.message_log_offset,
                         checkpoint.message_log_offset if held_from is None else held_from,
                         len(checkpoint.end_sequences))]
    for subject, end in sorted(checkpoint.end_sequences.items()):
        raw = subject.encode("utf-8")
        parts += [SUBJECT_LENGTH.pack(len(raw)), raw, END_SEQUENCE.pack(end)]
    return b"".join(parts)


def decode_store_checkpoint(payload: bytes) -> StoreCheckpoint:
    """Decode payload bytes; raises ValueError on any defect."""
    if len(payload) < HEADER_V1.size:
        raise ValueError(f"checkpoint payload of {len(payload)} bytes is shorter than the header")
    if payload[0] == 1:
        version, offset, count = HEADER_V1.unpack_from(payload, 0)
        held_from, at = offset, HEADER_V1.size
    elif payload[0] == VERSION and len(payload) >= HEADER.size:
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
    if at != len(payload):
        raise ValueError(f"{len(payload) - at} unexpected bytes after the last subject")
    # Nothing held below the offset decodes as None, the same as a version 1 payload.
    return StoreCheckpoint(offset, ends, held_from if held_from < offset else None)
