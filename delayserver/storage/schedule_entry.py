"""The schedule entry: one fixed-size record of a bucket file
``<data_dir>/schedule/<day>/<bucket start ms, 20 digits>.sched``.

A bucket file holds one entry per delay-log record filed in that bucket, appended in delay-log
order, so entry i is at byte ``i * 32`` and entries are sorted by ``delay_log_offset``. There is
no file header. All integers are big-endian::

    Offset | Size | Field
    -------+------+------------------------------------------------------------------
    0      | 8    | deliver_at_ms: u64, copied from the record
    8      | 8    | delay_log_offset: u64, offset of the record in the delay log
    16     | 4    | size_bytes: u32, body size of that delay-log record
    20     | 4    | id_hash: u32, CRC-32 of the message id's UTF-8 bytes
    24     | 2    | magic: 0x5345 ("SE")
    26     | 1    | version: 1
    27     | 1    | reserved: 0
    28     | 4    | crc32: u32, CRC-32 (zlib) of bytes 0..27

What it does NOT guarantee: schedule files are derived data. They are written after the delay
log is durable, fsynced only before a checkpoint, and rebuilt from the delay log on open, so after
a crash a file may lack its newest entries until recovery runs. An entry's index is its position
in the file, which a rebuild reproduces but does not promise: dispatch and cancel records match
entries by ``delay_log_offset``, never by index. The CRC detects torn writes and bit rot, not
tampering.
"""

from __future__ import annotations

import struct
import zlib
from itertools import repeat
from typing import Iterator, NamedTuple

from logstore.twins import c_twin

FIELDS = struct.Struct(
    ">Q"  # deliver_at_ms
    "Q"  # delay_log_offset
    "I"  # size_bytes
    "I"  # id_hash
    "H"  # magic
    "B"  # version
    "B"  # reserved
)
CRC = struct.Struct(">I")  # crc32 of the 28 bytes above
ENTRY_SIZE_BYTES = FIELDS.size + CRC.size  # 32
MAGIC = 0x5345
VERSION = 1
FILE_SUFFIX = ".sched"
_WHOLE = struct.Struct(">QQIIHBBI")


class RawEntry(NamedTuple):
    """One decoded schedule entry (its index is its position in the file)."""

    deliver_at_ms: int
    delay_log_offset: int
    size_bytes: int
    id_hash: int


def encode_schedule_entry(deliver_at_ms: int, delay_log_offset: int, size_bytes: int,
                          id_hash: int) -> bytes:
    """The 32 bytes of one entry."""
    head = FIELDS.pack(deliver_at_ms, delay_log_offset, size_bytes, id_hash, MAGIC, VERSION, 0)
    return head + CRC.pack(zlib.crc32(head))


def encode_schedule_entries_python(deliver_at_ms: list[int], delay_log_offsets: list[int],
                            sizes_bytes: list[int], id_hashes: list[int]) -> list[bytes]:
    """The 32 bytes of each entry of columns (the same bytes as ``encode_schedule_entry`` per
    row), in C-level passes: no Python call per entry.

    ``encode_schedule_entries`` is the C twin (``delayserver/_commit_codecs.c``) when it is
    built, this one otherwise; both give the same bytes (tests/unit/test_commit_codecs.py)."""
    count = len(deliver_at_ms)
    heads = list(map(FIELDS.pack, deliver_at_ms, delay_log_offsets, sizes_bytes, id_hashes,
                     repeat(MAGIC, count), repeat(VERSION, count), repeat(0, count)))
    return list(map(bytes.__add__, heads, map(CRC.pack, map(zlib.crc32, heads))))


encode_schedule_entries = (c_twin("delayserver._commit_codecs", "encode_schedule_entries")
                           or encode_schedule_entries_python)


def check_schedule_entry(data: bytes | memoryview, at: int = 0) -> str | None:
    """The problem with the entry at byte ``at`` of ``data``, or None when it verifies."""
    if len(data) - at < ENTRY_SIZE_BYTES:
        return f"torn entry: {len(data) - at} of {ENTRY_SIZE_BYTES} bytes"
    fields = _WHOLE.unpack_from(data, at)
    if zlib.crc32(data[at : at + FIELDS.size]) != fields[7]:
        return "crc mismatch"
    if fields[4] != MAGIC:
        return f"bad magic 0x{fields[4]:04x}"
    if fields[5] != VERSION:
        return f"unknown version {fields[5]}"
    return None


def decode_schedule_entry(data: bytes | memoryview) -> RawEntry:
    """Decode exactly 32 bytes; raises ValueError naming the problem."""
    if len(data) != ENTRY_SIZE_BYTES:
        raise ValueError(f"entry of {len(data)} bytes, expected {ENTRY_SIZE_BYTES}")
    problem = check_schedule_entry(data)
    if problem:
        raise ValueError(problem)
    return RawEntry(*_WHOLE.unpack_from(data, 0)[:4])


def iter_schedule_entries(data: bytes | memoryview) -> Iterator[tuple[int, RawEntry | None]]:
    """Yield (index, entry) for every whole 32-byte entry of ``data``; entry is None for one that
    fails verification (the caller decides what a bad entry means)."""
    view = memoryview(data)
    crc32 = zlib.crc32
    head_size = FIELDS.size
    for index, fields in enumerate(_WHOLE.iter_unpack(view[: len(view) - len(view) % ENTRY_SIZE_BYTES])):
        at = index * ENTRY_SIZE_BYTES
        if (fields[4] != MAGIC or fields[5] != VERSION
                or crc32(view[at : at + head_size]) != fields[7]):
            yield index, None
        else:
            yield index, RawEntry(fields[0], fields[1], fields[2], fields[3])


def file_name(bucket_ms: int) -> str:
    """The schedule file name of the bucket starting at ``bucket_ms``."""
    return f"{bucket_ms:020d}{FILE_SUFFIX}"
