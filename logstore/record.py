"""Record framing for every segmented log.

A record is a 12-byte header followed by the body the caller gave (opaque bytes)::

    Offset | Size | Field
    -------+------+---------------------------------------------------------------
    0      | 4    | body_length: u32 big-endian, bytes after the header
    4      | 4    | crc32: u32 big-endian, CRC-32 (zlib) of bytes 0..3 and 8..end
    8      | 2    | magic: 0x514D ("QM")
    10     | 1    | version: 1
    11     | 1    | attributes: reserved, 0
    12     | N    | body

A record's offset in a log is the byte position of its header in the log's whole byte stream,
so a read by offset is one seek. What it does NOT guarantee: the CRC detects torn writes and bit
rot, not tampering; records are not encrypted or compressed; a body is at most
``record_size_bytes_max`` and a larger stored length is treated as corruption, never allocated.
"""

from __future__ import annotations

import struct
import zlib

HEADER = struct.Struct(
    ">I"  # body_length: bytes of body after the header
    "I"  # crc32 over body_length and everything from magic to the end of the body
    "H"  # magic
    "B"  # version
    "B"  # attributes (reserved)
)
HEADER_SIZE_BYTES = HEADER.size
MAGIC = 0x514D
VERSION = 1
_LENGTH = struct.Struct(">I")
_TAIL = struct.Struct(">HBB")
_TAIL_BYTES = _TAIL.pack(MAGIC, VERSION, 0)


def encode_record(body: bytes) -> bytes:
    """Frame ``body`` as one record (header + body)."""
    length = _LENGTH.pack(len(body))
    crc = zlib.crc32(body, zlib.crc32(_TAIL_BYTES, zlib.crc32(length)))
    return length + _LENGTH.pack(crc) + _TAIL_BYTES + body


def encode_record_into(out: bytearray, body: bytes) -> int:
    """Append the framed ``body`` to ``out``; returns the framed size in bytes."""
    length = _LENGTH.pack(len(body))
    crc = zlib.crc32(body, zlib.crc32(_TAIL_BYTES, zlib.crc32(length)))
    out += length
    out += _LENGTH.pack(crc)
    out += _TAIL_BYTES
    out += body
    return HEADER_SIZE_BYTES + len(body)


def check_header(header: bytes, record_size_bytes_max: int) -> tuple[int, int, str | None]:
    """Parse a 12-byte header; returns (body_length, crc, problem or None)."""
    body_length, crc, magic, version, _attributes = HEADER.unpack(header)
    if magic != MAGIC:
        return body_length, crc, f"bad magic 0x{magic:04x}"
    if version != VERSION:
        return body_length, crc, f"unknown version {version}"
    if body_length > record_size_bytes_max:
        return body_length, crc, (
            f"stored length {body_length} exceeds record_size_bytes_max {record_size_bytes_max}"
        )
    return body_length, crc, None


def crc_matches(header: bytes, body: bytes | memoryview, crc: int) -> bool:
    """True when ``crc`` covers the header's length, magic, version, attributes and ``body``."""
    computed = zlib.crc32(body, zlib.crc32(header[8:12], zlib.crc32(header[0:4])))
    return computed == crc


def decode_record(data: bytes, record_size_bytes_max: int) -> tuple[bytes, int]:
    """Decode one whole record from the start of ``data``; returns (body, framed size).

    Raises ValueError naming the problem when the bytes are not a valid record.
    """
    if len(data) < HEADER_SIZE_BYTES:
        raise ValueError(f"{len(data)} bytes is shorter than the {HEADER_SIZE_BYTES}-byte header")
    header = data[:HEADER_SIZE_BYTES]
    body_length, crc, problem = check_header(header, record_size_bytes_max)
    if problem:
        raise ValueError(problem)
    end = HEADER_SIZE_BYTES + body_length
    if len(data) < end:
        raise ValueError(f"record needs {end} bytes, only {len(data)} present")
    body = data[HEADER_SIZE_BYTES:end]
    if not crc_matches(header, body, crc):
        raise ValueError("crc mismatch")
    return bytes(body), end
