"""The message store's checkpoint payload, written through ``logstore.CheckpointStore`` as
``<data_dir>/checkpoint/consumerlogs.<20-digit sequence>.ckpt`` (that file adds its own magic,
version, sequence, length and CRC-32). Payload, big-endian::

    Offset | Size | Field
    -------+------+------------------------------------------------------------------
    0      | 1    | version: 1
    1      | 8    | message_log_offset: u64; every consumer log indexes every record below it
    9      | 4    | subject_count: u32 (K)
    13     | ...  | K times: subject_length u16 (S), subject UTF-8 (S bytes),
           |      |          end_sequence u64 (the subject's end sequence at that offset)

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
    "I"  # subject_count
)
SUBJECT_LENGTH = struct.Struct(">H")  # subject_length
END_SEQUENCE = struct.Struct(">Q")  # end_sequence
VERSION = 1
CHECKPOINT_NAME = "consumerlogs"


@dataclass(frozen=True)
class StoreCheckpoint:
    """A decoded checkpoint payload."""

    message_log_offset: int
    end_sequences: dict[str, int]


def encode_store_checkpoint(checkpoint: StoreCheckpoint) -> bytes:
    """The payload bytes of ``checkpoint``."""
    parts = [HEADER.pack(VERSION, checkpoint.message_log_offset, len(checkpoint.end_sequences))]
    for subject, end in sorted(checkpoint.end_sequences.items()):
        raw = subject.encode("utf-8")
        parts += [SUBJECT_LENGTH.pack(len(raw)), raw, END_SEQUENCE.pack(end)]
    return b"".join(parts)


def decode_store_checkpoint(payload: bytes) -> StoreCheckpoint:
    """Decode payload bytes; raises ValueError on any defect."""
    if len(payload) < HEADER.size:
        raise ValueError(f"checkpoint payload of {len(payload)} bytes is shorter than the header")
    version, offset, count = HEADER.unpack_from(payload, 0)
    if version != VERSION:
        raise ValueError(f"unknown checkpoint payload version {version}")
    at = HEADER.size
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
    return StoreCheckpoint(offset, ends)
