"""Retention of the message log and the consumer-log files below it.

A message-log segment's time is the timestamp of the first record of the segment after it (an
upper bound of its own records' timestamps when timestamps do not go backwards); the active
segment is never deleted. Oldest first, a segment is deleted when:

- it is older than ``retention_hard_cap_ms`` ("hard_cap_age"), or
- the message log is larger than ``retention_hard_cap_bytes`` ("hard_cap_bytes"), or
- it is older than ``retention_ms`` and no entry at or after ``keep_sequences[subject]`` of any
  subject lies in it ("retention"): online groups have consumed it.

The first segment that qualifies for none of these stops the walk, so the log stays contiguous.
Records a hard cap deletes at or after ``keep_sequences[subject]`` (a pull-log group of their
subject had not consumed them) are counted in the report, and named when the caller passes
``name_unconsumed`` (payload -> trace members), so the server can trace each as given up; the
walk goes through the consumer logs, so a damaged record is passed over, not the end of it.
Then every subject's first sequence moves to its first entry inside the retained log, and its
consumer-log files whose entries are all below that are deleted (never its last file, which keeps
the end sequence).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Mapping

from realtime.storage.config import StoreConfig
from realtime.storage.consumer_log import ConsumerLog, DeletedFile
from logstore import CorruptRecord
from realtime.storage.message_log import MessageLog
from realtime.storage.errors import CorruptEntry

log = logging.getLogger(__name__)
NOTE_ENTRIES_PER_READ = 4_096  # consumer-log entries read at once by the hard cap's naming walk


@dataclass(frozen=True)
class DeletedSegment:
    """A message-log segment retention removed, and why."""

    base_offset: int
    end_offset: int
    size_bytes: int
    path: str
    newest_timestamp_ms: int | None  # upper bound of its records' timestamps; None if unknown
    reason: str  # "retention", "hard_cap_age" or "hard_cap_bytes"


@dataclass
class RetentionReport:
    """What one ``apply_retention`` deleted, for the server to log and trace."""

    deleted_segments: list[DeletedSegment] = field(default_factory=list)
    bytes_deleted: int = 0  # message-log bytes plus consumer-log bytes
    message_log_first_offset: int = 0
    first_sequences: dict[str, int] = field(default_factory=dict)  # subjects whose first moved
    consumer_log_files_deleted: dict[str, list[DeletedFile]] = field(default_factory=dict)
    kept_for: str | None = None  # the subject whose group stopped time-based deletion, if any
    unconsumed_deleted: int = 0  # records a hard cap deleted that a pull-log group still needed
    unconsumed_names: list[str] = field(default_factory=list)  # their name_unconsumed results
    # (subject, sequence) of those whose record could not be read or named (named_unconsumed
    # given): the server names them by their location
    unconsumed_unnamed: list[tuple[str, int]] = field(default_factory=list)
    # (subject, message id) of held messages (not yet visible) a hard cap deleted
    held_deleted: list[tuple[str, str]] = field(default_factory=list)

    def __bool__(self) -> bool:
        """True when anything was deleted or any first sequence moved (worth logging)."""
        return bool(self.deleted_segments or self.first_sequences
                    or self.consumer_log_files_deleted)


def _keep_offset(consumer_logs: dict[str, ConsumerLog],
                 keep_sequences: Mapping[str, int]) -> tuple[int | None, str | None]:
    """The lowest message-log offset an online group still needs, and whose it is."""
    lowest: int | None = None
    lowest_subject = None
    for subject, keep in keep_sequences.items():
        clog = consumer_logs.get(subject)
        if clog is None:
            continue
        sequence = max(keep, clog.first_sequence)
        if sequence >= clog.end:
            continue
        offset = clog.entry(sequence).message_log_offset
        if lowest is None or offset < lowest:
            lowest, lowest_subject = offset, subject
    return lowest, lowest_subject


def _note_unconsumed(message_log: MessageLog, consumer_logs: dict[str, ConsumerLog],
                     doomed: list[DeletedSegment], keep_sequences: Mapping[str, int],
                     name: Callable[[bytes], str | None] | None, report: RetentionReport) -> None:
    """Count (and name) the records of the ``doomed`` segments at or after the lowest sequence
    a pull-log group of their subject still needs, when a hard cap deleted any of them: they
    are given up on. (A segment deleted by plain retention holds no such record.)

    Walked through each subject's consumer log rather than the message log: every entry says
    where its record starts, so a damaged record is passed over and the walk goes on with the
    next one (a scan of the message log would stop there, its length unknown). A record that
    cannot be read or named goes to ``unconsumed_unnamed`` as (subject, sequence)."""
    if all(d.reason == "retention" for d in doomed) or not keep_sequences:
        return
    low, high = doomed[0].base_offset, doomed[-1].end_offset
    for subject, keep in keep_sequences.items():
        clog = consumer_logs.get(subject)
        if clog is None:
            continue
        try:
            sequence = max(keep, clog.find_first(
                lambda e: not e.is_hole and e.message_log_offset >= low))
            _note_subject(message_log, clog, sequence, high, name, report)
        except CorruptEntry as exc:  # the index itself is damaged: the rest cannot be found
            log.warning("message log: a consumer log of %r is damaged; records the hard cap "
                        "deleted past it are not counted as given up: %s", subject, exc)


def _note_subject(message_log: MessageLog, clog: ConsumerLog, sequence: int, high: int,
                  name: Callable[[bytes], str | None] | None, report: RetentionReport) -> None:
    """``_note_unconsumed`` for one subject: its entries from ``sequence`` below ``high``."""
    while sequence < clog.end:
        for entry in clog.entries(sequence, min(NOTE_ENTRIES_PER_READ, clog.end - sequence)):
            if not entry.is_hole:
                if entry.message_log_offset >= high:
                    return
                report.unconsumed_deleted += 1
                named = None
                if name is not None:
                    try:
                        record, _size = message_log.read(entry.message_log_offset)
                    except CorruptRecord:
                        pass
                    else:
                        if (record.subject, record.subject_sequence) == (clog.subject, sequence):
                            named = name(record.payload)
                    if named is None:
                        report.unconsumed_unnamed.append((clog.subject, sequence))
                    else:
                        report.unconsumed_names.append(named)
            sequence += 1


def apply_retention(message_log: MessageLog, consumer_logs: dict[str, ConsumerLog],
                    config: StoreConfig, now_ms: int,
                    keep_sequences: Mapping[str, int],
                    name_unconsumed: Callable[[bytes], str | None] | None = None,
                    held_from_offset: int | None = None,
                    ) -> RetentionReport:
    """Delete what the rules above allow; returns the report. Plain retention also keeps
    every segment from ``held_from_offset`` (the lowest held record not yet visible)."""
    report = RetentionReport()
    keep_offset, keep_subject = _keep_offset(consumer_logs, keep_sequences)
    if held_from_offset is not None and (keep_offset is None or held_from_offset < keep_offset):
        keep_offset, keep_subject = held_from_offset, "<held messages>"
    segments = message_log.segments()
    total_bytes = sum(info.size_bytes for info in segments)
    doomed: list[DeletedSegment] = []
    for index, info in enumerate(segments[:-1]):
        following = segments[index + 1]
        newest_ms = message_log.timestamp_at(following.base_offset) if following.size_bytes else None
        age_ms = None if newest_ms is None else now_ms - newest_ms
        if age_ms is not None and age_ms > config.retention_hard_cap_ms:
            reason = "hard_cap_age"
        elif total_bytes > config.retention_hard_cap_bytes:
            reason = "hard_cap_bytes"
        elif age_ms is not None and age_ms > config.retention_ms:
            if keep_offset is not None and info.end_offset > keep_offset:
                report.kept_for = keep_subject
                break
            reason = "retention"
        else:
            break
        total_bytes -= info.size_bytes
        doomed.append(DeletedSegment(info.base_offset, info.end_offset, info.size_bytes,
                                     info.path, newest_ms, reason))
    if doomed:
        _note_unconsumed(message_log, consumer_logs, doomed, keep_sequences, name_unconsumed,
                         report)
        message_log.log.delete_segments_before(doomed[-1].end_offset)
        report.deleted_segments = doomed
        report.bytes_deleted = sum(d.size_bytes for d in doomed)
        for item in doomed:
            log.info("message log: deleted segment %s (%d bytes, %s)", item.path, item.size_bytes,
                     item.reason)
    first_offset = message_log.first_offset
    report.message_log_first_offset = first_offset
    for subject, clog in consumer_logs.items():
        first = clog.find_first(lambda e: not e.is_hole and e.message_log_offset >= first_offset)
        if first != clog.first_sequence:
            clog.first_sequence = first
            report.first_sequences[subject] = first
        deleted = clog.delete_files_below(first)
        if deleted:
            report.consumer_log_files_deleted[subject] = deleted
            report.bytes_deleted += sum(d.size_bytes for d in deleted)
    return report
