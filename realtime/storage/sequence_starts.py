"""The message log's snapshot for a slave that joins after retention (docs/REPLICATION.md 8.2):
every subject's next sequence at the master's message-log start.

A slave that cannot copy the message log from offset 0 starts its copy at the master's log
start and derives its consumer logs from the records it copies. A subject whose every record
lies below that start would be unknown to it, and once promoted it would number that subject's
next message 0, below the cursors the copied pull log holds (those messages would never be
handed out). So it first installs this snapshot: each subject's consumer log is filled with
holes up to the sequence the subject has at the log start. It travels in ``snapshot`` answers
(never stored as a file)::

    Offset | Size | Field
    -------+------+---------------------------------------------------------------
    0      | 4    | magic: 0x514D5353 ("QMSS")
    4      | 1    | version: 1
    5      | 3    | reserved, 0
    8      | 8    | covers_offset: u64, the master's message-log start it describes
    16     | N    | body: msgpack array [[subject str, sequence uint]], sorted by subject:
           |      | the sequence of the subject's first record at or after covers_offset,
           |      | or its end when it has none
    16+N   | 4    | crc32: u32, CRC-32 (zlib) of bytes 0..16+N

What it does NOT guarantee: it says nothing of the records themselves (the slave copies them
from covers_offset), and it is right only for that one log start: a slave whose copy begins
elsewhere must ask again.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import msgpack

HEADER = struct.Struct(
    ">I"  # magic
    "B"  # version
    "3x"  # reserved
    "Q"  # covers_offset
)
CRC = struct.Struct(">I")
MAGIC = 0x514D5353
VERSION = 1
SEQUENCE_MAX = (1 << 64) - 1


@dataclass(frozen=True)
class StartsSnapshot:
    """What a ``snapshot`` answer of the message log ships: ``sequence`` names it (the log
    start it covers), ``payload`` is the encoded starts."""

    sequence: int
    payload: bytes


def encode_sequence_starts(starts: dict[str, int], covers_offset: int) -> bytes:
    """The payload for ``starts`` (subject -> sequence) at message-log offset ``covers_offset``."""
    assert 0 <= covers_offset <= SEQUENCE_MAX, covers_offset
    assert all(0 <= sequence <= SEQUENCE_MAX for sequence in starts.values()), starts
    head = HEADER.pack(MAGIC, VERSION, covers_offset)
    body = msgpack.packb(sorted(starts.items()), use_bin_type=True)
    return head + body + CRC.pack(zlib.crc32(head + body))


def decode_sequence_starts(payload: bytes) -> tuple[dict[str, int], int]:
    """(subject -> sequence, covers_offset); ValueError names what is wrong."""
    if len(payload) < HEADER.size + CRC.size:
        raise ValueError(f"sequence starts of {len(payload)} bytes, below the "
                         f"{HEADER.size + CRC.size}-byte minimum")
    (crc,) = CRC.unpack_from(payload, len(payload) - CRC.size)
    if zlib.crc32(payload[:-CRC.size]) != crc:
        raise ValueError("sequence starts: crc mismatch")
    magic, version, covers_offset = HEADER.unpack_from(payload)
    if magic != MAGIC or version != VERSION:
        raise ValueError(f"sequence starts: bad magic 0x{magic:08x} or version {version}")
    try:
        pairs = msgpack.unpackb(payload[HEADER.size:-CRC.size], raw=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise ValueError(f"sequence starts: body does not decode: {exc}") from exc
    starts: dict[str, int] = {}
    for pair in pairs if isinstance(pairs, list) else [None]:
        if (not isinstance(pair, list) or len(pair) != 2 or not isinstance(pair[0], str)
                or type(pair[1]) is not int or not 0 <= pair[1] <= SEQUENCE_MAX):
            raise ValueError(f"sequence starts: bad entry {pair!r}")
        starts[pair[0]] = pair[1]
    return starts, covers_offset


__all__ = ["MAGIC", "StartsSnapshot", "VERSION", "decode_sequence_starts", "encode_sequence_starts"]
