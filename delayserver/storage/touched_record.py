"""The touched log: ``<data_dir>/touched/<epoch, 20 digits>.touched`` lists the buckets that got
a dispatch or cancel record during that epoch (after checkpoint ``epoch`` was written).

Recovery reads the touched logs of the epochs at and after its checkpoint to find the dispatch and
cancel records whose effect on the pending counts the checkpoint does not hold, without opening
every bucket's files. A bucket is written here (and fsynced) before its first dispatch or cancel
record of the epoch. Fixed-size records, big-endian::

    Offset | Size | Field
    -------+------+------------------------------------------------------------------
    0      | 8    | bucket_ms: u64, start of the bucket
    8      | 2    | magic: 0x5442 ("TB")
    10     | 1    | version: 1
    11     | 1    | reserved: 0
    12     | 4    | crc32: u32, CRC-32 (zlib) of bytes 0..11

What it does NOT guarantee: it may list a bucket that got no record (a crash between the two
writes) or list one twice; it is cut at the first torn or corrupt record.
"""

from __future__ import annotations

import struct
import zlib

FIELDS = struct.Struct(
    ">Q"  # bucket_ms
    "H"  # magic
    "B"  # version
    "B"  # reserved
)
CRC = struct.Struct(">I")  # crc32 of the 12 bytes above
RECORD_SIZE_BYTES = FIELDS.size + CRC.size  # 16
MAGIC = 0x5442
VERSION = 1
FILE_SUFFIX = ".touched"


def encode_touched(bucket_ms: int) -> bytes:
    """The 16 bytes recording ``bucket_ms``."""
    head = FIELDS.pack(bucket_ms, MAGIC, VERSION, 0)
    return head + CRC.pack(zlib.crc32(head))


def decode_touched(data: bytes | memoryview) -> tuple[list[int], int, str]:
    """Decode a whole file: (bucket starts, bytes of the valid prefix, problem or "")."""
    buckets = []
    at = 0
    while at < len(data):
        if len(data) - at < RECORD_SIZE_BYTES:
            return buckets, at, f"torn record: {len(data) - at} of {RECORD_SIZE_BYTES} bytes"
        bucket_ms, magic, version, _reserved = FIELDS.unpack_from(data, at)
        (crc,) = CRC.unpack_from(data, at + FIELDS.size)
        if zlib.crc32(data[at : at + FIELDS.size]) != crc:
            return buckets, at, "crc mismatch"
        if magic != MAGIC or version != VERSION:
            return buckets, at, f"bad magic 0x{magic:04x} or version {version}"
        buckets.append(bucket_ms)
        at += RECORD_SIZE_BYTES
    return buckets, at, ""


def file_name(epoch: int) -> str:
    """The touched-log file name of ``epoch``."""
    return f"{epoch:020d}{FILE_SUFFIX}"
