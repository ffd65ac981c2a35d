"""Opening a delay store: from the newest checkpoint to a consistent state, and the full-scan
rebuild of schedule files that recovery and ``load_bucket`` fall back to.

Steps (the checkpoint gives the delay-log offset C, the done watermark W and the epoch E):

1. Open the delay log verifying records from C (logstore cuts a torn or corrupt tail).
2. List the schedule directories: index every ``.sched`` file of a bucket >= W with its entry
   count (cutting a torn partial entry), delete every file of a bucket < W (retention that a
   crash interrupted), and count entries per day.
3. Replay the delay log from C: each record is counted as pending and its schedule entry is
   re-appended to its bucket's file after cutting that file at its first entry at or past C (or
   its first bad entry). So every entry at or past C is rebuilt, never trusted, and indexes come
   out as they were.
4. Check the schedule files against the checkpoint's per-day entry counts. A day that does not
   match (a file lost, truncated or holding entries of records the delay log lost) is first cut at
   C bucket by bucket; if it still does not match, all its schedule files are rebuilt by scanning
   the whole delay log (slow: this is the path for lost files, not for crashes).
5. Read the touched logs of epochs >= E; in those buckets, every entry whose first dispatch or
   cancel record has epoch >= E was done after the checkpoint, so it is taken off the counts (the
   subject comes from its delay-log record).

Cost: the replay is bounded by ``checkpoint_every_bytes`` of delay log plus the dispatch/cancel
records of one epoch, and the listing is one ``stat`` per bucket file, so a restart does not
scan the pending messages.
"""

from __future__ import annotations

import logging
import os
import zlib
from collections import defaultdict
from dataclasses import dataclass, field

from delayserver.storage import schedule_entry
from delayserver.storage.delay_checkpoint import DelayCheckpoint, decode_delay_checkpoint
from delayserver.storage.delay_record import decode_delay_header
from delayserver.storage.done_log import DoneLog, done_key
from delayserver.storage.done_record import KIND_CANCELLED, KIND_DISPATCHED
from delayserver.storage.errors import ConfigMismatch, CorruptCheckpoint, StoreFailed
from delayserver.storage.layout import DAY_MS, Layout, parse_bucket_file_name
from delayserver.storage.schedule import FlushFailed, ScheduleFiles, is_enospc
from delayserver.storage.stats import PendingCounts
from logstore import (
    CheckpointStore,
    CorruptRecord,
    DiskFull,
    LogConfig,
    LogStoreError,
    Opener,
    RecoveryReport,
    SegmentedLog,
    fsync_directory,
)

log = logging.getLogger(__name__)

REPLAY_WRITE_EVERY_RECORDS = 500_000  # replayed entries held in memory (32 B each) before
# they are written: one default checkpoint interval (~210,000 records) fits, one open per bucket
CHECKPOINTS_KEPT = 3  # CheckpointStore's default; touched logs are kept for as many epochs


@dataclass(frozen=True)
class DelayRecoveryReport:
    """What opening the store found and did."""

    checkpoint_sequence: int | None  # the checkpoint recovery started from (None: none usable)
    replay_from_offset: int  # delay-log offset the replay started at
    records_replayed: int  # delay-log records re-indexed (entries rebuilt) after the checkpoint
    delay_log: RecoveryReport  # logstore's report: records verified, a tail cut
    delay_log_lost_bytes: int  # bytes the checkpoint said were durable but the log lacks (0)
    schedule_entries_cut: int  # entries cut from schedule files before being rebuilt
    days_rebuilt: tuple[int, ...]  # days whose schedule files were rebuilt by a full scan
    done_records_replayed: int  # dispatches/cancels after the checkpoint taken off the counts
    buckets_retired: int  # files of done buckets (below the watermark) deleted
    repairs: tuple[str, ...]  # torn or corrupt tails cut, invariants found broken


@dataclass
class RecoveredState:
    """Everything ``DelayStore`` takes over from recovery."""

    log: SegmentedLog
    schedule: ScheduleFiles
    done: DoneLog
    counts: PendingCounts
    done_before_ms: int
    chunk_size_bytes: int
    chunk_max_bucket: dict[int, int]
    report: DelayRecoveryReport
    replayed_bytes: int  # delay-log bytes replayed: they count towards the next checkpoint
    repairs: list[str] = field(default_factory=list)


def load_checkpoint(checkpoints: CheckpointStore) -> tuple[int | None, DelayCheckpoint | None]:
    """(sequence, payload) of the newest usable checkpoint, or (None, None)."""
    latest = checkpoints.load_latest()
    if latest is None:
        return None, None
    try:
        return latest.sequence, decode_delay_checkpoint(latest.payload)
    except ValueError as exc:
        raise CorruptCheckpoint(latest.path, str(exc)) from exc


def write_entries(schedule: ScheduleFiles, groups: dict[int, bytearray],
                  cut_from_offset: int | None = None, cut_buckets: set[int] | None = None,
                  cut_per_day: dict[int, int] | None = None) -> None:
    """Append grouped entries to their bucket files and index them. With ``cut_from_offset``,
    a bucket not yet in ``cut_buckets`` is first cut at that offset (counted in
    ``cut_per_day``). Raises DiskFull or StoreFailed."""
    for bucket, data in groups.items():
        cut_at = None
        if cut_buckets is not None and bucket not in cut_buckets:
            cut_at = cut_from_offset
            cut_buckets.add(bucket)
        try:
            cut = schedule.write_file(bucket, data, cut_from_offset=cut_at)
        except FlushFailed as exc:
            entries = len(data) // schedule_entry.ENTRY_SIZE_BYTES
            if is_enospc(exc):
                raise DiskFull(exc.path, entries) from exc
            raise StoreFailed(exc.path, exc.cause) from exc
        if cut and cut_per_day is not None:
            cut_per_day[bucket // DAY_MS] += cut
        schedule.index.set_count(
            bucket, schedule.index.count(bucket) - cut + len(data) // schedule_entry.ENTRY_SIZE_BYTES)
    groups.clear()


def scan_schedule(layout: Layout, schedule: ScheduleFiles, done_before_ms: int,
                  repairs: list[str]) -> tuple[dict[int, int], int]:
    """Index the schedule files of buckets >= ``done_before_ms`` and delete the files of buckets
    below it. Returns (entries per day, buckets retired)."""
    per_day: dict[int, int] = defaultdict(int)
    retired: set[int] = set()
    for day in layout.list_days():
        directory = layout.day_dir(day)
        with os.scandir(directory) as found:
            names = [(entry.name, entry) for entry in found]
        removed = 0
        for name, entry in names:
            parsed = parse_bucket_file_name(name)
            if parsed is None:
                continue
            bucket, suffix = parsed
            if bucket < done_before_ms:
                os.unlink(entry.path)
                retired.add(bucket)
                removed += 1
                continue
            if suffix != schedule_entry.FILE_SUFFIX:
                continue
            size = entry.stat().st_size
            whole = size - size % schedule_entry.ENTRY_SIZE_BYTES
            if whole != size:
                os.truncate(entry.path, whole)
                repairs.append(f"{entry.path}: cut a torn entry of {size - whole} bytes")
            count = whole // schedule_entry.ENTRY_SIZE_BYTES
            schedule.index.set_count(bucket, count)
            per_day[day] += count
        if removed:
            if removed == len(names):
                os.rmdir(directory)
                fsync_directory(layout.schedule_dir)
            else:
                fsync_directory(directory)
    return per_day, len(retired)


def rebuild_days(log_: SegmentedLog, schedule: ScheduleFiles, days: set[int],
                 done_before_ms: int) -> int:
    """Rebuild every schedule file of ``days`` from a scan of the whole delay log (records of
    buckets >= ``done_before_ms``). Returns the entries written."""
    layout = schedule.layout
    for day in days:
        buckets = set(schedule.index.buckets_of_day(day))
        directory = layout.day_dir(day)
        if os.path.isdir(directory):
            for name in os.listdir(directory):
                parsed = parse_bucket_file_name(name)
                if parsed and parsed[1] == schedule_entry.FILE_SUFFIX:
                    buckets.add(parsed[0])
        for bucket in buckets:
            schedule.forget(bucket)
            schedule.truncate_bucket(bucket)
    groups: dict[int, bytearray] = defaultdict(bytearray)
    written = 0
    for offset, body in log_.iterate():
        try:
            deliver_at, bucket, id_bytes, _subject, _ = decode_delay_header(body)
        except ValueError as exc:
            raise CorruptRecord(log_.directory, offset, str(exc)) from exc
        if bucket // DAY_MS not in days or bucket < done_before_ms:
            continue
        groups[bucket] += schedule_entry.encode_schedule_entry(
            deliver_at, offset, len(body), zlib.crc32(id_bytes))
        written += 1
        if written % REPLAY_WRITE_EVERY_RECORDS == 0:
            write_entries(schedule, groups)
    write_entries(schedule, groups)
    log.warning("delay store: rebuilt the schedule files of days %s from the delay log "
                "(%d entries)", sorted(days), written)
    return written


def _subject_at(log_: SegmentedLog, offset: int, bucket_ms: int, id_hash: int) -> str | None:
    """The subject of the record at ``offset`` if it is the record the done record names."""
    try:
        body = log_.read(offset)
        _deliver_at, bucket, id_bytes, subject, _ = decode_delay_header(body)
    except (LogStoreError, ValueError):
        return None
    if bucket != bucket_ms or zlib.crc32(id_bytes) != id_hash:
        return None
    return subject


def _replay_done(done: DoneLog, log_: SegmentedLog, counts: PendingCounts, epoch: int,
                 done_before_ms: int, repairs: list[str]) -> int:
    """Take dispatches and cancels written at or after ``epoch`` off the counts."""
    touched: set[int] = set()
    for touched_epoch in done.touched_epochs():
        if touched_epoch >= epoch:
            touched.update(done.read_touched(touched_epoch))
    applied = 0
    for bucket in sorted(touched):
        if bucket < done_before_ms:
            continue
        first_epoch: dict[int, int] = {}
        for kind in (KIND_DISPATCHED, KIND_CANCELLED):
            for record in done.read_records(bucket, kind):
                key = done_key(record.delay_log_offset, record.id_hash)
                seen = first_epoch.get(key)
                if seen is None or record.epoch < seen:
                    first_epoch[key] = record.epoch
        for key, record_epoch in first_epoch.items():
            if record_epoch < epoch:
                continue
            offset, hashed = key >> 32, key & 0xFFFFFFFF
            subject = _subject_at(log_, offset, bucket, hashed)
            if subject is None:
                repairs.append(f"bucket {bucket}: done record for offset {offset} names no "
                               f"readable record of the bucket; not counted")
                continue
            if counts.remove(bucket, subject):
                applied += 1
            else:
                repairs.append(f"bucket {bucket}: done record for offset {offset} but the hour "
                               f"has no pending message; not counted")
    return applied


def recover(layout: Layout, bucket_ms: int, log_config: LogConfig, opener: Opener,
            checkpoints: CheckpointStore) -> RecoveredState:
    """Open everything under ``layout`` consistently (module docstring)."""
    repairs: list[str] = []
    sequence, checkpoint = load_checkpoint(checkpoints)
    if checkpoint is not None and checkpoint.bucket_ms != bucket_ms:
        raise ConfigMismatch("bucket_ms", checkpoint.bucket_ms, bucket_ms)
    epoch = sequence or 0
    start = checkpoint.delay_log_offset if checkpoint else 0
    done_before = checkpoint.done_before_ms if checkpoint else 0
    delay_log = SegmentedLog(layout.delaylog_dir, log_config, opener=opener,
                             verify_from_offset=start)
    lost_bytes = 0
    if start > delay_log.end_offset:
        lost_bytes = start - delay_log.end_offset
        log.error("delay store: the checkpoint says the delay log was durable up to %d but it "
                  "ends at %d: %d bytes of acknowledged messages are lost", start,
                  delay_log.end_offset, lost_bytes)
        repairs.append(f"delay log ends {lost_bytes} bytes before the checkpoint offset {start}")
        start = delay_log.end_offset
    replay_from = max(start, delay_log.first_offset)
    chunk_size = log_config.segment_size_bytes_max
    chunks: dict[int, int] = {}
    if checkpoint is not None and checkpoint.chunk_size_bytes == chunk_size:
        chunks = dict(checkpoint.max_bucket_per_chunk)
    rescan_chunks = checkpoint is not None and checkpoint.chunk_size_bytes != chunk_size
    counts = PendingCounts(checkpoint.pending_per_hour if checkpoint else None,
                           checkpoint.pending_per_subject if checkpoint else None)

    schedule = ScheduleFiles(layout, opener)
    listed_per_day, retired = scan_schedule(layout, schedule, done_before, repairs)

    cut_per_day: dict[int, int] = defaultdict(int)
    cut_buckets: set[int] = set()
    groups: dict[int, bytearray] = defaultdict(bytearray)

    def write_groups() -> None:
        write_entries(schedule, groups, start, cut_buckets, cut_per_day)

    replayed = 0
    scan_from = delay_log.first_offset if rescan_chunks else replay_from
    for offset, body in delay_log.iterate(scan_from):
        try:
            deliver_at, bucket, id_bytes, subject, _ = decode_delay_header(body)
        except ValueError as exc:
            raise CorruptRecord(delay_log.directory, offset, str(exc)) from exc
        chunk = offset // chunk_size
        if chunks.get(chunk, -1) < bucket:
            chunks[chunk] = bucket
        if offset < replay_from:
            continue
        if bucket < done_before:
            repairs.append(f"record at offset {offset} after the checkpoint is filed in bucket "
                           f"{bucket}, below the done watermark {done_before}; skipped")
            continue
        counts.add(bucket, subject)
        groups[bucket] += schedule_entry.encode_schedule_entry(
            deliver_at, offset, len(body), zlib.crc32(id_bytes))
        replayed += 1
        if replayed % REPLAY_WRITE_EVERY_RECORDS == 0:
            write_groups()
    write_groups()

    days_rebuilt: set[int] = set()
    if checkpoint is not None:
        expected = checkpoint.entries_per_day

        def mismatched(days) -> set[int]:
            return {day for day in days
                    if listed_per_day.get(day, 0) - cut_per_day.get(day, 0) != expected.get(day, 0)}

        suspicious = mismatched(set(expected) | set(listed_per_day))
        for day in suspicious:
            for bucket in schedule.index.buckets_of_day(day):
                if bucket not in cut_buckets:
                    cut_per_day[day] += schedule.cut_from_offset(bucket, start)
                    cut_buckets.add(bucket)
        days_rebuilt = mismatched(suspicious)
        for day in sorted(days_rebuilt):
            repairs.append(f"day {day}: schedule files hold "
                           f"{listed_per_day.get(day, 0) - cut_per_day.get(day, 0)} entries from "
                           f"before the checkpoint, expected {expected.get(day, 0)}; rebuilt")
        if days_rebuilt:
            rebuild_days(delay_log, schedule, days_rebuilt, done_before)

    done = DoneLog(layout, opener, epoch)
    done_replayed = _replay_done(done, delay_log, counts, epoch, done_before, repairs)
    done.delete_touched_before(epoch - (CHECKPOINTS_KEPT - 1))
    repairs.extend(done.repairs)
    done.repairs.clear()
    cut_total = sum(cut_per_day.values())
    report = DelayRecoveryReport(
        checkpoint_sequence=sequence,
        replay_from_offset=replay_from,
        records_replayed=replayed,
        delay_log=delay_log.recovery,
        delay_log_lost_bytes=lost_bytes,
        schedule_entries_cut=cut_total,
        days_rebuilt=tuple(sorted(days_rebuilt)),
        done_records_replayed=done_replayed,
        buckets_retired=retired,
        repairs=tuple(repairs),
    )
    return RecoveredState(delay_log, schedule, done, counts, done_before, chunk_size, chunks,
                          report, delay_log.end_offset - replay_from, repairs)
