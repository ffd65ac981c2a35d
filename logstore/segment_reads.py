"""Reading a ``SegmentedLog``: a record by offset (verified), runs of records in one pread, and
iteration; the ``SegmentReadsMixin`` part of ``logstore.segment_log.SegmentedLog`` (split from it;
the log's docstring states its contract: one owner thread, every read verified).
"""

from __future__ import annotations

import bisect
from itertools import repeat
from operator import add, eq, sub
from typing import TYPE_CHECKING, Iterator, Sequence

from logstore.errors import CorruptRecord, LogClosed, OffsetOutOfRange
from logstore.record import HEADER as HEADER_STRUCT
from logstore.record import (CRC_SEEDS, HEADER_SIZE_BYTES, LENGTH_CRC, MAGIC, VERSION, check_header,
                             crc32, crc_matches, record_crc)

if TYPE_CHECKING:
    from logstore.segment_log import LogConfig, _Segment

_READ_AHEAD_BYTES = 4096
_SCAN_CHUNK_BYTES = 1 << 20
# read_bodies: records at most this far apart share one pread (reading ~4 KiB between them costs
# less than a syscall of its own), and one pread reads at most READ_RUN_BYTES_MAX.
READ_RUN_GAP_BYTES_MAX = 4096
READ_RUN_BYTES_MAX = 4 << 20


class SegmentReadsMixin:
    """The reading methods of ``SegmentedLog``, which sets these fields."""

    directory: str
    config: LogConfig
    _segments: list[_Segment]
    _bases: list[int]
    _pending: list[bytes]
    _end: int
    _durable_end: int
    _closed: bool
    _directory_dirty: bool

    # ------------------------------------------------------------------ reading

    def _locate(self, offset: int) -> tuple[_Segment, int]:
        if offset < self.first_offset or offset >= self._end:
            raise OffsetOutOfRange(offset, self.first_offset, self._end)
        index = bisect.bisect_right(self._bases, offset) - 1
        segment = self._segments[index]
        return segment, offset - segment.base_offset

    def read(self, offset: int) -> bytes:
        """The body of the record at ``offset``; raises CorruptRecord rather than return bad bytes."""
        return self.read_with_next(offset)[0]

    def read_with_next(self, offset: int) -> tuple[bytes, int]:
        """The body of the record at ``offset`` and the offset of the record after it."""
        if self._closed:
            raise LogClosed(self.directory)
        if self._pending and offset >= self._end - self._buffered_bytes():
            self.flush()
        segment, position = self._locate(offset)
        data = segment.handle.pread(position, _READ_AHEAD_BYTES)
        if len(data) < HEADER_SIZE_BYTES:
            raise CorruptRecord(segment.path, offset, "no record header at this offset")
        header = data[:HEADER_SIZE_BYTES]
        body_length, crc, problem = check_header(header, self.config.record_size_bytes_max)
        if problem:
            raise CorruptRecord(segment.path, offset, problem)
        framed = HEADER_SIZE_BYTES + body_length
        if len(data) < framed:
            data = segment.handle.pread(position, framed)
            if len(data) < framed:
                raise CorruptRecord(segment.path, offset, "record runs past the end of its segment")
        body = data[HEADER_SIZE_BYTES:framed]
        if not crc_matches(header, body, crc):
            raise CorruptRecord(segment.path, offset, "crc mismatch")
        return body, offset + framed

    def read_unverified(self, offset: int) -> bytes | None:
        """The bytes of the record at ``offset`` WITHOUT the CRC check, or None when its
        header is bad or it runs past its segment. Only for naming a record ``read`` refused
        (a damaged body still holds its key fields): never return these bytes as data."""
        if self._closed:
            raise LogClosed(self.directory)
        segment, position = self._locate(offset)
        header = segment.handle.pread(position, HEADER_SIZE_BYTES)
        if len(header) < HEADER_SIZE_BYTES:
            return None
        body_length, _crc, problem = check_header(header, self.config.record_size_bytes_max)
        if problem:
            return None
        body = segment.handle.pread(position + HEADER_SIZE_BYTES, body_length)
        return body if len(body) == body_length else None

    def read_bodies(self, offsets: Sequence[int], body_sizes: Sequence[int],
                    gap_bytes_max: int = READ_RUN_GAP_BYTES_MAX) -> list[memoryview | None]:
        """The bodies of the records at ``offsets`` (ascending), whose body sizes the caller
        knows from an index: records of one segment lying within ``gap_bytes_max`` of each other
        are fetched with one ``pread`` per run (``read_runs``) instead of one each. Each record
        is checked like ``read`` (magic, version, length equal to the size given, CRC); a record
        that fails, or an offset outside the log, gives None in its place, so the caller can
        ``read`` it alone for the exact error."""
        out: list[memoryview | None] = [None] * len(offsets)
        limit = self.config.record_size_bytes_max
        for data, run_start, i, j in self.read_runs(offsets, body_sizes, gap_bytes_max):
            self._check_run(data, run_start, offsets, body_sizes, i, j, out, limit)
        return out

    def read_runs(self, offsets: Sequence[int], body_sizes: Sequence[int],
                  gap_bytes_max: int = READ_RUN_GAP_BYTES_MAX,
                  ) -> list[tuple[memoryview, int, int, int]]:
        """The raw bytes behind ``read_bodies``, unchecked: (data, run start offset, i, j) per
        run, ``data`` holding records i..j-1 of ``offsets`` (ascending, body sizes known) read
        with one ``pread`` (shorter than asked only if the file was cut). Offsets outside the
        log are in no run. For a caller that checks and parses records in one pass."""
        if self._closed:
            raise LogClosed(self.directory)
        count = len(offsets)
        runs: list[tuple[memoryview, int, int, int]] = []
        if not count:
            return runs
        if self._pending and offsets[-1] + HEADER_SIZE_BYTES + body_sizes[-1] > (
                self._end - self._buffered_bytes()):
            self.flush()
        first_offset, end = self.first_offset, self._end
        # Run boundaries, found with C-level maps: a new run starts where the gap to the
        # previous record is too wide or a new segment begins.
        ends = list(map(add, offsets, map(add, body_sizes, repeat(HEADER_SIZE_BYTES))))
        segment_of = list(map(bisect.bisect_right, repeat(self._bases, count), offsets))
        breaks = [k for k, gap, same in zip(range(1, count), map(sub, offsets[1:], ends),
                                             map(eq, segment_of[1:], segment_of))
                  if gap > gap_bytes_max or not same]
        breaks.append(count)
        i = 0
        for run_stop in breaks:
            while i < run_stop:
                offset = offsets[i]
                if not first_offset <= offset < end:
                    i += 1
                    continue
                segment, position = self._locate(offset)
                # At most READ_RUN_BYTES_MAX per pread (at least one record).
                j = max(i + 1, bisect.bisect_right(ends, offset + READ_RUN_BYTES_MAX, i, run_stop))
                run_end = max(ends[i:j]) if j - i > 1 else ends[i]
                runs.append((memoryview(segment.handle.pread(position, run_end - offset)),
                             offset, i, j))
                i = j
        return runs

    @staticmethod
    def _check_run(data: memoryview, offset: int, offsets: Sequence[int],
                   body_sizes: Sequence[int], i: int, j: int, out: list[memoryview | None],
                   limit: int) -> None:
        """Check records i..j-1 of a run read from ``offset`` into ``data``; the body of each
        one that checks out goes to ``out``."""
        sizes = body_sizes[i:j]
        if j - i >= 8 and len(data) >= max(map(add, offsets[i:j], sizes)) - offset + (
                HEADER_SIZE_BYTES) and max(sizes) <= limit:
            # Every record is there: check them with C-level maps (no bytecode per record).
            # Seeding the CRC with the caller's size and the standard magic/version/attributes
            # makes one CRC call check the header too.
            starts = [following - offset + HEADER_SIZE_BYTES for following in offsets[i:j]]
            bodies = list(map(data.__getitem__, map(slice, starts, map(add, starts, sizes))))
            crcs = map(crc32, bodies, map(CRC_SEEDS.__getitem__, sizes))
            stored = map(LENGTH_CRC.unpack_from, repeat(data, j - i),
                         [start - HEADER_SIZE_BYTES for start in starts])
            out[i:j] = map(_body_if, map(eq, stored, zip(sizes, crcs)), bodies)
            return
        for k in range(i, j):  # a few records, a short read (a file cut) or an odd size
            at = offsets[k] - offset
            size = body_sizes[k]
            if at + HEADER_SIZE_BYTES + size > len(data) or size > limit:
                continue
            body_length, crc, magic, version, _attributes = HEADER_STRUCT.unpack_from(data, at)
            if body_length != size or magic != MAGIC or version != VERSION:
                continue
            body = data[at + HEADER_SIZE_BYTES : at + HEADER_SIZE_BYTES + size]
            if record_crc(data, at, body) == crc:
                out[k] = body

    def iterate(self, from_offset: int | None = None) -> Iterator[tuple[int, bytes]]:
        """Yield (offset, body) from ``from_offset`` (default: the first record) to the end.

        Reads in large chunks; every record's CRC is checked and a bad one raises CorruptRecord.
        """
        if self._closed:
            raise LogClosed(self.directory)
        if self._pending:
            self.flush()
        offset = self.first_offset if from_offset is None else from_offset
        if offset == self._end:
            return
        segment, position = self._locate(offset)
        index = self._segments.index(segment)
        limit = self.config.record_size_bytes_max
        while index < len(self._segments):
            segment = self._segments[index]
            # Re-read the size on every pass: appends while the caller holds this generator
            # grow the active segment, and a roll flushes more into it before moving on.
            while position < segment.size_bytes:
                size = segment.size_bytes
                chunk = segment.handle.pread(position, min(_SCAN_CHUNK_BYTES, size - position))
                view = memoryview(chunk)
                at = 0
                while at + HEADER_SIZE_BYTES <= len(chunk):
                    header = chunk[at : at + HEADER_SIZE_BYTES]
                    body_length, crc, problem = check_header(header, limit)
                    if problem:
                        raise CorruptRecord(segment.path, segment.base_offset + position + at, problem)
                    record_end = at + HEADER_SIZE_BYTES + body_length
                    if record_end > len(chunk):
                        break
                    body = view[at + HEADER_SIZE_BYTES : record_end]
                    if not crc_matches(header, body, crc):
                        raise CorruptRecord(
                            segment.path, segment.base_offset + position + at, "crc mismatch"
                        )
                    yield segment.base_offset + position + at, bytes(body)
                    at = record_end
                if at == 0:
                    # One record larger than the chunk: read it whole.
                    body, next_offset = self.read_with_next(segment.base_offset + position)
                    yield segment.base_offset + position, body
                    at = next_offset - segment.base_offset - position
                position += at
            index += 1
            position = 0


def _body_if(good: bool, body: memoryview) -> memoryview | None:
    """``body`` when its record checked out, else None (read_bodies' result per record)."""
    return body if good else None
