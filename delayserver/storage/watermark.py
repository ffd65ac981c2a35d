"""The done watermark and checkpoints of a delay store: ``mark_done_before`` persists that every
bucket below a bucket start is fully dispatched or cancelled and retires those buckets' files
and delay-log segments; ``checkpoint`` makes the log and schedule durable and writes the state a
restart starts from. A mixin of ``DelayStore`` (``delayserver.storage.store``), which owns every
field used here; same owner thread (the delay-io thread), no clock reads."""

from __future__ import annotations

import errno
import logging

from delayserver.storage.delay_checkpoint import DelayCheckpoint, encode_delay_checkpoint
from delayserver.storage.done_journal import KIND_DONE_BEFORE, encode_journal_record
from delayserver.storage.errors import StoreFailed
from delayserver.storage.layout import HOUR_MS
from delayserver.storage.recovery import CHECKPOINTS_KEPT
from delayserver.storage.retention import delete_done_segments, retire_bucket_files
from logstore import DiskFull, LogWriteFailed

log = logging.getLogger("delayserver.storage.store")  # the store's logger: these lines are its own

CHECKPOINT_EVERY_DONE_RECORDS = 100_000  # dispatch/cancel records between checkpoints


class WatermarkMixin:
    """The watermark and checkpoint side of ``DelayStore`` (module docstring)."""

    def mark_done_before(self, bucket_ms: int) -> None:
        """Declare every bucket below ``bucket_ms`` fully dispatched or cancelled: persist it in a
        checkpoint, then delete those buckets' files and every delay-log segment whose records
        all belong to them. Raises ValueError, changing nothing, when an hour wholly below
        ``bucket_ms`` or a bucket between the old watermark and ``bucket_ms`` still has pending
        messages."""
        self._check_writable()
        if not isinstance(bucket_ms, int) or bucket_ms < 0 or bucket_ms % self.config.bucket_ms:
            raise ValueError(f"bucket_ms {bucket_ms!r} is not a bucket start (a multiple of "
                             f"{self.config.bucket_ms} >= 0)")
        if bucket_ms <= self._done_before:
            return
        for hour, pending in sorted(self._counts.per_hour.items()):
            if hour + HOUR_MS <= bucket_ms:
                raise ValueError(f"hour {hour} still has {pending} pending message(s); "
                                 f"mark_done_before({bucket_ms}) would skip them")
        # Buckets below the old watermark are retired, so this looks only at the buckets
        # finished since the last call (usually one). Their exact pending counts are known
        # when they were loaded since open, which the server does before passing them: then
        # nothing is read. Re-reading and verifying a whole bucket here used to stall the
        # single I/O thread for 180-690 ms at every minute (docs/BENCHMARKS.md).
        for bucket in list(self._schedule.index.buckets(self._done_before, bucket_ms - 1)):
            if not self._counts.hour_pending(bucket):
                continue
            pending = self._bucket_pending.get(bucket)
            if pending is None:
                pending = len(self.load_bucket(bucket))
            if pending:
                raise ValueError(f"bucket {bucket} still has {pending} pending message(s); "
                                 f"mark_done_before({bucket_ms}) would skip them")
        self._advance_watermark(bucket_ms)
        self.journal_done([encode_journal_record(KIND_DONE_BEFORE, bucket_ms, [], [], [], {})])

    def _advance_watermark(self, bucket_ms: int) -> None:
        """Move the done watermark to ``bucket_ms``, checkpoint it (put back if the checkpoint
        fails, so memory never runs ahead of disk) and retire what lies below it."""
        previous = self._done_before
        self._done_before = bucket_ms
        try:
            self.checkpoint()
        except BaseException:
            self._done_before = previous
            raise
        self._retire(bucket_ms)

    def _retire(self, done_before_ms: int) -> None:
        """Delete the files of buckets below the (persisted) watermark and the delay-log
        segments that hold only their records."""
        retired = retire_bucket_files(self.layout, done_before_ms)
        retired.update(self._schedule.index.buckets(0, done_before_ms - 1))
        for bucket in retired:
            self._schedule.forget(bucket)
            self._done.forget(bucket)
            self._empty_buckets.discard(bucket)
            self._bucket_pending.pop(bucket, None)
        delete_done_segments(self._log, self._chunk_max, self._chunk_size, done_before_ms)
        self._journal.retire_below(done_before_ms)

    # ------------------------------------------------------------------ checkpoints

    def _maybe_checkpoint(self) -> None:
        if (self._bytes_since_checkpoint >= self.config.checkpoint_every_bytes
                or self._done_since_checkpoint >= CHECKPOINT_EVERY_DONE_RECORDS):
            try:
                self.checkpoint()
                self.checkpoint_error = None
            except DiskFull as exc:
                # The old checkpoint still holds (a restart replays more); the next trigger
                # retries. Surfaced in ``checkpoint_error`` for the server's health report.
                log.warning("delay store: checkpoint not written, disk full: %s", exc)
                self.checkpoint_error = exc
            except (StoreFailed, LogWriteFailed):
                pass  # sticky now: the next call raises it

    def checkpoint(self) -> None:
        """Make the delay log and every schedule file durable and write a checkpoint, so a
        restart replays nothing before this point."""
        self.sync()  # the delay log fsynced, the schedule buffer written (DelayStore.sync)
        try:
            self._schedule.sync()
        except OSError as exc:
            raise self._fail(StoreFailed(self.layout.schedule_dir, exc)) from exc
        payload = encode_delay_checkpoint(DelayCheckpoint(
            bucket_ms=self.config.bucket_ms,
            chunk_size_bytes=self._chunk_size,
            delay_log_offset=self._log.end_offset,
            done_before_ms=self._done_before,
            pending_per_hour=dict(self._counts.per_hour),
            pending_per_subject=dict(self._counts.per_subject),
            entries_per_day=self._schedule.index.entries_per_day(self._done_before),
            max_bucket_per_chunk=dict(self._chunk_max),
        ))
        try:
            written = self._checkpoints.write(payload)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise DiskFull(self.layout.checkpoint_dir, 0) from exc
            raise self._fail(StoreFailed(self.layout.checkpoint_dir, exc)) from exc
        self._done.new_epoch(written.sequence)
        self._done.delete_touched_before(written.sequence - (CHECKPOINTS_KEPT - 1))
        self._bytes_since_checkpoint = 0
        self._done_since_checkpoint = 0
