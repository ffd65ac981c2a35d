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
``name_unconsumed`` (payload -> trace members), so the server can trace each as given up.
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
from realtime.storage.message_record import decode_message_record

log = logging.getLogger(__name__)


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


def _note_unconsumed(message_log: MessageLog, doomed: list[DeletedSegment],
                     keep_sequences: Mapping[str, int],
                     name: Callable[[bytes], str | None] | None, report: RetentionReport) -> None:
    """Count (and name) the records of hard-capped ``doomed`` segments at or after the lowest
    sequence a pull-log group of their subject still needs: they are given up on."""
    capped = [d for d in doomed if d.reason != "retention"]
    if not capped or not keep_sequences:
        return
    for segment in capped:
        try:
            for offset, body in message_log.log.iterate(segment.base_offset):
                if offset >= segment.end_offset:
                    break
                record = decode_message_record(body)
                keep = keep_sequences.get(record.subject)
                if keep is None or record.subject_sequence < keep:
                    continue
                report.unconsumed_deleted += 1
                named = name(record.payload) if name is not None else None
                if named is not None:
                    report.unconsumed_names.append(named)
        except (CorruptRecord, ValueError) as exc:  # the rest of the segment cannot be named
            log.warning("message log: segment %s deleted by the hard cap has an unreadable "
                        "record; its later records are not counted as given up: %s",
                        segment.path, exc)


def apply_retention(message_log: MessageLog, consumer_logs: dict[str, ConsumerLog],
                    config: StoreConfig, now_ms: int,
                    keep_sequences: Mapping[str, int],
                    name_unconsumed: Callable[[bytes], str | None] | None = None,
                    ) -> RetentionReport:
    """Delete what the rules above allow; returns the report."""
    report = RetentionReport()
    keep_offset, keep_subject = _keep_offset(consumer_logs, keep_sequences)
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
        _note_unconsumed(message_log, doomed, keep_sequences, name_unconsumed, report)
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
