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
from itertools import accumulate, groupby, repeat
from operator import add
from typing import Callable

from logstore import CorruptRecord
from logstore.checkpoint import Checkpoint, CheckpointStore
from logstore.record import HEADER_SIZE_BYTES
from realtime.storage.consumer_log import ConsumerLog
from realtime.storage.control_record import (
    KIND_CANCELLED, KIND_DROPPED, control_kind, decode_cancelled, decode_dropped, decode_held,
)
from realtime.storage.dedup import DedupIndex
from realtime.storage.errors import CorruptEntry
from realtime.storage.held import (
    DROPPED_SEQUENCE, HELD_SEQUENCE, Held, HeldSet, is_held_control, message_header,
    note_control,
)
from realtime.storage.message_log import MessageLog
from realtime.storage.message_record import decode_message_headers
from realtime.storage.recovery import held_below, held_from_checkpoint
from realtime.storage.store_checkpoint import (
    StoreCheckpoint, checkpoint_offset, decode_store_checkpoint,
)

log = logging.getLogger(__name__)


def index_copied(bodies: list[bytes], first_offset: int, consumer_logs: dict[str, ConsumerLog],
                 open_consumer_log: Callable[[str], ConsumerLog], dedup: DedupIndex,
                 directory: str, held: HeldSet) -> int:
    """Append the consumer-log entries and dedup ids of copied record ``bodies`` (the first at
    message-log offset ``first_offset``, the others following), column by column as a master's
    commit does (``ConsumerLog.append_columns``, ``DedupIndex.add_many``). A subject's first
    record past its log's end (a copy that began at the master's retention point) is preceded
    by holes; a record whose sequence its log already holds is an inconsistent copy
    (CorruptRecord). Held and cancelled records update ``held``, a visible-message record is
    indexed as a message and takes its held record out, so a promoted slave holds what its
    master held. Returns the records indexed."""
    sizes = list(map(len, bodies))
    offsets = list(accumulate(map(add, sizes, repeat(HEADER_SIZE_BYTES)), initial=first_offset))
    del offsets[-1]  # the end of the last record
    columns = decode_message_headers(bodies)
    if columns is None:  # control records among them, or a defect to name
        columns, offsets, sizes = _decode_one_by_one(bodies, offsets, held, dedup, directory)
    timestamps, sequences, blooms, subjects, message_ids = columns
    keys: list[str] = []
    pending: dict[str, list[tuple[int, int]]] = {}  # subject -> slices not written yet
    expected: dict[str, int] = {}  # subject -> the sequence its next record must have

    def write(subject: str) -> None:
        slices = pending.pop(subject, None)
        if slices:
            consumer_logs[subject].append_columns(slices, timestamps, offsets, sizes, blooms)

    start = 0
    for subject, run in groupby(subjects):
        stop = start + len(list(run))
        keys += dedup.keys(subject, message_ids[start:stop])
        if subject not in expected:
            if subject not in consumer_logs:
                consumer_logs[subject] = open_consumer_log(subject)
            expected[subject] = consumer_logs[subject].end
        for piece_start, piece_stop in _numbered_runs(sequences, start, stop):
            first = sequences[piece_start]
            if first > expected[subject]:
                write(subject)
                consumer_logs[subject].fill_holes(first)
            elif first < expected[subject]:
                raise CorruptRecord(directory, offsets[piece_start], (
                    f"copied record of {subject!r} has sequence {first}, but its consumer log "
                    f"already ends at {expected[subject]}"))
            pending.setdefault(subject, []).append((piece_start, piece_stop))
            expected[subject] = first + piece_stop - piece_start
        start = stop
    for subject in list(pending):
        write(subject)
    dedup.add_many(keys, sequences, timestamps)
    return len(bodies)


def _numbered_runs(sequences: list[int], start: int, stop: int) -> list[tuple[int, int]]:
    """[start, stop) of ``sequences`` cut where a sequence is not its predecessor's + 1: one
    piece, checked by one list compare, for a subject's records of a commit."""
    first = sequences[start]
    if sequences[start:stop] == list(range(first, first + stop - start)):
        return [(start, stop)]
    pieces = []
    for at in range(start + 1, stop + 1):
        if at == stop or sequences[at] != sequences[at - 1] + 1:
            pieces.append((start, at))
            start = at
    return pieces


def _decode_one_by_one(bodies: list[bytes], offsets: list[int], held: HeldSet,
                       dedup: DedupIndex, directory: str,
                       ) -> tuple[tuple[list, list, list, list, list], list[int], list[int]]:
    """``index_copied``'s decode of a copy with control records (or a defect, named here as
    a CorruptRecord at its offset): held, cancelled and dropped records change ``held`` (and
    ``dedup``) in log order, a visible-message record takes its held record out; returns the
    message records' columns (as ``decode_message_headers``), offsets and body sizes."""
    columns: tuple[list, list, list, list, list] = ([], [], [], [], [])
    message_offsets: list[int] = []
    sizes: list[int] = []
    for body, offset in zip(bodies, offsets):
        if is_held_control(body):
            note_control(body, offset, held, dedup, -1, directory)
            continue
        try:
            *fields, held_offset = message_header(body)
        except ValueError as exc:
            raise CorruptRecord(directory, offset, f"copied record: {exc}") from exc
        if held_offset is not None:
            held.pop(held_offset)
        for column, value in zip(columns, fields):
            column.append(value)
        message_offsets.append(offset)
        sizes.append(len(body))
    return columns, message_offsets, sizes


def checkpoints_to(checkpoints: CheckpointStore, offset: int,
                   ) -> Callable[[], StoreCheckpoint | None]:
    """Before a copy is cut at ``offset``: delete every kept checkpoint past it, durably (it
    describes records the cut takes away; once the copy grows past it again, an open or a
    later repair would take it as true even when no checkpoint is written after the cut).
    Returns a loader of the newest checkpoint left that carries a held set (version 3), or
    None; it decodes only when called, on the rare repair path."""
    kept: list[Checkpoint] = []
    past: list[Checkpoint] = []
    for checkpoint in checkpoints.load_all():  # newest first
        try:
            (past if checkpoint_offset(checkpoint.payload) > offset else kept).append(checkpoint)
        except ValueError:
            continue  # unusable anyway: recovery skips it too
    checkpoints.delete(past)

    def newest() -> StoreCheckpoint | None:
        for checkpoint in kept:
            try:
                decoded = decode_store_checkpoint(checkpoint.payload)
            except (ValueError, UnicodeDecodeError) as exc:
                log.warning("checkpoint %s unusable for the repair: %s", checkpoint.path, exc)
                continue
            if decoded.held is not None:
                return decoded
        return None
    return newest


def cut_indexes(message_log: MessageLog, consumer_logs: dict[str, ConsumerLog],
                dedup: DedupIndex, offset: int, held: HeldSet,
                base: Callable[[], StoreCheckpoint | None] = lambda: None) -> int:
    """Before the message log is cut at ``offset``: forget the dedup ids of its records from
    there, cut every consumer-log entry that points at or past it (within a subject entry
    offsets rise with the sequence, visible held messages included), and put back in ``held``
    the held records below it that a cut visible-message or cancelled record had taken out.
    When one of the records from ``offset`` is unreadable (a rotten record is why the copy is
    cut), the dedup index is cleared and the held set rebuilt as recovery does: that of the
    checkpoint ``base()`` (at or below the cut), then the records from it to the cut.
    Returns the entries cut."""
    try:
        _forget_from(message_log, dedup, offset, held)
    except (CorruptRecord, ValueError) as exc:
        log.warning("message store: cut at %d: %s; the dedup index is cleared and the held set "
                    "rebuilt from the checkpoint and the records above it", offset, exc)
        dedup.clear()
        _rebuild_held(message_log, offset, held, dedup, base())
    cut = 0
    for subject, clog in consumer_logs.items():
        try:
            first = clog.find_first(lambda e: not e.is_hole and e.message_log_offset >= offset)
        except CorruptEntry as exc:
            first = exc.sequence
        cut += clog.truncate(first)
    return cut


def _forget_from(message_log: MessageLog, dedup: DedupIndex, offset: int,
                 held: HeldSet) -> None:
    """``cut_indexes``'s walk over the records from ``offset``: their dedup ids and held
    records go, what they took out of the held set below ``offset`` is held again."""
    restore: list[int] = []  # held offsets below the cut to hold again
    for at, body in message_log.iterate_bodies(offset):
        if not is_held_control(body):
            _ts, sequence, _bloom, subject, message_id, held_offset = message_header(body)
            dedup.forget(subject, message_id, sequence)
            if held_offset is not None and held_offset < offset:
                restore.append(held_offset)
        elif (kind := control_kind(body)) == KIND_DROPPED:  # no longer dropped: held again
            _ts, subject, offsets, message_ids = decode_dropped(body)
            restore += [o for o in offsets if o < offset]
            for message_id in message_ids:
                dedup.forget(subject, message_id, DROPPED_SEQUENCE)
        elif kind == KIND_CANCELLED:
            restore += [o for o in decode_cancelled(body)[1] if o < offset]
        else:
            record, _p = decode_held(body)
            held.pop(at)
            dedup.forget(record.subject, record.message_id, HELD_SEQUENCE)
    for held_offset in restore:
        body = message_log.log.read(held_offset)
        record, _p = decode_held(body)
        held.add(Held(held_offset, len(body), record.visible_at_ms, record.tag_bloom,
                      record.subject, record.message_id))
        dedup.add(record.subject, record.message_id, HELD_SEQUENCE, record.timestamp_ms)


def _rebuild_held(message_log: MessageLog, stop_offset: int, held: HeldSet,
                  dedup: DedupIndex, checkpoint: StoreCheckpoint | None) -> None:
    """The held set at ``stop_offset`` (a rare repair: a rotten record at a cut): the held set
    ``checkpoint`` carries, then the records from it to the cut (from the log's start without
    one), passing over a record that fails its CRC; the held and dropped ids in ``dedup``
    again. No record below the checkpoint is read, so rot there loses nothing held, and the
    cost is that of the records above it, not of the whole log."""
    held.clear()
    first = message_log.first_offset
    start = first
    if checkpoint is not None and checkpoint.held is not None:
        start = max(checkpoint.message_log_offset, first)
        held_from_checkpoint(checkpoint, first, held)
    held_below(message_log, held, start, stop_offset, dedup)
    for item in list(held.by_offset.values()):
        try:
            timestamp_ms = message_log.timestamp_at(item.offset)
        except CorruptRecord:
            continue  # the held set still knows the id; given up when due (held_unreadable)
        dedup.add(item.subject, item.message_id, HELD_SEQUENCE, timestamp_ms)


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


__all__ = ["checkpoints_to", "cut_indexes", "index_copied", "install_sequence_starts", "sequence_starts"]
