"""Dispatch and cancel records: the fixed-size records of ``<bucket>.dispatched`` (confirmed
dispatches) and ``<bucket>.cancelled`` (cancels), next to the bucket's ``.sched`` file.

Both files are append-only and fsynced before the call that wrote them returns. All integers are
big-endian::

    Offset | Size | Field
    -------+------+------------------------------------------------------------------
    0      | 8    | delay_log_offset: u64, the record that was dispatched or cancelled
    8      | 4    | id_hash: u32, CRC-32 of its message id (must match the schedule entry)
    12     | 4    | index: u32, the entry's index in the bucket file when this was written
    16     | 4    | epoch: u32, the sequence of the newest checkpoint when this was written
    20     | 2    | magic: 0x444E ("DN")
    22     | 1    | version: 1
    23     | 1    | kind: 1 = dispatched, 2 = cancelled (must match the file's suffix)
    24     | 4    | crc32: u32, CRC-32 (zlib) of bytes 0..23

An entry counts as done when a record of either file has its ``delay_log_offset`` and
``id_hash``; ``index`` is kept for tools. ``epoch`` lets recovery tell the records written after
the newest checkpoint (their effect on the pending counts is replayed) from older ones (already
counted in the checkpoint). A torn or corrupt record is cut on read with every record after it.

What it does NOT guarantee: a record cut for corruption is lost, so that dispatch may happen
again (a cut cancel record lets the message be delivered); matching by offset assumes a delay-log
offset is never reused for a different message, which holds unless an ``async``-mode delay log
lost its unsynced tail in a power failure and the same offset was later reused in the same bucket
by a message with the same id hash.
"""

from __future__ import annotations

import struct
import zlib
from typing import NamedTuple, Sequence

FIELDS = struct.Struct(
    ">Q"  # delay_log_offset
    "I"  # id_hash
    "I"  # index
    "I"  # epoch
    "H"  # magic
    "B"  # version
    "B"  # kind
)
CRC = struct.Struct(">I")  # crc32 of the 24 bytes above
RECORD_SIZE_BYTES = FIELDS.size + CRC.size  # 28
MAGIC = 0x444E
VERSION = 1
KIND_DISPATCHED = 1
KIND_CANCELLED = 2
SUFFIXES = {KIND_DISPATCHED: ".dispatched", KIND_CANCELLED: ".cancelled"}
U32_MAX = (1 << 32) - 1
_WHOLE = struct.Struct(">QIIIHBBI")


class DoneRecord(NamedTuple):
    """One decoded dispatch or cancel record."""

    delay_log_offset: int
    id_hash: int
    index: int
    epoch: int
    kind: int


def encode_done_record(record: DoneRecord) -> bytes:
    """The 28 bytes of ``record``."""
    if record.kind not in SUFFIXES:
        raise ValueError(f"kind {record.kind} is not one of {sorted(SUFFIXES)}")
    for name in ("id_hash", "index", "epoch"):
        if not 0 <= getattr(record, name) <= U32_MAX:
            raise ValueError(f"{name} {getattr(record, name)} is outside u32")
    head = FIELDS.pack(record.delay_log_offset, record.id_hash, record.index, record.epoch,
                       MAGIC, VERSION, record.kind)
    return head + CRC.pack(zlib.crc32(head))


def encode_done_records(offsets: Sequence[int], id_hashes: Sequence[int], indexes: Sequence[int],
                        epoch: int, kind: int) -> bytes:
    """The records of a batch of entries of one kind and epoch, one after the other: the bytes
    ``encode_done_record`` gives for each, made without a ``DoneRecord`` per entry."""
    if kind not in SUFFIXES:
        raise ValueError(f"kind {kind} is not one of {sorted(SUFFIXES)}")
    if not 0 <= epoch <= U32_MAX:
        raise ValueError(f"epoch {epoch} is outside u32")
    pack, pack_crc, crc32 = FIELDS.pack, CRC.pack, zlib.crc32
    parts = []
    try:
        for offset, hashed, index in zip(offsets, id_hashes, indexes):
            head = pack(offset, hashed, index, epoch, MAGIC, VERSION, kind)
            parts.append(head)
            parts.append(pack_crc(crc32(head)))
    except struct.error as exc:
        raise ValueError(f"a done record field is out of range: {exc}") from None
    return b"".join(parts)


def decode_done_record(data: bytes | memoryview, at: int = 0) -> DoneRecord:
    """Decode the 28 bytes at ``at``; raises ValueError naming the problem."""
    if len(data) - at < RECORD_SIZE_BYTES:
        raise ValueError(f"torn record: {len(data) - at} of {RECORD_SIZE_BYTES} bytes")
    offset, hashed, index, epoch, magic, version, kind, crc = _WHOLE.unpack_from(data, at)
    if zlib.crc32(data[at : at + FIELDS.size]) != crc:
        raise ValueError("crc mismatch")
    if magic != MAGIC:
        raise ValueError(f"bad magic 0x{magic:04x}")
    if version != VERSION:
        raise ValueError(f"unknown version {version}")
    if kind not in SUFFIXES:
        raise ValueError(f"unknown kind {kind}")
    return DoneRecord(offset, hashed, index, epoch, kind)


def decode_done_records(data: bytes | memoryview, kind: int) -> tuple[list[DoneRecord], int, str]:
    """Decode a whole file's bytes: (records, bytes of the valid prefix, problem or "").

    Stops at the first torn or bad record, or one of the wrong kind; everything from there on is
    to be cut."""
    records = []
    at = 0
    while at < len(data):
        try:
            record = decode_done_record(data, at)
        except ValueError as exc:
            return records, at, str(exc)
        if record.kind != kind:
            return records, at, f"kind {record.kind} in a file of kind {kind}"
        records.append(record)
        at += RECORD_SIZE_BYTES
    return records, at, ""
