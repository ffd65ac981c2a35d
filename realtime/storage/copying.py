"""A slave's message store: indexing records copied from the master's message log, cutting a
copy back, and the sequence starts a copy that begins at the master's retention point installs
first (docs/REPLICATION.md 8.2, 8.4 and 8.6).

A copied record carries everything its index entry needs (subject, subject sequence, timestamp,
tag bloom, message id), so a slave derives consumer logs and the dedup index from the records
exactly as recovery does, and ends with the master's sequences at the master's offsets.
Synchronous, called by ``MessageStore`` on its owner thread.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Callable

from logstore import CorruptRecord
from logstore.record import HEADER_SIZE_BYTES
from realtime.storage.consumer_log import ConsumerLog, Entry
from realtime.storage.dedup import DedupIndex
from realtime.storage.errors import CorruptEntry
from realtime.storage.message_log import MessageLog
from realtime.storage.message_record import decode_message_header

log = logging.getLogger(__name__)


def index_copied(bodies: list[bytes], first_offset: int, consumer_logs: dict[str, ConsumerLog],
                 open_consumer_log: Callable[[str], ConsumerLog], dedup: DedupIndex,
                 directory: str) -> int:
    """Append the consumer-log entries and dedup ids of copied record ``bodies`` (the first at
    message-log offset ``first_offset``, the others following). A subject's first record past
    its log's end (a copy that began at the master's retention point) is preceded by holes; a
    record whose sequence its log already holds is an inconsistent copy (CorruptRecord).
    Returns the records indexed."""
    pending: dict[str, list[Entry]] = defaultdict(list)
    keys: list[str] = []
    sequences: list[int] = []
    stamps: list[int] = []
    offset = first_offset
    for body in bodies:
        try:
            timestamp_ms, sequence, bloom, subject, message_id, _at = decode_message_header(body)
        except ValueError as exc:
            raise CorruptRecord(directory, offset, f"copied record: {exc}") from exc
        clog = consumer_logs.get(subject)
        if clog is None:
            clog = consumer_logs[subject] = open_consumer_log(subject)
        expected = clog.end + len(pending[subject])
        if sequence > expected:
            entries = pending.pop(subject, None)
            if entries:
                clog.append_entries(entries)
            clog.fill_holes(sequence)
        elif sequence < expected:
            raise CorruptRecord(directory, offset, f"copied record of {subject!r} has sequence "
                                f"{sequence}, but its consumer log already ends at {expected}")
        pending[subject].append(Entry(timestamp_ms, offset, len(body), bloom))
        keys.extend(dedup.keys(subject, (message_id,)))
        sequences.append(sequence)
        stamps.append(timestamp_ms)
        offset += HEADER_SIZE_BYTES + len(body)
    for subject, entries in pending.items():
        if entries:
            consumer_logs[subject].append_entries(entries)
    dedup.add_many(keys, sequences, stamps)
    return len(bodies)


def cut_indexes(message_log: MessageLog, consumer_logs: dict[str, ConsumerLog],
                dedup: DedupIndex, offset: int) -> int:
    """Before the message log is cut at ``offset``: forget the dedup ids of its records from
    there (all of them when one of those records is unreadable: a rotten record is why the
    copy is cut) and cut every consumer-log entry that points at or past it. Returns the
    entries cut."""
    try:
        for _at, _size, (_ts, sequence, _bloom, subject, message_id) in (
                message_log.iterate_headers(offset)):
            dedup.forget(subject, message_id, sequence)
    except CorruptRecord as exc:
        log.warning("message store: cut at %d: %s; the dedup index is cleared", offset, exc)
        dedup.clear()
    cut = 0
    for clog in consumer_logs.values():
        try:
            first = clog.find_first(lambda e: not e.is_hole and e.message_log_offset >= offset)
        except CorruptEntry as exc:
            first = exc.sequence
        cut += clog.truncate(first)
    return cut


def sequence_starts(consumer_logs: dict[str, ConsumerLog], first_offset: int) -> dict[str, int]:
    """The master: every subject's sequence at message-log offset ``first_offset`` (its log
    start): that of its first record at or after it, or its end when it has none. A damaged
    consumer-log entry makes it the subject's first kept sequence, a lower bound that the
    copied records' own holes make up for."""
    starts: dict[str, int] = {}
    for subject, clog in consumer_logs.items():
        try:
            starts[subject] = clog.find_first(
                lambda e: not e.is_hole and e.message_log_offset >= first_offset)
        except CorruptEntry:
            starts[subject] = clog.first_sequence
    return starts


def install_sequence_starts(consumer_logs: dict[str, ConsumerLog],
                            open_consumer_log: Callable[[str], ConsumerLog],
                            starts: dict[str, int]) -> None:
    """A slave whose copy is empty: start every subject's consumer log at the master's
    sequence (holes below it), so a subject whose records all lie below the copy's start goes
    on numbering where the master did."""
    for subject, sequence in starts.items():
        clog = consumer_logs.get(subject)
        if clog is None:
            clog = consumer_logs[subject] = open_consumer_log(subject)
        assert clog.end <= sequence, (subject, clog.end, sequence)
        clog.fill_holes(sequence)
        clog.sync()


__all__ = ["cut_indexes", "index_copied", "install_sequence_starts", "sequence_starts"]
