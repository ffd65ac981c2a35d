"""A segmented append-only log of CRC-framed records (see ``logstore.record`` for the framing).

Files: one directory per log, segments named ``<20-digit base offset>.log`` so ``ls`` sorts them.
A segment holds whole records; the next segment's base offset is the previous segment's end.

Durability contract:
- ``append`` keeps the body in an in-memory write buffer and returns its offset. The offset is
  provisional until ``flush()`` (framed and written to the OS) or ``sync()`` (fsynced) returns.
  Framing a whole buffer at once in ``flush()`` (``record.frame_records``) is what makes
  ``append`` cheap: it does one comparison, a list append and an offset update.
- ``sync()`` makes every earlier append durable with one fsync: callers group many appends under
  one sync (group commit) and acknowledge them after it returns.
- ``flush_mode="async"``: the owner calls ``tick(now_ms)`` regularly; it fsyncs every
  ``flush_interval_ms``. The log never reads the clock.
- A failed write or fsync is sticky (``LogWriteFailed``) until the log is reopened. ENOSPC is not
  sticky: the unflushed appends are dropped, the file is cut back, and ``DiskFull`` is raised.

Recovery on open verifies every record from ``verify_from_offset`` (the owner's last checkpoint)
to the end, truncates a torn or corrupt tail and reports what was cut. With
``preallocate_step_bytes`` the active segment's file is allocated ahead of its data
(``logstore.segment_space``): recovery then finds the data's end at a zero header followed by
zeros only, and cuts those zeros off without reporting a truncation. Records before that offset
are trusted at open but verified on every read: a corrupt record raises ``CorruptRecord``, it is
never returned as data. Not thread-safe: one owner calls it.

Observing fsyncs: ``on_fsync`` (None by default) is called on the owner's thread with the seconds
one ``sync()`` spent in fsync calls, whenever it fsynced anything. The log reads a monotonic
counter only for that measurement and decides nothing on it; servers wire it to a metric.

Reading is in ``logstore.segment_reads``, copying to another server in ``logstore.segment_copy``,
syncing in ``logstore.segment_sync`` and allocating ahead in ``logstore.segment_space`` (mixins
of ``SegmentedLog``).
"""

from __future__ import annotations

import bisect
import errno
import logging
import os
from dataclasses import dataclass, field
from itertools import accumulate, repeat
from operator import add
from typing import Callable, Iterable

from logstore.errors import DiskFull, LogClosed, LogWriteFailed, RecordTooLarge
from logstore.fileio import FileHandle, Opener, OsFile, fsync_directory
from logstore.record import HEADER_SIZE_BYTES, check_header, crc_matches, frame_records
from logstore.segment_copy import SegmentCopyMixin
from logstore.segment_reads import _SCAN_CHUNK_BYTES, SegmentReadsMixin
from logstore.segment_space import NEVER, ZERO_HEADER, ZERO_TAIL, SegmentSpaceMixin
from logstore.segment_sync import SegmentSyncMixin

log = logging.getLogger(__name__)

SEGMENT_SUFFIX = ".log"
FLUSH_MODES = ("sync", "async")


@dataclass(frozen=True)
class LogConfig:
    """Settings of one segmented log."""

    segment_size_bytes_max: int = 64 << 20  # a segment is rolled before it would pass this size
    record_size_bytes_max: int = 16 << 20  # largest body; a larger stored length is corruption
    flush_mode: str = "sync"  # "sync": owner calls sync(); "async": tick() fsyncs on an interval
    flush_interval_ms: int = 100  # async mode: longest time between fsyncs while data is pending
    write_buffer_bytes_max: int = 256 << 10  # appends are buffered up to this before a write(2)
    # The active segment's file is allocated this far ahead of its data, in steps (0: not at
    # all; logstore.segment_space), never past segment_size_bytes_max and one header: the
    # whole segment at once when the step is at least that.
    preallocate_step_bytes: int = 0

    def __post_init__(self) -> None:
        if self.flush_mode not in FLUSH_MODES:
            raise ValueError(f"flush_mode {self.flush_mode!r} is not one of {FLUSH_MODES}")
        if self.segment_size_bytes_max < HEADER_SIZE_BYTES + 1:
            raise ValueError(f"segment_size_bytes_max {self.segment_size_bytes_max} is too small")
        if self.record_size_bytes_max < 1:
            raise ValueError(f"record_size_bytes_max {self.record_size_bytes_max} must be >= 1")
        if self.flush_interval_ms < 1:
            raise ValueError(f"flush_interval_ms {self.flush_interval_ms} must be >= 1")
        if self.write_buffer_bytes_max < 0:
            raise ValueError(f"write_buffer_bytes_max {self.write_buffer_bytes_max} must be >= 0")
        if self.preallocate_step_bytes < 0:
            raise ValueError(f"preallocate_step_bytes {self.preallocate_step_bytes} must be >= 0")


@dataclass(frozen=True)
class Truncation:
    """What recovery cut from the tail of a log."""

    offset: int  # log offset where the cut starts (the first bad record)
    bytes_cut: int  # bytes removed, counting whole segments deleted after it
    reason: str  # why the record at ``offset`` was rejected
    path: str  # the segment file in which the bad record sat


@dataclass(frozen=True)
class RecoveryReport:
    """The outcome of opening a log."""

    first_offset: int
    end_offset: int
    records_verified: int
    truncation: Truncation | None


@dataclass(frozen=True)
class SegmentInfo:
    """One segment file as seen by retention and tools."""

    base_offset: int
    end_offset: int
    size_bytes: int
    path: str
    modified_ms: int


@dataclass
class _Segment:
    base_offset: int
    path: str
    handle: FileHandle
    size_bytes: int = 0
    synced: bool = field(default=True)


def segment_name(base_offset: int) -> str:
    """The file name of the segment starting at ``base_offset``."""
    return f"{base_offset:020d}{SEGMENT_SUFFIX}"


class SegmentedLog(SegmentReadsMixin, SegmentCopyMixin, SegmentSyncMixin, SegmentSpaceMixin):
    """An append-only log of records split into size-bounded segment files."""

    def __init__(
        self,
        directory: str,
        config: LogConfig = LogConfig(),
        *,
        opener: Opener = OsFile,
        verify_from_offset: int = 0,
    ) -> None:
        self.directory = directory
        self.config = config
        self._opener = opener
        self._segments: list[_Segment] = []
        self._bases: list[int] = []
        # The write buffer: bodies appended since the last flush, framed by flush() in one
        # frame_records call. They are bytes (immutable), so holding them is as safe as copying.
        self._pending: list[bytes] = []
        self._pend = self._pending.append
        self._end = 0
        # append's fast path is taken while the record ends at or below this log offset: then it
        # needs no roll and no flush, and the log is open and not failed. -1 (closed or failed)
        # sends every append down the checked path, which raises. Kept by _update_fast_path_end().
        self._fast_path_end = -1
        self._durable_end = 0
        # The base offset of the oldest segment flush() wrote since the last sync(), None when
        # it wrote none: sync() looks at the segments from there, not at every segment of a
        # log that keeps thousands (1,600 added ~23 us to each group commit's sync).
        self._unsynced_base: int | None = None
        self._failed: LogWriteFailed | None = None
        self._closed = False
        self._directory_dirty = False
        self._last_sync_ms: int | None = None
        # Allocating ahead (logstore.segment_space): when the next step is due, and whether the
        # filesystem said it cannot.
        self._allocate_at = NEVER
        self._cannot_allocate = False
        # Told how long each sync() spent in fsync (seconds); see the module docstring.
        self.on_fsync: Callable[[float], None] | None = None
        os.makedirs(directory, exist_ok=True)
        self.recovery = self._recover(verify_from_offset)
        self._update_fast_path_end()

    # ------------------------------------------------------------------ properties

    @property
    def first_offset(self) -> int:
        """Offset of the oldest record still stored."""
        return self._segments[0].base_offset

    @property
    def end_offset(self) -> int:
        """Offset the next append will get (one past the last record)."""
        return self._end

    @property
    def durable_offset(self) -> int:
        """Every record below this offset has been fsynced."""
        return self._durable_end

    @property
    def flushed_offset(self) -> int:
        """Every record below this offset has been written to the OS (``read_raw``'s limit):
        the active segment's end, as the buffer holds what comes after it."""
        active = self._segments[-1]
        return active.base_offset + active.size_bytes

    @property
    def buffered_room_bytes(self) -> int:
        """Bytes of records (headers included) that ``append`` can still take with no write to
        the OS, no roll and no check: 0 when closed or failed."""
        return max(0, self._fast_path_end - self._end)

    # ------------------------------------------------------------------ recovery

    def _recover(self, verify_from_offset: int) -> RecoveryReport:
        names = sorted(n for n in os.listdir(self.directory) if n.endswith(SEGMENT_SUFFIX))
        if not names:
            self._open_segment(0, create=True)
            self._end = self._durable_end = 0
            return RecoveryReport(0, 0, 0, None)
        for name in names:
            self._open_segment(int(name[: -len(SEGMENT_SUFFIX)]), create=False)
        truncation: Truncation | None = None
        verified = 0
        for index, segment in enumerate(self._segments):
            expected_base = (
                self._segments[index - 1].base_offset + self._segments[index - 1].size_bytes
                if index
                else segment.base_offset
            )
            if segment.base_offset != expected_base and not self._zero_tail_before(index):
                truncation = self._cut(index - 1, self._segments[index - 1].size_bytes,
                                       f"gap: next segment starts at {segment.base_offset}")
                break
            segment_end = segment.base_offset + segment.size_bytes
            if segment_end <= verify_from_offset:
                continue
            start = max(0, verify_from_offset - segment.base_offset)
            count, bad_position, reason = self._scan_segment(segment, start)
            if reason == ZERO_TAIL and count == 0 and start > 0:
                # Zeros right at the checkpoint: its offset is the data's end only if it is a
                # record boundary at or before that end, which the zeros do not prove (a
                # checkpoint past the data). Verify this segment from its start instead.
                count, bad_position, reason = self._scan_segment(segment, 0)
            verified += count
            if reason == ZERO_TAIL:
                self._cut_zero_tail(segment, bad_position)  # type: ignore[arg-type]
            elif bad_position is not None:
                truncation = self._cut(index, bad_position, reason)
                break
        last = self._segments[-1]
        self._end = self._durable_end = last.base_offset + last.size_bytes
        self._allocation_due_from(self._end)
        if truncation:
            log.warning(
                "log %s: cut %d bytes at offset %d (%s)",
                self.directory, truncation.bytes_cut, truncation.offset, truncation.reason,
            )
        return RecoveryReport(self.first_offset, self._end, verified, truncation)

    def _scan_segment(self, segment: _Segment, position: int) -> tuple[int, int | None, str]:
        """Verify records from ``position``; returns (count, first bad position or None, reason)."""
        count = 0
        size = segment.size_bytes
        limit = self.config.record_size_bytes_max
        chunk = b""
        chunk_start = position
        while position < size:
            offset_in_chunk = position - chunk_start
            if len(chunk) - offset_in_chunk < HEADER_SIZE_BYTES:
                chunk = segment.handle.pread(position, _SCAN_CHUNK_BYTES)
                chunk_start, offset_in_chunk = position, 0
                if len(chunk) < HEADER_SIZE_BYTES:
                    return count, position, f"torn header: {len(chunk)} of {HEADER_SIZE_BYTES} bytes"
            header = chunk[offset_in_chunk : offset_in_chunk + HEADER_SIZE_BYTES]
            body_length, crc, problem = check_header(header, limit)
            if problem:
                if header == ZERO_HEADER and self._zeros_from(segment, position):
                    return count, position, ZERO_TAIL
                return count, position, problem
            record_end = offset_in_chunk + HEADER_SIZE_BYTES + body_length
            if record_end > len(chunk):
                chunk = segment.handle.pread(position, HEADER_SIZE_BYTES + body_length)
                chunk_start, offset_in_chunk = position, 0
                record_end = HEADER_SIZE_BYTES + body_length
                if len(chunk) < record_end:
                    return count, position, (
                        f"torn record: {len(chunk)} of {record_end} bytes present"
                    )
            body = memoryview(chunk)[offset_in_chunk + HEADER_SIZE_BYTES : record_end]
            if not crc_matches(header, body, crc):
                return count, position, "crc mismatch"
            position += HEADER_SIZE_BYTES + body_length
            count += 1
        return count, None, ""

    def _cut_zero_tail(self, segment: _Segment, position: int) -> None:
        """Recovery found the segment's data ending at ``position``, zeros after it (space
        allocated ahead): cut them off, durably, and report no truncation."""
        if self.config.preallocate_step_bytes:
            log.info("log %s: %s holds %d bytes of data and %d zero bytes allocated ahead "
                     "after them; cut back to its data", self.directory, segment.path,
                     position, segment.size_bytes - position)
        else:
            # A log that does not allocate (or no longer does) can also be left a zero tail by
            # a power cut: the file's new size reached the journal, its blocks did not, so
            # writes never synced are lost. Nothing acknowledged, but the operator is told.
            log.warning("log %s: %s holds %d bytes of data and %d zero bytes after them, and "
                        "this log does not allocate ahead: writes not synced before a crash "
                        "were lost there; cut back to its data", self.directory, segment.path,
                        position, segment.size_bytes - position)
        segment.handle.truncate(position)
        segment.handle.sync()
        segment.size_bytes = position

    def _zero_tail_before(self, index: int) -> bool:
        """Recovery: segment ``index`` starts before the end of the file before it, which
        holds nothing but zeros from there (space allocated ahead that a crash kept from being
        cut back at its roll): cut the zeros and say True; else False (a real gap)."""
        previous = self._segments[index - 1]
        data_bytes = self._segments[index].base_offset - previous.base_offset
        if not 0 <= data_bytes < previous.size_bytes or not self._zeros_from(previous,
                                                                              data_bytes):
            return False
        self._cut_zero_tail(previous, data_bytes)
        return True

    def _cut(self, index: int, position: int, reason: str) -> Truncation:
        """Truncate segment ``index`` at ``position`` and delete every later segment."""
        segment = self._segments[index]
        bytes_cut = segment.size_bytes - position
        segment.handle.truncate(position)
        segment.handle.sync()
        segment.size_bytes = position
        self._allocation_due_from(segment.base_offset + position)
        for later in self._segments[index + 1 :]:
            bytes_cut += later.size_bytes
            later.handle.close()
            os.unlink(later.path)
        del self._segments[index + 1 :]
        del self._bases[index + 1 :]
        fsync_directory(self.directory)
        return Truncation(segment.base_offset + position, bytes_cut, reason, segment.path)

    def _open_segment(self, base_offset: int, *, create: bool) -> _Segment:
        path = os.path.join(self.directory, segment_name(base_offset))
        handle = self._opener(path)
        segment = _Segment(base_offset, path, handle, handle.size())
        self._segments.append(segment)
        self._bases.append(base_offset)
        if create:
            self._directory_dirty = True
            self._allocation_due_from(base_offset)
        return segment

    # ------------------------------------------------------------------ writing

    def _check_writable(self) -> None:
        if self._closed:
            raise LogClosed(self.directory)
        if self._failed is not None:
            raise self._failed

    def _update_fast_path_end(self) -> None:
        """Recompute the log offset up to which ``append`` may skip every check.

        Called after anything that changes the active segment, the buffer's start, or the log's
        open/failed state. A record ending at or below it fits in the active segment without a
        roll and leaves the buffer below ``write_buffer_bytes_max`` (so no flush is due).
        """
        if self._closed or self._failed is not None:
            self._fast_path_end = -1
            return
        active = self._segments[-1]
        buffer_start = active.base_offset + active.size_bytes
        # The buffer's span is also held to one largest record, so a body over
        # record_size_bytes_max always ends past it and append needs no size check of its own.
        buffered_bytes_max = min(self.config.write_buffer_bytes_max - 1,
                                 HEADER_SIZE_BYTES + self.config.record_size_bytes_max)
        self._fast_path_end = min(
            buffer_start + buffered_bytes_max,
            active.base_offset + self.config.segment_size_bytes_max,
        )
        if buffer_start >= self._allocate_at:
            # Every write of the active segment ends here (flush, sync, the caller's own
            # write through framed_target), so this is where the next step comes due.
            self._allocate_ahead()

    def _set_failed(self, failure: LogWriteFailed) -> LogWriteFailed:
        """Make ``failure`` sticky until reopen; returns it for the caller to raise."""
        self._failed = failure
        self._fast_path_end = -1
        return failure

    def append(self, body: bytes) -> int:
        """Buffer one record; returns its offset (provisional until flush()/sync() returns).

        Raises LogClosed, the sticky LogWriteFailed, RecordTooLarge, or (when the append fills
        the write buffer and its write hits ENOSPC) DiskFull.
        """
        # The hot path (bench.storage's goal): one comparison says no roll, no flush and no state
        # check is due; framing and CRCs happen in flush(), a whole buffer per frame_records call.
        size = len(body)
        offset = self._end
        end = offset + HEADER_SIZE_BYTES + size
        if end > self._fast_path_end or type(body) is not bytes:
            return self._append_checked(body)
        self._pend(body)
        self._end = end
        return offset

    def _append_checked(self, body: bytes) -> int:
        """``append`` with every check: closed, failed, too large, roll, flush when full."""
        self._check_writable()
        if type(body) is not bytes:
            # A bytearray or memoryview could change before flush() frames it: keep a copy. Its
            # size is taken from the copy: len() of a memoryview counts items, not bytes.
            body = bytes(body)
        size = len(body)
        if size > self.config.record_size_bytes_max:
            raise RecordTooLarge(size, self.config.record_size_bytes_max)
        active = self._segments[-1]
        used = self._end - active.base_offset
        if used and used + HEADER_SIZE_BYTES + size > self.config.segment_size_bytes_max:
            self._roll()
        offset = self._end
        self._pending.append(body)
        self._end += HEADER_SIZE_BYTES + size
        if self._buffered_bytes() >= self.config.write_buffer_bytes_max:
            self.flush()
        else:
            self._update_fast_path_end()
        return offset

    def append_many(self, bodies: Iterable[bytes]) -> list[int]:
        """Buffer several records; returns their offsets.

        The same result as ``append`` in a loop (and the same errors: on one, the records before
        it stay buffered). Bytes bodies are taken in runs that fit the write buffer and the
        active segment, each in one step with its offsets computed in C; only the record that
        fills the buffer (or needs a new segment) takes the checked path.
        """
        if type(bodies) is not list:
            bodies = list(bodies)  # read twice below: a generator would be empty the second time
        if not bodies:
            return []
        if set(map(type, bodies)) != {bytes}:
            append = self.append
            return [append(body) for body in bodies]
        # Records make one byte stream whatever path each takes (a roll starts the next segment
        # at the log's end offset), so every offset is known up front.
        offsets = list(accumulate(map(add, map(len, bodies), repeat(HEADER_SIZE_BYTES)),
                                  initial=self._end))
        ends = offsets[1:]
        offsets.pop()
        position, count = 0, len(bodies)
        while position < count:
            fitting = bisect.bisect_right(ends, self._fast_path_end, position)
            if fitting > position:
                self._pending.extend(bodies[position:fitting] if position or fitting < count
                                     else bodies)
                self._end = ends[fitting - 1]
                position = fitting
            else:
                self._append_checked(bodies[position])
                position += 1
        return offsets

    def _buffered_bytes(self) -> int:
        """Framed bytes appended but not yet written to the OS."""
        active = self._segments[-1]
        return self._end - active.base_offset - active.size_bytes

    def flush(self, framed: bytes | None = None) -> None:
        """Write buffered records to the OS (not fsynced); a process crash no longer loses them.
        ``framed``: records framed by the caller instead, the buffer empty (``sync_then``)."""
        self._check_writable()
        if framed is None:
            if not self._pending:
                return
            framed = frame_records(self._pending)
        active = self._segments[-1]
        try:
            active.handle.append(framed)
        except OSError as exc:
            self._on_write_error(active, exc)
        self._flushed(active, len(framed))

    def _flushed(self, active: _Segment, framed_bytes: int) -> None:
        """The write buffer reached the active segment's file (not fsynced)."""
        active.size_bytes += framed_bytes
        active.synced = False
        # Later flushes write here or after, unless a cut (truncate, reset) makes an earlier
        # segment the active one again: the base is then the lower of the two (review s14
        # rvb-5: a sync would otherwise fsync nothing and call the end durable).
        if self._unsynced_base is None or active.base_offset < self._unsynced_base:
            self._unsynced_base = active.base_offset
        self._pending.clear()
        self._update_fast_path_end()

    def _on_write_error(self, active: _Segment, exc: OSError) -> None:
        dropped = len(self._pending)
        if exc.errno == errno.ENOSPC:
            try:
                active.handle.truncate(active.size_bytes)
            except OSError as cut_exc:
                raise self._set_failed(
                    LogWriteFailed(active.path, "truncate after ENOSPC", cut_exc)
                ) from exc
            self._end = active.base_offset + active.size_bytes
            self._pending.clear()
            self._allocation_due_from(self._end)  # the cut gave the space ahead back
            self._update_fast_path_end()
            raise DiskFull(active.path, dropped) from exc
        raise self._set_failed(LogWriteFailed(active.path, "write", exc)) from exc

    def _roll(self) -> None:
        """Close the active segment for writing and start a new one at the end offset."""
        self.flush()
        self._cut_allocation(self._segments[-1])
        self._open_segment(self._end, create=True)
        self._update_fast_path_end()

    # ------------------------------------------------------------------ retention

    def segments(self) -> list[SegmentInfo]:
        """Every segment, oldest first, with its offsets, size and last-modified time."""
        infos = []
        for segment in self._segments:
            size = segment.size_bytes
            if segment is self._segments[-1]:
                size += self._buffered_bytes()
            try:
                modified_ms = int(os.stat(segment.path).st_mtime * 1000)
            except FileNotFoundError:
                modified_ms = 0
            infos.append(
                SegmentInfo(segment.base_offset, segment.base_offset + size, size, segment.path,
                            modified_ms)
            )
        return infos

    def delete_segments_before(self, offset: int) -> list[SegmentInfo]:
        """Delete whole segments that end at or before ``offset``; never the active segment."""
        deleted = []
        for info in self.segments()[:-1]:
            if info.end_offset > offset:
                break
            segment = self._segments[0]
            segment.handle.close()
            os.unlink(segment.path)
            del self._segments[0]
            del self._bases[0]
            deleted.append(info)
        if deleted:
            fsync_directory(self.directory)
            for info in deleted:
                log.info("log %s: deleted segment %s (%d bytes)", self.directory, info.path,
                         info.size_bytes)
        return deleted

    def apply_retention(
        self, now_ms: int, retention_ms: int, keep_from_offset: int | None = None
    ) -> list[SegmentInfo]:
        """Delete the oldest segments last modified more than ``retention_ms`` ago.

        Stops at the first segment that is too young, is the active one, or ends after
        ``keep_from_offset`` (data someone still needs), so the log stays contiguous.
        """
        cut = self.first_offset
        for info in self.segments()[:-1]:
            if now_ms - info.modified_ms <= retention_ms:
                break
            if keep_from_offset is not None and info.end_offset > keep_from_offset:
                break
            cut = info.end_offset
        return self.delete_segments_before(cut)

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Flush and fsync what is buffered (unless a write already failed), then close files."""
        if self._closed:
            return
        try:
            if self._failed is None:
                # The file cut back to its data (and no step allocated after), so a closed
                # log's files are exact.
                self._allocate_at = NEVER
                self._cut_allocation(self._segments[-1])
                self.sync()
        finally:
            for segment in self._segments:
                segment.handle.close()
            self._closed = True
            self._fast_path_end = -1
