"""Recovery of the derived indexes (consumer logs, dedup index) from the message log on open.

Steps, in order (the message log has already cut its own torn tail):

1. Each consumer log: cut files out of place (a gap, a short middle file), a torn last entry, and
   every entry from the first that fails its CRC (checked from the checkpoint's end sequence of
   that subject, or from the start without a checkpoint).
2. Cut entries that point at or beyond the message log's end (its tail was cut).
3. Choose where to replay: the checkpoint's message-log offset, unless there is no usable
   checkpoint, it lies beyond the message log's end, or a consumer log ends before the end sequence
   the checkpoint recorded for it; then replay everything (a full rebuild). Replay starts earlier
   when the dedup window reaches further back.
4. Replay records in order. An entry that already matches is kept; a missing one is appended; a
   different one (a stale index, or a record of a dropped batch whose sequence a later batch
   reused) is cut together with everything after it and rewritten. A record whose sequence lies
   beyond its consumer log's end means the index lost entries before the replay range: the
   replay restarts as a full rebuild. In a full rebuild, sequences whose records were already
   deleted by retention become holes. Control records (``control_record``) replay too: a held
   record joins the held set, a visible-message record is indexed like a message record (it
   is one, its payload written again) and takes its held record out, a cancelled record's
   leave it; so the replay starts at the checkpoint's held_from_offset when that is lower.
   When a record below the checkpoint is corrupt, the replay starts at the checkpoint and
   the held set there is the one the checkpoint carries (version 3; a walk of the records
   below it for an older checkpoint).
5. Entries that no replayed record confirmed are cut; records within ``dedup_window_ms`` of
   ``now_ms`` go into the dedup index.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

from logstore import CorruptRecord, RecoveryReport
from logstore.record import HEADER_SIZE_BYTES
from realtime.storage.consumer_log import ConsumerLog, Entry
from realtime.storage.dedup import DedupIndex
from realtime.storage.errors import CorruptEntry
from realtime.storage.control_record import is_control
from realtime.storage.held import (
    Held, HeldSet, is_held_control, message_header, note_control,
)
from realtime.storage.message_log import MessageLog
from realtime.storage.store_checkpoint import StoreCheckpoint

log = logging.getLogger(__name__)
_REPLAY_BATCH_ENTRIES = 1024  # entries buffered per subject before one write


@dataclass
class SubjectRecovery:
    """What recovery changed in one subject's consumer log."""

    subject: str
    entries_truncated: int = 0  # entries cut (torn, corrupt, past the log end, stale)
    entries_rebuilt: int = 0  # entries written by replay (holes included)
    holes: int = 0  # of those, placeholders for already-deleted messages
    reasons: list[str] = field(default_factory=list)


@dataclass
class StoreRecoveryReport:
    """The outcome of opening a message store."""

    message_log: RecoveryReport  # logstore's report: records verified, tail truncation if any
    checkpoint_offset: int | None  # the usable checkpoint's message-log offset, None if none
    full_rebuild_reason: str | None  # why every consumer log was replayed from the start
    replay_from_offset: int = 0
    records_replayed: int = 0
    dedup_ids_rebuilt: int = 0
    subjects: dict[str, SubjectRecovery] = field(default_factory=dict)  # only changed subjects

    @property
    def full_rebuild(self) -> bool:
        return self.full_rebuild_reason is not None


class _Restart(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def recover(
    message_log: MessageLog,
    consumer_logs: dict[str, ConsumerLog],
    open_consumer_log: Callable[[str], ConsumerLog],
    checkpoint: StoreCheckpoint | None,
    checkpoint_problem: str | None,
    dedup: DedupIndex,
    now_ms: int,
    held: HeldSet,
) -> StoreRecoveryReport:
    """Make every consumer log, the dedup index and the held set agree with the message log."""
    report = StoreRecoveryReport(message_log.log.recovery,
                                 checkpoint.message_log_offset if checkpoint else None, None)

    def subject_report(subject: str) -> SubjectRecovery:
        return report.subjects.setdefault(subject, SubjectRecovery(subject))

    end = message_log.end_offset
    for subject, clog in consumer_logs.items():
        for problem in clog.layout_problems:
            subject_report(subject).reasons.append(problem)
        verify_from = checkpoint.end_sequences.get(subject, clog.begin) if checkpoint else clog.begin
        bad = clog.first_valid_bad_entry(verify_from)
        if bad is not None:
            cut = clog.truncate(bad)
            subject_report(subject).entries_truncated += cut
            subject_report(subject).reasons.append(f"{cut} entries cut from corrupt sequence {bad}")
        past = _find_first(clog, lambda e: not e.is_hole and e.message_log_offset >= end,
                           subject_report)
        cut = clog.truncate(past)
        if cut:
            subject_report(subject).entries_truncated += cut
            subject_report(subject).reasons.append(
                f"{cut} entries from sequence {past} pointed at or past the message-log end {end}")

    reason = _full_rebuild_reason(message_log, consumer_logs, checkpoint, checkpoint_problem)
    start = message_log.first_offset if reason else max(checkpoint.replay_from_offset,
                                                        message_log.first_offset)
    start = min(start, _dedup_start_offset(message_log, now_ms - dedup.window_ms))
    replay = (message_log, consumer_logs, open_consumer_log, dedup, now_ms, held)
    try:
        try:
            _replay(*replay, start, full=reason is not None, subject_report=subject_report,
                    report=report)
        except CorruptRecord as exc:
            # Only records below the checkpoint escape logstore's verification at open; a bad
            # one inside the dedup window costs that part of the dedup index, not the store.
            if reason is not None or checkpoint is None or start >= checkpoint.message_log_offset:
                raise
            log.warning("dedup rebuild stopped at a corrupt record below the checkpoint "
                        "(%s); replaying from the checkpoint only", exc)
            dedup.clear()
            held.clear()
            # The replay starts at the checkpoint, whose records logstore verified at open.
            # The held set there: the checkpoint's own (version 3), else a walk of the records
            # below it from its held watermark that passes over a rotten record.
            start = max(checkpoint.message_log_offset, message_log.first_offset)
            if checkpoint.held is not None:
                held_from_checkpoint(checkpoint, message_log.first_offset, held)
                log.warning("held records: %d taken from the checkpoint at %d instead of the "
                            "records below it", len(held), checkpoint.message_log_offset)
            else:
                held_below(message_log, held, max(checkpoint.replay_from_offset,
                                                  message_log.first_offset), start)
            _replay(*replay, start, full=False, subject_report=subject_report, report=report)
    except _Restart as restart:
        reason = restart.reason
        dedup.clear()
        held.clear()
        start = message_log.first_offset
        _replay(*replay, start, full=True, subject_report=subject_report, report=report)
    # Finding each first sequence may run into a corrupt entry the replay did not cover: it is
    # cut with everything after it, and a full replay writes them again (a second full replay
    # at most, when the cut sat below the first replayed record and left holes to fill).
    for _ in range(3):
        if not _set_first_sequences(message_log, consumer_logs, subject_report):
            break
        reason = reason or "corrupt consumer-log entries found below the replay range"
        dedup.clear()
        held.clear()
        start = message_log.first_offset
        _replay(*replay, start, full=True, subject_report=subject_report, report=report)
    if reason and checkpoint and checkpoint.message_log_offset <= message_log.end_offset:
        # Sequences the checkpoint knew of whose records retention deleted entirely become
        # holes, so a subject never reuses a sequence. (A checkpoint past the log's end, whose
        # tail was cut, no longer describes it: those sequences are assigned again.)
        for subject, end_sequence in checkpoint.end_sequences.items():
            clog = consumer_logs.get(subject)
            if clog is None:
                clog = consumer_logs[subject] = open_consumer_log(subject)
            holes = clog.fill_holes(end_sequence)
            if holes:
                subject_report(subject).holes += holes
                subject_report(subject).entries_rebuilt += holes
        _set_first_sequences(message_log, consumer_logs, subject_report)
    report.full_rebuild_reason = reason
    report.replay_from_offset = start
    report.dedup_ids_rebuilt = len(dedup)
    for subject_recovery in report.subjects.values():
        log.warning("message store recovery: subject %r: %s", subject_recovery.subject,
                    subject_recovery)
    return report


def _set_first_sequences(message_log: MessageLog, consumer_logs: dict[str, ConsumerLog],
                         subject_report) -> bool:
    """Set every consumer log's first sequence; True when a corrupt entry had to be cut."""
    first = message_log.first_offset
    cut = False
    for clog in consumer_logs.values():
        end = clog.end
        clog.first_sequence = _find_first(
            clog, lambda e: not e.is_hole and e.message_log_offset >= first, subject_report)
        cut = cut or clog.end != end
    return cut


def _find_first(clog: ConsumerLog, predicate, subject_report) -> int:
    """``clog.find_first``, cutting the log at any corrupt entry the search runs into."""
    while True:
        try:
            return clog.find_first(predicate)
        except CorruptEntry as exc:
            cut = clog.truncate(exc.sequence)
            subject_report(clog.subject).entries_truncated += cut
            subject_report(clog.subject).reasons.append(
                f"{cut} entries cut from corrupt sequence {exc.sequence}")


def _full_rebuild_reason(message_log: MessageLog, consumer_logs: dict[str, ConsumerLog],
                         checkpoint: StoreCheckpoint | None, problem: str | None) -> str | None:
    if checkpoint is None:
        return problem or "no checkpoint"
    if checkpoint.message_log_offset > message_log.end_offset:
        return (f"checkpoint offset {checkpoint.message_log_offset} is past the message-log end "
                f"{message_log.end_offset}")
    for subject, end_sequence in sorted(checkpoint.end_sequences.items()):
        clog = consumer_logs.get(subject)
        have = clog.end if clog else 0
        if have < end_sequence:
            return (f"consumer log of {subject!r} ends at {have}, before the checkpoint's "
                    f"{end_sequence}")
    return None


def _dedup_start_offset(message_log: MessageLog, cutoff_ms: int) -> int:
    """The base of the newest segment whose first record is at or before ``cutoff_ms``: every
    record before it is older than the dedup window (timestamps are assumed non-decreasing)."""
    start = message_log.first_offset
    for info in message_log.segments():
        if info.size_bytes == 0 or message_log.timestamp_at(info.base_offset) > cutoff_ms:
            break
        start = info.base_offset
    return start


def held_from_checkpoint(checkpoint: StoreCheckpoint, first_offset: int,
                         held: HeldSet) -> None:
    """Add to ``held`` the checkpoint's held set (version 3): no record below the checkpoint
    is read, so rot there neither loses a held message nor holds a dropped one again. An
    entry below the log's start (a hard cap deleted its record after the checkpoint; it
    traced that) is not held."""
    assert checkpoint.held is not None
    for entry in checkpoint.held:
        if entry[0] >= first_offset:
            held.add(Held(*entry))


def held_below(message_log: MessageLog, held: HeldSet, start: int, stop: int,
               dedup: DedupIndex | None = None) -> None:
    """Rebuild ``held`` from the control and visible-message records in [start, stop), passing
    over a record that fails its CRC (its header still gives its length) and stopping at a bad
    header; what it could not read is logged. A rotten held record is not held again (its
    fields cannot be trusted); a rotten visible-message or cancelled record leaves its held
    record held, so it is made visible (again) at its due time rather than lost. ``dedup``,
    when given, learns the held and dropped ids walked over (a slave's repair)."""
    offset = start
    while offset < stop:
        try:
            body, next_offset = message_log.log.read_with_next(offset)
        except CorruptRecord as exc:
            rotten = message_log.log.read_unverified(offset)
            if rotten is None:
                log.error("held records: the walk of [%d, %d) stops at %d (%s); held records "
                          "from there are not held again", start, stop, offset, exc)
                return
            log.error("held records: passed over a corrupt record in [%d, %d) (%s)", start,
                      stop, exc)
            offset += HEADER_SIZE_BYTES + len(rotten)
            continue
        try:
            if is_held_control(body):
                note_control(body, offset, held, dedup, -1, message_log.directory)
            elif is_control(body):
                held.pop(message_header(body)[5])  # a visible-message record
        except (CorruptRecord, ValueError) as exc:
            log.error("held records: passed over an unreadable control record at %d (%s)",
                      offset, exc)
        offset = next_offset


def _replay(message_log, consumer_logs, open_consumer_log, dedup: DedupIndex, now_ms: int,
            held: HeldSet, start: int, *, full: bool, subject_report,
            report: StoreRecoveryReport) -> None:
    pending: dict[str, list[Entry]] = defaultdict(list)
    seen: dict[str, int] = {}  # subject -> next sequence after the last replayed record
    replayed_ids: dict[str, list[tuple[int, str]]] = defaultdict(list)
    cutoff_ms = now_ms - dedup.window_ms

    def flush(subject: str) -> None:
        entries = pending.pop(subject, None)
        if entries:
            consumer_logs[subject].append_entries(entries)

    def cut(subject: str, sequence: int, why: str) -> None:
        flush(subject)
        removed = consumer_logs[subject].truncate(sequence)
        if removed:
            subject_report(subject).entries_truncated += removed
            subject_report(subject).reasons.append(f"{removed} entries from sequence {sequence} {why}")
        ids = replayed_ids[subject]
        while ids and ids[-1][0] >= sequence:
            dedup.forget(subject, ids[-1][1], ids.pop()[0])

    def index(subject: str, sequence: int, timestamp_ms: int, offset: int, size: int,
              bloom: int, message_id: str | None = None, at: int | None = None) -> None:
        """One entry from a replayed record at ``offset`` (``at``, when given, names where)."""
        clog = consumer_logs.get(subject)
        if clog is None:
            clog = consumer_logs[subject] = open_consumer_log(subject)
        entry = Entry(timestamp_ms, offset, size, bloom)
        where = offset if at is None else at
        indexed_end = clog.end + len(pending[subject])
        if sequence > indexed_end:
            if not full:
                raise _Restart(f"record of {subject!r} sequence {sequence} at offset {where} "
                               f"but its consumer log ends at {indexed_end}")
            flush(subject)
            holes = clog.fill_holes(sequence)
            subject_report(subject).holes += holes
            subject_report(subject).entries_rebuilt += holes
        elif sequence < clog.begin:
            return
        elif sequence < indexed_end:
            flush(subject)
            try:
                matches = clog.entry(sequence) == entry
            except CorruptEntry:
                matches = False
            if not matches:
                cut(subject, sequence, f"disagreed with the record at offset {where}")
        if sequence == clog.end + len(pending[subject]):
            pending[subject].append(entry)
            subject_report(subject).entries_rebuilt += 1
            if len(pending[subject]) >= _REPLAY_BATCH_ENTRIES:
                flush(subject)
        seen[subject] = sequence + 1
        if message_id is not None and timestamp_ms > cutoff_ms:
            dedup.add(subject, message_id, sequence, timestamp_ms)
            replayed_ids[subject].append((sequence, message_id))

    count = 0
    for offset, body in message_log.iterate_bodies(start):
        count += 1
        if is_held_control(body):
            note_control(body, offset, held, dedup, cutoff_ms, message_log.directory)
            continue
        try:
            timestamp_ms, sequence, bloom, subject, message_id, held_offset = message_header(body)
        except ValueError as exc:
            raise CorruptRecord(message_log.directory, offset,
                                f"bad message record: {exc}") from exc
        if held_offset is not None:
            held.pop(held_offset)  # a visible-message record: its held record is not held
        index(subject, sequence, timestamp_ms, offset, len(body), bloom, message_id)
    for subject in list(pending):
        flush(subject)
    for subject, clog in consumer_logs.items():
        if subject in seen:
            cut(subject, seen[subject], "were not confirmed by any replayed record")
        else:
            stale = _find_first(clog, lambda e: not e.is_hole and e.message_log_offset >= start,
                                subject_report)
            cut(subject, stale, f"pointed at offset {start} or later with no record there")
    report.records_replayed = count
    # Drop the no-op entries of subjects replay only verified.
    for subject in list(report.subjects):
        item = report.subjects[subject]
        if not (item.entries_truncated or item.entries_rebuilt or item.reasons):
            del report.subjects[subject]
