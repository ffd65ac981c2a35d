"""Making a ``SegmentedLog`` durable: ``sync`` (flush and fsync; in the usual case the write and
the fsync are one call, ``OsFile.append_and_sync``, so a group commit's thread releases the GIL
once for both), ``sync_then`` (the same, then another file's bytes written in that call),
``sync_or_flush`` and async mode's ``tick``; the ``SegmentSyncMixin`` part of
``logstore.segment_log.SegmentedLog`` (split from it).
"""

from __future__ import annotations

import bisect
import time
from typing import TYPE_CHECKING, Callable

from logstore.errors import DiskFull, LogWriteFailed
from logstore.fileio import (
    FileHandle, FsyncFailed, OsFile, append_then, durable_write_done, fsync_directory)
from logstore.record import frame_records

if TYPE_CHECKING:
    from logstore.segment_log import LogConfig, _Segment


class SegmentSyncMixin:
    """The durability methods of ``SegmentedLog``, which sets these fields and the methods
    named below (``flush``, ``_flushed``, ``_on_write_error``, ...)."""

    directory: str
    config: LogConfig
    on_fsync: Callable[[float], None] | None
    _segments: list[_Segment]
    _bases: list[int]
    _pending: list[bytes]
    _end: int
    _durable_end: int
    _unsynced_base: int | None
    _directory_dirty: bool
    _last_sync_ms: int | None

    def sync(self) -> int:
        """Flush and fsync; every earlier append is durable when this returns the durable offset."""
        self.sync_then(None)
        return self._durable_end

    def append_durably_then(
        self, bodies: list[bytes],
        then_for: Callable[[list[int]], tuple[FileHandle, bytes] | None],
    ) -> tuple[list[int], OSError | None]:
        """``append_many(bodies)`` made durable per the flush mode (``sync_or_flush``), then
        ``then_for(their offsets)`` (a file, bytes; None for nothing) appended to that file: an
        owner's index entries of these records, in the same GIL release as the write and fsync
        where it can (``sync_then``). Returns the offsets and that append's error (returned,
        not raised: the records are durable; the caller cuts its file back).

        On a full disk (``DiskFull``, retriable) the log is first cut back to where it ended
        before: the first records of a batch written before the disk filled (a segment roll
        inside the batch, a batch over the write buffer) would otherwise stay in the file with
        nothing indexing them, and the owner's next batch would be numbered over them (review
        s14 rvb-2). ``LogWriteFailed`` propagates, also when that cut fails."""
        start = self._end
        try:
            offsets = self.append_many(bodies)  # type: ignore[attr-defined]
            then = then_for(offsets)
            if self.config.flush_mode == "sync":
                return offsets, self.sync_then(then)
            self.flush()
        except DiskFull:
            self.cut_back(start)  # type: ignore[attr-defined]
            raise
        return offsets, append_then(then)

    def framed_room(self) -> tuple[int, int] | None:
        """For ``append_framed_durably``: (the log's end offset, how many framed bytes it
        takes there in one write: no roll and no flush due, as ``append_many``'s fast path),
        or None when it cannot take them (async mode, records buffered, a segment or the
        directory not fsynced yet). The room is negative while the log is closed or failed."""
        if (self._pending or self._unsynced_base is not None or self._directory_dirty
                or self.config.flush_mode != "sync"):
            return None
        return self._end, self._fast_path_end - self._end

    def append_framed_durably(self, framed: bytes,
                              then: tuple[FileHandle, bytes] | None) -> OSError | None:
        """``append_durably_then`` of records the caller framed itself (``framed``, back to
        back, fitting ``framed_room``, which said where they start), with ``then`` given: the
        same write, fsync and ``then`` append (``sync_then``), the same failures, the same
        cut-back on a full disk. Returns that append's error."""
        start = self._end
        self._end = start + len(framed)
        try:
            return self.sync_then(then, framed)
        except DiskFull:
            self.cut_back(start)  # type: ignore[attr-defined]
            raise

    def framed_target(self, then: FileHandle) -> tuple[int, int, int, int, int, int] | None:
        """``framed_room`` for a caller that writes its framed records itself, durably and
        with ``then``'s bytes after them, in one call of ``write_sync``'s contract
        (``logstore/_framing.h``; ``realtime.storage._codecs.write_run``): (the log's end
        offset, the room there, the active segment's descriptor and file offset, ``then``'s
        descriptor and file offset), then ``framed_written``. None when ``framed_room`` is,
        or when either file is not an ``OsFile`` (a test's ``FaultyFile``: the caller frames
        the records and calls ``append_framed_durably``)."""
        if (self._pending or self._unsynced_base is not None or self._directory_dirty
                or self.config.flush_mode != "sync"):
            return None
        active = self._segments[-1].handle
        if type(active) is not OsFile or type(then) is not OsFile:
            return None
        end = self._end
        # Where each OsFile's next append writes (its descriptor, its end).
        return (end, self._fast_path_end - end, active._fd, active._end, then._fd, then._end)

    def framed_written(self, then: OsFile,
                       outcome: tuple[int, int, int, int, int, int, int, int]) -> OSError | None:
        """After the caller's durable write at ``framed_target`` (``outcome``: the framed
        records' size, then ``write_sync``'s answer): what ``append_framed_durably`` does
        after its write, the same failures (a full disk cuts the log back and raises
        ``DiskFull``; another write error or a failed fsync is sticky), the same bookkeeping.
        Returns ``then``'s write error, as ``append_framed_durably`` does. A room of 0 or less
        (the log closed or failed) let the caller write nothing."""
        framed_bytes = outcome[0]
        active = self._segments[-1]
        start = self._end
        self._end = start + framed_bytes
        try:
            # sync_then's handling of its append_and_sync, which ends in the same
            # durable_write_done.
            then_error = durable_write_done(active.handle, then, outcome[1:])  # type: ignore
        except FsyncFailed as exc:
            self._flushed(active, framed_bytes)
            raise self._set_failed(LogWriteFailed(active.path, "fsync", exc)) from exc
        except OSError as exc:
            try:
                self._on_write_error(active, exc)
            except DiskFull:
                self.cut_back(start)  # type: ignore[attr-defined]
                raise
        active.size_bytes += framed_bytes
        self._update_fast_path_end()
        self._durable_end = self._end
        if self.on_fsync is not None:
            self.on_fsync(active.handle.fsync_s)  # type: ignore[attr-defined]
        return then_error

    def sync_then(self, then: tuple[FileHandle, bytes] | None,
                  framed: bytes | None = None) -> OSError | None:
        """``sync``; then, with ``then`` (a file of another log, bytes), append those bytes to
        that file once this log is durable: a store's index entries of the records just
        synced, written in the same GIL release as the write and fsync where it can
        (``OsFile.append_and_sync``). That append's failure is returned, not raised: this log
        is durable and not failed by it; the caller cuts its own file back. ``framed``:
        records framed by the caller (``append_framed_durably``, nothing buffered), written
        where the buffer's would be."""
        fsync_s = 0.0
        then_error = None
        active = self._segments[-1]
        pending = self._pending
        append_and_sync = getattr(active.handle, "append_and_sync", None)
        if ((pending or framed is not None) and append_and_sync is not None
                and self._unsynced_base in (None, active.base_offset)):
            # The group commit's usual case: one buffer for the active segment alone, framed,
            # written and fsynced in one call (one GIL release, logstore.fileio), then ``then``
            # written in it too. Failures as ``flush`` and ``sync`` have them: ENOSPC is
            # ``DiskFull``, others sticky.
            if self._closed or self._failed is not None:
                self._check_writable()  # raises
            if framed is None:
                framed = frame_records(pending)
            try:
                then_error = append_and_sync(framed, then)
            except FsyncFailed as exc:
                self._flushed(active, len(framed))
                raise self._set_failed(LogWriteFailed(active.path, "fsync", exc)) from exc
            except OSError as exc:
                self._on_write_error(active, exc)
            active.size_bytes += len(framed)
            if pending:  # empty when the caller framed the records
                pending.clear()
            self._update_fast_path_end()
            fsync_s = active.handle.fsync_s  # type: ignore[attr-defined]
            fsynced = True
            then = None  # written, or its error in then_error
        else:
            self.flush(framed)  # a FaultyFile's path: its write, then its fsync below
            fsynced = False
        if self._unsynced_base is not None or self._directory_dirty:
            synced_s = self._sync_unsynced()
            if synced_s is not None:
                fsync_s += synced_s
                fsynced = True
        self._durable_end = self._end
        if fsynced and self.on_fsync is not None:
            self.on_fsync(fsync_s)
        if then is not None:
            return append_then(then)
        return then_error

    def _sync_unsynced(self) -> float | None:
        """fsync the segments ``flush`` wrote since the last sync and the directory if it
        changed; the seconds that took, None when there was nothing to fsync."""
        started_s = time.perf_counter()
        fsynced = False
        unsynced_base = self._unsynced_base
        # Only flush() marks a segment unsynced, and it notes the first it wrote: a segment
        # before that one (or deleted since) has nothing to fsync.
        if unsynced_base is not None:
            for segment in self._segments[bisect.bisect_left(self._bases, unsynced_base):]:
                if not segment.synced:
                    try:
                        segment.handle.sync()
                    except OSError as exc:
                        raise self._set_failed(
                            LogWriteFailed(segment.path, "fsync", exc)) from exc
                    segment.synced = True
                    fsynced = True
            self._unsynced_base = None
        if self._directory_dirty:
            try:
                fsync_directory(self.directory)
            except OSError as exc:
                raise self._set_failed(
                    LogWriteFailed(self.directory, "fsync directory", exc)
                ) from exc
            self._directory_dirty = False
            fsynced = True
        return time.perf_counter() - started_s if fsynced else None

    def sync_or_flush(self) -> None:
        """After an append, per ``config.flush_mode``: fsync it ("sync": durable when this
        returns) or write it to the OS ("async": a process crash no longer loses it, and
        ``tick`` fsyncs it on its interval). The one place a store decides this."""
        if self.config.flush_mode == "sync":
            self.sync()
        else:
            self.flush()

    @property
    def interval_started(self) -> bool:
        """A ``tick`` has run since the open, so the async flush interval counts from a known
        time. Until then the first tick only starts it: an owner that skips idle ticks must
        still make that first one, or the first write's fsync comes an interval late."""
        return self._last_sync_ms is not None

    def tick(self, now_ms: int) -> bool:
        """Async mode: flush, and fsync if ``flush_interval_ms`` passed with data pending.

        Returns True when it fsynced. The owner calls this on a timer; the log reads no clock.
        """
        self.flush()
        if self._last_sync_ms is None:
            self._last_sync_ms = now_ms
        if self._durable_end == self._end:
            self._last_sync_ms = now_ms
            return False
        if now_ms - self._last_sync_ms < self.config.flush_interval_ms:
            return False
        self.sync()
        self._last_sync_ms = now_ms
        return True
