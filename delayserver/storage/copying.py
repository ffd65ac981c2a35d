"""A delay store as a replica (docs/REPLICATION.md 8): its two replicated logs, the delay log and
the done journal (``done_journal``), on the master's side (what a fetch reads) and the slave's
(applying what it copied to its own schedule, bucket files, pending counts and watermark).

``DelayStore`` mixes in ``CopyingMixin``; ``delay_copy`` and ``done_copy`` are the two logs as
``serverkit.replica_log.CopyStore``. Synchronous, on the store's one thread (delay-io), no clock.

A slave files a copied message in the bucket the master filed it in (the record says), skips
one below its done watermark (as recovery does), and applies a dispatch or cancel record to its
bucket files and counts as the master's store call did. The watermark follows the master's
journal; the counts of hours below it are dropped if a copy that began late still shows some.
A copy is not cut back in place: a slave whose delay log or journal diverges from its master's
starts both again from the master's (``CopyReset``; the server's ``ReplicatedLog`` pair says
``empties``/``reset_with``, so the follower resets the delay log, which empties the journal,
whichever of the two diverged), which costs a full copy and is rare (a rejoining master with an
unreplicated tail, or a rotten record).
"""

from __future__ import annotations

import logging
import os
import shutil
import struct
import zlib
from collections import Counter, deque
from typing import TYPE_CHECKING, Any, Callable

from delayserver.storage.delay_record import decode_delay_header
from delayserver.storage.done_journal import (
    DIRECTORY,
    KIND_CANCELLED,
    KIND_DISPATCHED,
    KIND_DONE_BEFORE,
    KIND_DROPPED,
    KIND_HANDED,
    KIND_HANDED_IDS,
    decode_journal_record,
    encode_journal_record,
    journal_bucket,
    journal_done_keys,
)
from delayserver.storage.errors import StoreFailed
from delayserver.storage.layout import HOUR_MS
from logstore import (CopyReset, CorruptRecord, DiskFull, LogConfig, LogWriteFailed,
                      SegmentedLog, UndecodableRecord)
from logstore.record import HEADER_SIZE_BYTES, split_records

if TYPE_CHECKING:
    from delayserver.storage.bucket_reads import ScheduleEntry
    from delayserver.storage.store import DelayStore

log = logging.getLogger(__name__)

JOURNAL_SEGMENT_SIZE_BYTES_MAX = 4 << 20  # small segments: retention frees them sooner


class DoneJournal:
    """The done journal's log and, per segment, the highest bucket its records name, so that
    segments wholly below the done watermark can go, the highest handed record's time
    (``handed_until_ms``) and the entries the handed-entries records name (``handed``, as
    done keys; all scanned at open). A handed or handed-entries record counts as naming its
    time: its segment stays until the watermark passes it; the entries of a handed-entries
    record are forgotten with its segment (as a reopen would)."""

    def __init__(self, data_dir: str, opener: Any) -> None:
        self.log = SegmentedLog(os.path.join(data_dir, DIRECTORY), LogConfig(
            segment_size_bytes_max=JOURNAL_SEGMENT_SIZE_BYTES_MAX), opener=opener)
        self.max_bucket: dict[int, int] = {}  # segment base offset -> highest bucket named
        self.handed_until_ms = 0  # the highest handed record's (kind 4)
        self.handed_ids_until_ms = 0  # the highest handed-entries record's (kind 6)
        # done key -> journal offset of the newest handed-entries record naming it, and those
        # records' (offset, keys) in log order, so a retired segment's keys are forgotten
        self.handed: dict[int, int] = {}
        self._handed_records: deque[tuple[int, list[int]]] = deque()
        for offset, body in self.log.iterate():
            try:
                self._note(offset, body)
            except (ValueError, struct.error) as exc:  # CRC-valid, yet unreadable: a bug's
                self.log.close()
                raise CorruptRecord(self.log.directory, offset, f"journal record: {exc}") from exc

    def _note(self, offset: int, body: bytes) -> None:
        kind, bucket = journal_bucket(body)
        if kind == KIND_DONE_BEFORE:
            return
        if kind == KIND_HANDED:
            self.handed_until_ms = max(self.handed_until_ms, bucket)
        elif kind == KIND_HANDED_IDS:
            self.handed_ids_until_ms = max(self.handed_ids_until_ms, bucket)
            keys = journal_done_keys(body)
            self.handed.update(dict.fromkeys(keys, offset))
            self._handed_records.append((offset, keys))
        base = next((s.base_offset for s in reversed(self.log.segments())
                     if s.base_offset <= offset), 0)
        if self.max_bucket.get(base, -1) < bucket:
            self.max_bucket[base] = bucket

    def reset(self, offset: int) -> None:
        """Empty the journal to start at ``offset`` (a slave's copy thrown away): the log and
        everything noted from its records, so nothing of the old copy still counts as named
        or handed (review s12 rvdelay-4: only the segments' buckets were cleared)."""
        self.log.reset(offset)
        self.max_bucket.clear()
        self.handed_until_ms = self.handed_ids_until_ms = 0
        self.handed.clear()
        self._handed_records.clear()

    def append(self, bodies: list[bytes]) -> None:
        """Append and fsync journal records (the master's side)."""
        if not bodies:
            return
        offsets = self.log.append_many(bodies)
        self.log.sync()
        for offset, body in zip(offsets, bodies):
            self._note(offset, body)

    def append_copied(self, offset: int, data: bytes) -> list[bytes]:
        """Append records copied from the master's journal (fsynced); their bodies."""
        bodies = self.log.append_raw(offset, data)
        self.log.sync()
        at = offset
        for body in bodies:
            self._note(at, body)
            at += HEADER_SIZE_BYTES + len(body)
        return bodies

    def retire_below(self, done_before_ms: int) -> int:
        """Delete the leading segments (never the active one) whose records all name buckets
        below the watermark; returns how many."""
        cut = None
        for segment in self.log.segments()[:-1]:
            if self.max_bucket.get(segment.base_offset, -1) >= done_before_ms:
                break
            cut = segment.end_offset
        if cut is None:
            return 0
        deleted = self.log.delete_segments_before(cut)
        for info in deleted:
            self.max_bucket.pop(info.base_offset, None)
        handed, records = self.handed, self._handed_records
        while records and records[0][0] < cut:
            offset, keys = records.popleft()
            for key in keys:
                if handed.get(key) == offset:  # not named again by a later record
                    del handed[key]
        return len(deleted)


def journal_bodies_for_dispatch(bucket: int, offsets: list[int], hashes: list[int],
                                indexes: list[int], per_subject: Counter) -> bytes:
    """The journal record of one bucket's confirmed dispatches."""
    return encode_journal_record(KIND_DISPATCHED, bucket, offsets, hashes, indexes,
                                 dict(per_subject))


class _DelayCopy:
    """The delay log as a ``CopyStore``."""

    def __init__(self, store: DelayStore) -> None:
        self._store = store

    def copy_bounds(self) -> tuple[int, int]:
        log_ = self._store._log
        return log_.first_offset, log_.flushed_offset

    def read_copy(self, offset: int, max_bytes: int) -> bytes:
        return self._store._log.read_raw(offset, max_bytes)

    def append_copy(self, offset: int, data: bytes) -> int:
        return self._store.append_copied_records(offset, data)

    def truncate_copy(self, offset: int) -> int:
        if offset >= self._store._log.end_offset:
            return 0
        raise CopyReset(f"delay log cut at {offset} asked; a delay store starts its copy again")

    def reset_copy(self, offset: int) -> None:
        self._store.reset_copies(offset)

    def verify_copy(self, offset: int, max_bytes: int) -> tuple[int, int | None]:
        next_offset, problem = self._store._log.verify(offset, max_bytes)
        return next_offset, problem.offset if problem is not None else None


class _DoneCopy:
    """The done journal as a ``CopyStore``."""

    def __init__(self, store: DelayStore) -> None:
        self._store = store

    def copy_bounds(self) -> tuple[int, int]:
        log_ = self._store._journal.log
        return log_.first_offset, log_.flushed_offset

    def read_copy(self, offset: int, max_bytes: int) -> bytes:
        return self._store._journal.log.read_raw(offset, max_bytes)

    def append_copy(self, offset: int, data: bytes) -> int:
        return self._store.apply_copied_journal(offset, data)

    def truncate_copy(self, offset: int) -> int:
        if offset >= self._store._journal.log.end_offset:
            return 0
        raise CopyReset(f"done journal cut at {offset} asked; a delay store starts its copy "
                        f"again")

    def reset_copy(self, offset: int) -> None:
        # Records before the master's journal start name only finished buckets, which the
        # next watermark record covers.
        self._store._journal.reset(offset)

    def verify_copy(self, offset: int, max_bytes: int) -> tuple[int, int | None]:
        next_offset, problem = self._store._journal.log.verify(offset, max_bytes)
        return next_offset, problem.offset if problem is not None else None


class CopyingMixin:
    """The replication side of ``DelayStore`` (module docstring)."""

    @property
    def delay_copy(self: DelayStore) -> _DelayCopy:  # type: ignore[misc]
        """The delay log as replication sees it."""
        return _DelayCopy(self)

    @property
    def done_copy(self: DelayStore) -> _DoneCopy:  # type: ignore[misc]
        """The done journal as replication sees it."""
        return _DoneCopy(self)

    def append_copied_records(self: DelayStore, offset: int, data: bytes) -> int:  # type: ignore[misc]
        """A slave: append delay-log records copied from the master at ``offset`` (its end),
        make them durable per the flush mode, and file each in the bucket the master filed it
        in (one below the done watermark is skipped, as recovery does). Returns the new end."""
        self._check_writable()
        delay_log = self._log
        try:
            # The master's bytes as they came where they fit (no second framing), and on a
            # full disk the copy cut back to ``offset``, as the message log's copy is.
            bodies = delay_log.append_raw_durably(offset, data)
        except LogWriteFailed as exc:
            raise self._fail(exc)
        # Decoded (the check of each record) into rows, then filed as the master's commit
        # files its batch (``_index_records``): the same state, in C-level passes.
        rows = []
        done_before, at = self._done_before, offset
        for body in bodies:
            try:
                deliver_at, bucket, id_bytes, subject, _ = decode_delay_header(body)
            except ValueError as exc:
                raise self._fail(CorruptRecord(delay_log.directory, at, f"copied: {exc}"))
            if bucket >= done_before:
                rows.append((deliver_at, at, len(body), zlib.crc32(id_bytes), bucket, subject))
            at += HEADER_SIZE_BYTES + len(body)
        if rows:
            dues, offsets, sizes, hashes, buckets, subjects = map(list, zip(*rows))
            self._index_records(dues, offsets, sizes, hashes, buckets, subjects)
        self._bytes_since_checkpoint += at - offset
        if self._schedule.buffer_full:
            self._flush_schedule_quietly()
        self._maybe_checkpoint()
        return delay_log.end_offset

    def apply_copied_journal(self: DelayStore, offset: int, data: bytes) -> int:  # type: ignore[misc]
        """A slave: append done-journal records copied from the master at ``offset`` and apply
        each to the bucket files, pending counts and watermark. Returns the new end."""
        self._check_writable()
        # Every record is decoded before any is written: one the master framed soundly (its CRC
        # holds) but this server cannot read ends the chunk there (review s12 rvdelay-5: it was
        # appended, then its chunk's records were never applied). The records before it are
        # written and applied, nothing from it on, so the copy stops exactly at it, and the
        # follower reports where and why (UndecodableRecord: the same bytes come back on every
        # fetch, until this server is upgraded; review s13 rvmends-3).
        journal = self._journal.log
        framed, _used, _problem = split_records(data, journal.config.record_size_bytes_max)
        records, at = [], offset
        undecodable: UndecodableRecord | None = None
        for body in framed:  # a framing problem: append_copied below refuses the chunk
            try:
                records.append(decode_journal_record(bytes(body)))
            except ValueError as exc:
                kind, version = (body[0], body[1]) if len(body) >= 2 else (None, None)
                undecodable = UndecodableRecord(journal.directory, at, kind, version,
                                                f"copied journal record: {exc}")
                data = data[:at - offset]
                break
            at += HEADER_SIZE_BYTES + len(body)
        if data:
            try:
                self._journal.append_copied(offset, data)
            except LogWriteFailed as exc:
                raise self._fail(exc)
            self._apply_copied_records(records)
        if undecodable is not None:
            raise undecodable
        return self._journal.log.end_offset

    def _apply_copied_records(self: DelayStore, records: list[Any]) -> None:  # type: ignore[misc]
        """``apply_copied_journal``'s records, appended: to the bucket files, pending counts
        and watermark."""
        for record in records:
            if record.kind == KIND_DONE_BEFORE:
                self._follow_done_before(record.bucket_ms)
            elif record.kind in (KIND_HANDED, KIND_HANDED_IDS):
                continue  # noted by the journal (handed_until_ms, handed) as it was appended
            elif record.bucket_ms < self._done_before:
                continue
            elif record.kind == KIND_DROPPED:
                self._apply_dropped(record)
            else:
                self._apply_done(record)
        self._maybe_checkpoint()

    def _apply_done(self: DelayStore, record: Any) -> None:  # type: ignore[misc]
        state = self._done.state(record.bucket_ms)
        fresh = self._write_fresh(record, record.kind, state.is_done)
        if not fresh:
            return
        per_subject: dict[str | None, int] = {(s or None): n for s, n in record.per_subject}
        removed = self._counts.remove_many(record.bucket_ms, per_subject)
        self._lower_bucket_pending(record.bucket_ms, removed)
        self._done_since_checkpoint += fresh

    def _apply_dropped(self: DelayStore, record: Any) -> None:  # type: ignore[misc]
        """A dropped record (kind 5): cancel records beside the entries' dispatch records, as
        ``record_dropped`` wrote them on the master; the counts do not change."""
        state = self._done.state(record.bucket_ms)
        self._write_fresh(record, KIND_CANCELLED, state.cancelled.__contains__)

    def _write_fresh(self: DelayStore, record: Any, kind: int,  # type: ignore[misc]
                     written: Callable[[int], bool]) -> int:
        """Write, as ``kind``, the entries of a copied done record whose done key ``written``
        does not know yet (a record copied twice writes nothing twice); how many."""
        fresh = [i for i, (o, h) in enumerate(zip(record.offsets, record.id_hashes))
                 if not written((o << 32) | h)]
        if fresh:
            try:
                self._done.write_entries(record.bucket_ms, kind,
                                         [record.offsets[i] for i in fresh],
                                         [record.id_hashes[i] for i in fresh],
                                         [record.indexes[i] for i in fresh])
            except StoreFailed as exc:
                raise self._fail(exc)
        return len(fresh)

    def _follow_done_before(self: DelayStore, bucket_ms: int) -> None:  # type: ignore[misc]
        """The master finished every bucket below ``bucket_ms``: so has this copy. Counts a copy
        still shows below it (one that began after some of its dispatch records) are dropped."""
        if bucket_ms <= self._done_before:
            return
        stale = {hour: n for hour, n in self._counts.per_hour.items() if hour + HOUR_MS <= bucket_ms}
        for hour, n in stale.items():
            del self._counts.per_hour[hour]
            self._counts.total -= n
        if stale:
            log.warning("delay store copy: dropped %d pending count(s) below the master's done "
                        "watermark %d", sum(stale.values()), bucket_ms)
        for bucket in list(self._schedule.index.buckets(self._done_before, bucket_ms - 1)):
            self._bucket_pending[bucket] = 0
        self._advance_watermark(bucket_ms)

    def journal_done(self: DelayStore, bodies: list[bytes]) -> None:  # type: ignore[misc]
        """The master: append journal records written by this call's bucket files, durably. A
        full disk leaves them out (a slave may then dispatch those messages again after a
        failover; the realtime broker's de-duplication absorbs it)."""
        try:
            self._journal.append(bodies)
        except DiskFull as exc:
            log.warning("delay store: %d done-journal record(s) not written, disk full: %s",
                        len(bodies), exc)
        except LogWriteFailed as exc:
            raise self._fail(exc)

    def record_handed(self: DelayStore, until_ms: int) -> None:  # type: ignore[misc]
        """A handed record (kind 4) in the journal, fsynced (nothing when one as high is
        there), as releases before kind 6 wrote before handing off messages due up to
        ``until_ms``; the server writes none any more (tests and tools write one as such a
        release did). A full disk raises ``DiskFull``."""
        self._check_writable()
        if until_ms <= self._journal.handed_until_ms:
            return
        try:
            self._journal.append([encode_journal_record(KIND_HANDED, until_ms, [], [], [], {})])
        except LogWriteFailed as exc:
            raise self._fail(exc)

    def record_handed_entries(self: DelayStore,  # type: ignore[misc]
                              hand_offs: list[tuple[int, list[ScheduleEntry]]]) -> None:
        """The master, before it sends these hand-offs (each: the latest due time, its
        entries): one handed-entries record (kind 6) each in the journal, fsynced once. Unlike
        ``journal_done`` a full disk raises ``DiskFull``: then nothing may be handed off. The
        caller asked the replication gate that every slave reads kind 6."""
        self._check_writable()
        bodies = [encode_journal_record(
            KIND_HANDED_IDS, until_ms, [e.delay_log_offset for e in entries],
            [e.id_hash for e in entries], [e.index for e in entries], {})
            for until_ms, entries in hand_offs]
        try:
            self._journal.append(bodies)
        except LogWriteFailed as exc:
            raise self._fail(exc)

    def handed_ids_until_ms(self: DelayStore) -> int:  # type: ignore[misc]
        """The highest handed-entries record's time in the journal (0: none): a message due
        at or before it that such a record names may be held by a broker."""
        return self._journal.handed_ids_until_ms

    def handed_until_ms(self: DelayStore) -> int:  # type: ignore[misc]
        """The highest handed record's time in the journal (0: none): a message due at or
        before it may be held by a broker (``record_handed``)."""
        return self._journal.handed_until_ms

    def reset_copies(self: DelayStore, delay_start: int) -> None:  # type: ignore[misc]
        """A slave throws its whole copy away: the delay log starts empty at ``delay_start``
        (the master's log start), the journal at 0 (its follower then moves it to the master's
        start), and the schedule, bucket files, touched logs and checkpoints are deleted."""
        self._log.close()
        self._journal.log.close()
        for directory in (self.layout.delaylog_dir, self.layout.schedule_dir,
                          self.layout.touched_dir, self.layout.checkpoint_dir,
                          os.path.join(self.data_dir, DIRECTORY)):
            shutil.rmtree(directory, ignore_errors=True)
        self._reopen()
        self._log.reset(delay_start)
        log.warning("delay store %s: copy thrown away; it starts again at delay-log offset %d",
                    self.data_dir, delay_start)


__all__ = ["CopyingMixin", "DoneJournal", "JOURNAL_SEGMENT_SIZE_BYTES_MAX",
           "journal_bodies_for_dispatch"]
