"""Copying a ``SegmentedLog`` to another server (replication): whole records read and appended
as stored, verified, and the copy cut back or reset; the ``SegmentCopyMixin`` part of
``logstore.segment_log.SegmentedLog`` (split from it).
"""

from __future__ import annotations

import bisect
import logging
import os
from typing import TYPE_CHECKING

from logstore.errors import CorruptRecord, DiskFull, LogClosed, LogWriteFailed, OffsetOutOfRange
from logstore.fileio import fsync_directory
from logstore.record import HEADER as HEADER_STRUCT
from logstore.record import HEADER_SIZE_BYTES, split_records

if TYPE_CHECKING:
    from logstore.segment_log import LogConfig, _Segment
from logstore.segment_reads import READ_RUN_BYTES_MAX

log = logging.getLogger(__name__)


class SegmentCopyMixin:
    """The copying methods of ``SegmentedLog``, which sets these fields."""

    directory: str
    config: LogConfig
    _segments: list[_Segment]
    _bases: list[int]
    _pending: list[bytes]
    _end: int
    _durable_end: int
    _closed: bool
    _directory_dirty: bool

    # ------------------------------------------------------------------ copying (replication)

    def read_raw(self, offset: int, max_bytes: int, end_offset: int | None = None) -> bytes:
        """Whole records from ``offset`` exactly as stored (headers and bodies), for copying
        the log to another server: at most ``max_bytes``, or the first record alone when it is
        larger; never past ``end_offset`` nor past what was written to the OS
        (``flushed_offset``); never across a segment's end (the next call goes on from there).
        Every record is checked; a bad one raises CorruptRecord. Returns b"" at the limit;
        OffsetOutOfRange outside [first_offset, limit]."""
        if self._closed:
            raise LogClosed(self.directory)
        assert max_bytes > 0, max_bytes
        limit = self.flushed_offset if end_offset is None else min(end_offset,
                                                                   self.flushed_offset)
        if offset == limit and offset >= self.first_offset:
            return b""
        if not self.first_offset <= offset < limit:
            raise OffsetOutOfRange(offset, self.first_offset, limit)
        segment, position = self._locate(offset)
        stop = min(limit, segment.base_offset + segment.size_bytes)
        data = segment.handle.pread(position, min(max_bytes, stop - offset))
        bodies, used, problem = split_records(data, self.config.record_size_bytes_max)
        if not used and problem is None:
            # The first record alone is larger than max_bytes: it goes whole.
            header = segment.handle.pread(position, HEADER_SIZE_BYTES)
            if len(header) < HEADER_SIZE_BYTES:
                raise CorruptRecord(segment.path, offset, "no record header at this offset")
            framed = HEADER_SIZE_BYTES + HEADER_STRUCT.unpack(header)[0]
            if offset + framed > stop:
                raise CorruptRecord(segment.path, offset, "record runs past the end of its "
                                    "segment or the copy limit")
            data = segment.handle.pread(position, framed)
            bodies, used, problem = split_records(data, self.config.record_size_bytes_max)
        if problem is not None:
            raise CorruptRecord(segment.path, offset + used, problem)
        if not used:
            raise CorruptRecord(segment.path, offset, "no whole record before the copy limit")
        return data[:used]

    def append_raw(self, offset: int, data: bytes) -> list[bytes]:
        """Append whole records copied from another log with ``read_raw``, at ``offset``, which
        must be this log's end (the copy keeps the source's offsets). Every record is checked
        first and nothing is appended unless all are good (CorruptRecord names the first bad
        one); the bodies are framed again, which gives back the same bytes. Returns the bodies
        appended (for the caller to index); durable per the usual ``flush``/``sync`` contract."""
        copied = self._checked_copy(offset, data)
        self.append_many(copied)
        assert self._end == offset + len(data), (self._end, offset, len(data))
        return copied

    def append_raw_durably(self, offset: int, data: bytes) -> list[bytes]:
        """``append_raw`` made durable per the flush mode (``sync_or_flush``), with the same
        checks; returns the bodies. On a full disk (``DiskFull``) the log is first cut back to
        ``offset``. A copy in sync mode with nothing buffered (``framed_room``) whose records
        fit the active segment (the usual case: a source's chunk never spans its segments, and
        the copy's segments end where the source's do) writes ``data`` itself, the source's
        bytes, in one write and fsync (``append_framed_durably``), whatever the write buffer's
        size: checked records with attributes 0 frame again to exactly these bytes, so they
        are not framed twice."""
        copied = self._checked_copy(offset, data)
        room = self.framed_room()  # type: ignore[attr-defined]
        # A negative room: closed or failed; append_many below raises why.
        if room is not None and room[1] >= 0 and len(data) <= self._segment_room():
            self.append_framed_durably(data, None)  # type: ignore[attr-defined]
        else:
            try:
                self.append_many(copied)
                self.sync_or_flush()  # type: ignore[attr-defined]
            except DiskFull:
                self.cut_back(offset)
                raise
        assert self._end == offset + len(data), (self._end, offset, len(data))
        return copied

    def _segment_room(self) -> int:
        """Bytes the active segment takes before it must roll (a record may end at its max)."""
        active = self._segments[-1]
        return active.base_offset + self.config.segment_size_bytes_max - self._end

    def _checked_copy(self, offset: int, data: bytes) -> list[bytes]:
        """The bodies of the copied records ``data`` (at ``offset``, this log's end), every one
        checked (``split_records``); CorruptRecord names the first bad one, ValueError a wrong
        offset."""
        if offset != self._end:
            raise ValueError(f"copied records start at offset {offset} but the log {self.directory} "
                             f"ends at {self._end}")
        bodies, used, problem = split_records(data, self.config.record_size_bytes_max)
        if problem is None and used != len(data):
            problem = f"{len(data) - used} bytes of a partial record at the end"
        if problem is not None:
            raise CorruptRecord(f"{self.directory} (copied bytes)", offset + used, problem)
        if bodies and type(bodies[0]) is not bytes:  # the Python twin's memoryviews of data
            return [bytes(body) for body in bodies]
        return bodies

    def verify(self, offset: int, max_bytes: int) -> tuple[int, CorruptRecord | None]:
        """Check the records from ``offset`` (a record boundary), about ``max_bytes`` of them,
        as a scrub of a copy does: (where the next check goes on, or the first bad record's
        error). Only what was written to the OS is looked at; at its end the next offset is
        the end (start again from ``first_offset`` for another pass)."""
        offset = max(offset, self.first_offset)
        checked = 0
        while checked < max_bytes:
            try:
                data = self.read_raw(offset, min(max_bytes - checked, READ_RUN_BYTES_MAX))
            except CorruptRecord as exc:
                return offset, exc
            if not data:
                break
            offset += len(data)
            checked += len(data)
        return offset, None

    def truncate(self, offset: int) -> int:
        """Cut every record at or after ``offset`` durably (a follower dropping a tail its new
        source does not have, or a record found rotten); returns the bytes cut. ``offset`` must
        be a record boundary, which the caller knows (an epoch start, a record's offset).
        OffsetOutOfRange outside [first_offset, end_offset]."""
        self._check_writable()
        if not self.first_offset <= offset <= self._end:
            raise OffsetOutOfRange(offset, self.first_offset, self._end)
        if offset == self._end:
            return 0
        self.flush()
        cut_bytes = self._end - offset
        index = bisect.bisect_right(self._bases, offset) - 1
        self._cut(index, offset - self._segments[index].base_offset, "truncated by its owner")
        self._end = offset
        self._durable_end = min(self._durable_end, offset)
        self._update_fast_path_end()
        log.warning("log %s: truncated to offset %d (%d bytes cut)", self.directory, offset,
                    cut_bytes)
        return cut_bytes

    def cut_back(self, offset: int) -> None:
        """After a batch that failed part-way (a full disk, an index write that failed): cut
        whatever of it reached the file, back to ``offset`` where the log ended before it, so
        no record of it stays for a later batch, a recovery or a copying slave to take as
        written. Nothing to do when nothing went past it. LogWriteFailed when the cut itself
        fails (the caller makes it sticky)."""
        if self._end > offset:
            # Named in the error: ftruncate's and fsync's OSError name no file.
            segment = self._segments[max(0, bisect.bisect_right(self._bases, offset) - 1)]
            try:
                self.truncate(offset)
            except OSError as exc:
                raise LogWriteFailed(
                    self.directory, f"cut back to offset {offset} of segment "
                    f"{os.path.basename(segment.path)} after a failed write", exc) from exc

    def reset(self, offset: int) -> None:
        """Delete every record and start the log empty at ``offset`` (a copy beginning where its
        source's retention left off, or a copy thrown away)."""
        self._check_writable()
        self._pending.clear()
        for segment in self._segments:
            segment.handle.close()
            os.unlink(segment.path)
        self._segments.clear()
        self._bases.clear()
        self._open_segment(offset, create=True)
        fsync_directory(self.directory)
        self._directory_dirty = False
        self._end = self._durable_end = offset
        self._update_fast_path_end()
        log.warning("log %s: reset to start empty at offset %d", self.directory, offset)
