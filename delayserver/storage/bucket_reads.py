"""Reading a delay store's buckets: the schedule entries of a bucket, verified (a bucket whose
file does not match the index is rebuilt from the delay log once), its pending slice, and the
records and payloads they point at. A mixin of ``DelayStore`` (``delayserver.storage.store``),
which owns every field used here; same owner thread (the delay-io thread), no clock reads."""

from __future__ import annotations

import logging
import zlib
from typing import Callable, NamedTuple, Sequence

from delayserver.storage.delay_record import DelayedRecord, decode_delay_header, decode_delay_record
from delayserver.storage.due_records import parse_due_run
from delayserver.storage.errors import CorruptScheduleEntry, StoreFailed
from delayserver.storage.layout import DAY_MS
from delayserver.storage.recovery import rebuild_days
from delayserver.storage.schedule_entry import (
    ENTRY_SIZE_BYTES,
    FIELDS as ENTRY_FIELDS,
    RawEntry,
    check_schedule_entry,
    iter_schedule_entries,
)
from logstore import DiskFull, LogStoreError

log = logging.getLogger("delayserver.storage.store")  # the facade's logger: one name in logs

SUBJECT_CACHE_ENTRIES_MAX = 100_000  # subjects of read records kept for the pending counts
EMPTY_BUCKETS_MAX = 100_000  # buckets known to have nothing pending (for buckets_with_pending)


class ScheduleEntry(NamedTuple):
    """A message's place in the schedule.

    A named tuple, not a frozen dataclass: the delay-io thread makes one per message committed
    or loaded, and a frozen dataclass's ``__init__`` (one ``object.__setattr__`` per field) cost
    about four times as much, the largest single step of a commit's per-message work."""

    bucket_ms: int  # start of the bucket the entry is filed in
    index: int  # position of the entry in the bucket's schedule file
    deliver_at_ms: int  # when the message is due
    delay_log_offset: int  # where its record is in the delay log
    size_bytes: int  # body size of that record
    id_hash: int  # CRC-32 of the message id


class BucketReadsMixin:
    """The reading side of ``DelayStore`` (module docstring)."""

    def _bucket_entries(self, bucket_ms: int, from_offset: int = 0,
                        keep: Callable[[RawEntry], bool] | None = None,
                        count_max: int | None = None) -> list[tuple[int, RawEntry]]:
        """Every entry of the bucket (file + buffer) whose delay-log offset is at least
        ``from_offset`` (and that ``keep`` keeps), verified; at most ``count_max`` of them.
        Entries are in offset order, so a later slice of a bucket starts with a binary search
        and verifies only what it reads. A bucket whose file does not match the index, or holds
        a bad entry, is rebuilt from the delay log once."""
        for attempt in (1, 2):
            data = self._schedule.read_file(bucket_ms)
            expected = self._schedule.disk_count(bucket_ms)
            problem = None
            if len(data) != expected * ENTRY_SIZE_BYTES:
                problem = f"{len(data)} bytes, expected {expected} entries"
            data += self._schedule.buffered(bucket_ms)
            start = _first_entry_from(data, from_offset) if from_offset and not problem else 0
            entries = []
            end = self._log.end_offset
            for index, raw in iter_schedule_entries(memoryview(data)[start * ENTRY_SIZE_BYTES:]):
                index += start
                if raw is None or raw.delay_log_offset >= end:
                    problem = problem or f"entry {index} is corrupt or points past the delay log"
                    break
                if raw.delay_log_offset >= from_offset and (keep is None or keep(raw)):
                    entries.append((index, raw))
                    if len(entries) == count_max:
                        break
            if problem is None:
                return entries
            path = self.layout.schedule_path(bucket_ms)
            if attempt == 2:
                raise CorruptScheduleEntry(path, len(entries), problem)
            log.warning("delay store: %s: %s; rebuilding its day from the delay log", path,
                        problem)
            self._rebuild_days({bucket_ms // DAY_MS})
        raise AssertionError("unreachable")

    def _rebuild_days(self, days: set[int]) -> None:
        # A rebuilt day may get back entries its files had lost: count its buckets afresh.
        for bucket in [b for b in self._bucket_pending if b // DAY_MS in days]:
            del self._bucket_pending[bucket]
        try:
            rebuild_days(self._log, self._schedule, days, self._done_before)
        except (DiskFull, StoreFailed) as exc:
            raise self._fail(exc)

    def load_bucket(self, bucket_ms: int) -> list[ScheduleEntry]:
        """The bucket's entries that are neither dispatched nor cancelled, sorted by
        (deliver_at_ms, index)."""
        return self.load_bucket_slice(bucket_ms)[0]

    def load_bucket_slice(self, bucket_ms: int, from_offset: int = 0,
                          limit: int | None = None) -> tuple[list[ScheduleEntry], int | None]:
        """At most ``limit`` of the bucket's pending entries (neither dispatched nor cancelled),
        taking them in disk order from the first whose delay-log offset is ``from_offset`` or
        more, sorted by (deliver_at_ms, index); and the delay-log offset to continue from, None
        when the slice reached the bucket's end. A server whose window is full loads a large
        bucket slice by slice this way. A slice from offset 0 also counts the bucket's
        pending entries exactly (``bucket_pending``)."""
        self._check_open()
        state = self._done.state(bucket_ms)
        dispatched, cancelled = state.dispatched, state.cancelled

        def is_pending(raw: RawEntry) -> bool:
            key = (raw.delay_log_offset << 32) | raw.id_hash  # done_key, inlined
            return key not in dispatched and key not in cancelled

        # From offset 0 the whole bucket is read, to count it; a later slice reads one entry
        # past the limit (where to resume) and stops.
        pending = self._bucket_entries(
            bucket_ms, from_offset, is_pending,
            None if from_offset == 0 or limit is None else limit + 1)
        if from_offset == 0:
            self._bucket_pending[bucket_ms] = len(pending)
            if not pending:
                if len(self._empty_buckets) >= EMPTY_BUCKETS_MAX:
                    self._empty_buckets.clear()
                self._empty_buckets.add(bucket_ms)
        resume_offset = None
        if limit is not None and len(pending) > limit:
            resume_offset = pending[limit][1].delay_log_offset
            pending = pending[:limit]
        out = [ScheduleEntry(bucket_ms, index, raw.deliver_at_ms, raw.delay_log_offset,
                             raw.size_bytes, raw.id_hash) for index, raw in pending]
        out.sort(key=lambda e: (e.deliver_at_ms, e.index))
        return out, resume_offset

    def read(self, entry: ScheduleEntry) -> DelayedRecord:
        """The entry's message from the delay log, CRC-verified and checked against the entry."""
        self._check_open()
        return self._checked_record(entry, self._log.read(entry.delay_log_offset))

    def read_payloads(self, entries: Sequence[ScheduleEntry]) -> tuple[list[str], list[bytes]]:
        """The subject and the stored payload of each entry's record, in the order given: what
        dispatching needs, read batch-shaped. Records are fetched in delay-log order, runs of
        neighbours with one ``pread`` each (``SegmentedLog.read_runs``), then checked (CRC) and
        parsed against their entry (length, due time, bucket, id hash) a run at a time by
        ``parse_due_run`` (C where built), without decoding the message or building a
        ``DelayedRecord``. A record that fails any check is read alone with ``read``, which
        raises the exact error."""
        self._check_open()
        count = len(entries)
        all_offsets = [entry.delay_log_offset for entry in entries]
        order = sorted(range(count), key=all_offsets.__getitem__)
        ordered = [entries[i] for i in order]
        offsets = [entry.delay_log_offset for entry in ordered]
        sizes = [entry.size_bytes for entry in ordered]
        parsed: list[tuple[str, bytes] | None] = [None] * count
        limit = self.config.record_size_bytes_max
        for data, run_start, i, j in self._log.read_runs(offsets, sizes):
            run = ordered[i:j]
            parsed[i:j] = parse_due_run(
                data, [offset - run_start for offset in offsets[i:j]], sizes[i:j],
                [e.deliver_at_ms for e in run], [e.bucket_ms for e in run],
                [e.id_hash for e in run], limit)
        subjects: list[str] = [""] * count
        payloads: list[bytes] = [b""] * count
        names = self._subject_names
        for position, entry, pair in zip(order, ordered, parsed):
            if pair is None:
                record = self.read(entry)  # raises what is wrong with it
                pair = (record.subject, record.payload)
            subject = pair[0]
            # One str object per subject name, not one per message (they live in batches).
            subjects[position] = names.get(subject) or names.setdefault(subject, subject)
            payloads[position] = pair[1]
        return subjects, payloads

    def _checked_record(self, entry: ScheduleEntry, body: bytes) -> DelayedRecord:
        try:
            record = decode_delay_record(body)
        except ValueError as exc:
            raise CorruptScheduleEntry(self.layout.schedule_path(entry.bucket_ms), entry.index,
                                       f"record does not decode: {exc}") from exc
        if (len(body) != entry.size_bytes or record.deliver_at_ms != entry.deliver_at_ms
                or record.bucket_ms != entry.bucket_ms
                or zlib.crc32(record.message_id.encode("utf-8")) != entry.id_hash):
            raise CorruptScheduleEntry(self.layout.schedule_path(entry.bucket_ms), entry.index,
                                       f"record at offset {entry.delay_log_offset} does not match "
                                       f"the entry")
        self._remember_subject(entry.delay_log_offset, record.subject)
        return record

    def _remember_subject(self, offset: int, subject: str) -> None:
        subjects = self._subjects
        if len(subjects) >= SUBJECT_CACHE_ENTRIES_MAX:
            for old in list(subjects)[: SUBJECT_CACHE_ENTRIES_MAX // 2]:
                del subjects[old]
        subjects[offset] = self._subject_names.setdefault(subject, subject)

    def _subject_of(self, entry: ScheduleEntry) -> str | None:
        """The entry's subject for the pending counts: cached by ``read``, else read again."""
        subject = self._subjects.pop(entry.delay_log_offset, None)
        if subject is not None:
            return subject
        try:
            return decode_delay_header(self._log.read(entry.delay_log_offset))[3]
        except (LogStoreError, ValueError) as exc:
            log.warning("delay store: subject of offset %d unreadable (%s); per-subject pending "
                        "count not lowered", entry.delay_log_offset, exc)
            return None


def _first_entry_from(data: bytes, from_offset: int) -> int:
    """Index of the first entry of ``data`` (a bucket's entries, in delay-log offset order)
    whose delay_log_offset is ``from_offset`` or more, by binary search; 0 (scan it all) when
    the entries around the answer do not verify, so a bad entry cannot hide good ones."""
    whole = len(data) // ENTRY_SIZE_BYTES
    low, high = 0, whole
    while low < high:
        middle = (low + high) // 2
        if ENTRY_FIELDS.unpack_from(data, middle * ENTRY_SIZE_BYTES)[1] < from_offset:
            low = middle + 1
        else:
            high = middle
    for index in (low - 1, low):
        if 0 <= index < whole and check_schedule_entry(data, index * ENTRY_SIZE_BYTES):
            return 0
    return low
