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

Framing a batch (``frame_records``) and checking copied records (``split_records``) have C twins
in ``logstore/_framing.c``, used when built.

A record's offset in a log is the byte position of its header in the log's whole byte stream,
so a read by offset is one seek. What it does NOT guarantee: the CRC detects torn writes and bit
rot, not tampering; records are not encrypted or compressed; a body is at most
``record_size_bytes_max`` and a larger stored length is treated as corruption, never allocated.
"""

from __future__ import annotations

import struct

from logstore.twins import c_twin

try:
    # zlib-ng's crc32 is the same CRC-32 as zlib's (same polynomial, same values, checked by the
    # codec tests) computed with SIMD: about 4x faster on a 100-byte body. zlib's is the
    # fallback, so a missing wheel slows framing and reads down, never breaks them.
    from zlib_ng.zlib_ng import crc32
except ImportError:  # pragma: no cover - only where the zlib-ng wheel is not installed
    from zlib import crc32

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
_LENGTH_CRC = struct.Struct(">II")  # body_length, crc32: the header's two variable fields
CRC_SEED_CACHE_ENTRIES_MAX = 4096  # distinct body lengths whose CRC seed is kept (~300 KiB at most)


class _CrcSeeds(dict):
    """body_length -> CRC-32 of the header fields the record CRC covers before the body.

    The CRC runs over length, magic, version and attributes, then the body; everything before
    the body depends only on the length, so framing makes one ``crc32(body, seed)`` call per
    record. A dict subclass so ``frame_records`` can look seeds up from C (``map`` over
    ``__getitem__``). Bounded: past the cap a seed is computed and not kept, so a log of
    ever-changing sizes costs CPU, never memory.
    """

    def __missing__(self, body_length: int) -> int:
        seed = crc32(_TAIL_BYTES, crc32(_LENGTH.pack(body_length)))
        if len(self) < CRC_SEED_CACHE_ENTRIES_MAX:
            self[body_length] = seed
        return seed


_CRC_SEEDS = _CrcSeeds()
CRC_SEEDS = _CRC_SEEDS  # for readers that check records of known sizes (SegmentedLog.read_bodies)
LENGTH_CRC = _LENGTH_CRC  # a header's (body_length, crc32)


def encode_record(body: bytes) -> bytes:
    """Frame ``body`` as one record (header + body)."""
    size = len(body)
    return _LENGTH_CRC.pack(size, crc32(body, _CRC_SEEDS[size])) + _TAIL_BYTES + body


def encode_record_into(out: bytearray, body: bytes) -> int:
    """Append the framed ``body`` to ``out``; returns the framed size in bytes."""
    size = len(body)
    out += _LENGTH_CRC.pack(size, crc32(body, _CRC_SEEDS[size]))
    out += _TAIL_BYTES
    out += body
    return HEADER_SIZE_BYTES + size


def frame_records_python(bodies: list[bytes]) -> bytes:
    """Frame every body in ``bodies`` as back-to-back records: the bytes ``encode_record`` makes
    of each, joined. Pure Python; ``frame_records`` is the C twin when it was built.

    The log's write path: appends only collect bodies and this frames a whole write buffer at
    once. Every step is a ``map`` or a slice assignment run in C, so no Python bytecode runs per
    record.
    """
    sizes = list(map(len, bodies))
    crcs = map(crc32, bodies, map(_CRC_SEEDS.__getitem__, sizes))
    # [length+crc, magic+version+attributes, body] per record, interleaved by slice assignment
    # (cheaper than zip/chain), then one join: one copy of every byte.
    parts = [_TAIL_BYTES] * (3 * len(bodies))
    parts[0::3] = map(_LENGTH_CRC.pack, sizes, crcs)
    parts[2::3] = bodies
    return b"".join(parts)


# The same function in C (logstore/_framing.c, optional, chosen by logstore.twins): about 3x
# cheaper per record, which is most of what a log append costs.
frame_records = c_twin("logstore._framing", "frame_records") or frame_records_python
FRAMING = "python" if frame_records is frame_records_python else "c"  # bench.storage prints it


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


def record_crc(data: bytes | memoryview, at: int, body: bytes | memoryview) -> int:
    """The CRC-32 that the header at byte ``at`` of ``data`` must hold for ``body``: over the
    header's length (bytes 0..3), magic, version and attributes (8..11), then the body. The one
    definition of the record CRC for every reader (the C twins compute the same with zlib)."""
    return crc32(body, crc32(data[at + 8 : at + 12], crc32(data[at : at + 4])))


def crc_matches(header: bytes, body: bytes | memoryview, crc: int) -> bool:
    """True when ``crc`` covers the header's length, magic, version, attributes and ``body``."""
    return record_crc(header, 0, body) == crc


def split_records_python(data: bytes | memoryview, record_size_bytes_max: int,
                         ) -> tuple[list[memoryview], int, str | None]:
    """Check the whole records at the start of ``data`` (bytes copied from a log, as
    replication ships them): (their bodies, the bytes they span, the problem that stopped the
    scan or None). None means the scan reached the end of ``data`` or stopped at a record that
    is only partly there, which a reader that asked for a byte budget expects; a problem is
    corruption (bad magic, version or attributes, a length over the limit, a CRC mismatch).
    Pure Python, the bodies memoryviews of ``data``; ``split_records`` is the C twin when it was
    built (the same answers, each body a bytes copy).
    Attributes must be 0, the only value written, so framing the bodies again gives these bytes.
    """
    view = memoryview(data)
    bodies: list[memoryview] = []
    at, size = 0, len(view)
    while size - at >= HEADER_SIZE_BYTES:
        header = view[at : at + HEADER_SIZE_BYTES]
        body_length, crc, problem = check_header(bytes(header), record_size_bytes_max)
        if problem is None and header[11] != 0:
            problem = f"attributes 0x{header[11]:02x} are not 0"
        if problem is not None:
            return bodies, at, problem
        end = at + HEADER_SIZE_BYTES + body_length
        if end > size:
            break
        body = view[at + HEADER_SIZE_BYTES : end]
        if record_crc(view, at, body) != crc:
            return bodies, at, "crc mismatch"
        bodies.append(body)
        at = end
    return bodies, at, None


# The C twin (logstore/_framing.c): a slave checks every copied record and a master every record
# it ships; in Python that is ~8 calls a record, about half of a slave's CPU per copied commit.
split_records = c_twin("logstore._framing", "split_records") or split_records_python


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
