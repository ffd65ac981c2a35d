"""``DelayStore``: the delay server's storage facade (synchronous; the server wraps it).

What is where (formats in ``docs/FORMATS.md``):

- the delay log (``delay_record``): every accepted message, in arrival order;
- one schedule file per time bucket (``schedule_entry``): where each message of the bucket is in
  the delay log; derived data, rebuilt from the delay log on open;
- per bucket, a dispatch file and a cancel file (``done_record``), durable before the call that
  wrote them returns; the touched logs (``touched_record``) name the buckets they changed per epoch;
- checkpoints (``delay_checkpoint``): the replay start, the done watermark, the pending counts.

Durability contract:

- ``append`` only encodes and buffers (provisional). ``commit`` writes everything appended since
  the last commit to the delay log and fsyncs once (group commit; ``flush_mode="async"``: writes to
  the OS and lets ``tick`` fsync every ``flush_interval_ms``), THEN indexes the batch. When the
  delay log write fails (``DiskFull``, ``LogWriteFailed``) the batch is dropped and nothing is
  indexed.
- ``record_dispatched`` and ``cancel`` are fsynced before they return.
- ``mark_done_before`` writes a checkpoint before it deletes anything.

Memory: no Python object per pending message outside a loaded bucket. The store holds the bucket
index (16 bytes per bucket), the pending counts (per hour and per subject), the write-behind
buffer of schedule entries (``SCHEDULE_BUFFER_BYTES_MAX``), the done keys of at most
``DONE_CACHE_BUCKETS_MAX`` recently used buckets and the subjects of at most
``SUBJECT_CACHE_ENTRIES_MAX`` recently read records.

Late messages: a message whose bucket is already below the done watermark (its time passed and
the server finished that bucket) is filed in the watermark's bucket, so the server, which
resumes from the watermark, still delivers it at once. ``ScheduleEntry.bucket_ms`` is the bucket
it was filed in.

Not thread-safe: one owner calls it. In the delay server that is the scheduler's delay-io
thread, for every call from opening to ``close`` (the ``observe_fsync`` callback runs there too).
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from itertools import accumulate, repeat
from operator import add
from dataclasses import dataclass
from typing import Callable, Iterable

from delayserver.storage.delay_checkpoint import CHECKPOINT_NAME
from delayserver.storage.delay_record import (
    U64_MAX,
    encode_delay_record,
    frame_delay_records,
    subject_tail,
)
from delayserver.storage.bucket_reads import (
    SUBJECT_CACHE_ENTRIES_MAX,
    BucketReadsMixin,
    ScheduleEntry,
)
from delayserver.storage.copying import CopyingMixin, DoneJournal
from delayserver.storage.done_marks import DoneMarksMixin
from delayserver.storage.watermark import WatermarkMixin
from delayserver.storage.errors import StoreClosed, StoreFailed
from delayserver.storage.layout import DAY_MS, Layout
from delayserver.storage.recovery import CHECKPOINTS_KEPT, recover
from delayserver.storage.schedule import FlushFailed, is_enospc
from delayserver.storage.schedule_entry import encode_schedule_entries
from delayserver.storage.stats import PendingStats
from logstore import (
    CheckpointStore,
    DiskFull,
    LogConfig,
    LogWriteFailed,
    Opener,
    OsFile,
    RecordTooLarge,
)
from logstore.record import HEADER_SIZE_BYTES, frame_records
from logstore.segment_log import FLUSH_MODES

log = logging.getLogger(__name__)

SCHEDULE_FLUSH_INTERVAL_MS = 1_000  # tick() writes the schedule buffer at least this often
DELAY_LOG_WRITE_BUFFER_BYTES_MAX = 64 << 20  # a commit's batch reaches the OS in one write
CANCEL_OUTCOMES = ("cancelled", "already_dispatched", "already_cancelled", "already_past",
                   "unknown")


@dataclass(frozen=True)
class DelayStoreConfig:
    """Settings of a delay store (a bad value fails at start, naming the key and the value)."""

    bucket_ms: int = 60_000  # width of a schedule bucket in ms; must divide a day (86_400_000)
    segment_size_bytes_max: int = 64 << 20  # delay-log segment size in bytes
    flush_mode: str = "sync"  # "sync": commit fsyncs; "async": commit writes, tick() fsyncs
    flush_interval_ms: int = 100  # async mode: longest time in ms between fsyncs
    checkpoint_every_bytes: int = 64 << 20  # delay-log bytes between checkpoints (bounds replay)
    record_size_bytes_max: int = 16 << 20  # largest delay-log record body in bytes
    preallocate_step_bytes: int = 8 << 20  # the active delay-log segment is allocated this far
    # ahead of its data, so a commit's fsync writes no new size (0: not at all)

    def __post_init__(self) -> None:
        if not isinstance(self.bucket_ms, int) or self.bucket_ms < 1 or DAY_MS % self.bucket_ms:
            raise ValueError(f"bucket_ms {self.bucket_ms!r} must be a positive divisor of "
                             f"{DAY_MS} (one day in ms)")
        if self.flush_mode not in FLUSH_MODES:
            raise ValueError(f"flush_mode {self.flush_mode!r} is not one of {FLUSH_MODES}")
        for key in ("segment_size_bytes_max", "flush_interval_ms", "checkpoint_every_bytes",
                    "record_size_bytes_max"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} {value!r} must be an int >= 1")
        if not isinstance(self.preallocate_step_bytes, int) or self.preallocate_step_bytes < 0:
            raise ValueError(f"preallocate_step_bytes {self.preallocate_step_bytes!r} must be "
                             f"an int >= 0")

    def log_config(self) -> LogConfig:
        """The delay log's settings."""
        return LogConfig(
            segment_size_bytes_max=self.segment_size_bytes_max,
            record_size_bytes_max=self.record_size_bytes_max,
            flush_mode=self.flush_mode,
            flush_interval_ms=self.flush_interval_ms,
            write_buffer_bytes_max=DELAY_LOG_WRITE_BUFFER_BYTES_MAX,
            preallocate_step_bytes=self.preallocate_step_bytes,
        )


class _PendingColumns:
    """What ``append`` buffered for the next ``commit``, as columns (one row per message)."""

    __slots__ = ("framed", "sizes", "dues", "buckets", "hashes", "subjects")

    def __init__(self) -> None:
        # The records framed as the delay log writes them (logstore records back to back), in
        # append order: one chunk per ``append_many`` (or ``append``) call; the commit writes
        # them as they are, with no step per record.
        self.framed: list[bytes] = []
        self.sizes: list[int] = []  # each record's body size in bytes
        self.dues: list[int] = []  # deliver_at_ms
        self.buckets: list[int] = []  # the bucket each is filed in
        self.hashes: list[int] = []  # CRC-32 of each message id
        self.subjects: list[str] = []


_new_tuple = tuple.__new__  # a ScheduleEntry from its fields without its generated __new__


def _unframed(framed: bytes, sizes: list[int]) -> list[bytes]:
    """The bodies of the records ``framed`` holds back to back (their body sizes ``sizes``),
    for a commit the delay log takes record by record (``DelayStore.commit``)."""
    starts = accumulate(map(add, sizes, repeat(HEADER_SIZE_BYTES)), initial=HEADER_SIZE_BYTES)
    return [framed[start:start + size] for start, size in zip(starts, sizes)]


class DelayStore(BucketReadsMixin, DoneMarksMixin, CopyingMixin, WatermarkMixin):
    """The delay server's messages on disk (module docstring). Reading buckets is
    ``delayserver.storage.bucket_reads``, dispatch and cancel marks
    ``delayserver.storage.done_marks``, replication's side (the done journal, a slave's copies)
    ``delayserver.storage.copying``, the done watermark and checkpoints
    ``delayserver.storage.watermark``."""

    def __init__(self, data_dir: str, config: DelayStoreConfig = DelayStoreConfig(), *,
                 opener: Opener = OsFile, now_ms: int) -> None:
        self.data_dir = data_dir
        self.config = config
        self._opener = opener
        self._now_at_open_ms = now_ms
        self._reopen()

    def _reopen(self) -> None:
        """Open (and recover) everything under the data dir: at construction, and after a
        replica threw its copy away."""
        data_dir, config, opener, now_ms = (self.data_dir, self.config, self._opener,
                                            self._now_at_open_ms)
        self.layout = Layout(data_dir)
        for directory in (data_dir, self.layout.schedule_dir, self.layout.checkpoint_dir):
            os.makedirs(directory, exist_ok=True)
        self._checkpoints = CheckpointStore(self.layout.checkpoint_dir, CHECKPOINT_NAME,
                                            keep=CHECKPOINTS_KEPT)
        self._pending = _PendingColumns()
        self._subject_tails: dict[str, bytes] = {}  # subject -> its record tail (append_many)
        self._closed = False
        self._failed: Exception | None = None
        self._schedule_error: FlushFailed | None = None
        self.checkpoint_error: Exception | None = None  # why the last due checkpoint failed
        self._last_schedule_flush_ms = now_ms
        self._subjects: dict[int, str] = {}
        self._subject_names: dict[str, str] = {}
        self._empty_buckets: set[int] = set()
        # Exact pending counts of the buckets loaded or begun since open (``load_bucket``
        # counts them, or the bucket's first entry is committed now; commits, dispatches and
        # cancels keep them): what lets ``mark_done_before`` pass a finished bucket without
        # reading it again. In memory only; a bucket neither loaded nor begun since open is
        # read once when the watermark passes it.
        self._bucket_pending: dict[int, int] = {}
        state = recover(self.layout, config.bucket_ms, config.log_config(), opener,
                        self._checkpoints)
        self._log = state.log
        self._schedule = state.schedule
        self._done = state.done
        self._counts = state.counts
        self._done_before = state.done_before_ms
        self._chunk_size = state.chunk_size_bytes
        self._chunk_max = state.chunk_max_bucket
        self.recovery = state.report
        # No checkpoint here: restart-to-serving stays short, and a crash before the next one
        # replays the same records again (idempotent). The replayed work counts towards it.
        self._bytes_since_checkpoint = state.replayed_bytes
        self._done_since_checkpoint = state.report.done_records_replayed
        # Every dispatch, cancel and watermark move in commit order: what slaves copy.
        self._journal = DoneJournal(data_dir, opener)

    # ------------------------------------------------------------------ state checks

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed(self.data_dir)

    def _check_writable(self) -> None:
        self._check_open()
        if self._failed is not None:
            raise self._failed

    def _fail(self, exc: Exception) -> Exception:
        """Make ``exc`` the sticky failure and return it for raising."""
        if self._failed is None:
            self._failed = exc
        return self._failed

    # ------------------------------------------------------------------ appending

    def bucket_of(self, deliver_at_ms: int) -> int:
        """Start of the bucket that holds ``deliver_at_ms`` (a late message is filed in the done
        watermark's bucket instead: see ``ScheduleEntry.bucket_ms``)."""
        return deliver_at_ms - deliver_at_ms % self.config.bucket_ms

    def append(self, message_id: str, subject: str, deliver_at_ms: int, payload: bytes) -> None:
        """Buffer one message; provisional until ``commit`` returns."""
        self._check_writable()
        if not isinstance(deliver_at_ms, int) or not 0 <= deliver_at_ms <= U64_MAX:
            raise ValueError(f"deliver_at_ms {deliver_at_ms!r} is outside [0, {U64_MAX}]")
        id_bytes = message_id.encode("utf-8")
        natural = deliver_at_ms - deliver_at_ms % self.config.bucket_ms
        bucket = natural if natural >= self._done_before else self._done_before
        body = encode_delay_record(deliver_at_ms, bucket, id_bytes, subject.encode("utf-8"),
                                   payload)
        if len(body) > self.config.record_size_bytes_max:
            raise RecordTooLarge(len(body), self.config.record_size_bytes_max)
        pending = self._pending
        pending.framed.append(frame_records([body]))
        pending.sizes.append(len(body))
        pending.dues.append(deliver_at_ms)
        pending.buckets.append(bucket)
        pending.hashes.append(zlib.crc32(id_bytes))
        pending.subjects.append(subject)

    def append_many(self, message_ids: list[str], subjects: list[str],
                    deliver_at_ms: list[int], payloads: list[bytes]) -> None:
        """``append`` of each row of the columns, in order, with the same checks and errors
        (on one, the rows before it stay buffered), in C-level passes rather than a call per
        message: the delay server appends each group commit's sends this way."""
        self._check_writable()
        count = len(message_ids)
        ids_bytes = list(map(str.encode, message_ids))
        tails = self._subject_tails
        try:
            subject_tails = list(map(tails.__getitem__, subjects))
        except (KeyError, TypeError):
            subject_tails = None
        framed = None
        if (subject_tails is not None and count and len(subjects) == count
                and len(deliver_at_ms) == count and len(payloads) == count
                and b"" not in ids_bytes):
            # The due times' type and range and the ids' length are checked by the encoder
            # itself (an error for a value a u64 or the u16 id length cannot hold, or that is
            # not an int), not by passes of their own: what it refuses goes one by one below.
            bucket_ms, done_before = self.config.bucket_ms, self._done_before
            try:
                buckets = [due - due % bucket_ms for due in deliver_at_ms]
                if min(buckets) < done_before:  # late messages: filed in the watermark's bucket
                    buckets = [max(bucket, done_before) for bucket in buckets]
                framed, sizes, hashes = frame_delay_records(deliver_at_ms, buckets, ids_bytes,
                                                            subject_tails, payloads)
            except (TypeError, OverflowError, struct.error):
                framed = None
        if framed is None:
            # Something to word (or a subject not seen yet): one by one, which raises at the
            # first bad row exactly as append does, and learns the subjects' encoding.
            for row in zip(message_ids, subjects, deliver_at_ms, payloads):
                self.append(*row)
                self._learn_subject(row[1])
            return
        size_max = self.config.record_size_bytes_max
        if max(sizes) > size_max:
            first_too_large = next(k for k, size in enumerate(sizes) if size > size_max)
            framed_bytes = sum(sizes[:first_too_large]) + HEADER_SIZE_BYTES * first_too_large
            self._extend_pending(framed[:framed_bytes], sizes, hashes, deliver_at_ms, buckets,
                                 subjects, first_too_large)
            raise RecordTooLarge(sizes[first_too_large], size_max)
        self._extend_pending(framed, sizes, hashes, deliver_at_ms, buckets, subjects, count)

    def _extend_pending(self, framed: bytes, sizes: list[int], hashes: list[int],
                        dues: list[int], buckets: list[int], subjects: list[str],
                        count: int) -> None:
        """Buffer the first ``count`` rows of the columns (``framed`` holds exactly those
        records, framed)."""
        if not count:
            return
        pending = self._pending
        pending.framed.append(framed)
        pending.sizes += sizes[:count]
        pending.dues += dues[:count]
        pending.buckets += buckets[:count]
        pending.hashes += hashes[:count]
        pending.subjects += subjects[:count]

    def _learn_subject(self, subject: str) -> None:
        """Keep the record tail of a subject ``append`` accepted, for ``append_many``."""
        tails = self._subject_tails
        if subject not in tails:
            if len(tails) >= SUBJECT_CACHE_ENTRIES_MAX:
                tails.clear()
            tails[subject] = subject_tail(subject.encode("utf-8"))

    def commit(self) -> list[ScheduleEntry]:
        """Make every message appended since the last commit durable with one fsync (async mode:
        one write), then index them. Returns their entries in append order.

        ``DiskFull``/``LogWriteFailed``: the batch is dropped, nothing is indexed, the error
        propagates (``DiskFull`` is retriable: append and commit again; the delay log is cut
        back to where it ended before the batch, so none of it stays)."""
        self._check_writable()
        batch, self._pending = self._pending, _PendingColumns()
        sizes = batch.sizes
        count = len(sizes)
        if not count:
            return []
        if self._schedule_error is not None:
            self._retry_schedule_flush(count)
        delay_log = self._log
        end_before = delay_log.end_offset
        chunks = batch.framed
        framed = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        # Each record's offset: the framed records follow each other from the log's end.
        offsets = list(accumulate(map(add, sizes, repeat(HEADER_SIZE_BYTES)), initial=end_before))
        offsets.pop()
        try:
            room = delay_log.framed_room()
            if room is not None and len(framed) <= room[1]:
                # The usual (sync flush, no segment roll): the framed bytes written as they
                # are, fsynced (``append_framed_durably``: the same write, fsync and failures).
                delay_log.append_framed_durably(framed, None)
            else:  # async flush, a roll, a log failed or closed: record by record, as before
                delay_log.append_many(_unframed(framed, sizes))
                delay_log.sync_or_flush()
        except LogWriteFailed as exc:
            raise self._fail(exc)
        except DiskFull:
            # What of the batch reached the file before the disk filled (a segment roll, a
            # batch over the write buffer) is cut: a slave copying the log would schedule it,
            # though this master never does (review s14 rvb-7).
            try:
                delay_log.cut_back(end_before)
            except LogWriteFailed as cut_exc:
                raise self._fail(cut_exc) from cut_exc
            raise
        dues, buckets, hashes = batch.dues, batch.buckets, batch.hashes
        indexes = self._index_records(dues, offsets, sizes, hashes, buckets, batch.subjects)
        entries = list(map(_new_tuple, repeat(ScheduleEntry, count),
                           zip(buckets, indexes, dues, offsets, sizes, hashes)))
        self._bytes_since_checkpoint += delay_log.end_offset - end_before
        if self._schedule.buffer_full:
            self._flush_schedule_quietly()
        self._maybe_checkpoint()
        return entries

    def _index_records(self, dues: list[int], offsets: list[int], sizes: list[int],
                       hashes: list[int], buckets: list[int], subjects: list[str]
                       ) -> Iterable[int]:
        """File records just made durable in the delay log (columns, one row per record, at
        least one): their schedule entries, bucket and pending counts, the chunks' highest
        buckets. Returns each one's index in its bucket. The one indexing of a master's commit
        and of a slave's copied records (``append_copied_records``).

        Indexed in C-level passes over the columns (map, zip), not a Python step per entry
        but the schedule buffer's append and the bucket bookkeeping."""
        count = len(buckets)
        encoded = encode_schedule_entries(dues, offsets, sizes, hashes)
        known = self._bucket_pending
        bucket = top = buckets[0]
        one_bucket = buckets.count(bucket) == count
        if one_bucket:  # the usual: one bucket, its entries as one run
            first = self._schedule.append_run(bucket, b"".join(encoded))
            indexes: Iterable[int] = range(first, first + count)
            if bucket in known:
                known[bucket] += count
            elif first == 0:  # the bucket's first entries: its count is known from here on
                known[bucket] = count
        else:
            indexes = self._schedule.append_each(buckets, encoded)
            for bucket, index in zip(buckets, indexes):
                if bucket in known:
                    known[bucket] += 1
                elif index == 0:
                    known[bucket] = 1
        self._counts.add_many(buckets, subjects)
        chunk_size, chunk_max = self._chunk_size, self._chunk_max
        if offsets[0] // chunk_size == offsets[-1] // chunk_size:  # the usual: one chunk
            chunk = offsets[0] // chunk_size
            if not one_bucket:
                top = max(buckets)
            if chunk_max.get(chunk, -1) < top:
                chunk_max[chunk] = top
        else:
            for offset, bucket in zip(offsets, buckets):
                chunk = offset // chunk_size
                if chunk_max.get(chunk, -1) < bucket:
                    chunk_max[chunk] = bucket
        if self._empty_buckets:
            self._empty_buckets.difference_update(buckets)
        return indexes

    # ------------------------------------------------------------------ schedule buffer

    def _flush_schedule_quietly(self) -> None:
        """Write the schedule buffer after a durable commit: a failure must not fail that commit
        (its messages are safe in the delay log and indexed in memory), so it is kept: ENOSPC
        makes the next commit retry and refuse its batch while the disk is full; anything else
        makes the store fail (sticky)."""
        try:
            self._schedule.flush()
            self._schedule_error = None
        except FlushFailed as exc:
            if is_enospc(exc):
                log.warning("delay store: schedule buffer not written, disk full: %s", exc)
                self._schedule_error = exc
            else:
                self._fail(StoreFailed(exc.path, exc.cause))

    def _retry_schedule_flush(self, batch_records: int) -> None:
        try:
            self._schedule.flush()
            self._schedule_error = None
        except FlushFailed as exc:
            if is_enospc(exc):
                self._schedule_error = exc
                raise DiskFull(exc.path, batch_records) from exc
            raise self._fail(StoreFailed(exc.path, exc.cause)) from exc

    # ------------------------------------------------------------------ queries

    def buckets_with_pending(self, from_bucket_ms: int, to_bucket_ms: int) -> list[int]:
        """Buckets in [from_bucket_ms, to_bucket_ms] (both included) that may hold pending
        entries, ascending, from the in-memory index: every bucket with a pending entry is
        listed; a listed bucket may turn out empty (``load_bucket`` returns [])."""
        self._check_open()
        counts, empty = self._counts, self._empty_buckets
        return [
            bucket for bucket in self._schedule.index.buckets(from_bucket_ms, to_bucket_ms)
            if bucket not in empty and counts.hour_pending(bucket) > 0
        ]

    def pending_stats(self) -> PendingStats:
        """Pending counts per hour (bucket start rounded down to the hour), per subject, total."""
        self._check_open()
        return self._counts.snapshot()

    def delay_end(self) -> int:
        """The delay log's end as a slave's fetch may read it (``delay_copy.copy_bounds()[1]``:
        after a commit, everything committed so far), in one call: each group commit hands it
        back with its entries."""
        return self._log.flushed_offset

    def done_before(self) -> int:
        """The persisted done watermark: every bucket below it is fully dispatched or cancelled
        (0 until ``mark_done_before`` is first called)."""
        return self._done_before

    # ------------------------------------------------------------------ timer and closing

    def observe_fsync(self, callback: Callable[[float], None] | None) -> None:
        """Call ``callback(seconds)`` after each delay-log fsync, on this store's thread."""
        self._log.on_fsync = callback

    def tick(self, now_ms: int) -> None:
        """Call on a timer: async mode fsyncs the delay log every ``flush_interval_ms``; the
        schedule buffer is written every ``SCHEDULE_FLUSH_INTERVAL_MS``."""
        self._check_writable()
        try:
            self._log.tick(now_ms)
        except LogWriteFailed as exc:
            raise self._fail(exc)
        if (self._schedule.buffered_bytes
                and now_ms - self._last_schedule_flush_ms >= SCHEDULE_FLUSH_INTERVAL_MS):
            self._flush_schedule_quietly()
            self._last_schedule_flush_ms = now_ms

    def tick_is_idle(self) -> bool:
        """True when ``tick`` would do nothing: open, not failed, the delay log durable and its
        flush interval started, no schedule entry buffered (the scheduler's round then makes
        no hop to an idle thread for it; issue 18: idle CPU)."""
        log_ = self._log
        return (not self._closed and self._failed is None and not self._schedule.buffered_bytes
                and log_.interval_started and log_.durable_offset == log_.end_offset)

    def sync(self) -> None:
        """fsync the delay log and write the schedule buffer to the files."""
        self._check_writable()
        try:
            self._log.sync()
        except LogWriteFailed as exc:
            raise self._fail(exc)
        self._retry_schedule_flush(0)

    def close(self) -> None:
        """Write a final checkpoint (so the next open replays nothing) and close the files.
        Messages appended and not committed are dropped."""
        if self._closed:
            return
        try:
            if self._failed is None:
                self._pending = []
                self.checkpoint()
        finally:
            self._log.close()
            self._journal.log.close()
            self._closed = True
