"""The delay store's checkpoint payload, written through ``logstore.CheckpointStore`` as
``<data_dir>/checkpoint/delaystore.<20-digit sequence>.ckpt`` (that file adds its own magic,
version, sequence, length and CRC-32). Payload, big-endian::

    Offset | Size   | Field
    -------+--------+------------------------------------------------------------------
    0      | 1      | version: 1
    1      | 8      | bucket_ms: u64, the bucket width the data directory was written with
    9      | 8      | chunk_size_bytes: u64, width of the delay-log chunks below
    17     | 8      | delay_log_offset: u64; every record below it has its schedule entry
           |        | written and fsynced, and is counted in the pending counts below
    25     | 8      | done_before_ms: u64, the done watermark (every bucket below is done)
    33     | 4      | hour_count: u32 (H)
    37     | 16*H   | H times: hour_ms u64, pending u64
    ...    | 4      | subject_count: u32 (S)
    ...    | ...    | S times: subject_length u16 (L), subject UTF-8 (L bytes), pending u64
    ...    | 4      | day_count: u32 (D)
    ...    | 16*D   | D times: day_index u64, entries u64 (schedule entries in the day's
           |        | buckets at or after done_before_ms; recovery checks the files against it)
    ...    | 4      | chunk_count: u32 (K)
    ...    | 16*K   | K times: chunk_index u64, max_bucket_ms u64 (the highest bucket of any
           |        | record whose offset is in [chunk_index * chunk_size_bytes, + chunk_size_bytes))

A checkpoint is written only after the delay log is durable up to ``delay_log_offset`` and every
schedule file has been written and fsynced. What it does NOT guarantee: it is a starting point for
replay, not proof; recovery still checks the schedule files against its day counts and replays
the delay log and the touched logs after it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

HEADER = struct.Struct(
    ">B"  # version
    "Q"  # bucket_ms
    "Q"  # chunk_size_bytes
    "Q"  # delay_log_offset
    "Q"  # done_before_ms
)
COUNT = struct.Struct(">I")  # hour_count, subject_count, day_count, chunk_count
PAIR = struct.Struct(">QQ")  # (hour_ms, pending), (day_index, entries), (chunk_index, max_bucket)
SUBJECT_LENGTH = struct.Struct(">H")
PENDING = struct.Struct(">Q")
VERSION = 1
CHECKPOINT_NAME = "delaystore"


@dataclass(frozen=True)
class DelayCheckpoint:
    """A decoded checkpoint payload."""

    bucket_ms: int
    chunk_size_bytes: int
    delay_log_offset: int
    done_before_ms: int
    pending_per_hour: dict[int, int] = field(default_factory=dict)
    pending_per_subject: dict[str, int] = field(default_factory=dict)
    entries_per_day: dict[int, int] = field(default_factory=dict)
    max_bucket_per_chunk: dict[int, int] = field(default_factory=dict)


def _pairs(mapping: dict[int, int]) -> list[bytes]:
    return [COUNT.pack(len(mapping))] + [PAIR.pack(k, v) for k, v in sorted(mapping.items())]


def encode_delay_checkpoint(checkpoint: DelayCheckpoint) -> bytes:
    """The payload bytes of ``checkpoint``."""
    parts = [HEADER.pack(VERSION, checkpoint.bucket_ms, checkpoint.chunk_size_bytes,
                         checkpoint.delay_log_offset, checkpoint.done_before_ms)]
    parts += _pairs(checkpoint.pending_per_hour)
    parts.append(COUNT.pack(len(checkpoint.pending_per_subject)))
    for subject, pending in sorted(checkpoint.pending_per_subject.items()):
        raw = subject.encode("utf-8")
        parts += [SUBJECT_LENGTH.pack(len(raw)), raw, PENDING.pack(pending)]
    parts += _pairs(checkpoint.entries_per_day)
    parts += _pairs(checkpoint.max_bucket_per_chunk)
    return b"".join(parts)


class _Reader:
    def __init__(self, payload: bytes) -> None:
        self.payload = payload
        self.at = 0

    def take(self, layout: struct.Struct, what: str) -> tuple:
        if self.at + layout.size > len(self.payload):
            raise ValueError(f"checkpoint payload ends inside {what} at byte {self.at}")
        values = layout.unpack_from(self.payload, self.at)
        self.at += layout.size
        return values

    def pairs(self, what: str) -> dict[int, int]:
        (count,) = self.take(COUNT, f"the {what} count")
        if self.at + count * PAIR.size > len(self.payload):
            raise ValueError(f"checkpoint payload too short for {count} {what} pairs")
        out = {}
        for _ in range(count):
            key, value = self.take(PAIR, what)
            out[key] = value
        return out


def decode_delay_checkpoint(payload: bytes) -> DelayCheckpoint:
    """Decode payload bytes; raises ValueError on any defect."""
    reader = _Reader(payload)
    version, bucket_ms, chunk_size, offset, done_before = reader.take(HEADER, "the header")
    if version != VERSION:
        raise ValueError(f"unknown checkpoint payload version {version}")
    if bucket_ms < 1 or chunk_size < 1:
        raise ValueError(f"bucket_ms {bucket_ms} and chunk_size_bytes {chunk_size} must be >= 1")
    hours = reader.pairs("hour")
    (subject_count,) = reader.take(COUNT, "the subject count")
    subjects: dict[str, int] = {}
    for _ in range(subject_count):
        (length,) = reader.take(SUBJECT_LENGTH, "a subject length")
        if reader.at + length > len(payload):
            raise ValueError("checkpoint payload ends inside a subject")
        try:
            subject = payload[reader.at : reader.at + length].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"subject is not UTF-8: {exc}") from exc
        reader.at += length
        (subjects[subject],) = reader.take(PENDING, "a subject's pending count")
    days = reader.pairs("day")
    chunks = reader.pairs("chunk")
    if reader.at != len(payload):
        raise ValueError(f"{len(payload) - reader.at} unexpected bytes after the last chunk")
    return DelayCheckpoint(bucket_ms, chunk_size, offset, done_before, hours, subjects, days,
                           chunks)
