"""The done journal: every dispatch record, cancel record and move of the done watermark, in
commit order, in one ``logstore.SegmentedLog`` under ``<data_dir>/donelog/``.

The per-bucket ``.dispatched`` / ``.cancelled`` files are scattered over up to ~1 M buckets;
the journal gives them one ordered log with one offset space, which is what a slave copies and
applies to its own bucket files (docs/REPLICATION.md 8.1). It is appended in the same store call
that writes the bucket files, after them, and fsynced before that call returns.

Each journal record is one logstore record (logstore's framing gives it a length, a magic, a
version and a CRC-32). Its body, all integers big-endian::

    Offset | Size  | Field
    -------+-------+-------------------------------------------------------------------
    0      | 1     | kind: 1 = dispatched, 2 = cancelled, 3 = done watermark, 4 = handed,
           |       | 5 = dropped (handed entries a broker dropped at a cancel), 6 = handed
           |       | entries (the entries of one hand-off)
    1      | 1     | body_version: 1
    2      | 2     | reserved: 0
    4      | 8     | bucket_ms: u64; kinds 1, 2 and 5: the bucket the entries are filed in;
           |       | kind 3: the new done watermark (every bucket below it is finished);
           |       | kind 4: handed_until_ms (a message due at or before it may have been
           |       | handed to a realtime broker that holds it until its due time);
           |       | kind 6: the latest due time of its entries
    12     | 4     | entry_count: u32 (N; 0 for kinds 3 and 4)
    16     | 4     | subject_count: u32 (K; 0 for kinds 3, 4, 5 and 6)
    20     | 16*N  | entries: delay_log_offset u64, id_hash u32, index u32 (as in done_record)
    ...    | ...   | K times: subject_length u16, subject UTF-8, count u32: how many of the
           |       | entries are of that subject (for the pending counts; "" when unreadable)

A handed record (kind 4) was written and fsynced, and replicated, by releases before kind 6,
before the delay server sent a hand-off ahead of the due time (``hold``) of messages due up to
it, so a restarted or promoted server knows which cancels must ask the broker
(docs/REPLICATION.md 16); the highest one counts. This release reads them and writes none
(``DelayStore.record_handed`` stays for tests and tools).
A dropped record (kind 5) names entries recorded as dispatched (handed off) that their broker
dropped at a cancel (``DelayStore.record_dropped``): each gets a cancel record in its bucket's
``.cancelled`` file beside its dispatch record (the pending counts do not change: the dispatch
took it off them), so a later cancel, after a restart or on a promoted slave too, answers
``already_cancelled``. A handed-entries record (kind 6) names the entries of a hand-off, by
delay-log offset and id hash (index: the entry's in its bucket file, for tools; entries of
several buckets may share one record); written, fsynced and replicated before that ``hold``
is sent, while every slave reads kind 6 (the master asks the replication gate first; this
release writes no handed record, kind 4, any more: it reads those an earlier release wrote):
after a restart or failover only the entries it names, not every message due by a handed
record, make a cancel ask the broker (review s11 rvho-7). A server older than kind 4
(5, 6) refuses a journal holding one (unknown kind): replication gates all three
(``GATED_KINDS``, serverkit.kind_gate), so a master writes them only while every slave reads
them, and serves them to none that does not.

What it does NOT guarantee: a crash between the bucket files' write and the journal's loses the
journal record, so a slave may dispatch that message again after a failover (the realtime
broker's de-duplication absorbs it); records are not compressed (16 bytes per entry).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

HEADER = struct.Struct(
    ">B"  # kind
    "B"  # body_version
    "H"  # reserved
    "Q"  # bucket_ms
    "I"  # entry_count
    "I"  # subject_count
)
ENTRY = struct.Struct(
    ">Q"  # delay_log_offset
    "I"  # id_hash
    "I"  # index
)
SUBJECT_LENGTH = struct.Struct(">H")  # subject_length
SUBJECT_COUNT = struct.Struct(">I")  # count
BODY_VERSION = 1
KIND_DISPATCHED = 1
KIND_CANCELLED = 2
KIND_DONE_BEFORE = 3
KIND_HANDED = 4
KIND_DROPPED = 5
KIND_HANDED_IDS = 6
KINDS = (KIND_DISPATCHED, KIND_CANCELLED, KIND_DONE_BEFORE, KIND_HANDED, KIND_DROPPED,
         KIND_HANDED_IDS)
# The kinds replication gates on what a slave reads (serverkit.kind_gate): those newer than
# the fetch's ``reads``. A new kind is added here too: a master writes it only while every
# slave reads it, and serves it to none that does not.
GATED_KINDS = frozenset((KIND_HANDED, KIND_DROPPED, KIND_HANDED_IDS))


def gated_kind_at(data: bytes, body_at: int) -> int | None:
    """The gated kind of the journal record body at ``body_at`` of ``data`` (whole records,
    as a fetch ships them), or None (an older kind, or past the end)."""
    if body_at >= len(data):
        return None
    kind = data[body_at]
    return kind if kind in GATED_KINDS else None


DIRECTORY = "donelog"


@dataclass(frozen=True)
class JournalRecord:
    """One decoded journal record."""

    kind: int
    bucket_ms: int
    offsets: tuple[int, ...] = ()
    id_hashes: tuple[int, ...] = ()
    indexes: tuple[int, ...] = ()
    per_subject: tuple[tuple[str, int], ...] = ()  # subject ("" = unreadable) -> entries


def encode_journal_record(kind: int, bucket_ms: int, offsets: list[int], id_hashes: list[int],
                          indexes: list[int], per_subject: dict[str | None, int]) -> bytes:
    """The body of one journal record; ValueError for a field out of range."""
    if kind not in KINDS:
        raise ValueError(f"journal kind {kind} is not one of {KINDS}")
    if not len(offsets) == len(id_hashes) == len(indexes):
        raise ValueError("journal entries need one offset, id hash and index each")
    subjects = [((subject or "").encode("utf-8"), count) for subject, count in
                per_subject.items() if count]
    try:
        parts = [HEADER.pack(kind, BODY_VERSION, 0, bucket_ms, len(offsets), len(subjects))]
        parts.extend(map(ENTRY.pack, offsets, id_hashes, indexes))
        for raw, count in subjects:
            parts += [SUBJECT_LENGTH.pack(len(raw)), raw, SUBJECT_COUNT.pack(count)]
    except struct.error as exc:
        raise ValueError(f"a journal field is out of range: {exc}") from None
    return b"".join(parts)


def decode_journal_record(body: bytes) -> JournalRecord:
    """Parse a journal record body; ValueError naming the defect."""
    if len(body) < HEADER.size:
        raise ValueError(f"journal record of {len(body)} bytes is shorter than its header")
    kind, version, _reserved, bucket_ms, count, subject_count = HEADER.unpack_from(body)
    if kind not in KINDS:
        raise ValueError(f"unknown journal kind {kind}")
    if version != BODY_VERSION:
        raise ValueError(f"unknown journal body version {version}")
    at = HEADER.size
    if at + count * ENTRY.size > len(body):
        raise ValueError(f"{count} entries run past the {len(body)}-byte record")
    fields = [ENTRY.unpack_from(body, at + i * ENTRY.size) for i in range(count)]
    at += count * ENTRY.size
    per_subject = []
    for _ in range(subject_count):
        if at + SUBJECT_LENGTH.size > len(body):
            raise ValueError("journal record ends inside a subject length")
        (length,) = SUBJECT_LENGTH.unpack_from(body, at)
        at += SUBJECT_LENGTH.size
        if at + length + SUBJECT_COUNT.size > len(body):
            raise ValueError("journal record ends inside a subject")
        subject = body[at:at + length].decode("utf-8")
        (number,) = SUBJECT_COUNT.unpack_from(body, at + length)
        per_subject.append((subject, number))
        at += length + SUBJECT_COUNT.size
    if at != len(body):
        raise ValueError(f"{len(body) - at} bytes after the journal record's last field")
    return JournalRecord(kind, bucket_ms, tuple(f[0] for f in fields),
                         tuple(f[1] for f in fields), tuple(f[2] for f in fields),
                         tuple(per_subject))


def journal_done_keys(body: bytes) -> list[int]:
    """The done keys (``done_log.done_key``: delay-log offset and id hash) of a journal record
    body's entries, read without decoding the rest (a handed-entries record, at open and as
    it is appended); ValueError when they run past the body."""
    count = HEADER.unpack_from(body)[4]
    end = HEADER.size + count * ENTRY.size
    if end > len(body):
        raise ValueError(f"{count} entries run past the {len(body)}-byte record")
    return [(offset << 32) | id_hash
            for offset, id_hash, _index in ENTRY.iter_unpack(body[HEADER.size:end])]


def journal_bucket(body: bytes) -> tuple[int, int]:
    """(kind, bucket_ms) of a journal record body, read from its header alone."""
    kind, _version, _reserved, bucket_ms, _count, _subjects = HEADER.unpack_from(body)
    return kind, bucket_ms


__all__ = ["DIRECTORY", "ENTRY", "GATED_KINDS", "HEADER", "JournalRecord", "KIND_CANCELLED",
           "KIND_DISPATCHED", "KIND_DONE_BEFORE", "KIND_DROPPED", "KIND_HANDED",
           "KIND_HANDED_IDS", "decode_journal_record", "encode_journal_record",
           "gated_kind_at", "journal_bucket", "journal_done_keys"]
