"""Space allocated ahead of a ``SegmentedLog``'s data: the active segment's file is made longer
than its data in steps of ``LogConfig.preallocate_step_bytes`` (``OsFile.allocate``,
``posix_fallocate``), so a commit's write lands in space that is already allocated, and its
fsync writes no new size or block map (docs/BENCHMARKS.md, session 21, "prealloc"). The
``SegmentSpaceMixin`` part of ``logstore.segment_log.SegmentedLog`` (split from it).

The rules (docs/FORMATS.md, "Space allocated ahead"):

- Only the active segment has space after its data. A rolled segment is cut back to its data
  (``_cut_allocation``), and so is the active one at a clean ``close``.
- The space reads as zeros, and no record starts with a zero header (its magic is 0x514D), so
  recovery takes a zero header followed by nothing but zeros to the end of the file as the
  clean end of the written data (``ZERO_TAIL``), cuts the zeros off without reporting a
  truncation, and the writer goes on from there. A zero header with anything else after it is
  still a bad record, cut and reported.
- Allocating is never needed for correctness: when it fails (a full disk: ENOSPC) the part it
  got is given back and the segment grows as it is written, as without it; the log tries again
  a step later. A filesystem that cannot allocate (EOPNOTSUPP, EINVAL) turns it off for the
  log's life. Either way nothing written is lost and the log is not failed.
"""

from __future__ import annotations

import errno
import logging
from typing import TYPE_CHECKING

from logstore.record import HEADER_SIZE_BYTES

if TYPE_CHECKING:
    from logstore.segment_log import LogConfig, _Segment

log = logging.getLogger(__name__)

# The reason _scan_segment gives for a zero header followed only by zeros: the end of the data
# in a segment allocated ahead, not a bad record.
ZERO_TAIL = "zeros to the end of the file (space allocated ahead)"
ZERO_HEADER = bytes(HEADER_SIZE_BYTES)
# _allocate_at when nothing is to be allocated (no step, the segment allocated to its max, or
# the filesystem cannot): past any offset a log reaches.
NEVER = 1 << 62
# errnos of a filesystem that cannot allocate ahead at all.
_CANNOT_ALLOCATE = (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS)
_ZERO_CHUNK_BYTES = 1 << 20
_ZERO_CHUNK = bytes(_ZERO_CHUNK_BYTES)


class SegmentSpaceMixin:
    """The allocating methods of ``SegmentedLog``, which sets these fields."""

    directory: str
    config: LogConfig
    _segments: list[_Segment]
    _unsynced_base: int | None
    # The log offset at which the active segment's written end makes the next step due
    # (NEVER: none is). Owner: the log's owner thread, as every field of the log.
    _allocate_at: int
    _cannot_allocate: bool

    def _allocation_due_from(self, written_end: int) -> None:
        """Make the next allocation due once the active segment's written end reaches
        ``written_end`` (a log offset): after a segment opens, or a cut gave its space back."""
        step = self.config.preallocate_step_bytes
        self._allocate_at = written_end if step and not self._cannot_allocate else NEVER

    def _allocate_ahead(self) -> None:
        """Allocate the active segment's next step (up to ``segment_size_bytes_max``), and set
        when the one after is due: half a step before this one runs out."""
        active = self._segments[-1]
        allocate = getattr(active.handle, "allocate", None)
        step = self.config.preallocate_step_bytes
        # A header past the segment's max: data ending at (or just before) the max still has
        # a whole zero header after it, which recovery needs to tell the end from a torn one.
        cap = self.config.segment_size_bytes_max + HEADER_SIZE_BYTES
        written = active.size_bytes
        target = min(cap, written + step)
        if allocate is None or target <= written:
            self._allocate_at = NEVER  # a handle that cannot, or a segment at its max
            return
        try:
            allocate(target)
        except OSError as exc:
            if exc.errno in _CANNOT_ALLOCATE:
                self._cannot_allocate = True
                self._allocate_at = NEVER
                log.info("log %s: the filesystem cannot allocate ahead (%s); segments grow as "
                         "they are written", self.directory, exc)
                return
            # A full disk (or a sick one): give back what part of the step was had, so the
            # space serves writes, and try again a step later. The log goes on as without.
            log.warning("log %s: could not allocate %d bytes ahead in %s (%s); trying again "
                        "after %d more bytes", self.directory, target - written, active.path,
                        exc, step)
            self._give_back(active)
            self._allocate_at = active.base_offset + written + step
            return
        self._allocate_at = (NEVER if target >= cap
                             else active.base_offset + max(written + 1, target - step // 2))

    def _allocated_past_data(self, segment: _Segment) -> bool:
        """The segment's file is longer than its data (space allocated ahead)."""
        allocated_bytes = getattr(segment.handle, "allocated_bytes", None)
        return allocated_bytes is not None and allocated_bytes() > segment.size_bytes

    def _give_back(self, segment: _Segment) -> None:
        """Cut the segment's file back to its data, when it is longer; a failure is only
        logged: the zeros left are what recovery takes for the clean end."""
        if not self._allocated_past_data(segment):
            return
        try:
            segment.handle.truncate(segment.size_bytes)
        except OSError as exc:
            log.warning("log %s: could not cut %s back to its %d bytes of data (%s); recovery "
                        "will", self.directory, segment.path, segment.size_bytes, exc)

    def _cut_allocation(self, segment: _Segment) -> None:
        """A segment no longer written (rolled, or the log closing): cut its file back to its
        data, the cut made durable by the next sync (as the data flushed before it), so only
        the active segment has space after its data."""
        if not self._allocated_past_data(segment):
            return
        self._give_back(segment)
        segment.synced = False
        if self._unsynced_base is None or segment.base_offset < self._unsynced_base:
            self._unsynced_base = segment.base_offset

    @staticmethod
    def _zeros_from(segment: _Segment, position: int) -> bool:
        """Every byte of the segment's file from ``position`` to its end is zero."""
        size = segment.size_bytes
        while position < size:
            chunk = segment.handle.pread(position, min(_ZERO_CHUNK_BYTES, size - position))
            if not chunk or chunk != _ZERO_CHUNK[: len(chunk)]:
                return False  # data, or a file shorter than its size said: not a clean end
            position += len(chunk)
        return True
