"""ConsumerLog: one subject's index from subject sequence to message-log record.

Files: ``<data_dir>/consumerlog/<encoded subject>/<20-digit base sequence>.clog`` (see
``realtime.storage.subject_names`` for the encoding). Every file holds ``entries_per_file``
fixed-size entries; the entry for sequence i is at byte ``(i - base) * 32`` of the file whose base
is ``i - i % entries_per_file``. Every file but the last is full. Entries are big-endian::

    Offset | Size | Field
    -------+------+------------------------------------------------------------------
    0      | 8    | timestamp_ms: u64, the message's timestamp (copied from its record)
    8      | 8    | message_log_offset: u64, offset of the record in the message log
    16     | 4    | size_bytes: u32, body size of that message-log record; 0 marks a hole
    20     | 8    | tag_bloom: u64, the record's tag bloom (bit h % 64 per tag hash h)
    28     | 4    | crc32: u32, CRC-32 (zlib) of bytes 0..27

A hole (all fields 0, valid CRC) stands for a sequence whose message was already deleted when
the index was rebuilt; holes only ever sit below the subject's first sequence.

What it does NOT guarantee: the consumer log is derived data; it is fsynced only before a
checkpoint is written and is verified and rebuilt from the message log on open, so after a crash
its tail may be older than the message log until recovery runs. The CRC detects torn writes and
bit rot, not tampering.
"""

from __future__ import annotations

import errno
import os
import struct
import zlib
from dataclasses import dataclass
from itertools import chain
from typing import NamedTuple, NoReturn, Sequence

from logstore import DiskFull, FileHandle, LogWriteFailed, OutOfDescriptors, fsync_directory
from logstore.descriptors import DescriptorCache, out_of_descriptors
from logstore.twins import c_twin
from realtime.storage.errors import CorruptEntry, StoreFailed

# The C twin of encode_entries (realtime/storage/_codecs.c); optional, chosen by logstore.twins.
_encode_entries_c = c_twin("realtime.storage._codecs", "encode_entries")

ENTRY = struct.Struct(
    ">Q"  # timestamp_ms
    "Q"  # message_log_offset
    "I"  # size_bytes (0 = hole)
    "Q"  # tag_bloom
)
CRC = struct.Struct(">I")  # crc32 of the 28 bytes above
ENTRY_SIZE_BYTES = ENTRY.size + CRC.size  # 32
FILE_SUFFIX = ".clog"


class Entry(NamedTuple):
    """One decoded consumer-log entry."""

    timestamp_ms: int
    message_log_offset: int
    size_bytes: int
    tag_bloom: int

    @property
    def is_hole(self) -> bool:
        """True for a placeholder of an already-deleted message."""
        return self.size_bytes == 0


HOLE = Entry(0, 0, 0, 0)


def encode_entry(entry: Entry) -> bytes:
    """The 32 bytes of ``entry``."""
    head = ENTRY.pack(*entry)
    return head + CRC.pack(zlib.crc32(head))


def _check_columns(timestamps_ms: Sequence[int], message_log_offsets: Sequence[int],
                   sizes_bytes: Sequence[int], tag_blooms: Sequence[int]) -> None:
    """ValueError naming the lengths when ``encode_entries``' columns differ in length."""
    if not len(timestamps_ms) == len(message_log_offsets) == len(sizes_bytes) == len(tag_blooms):
        raise ValueError(f"columns of {len(timestamps_ms)} timestamps, "
                         f"{len(message_log_offsets)} offsets, {len(sizes_bytes)} sizes and "
                         f"{len(tag_blooms)} blooms differ in length")


def encode_entries(timestamps_ms: Sequence[int], message_log_offsets: Sequence[int],
                   sizes_bytes: Sequence[int], tag_blooms: Sequence[int]) -> bytes:
    """The bytes of several entries given column by column: ``encode_entry`` of each, joined.

    The store indexes a whole commit at once: with the optional C twin built (``_codecs``) and
    the columns given as lists, it does the work; otherwise every step here is a ``map`` in C.
    Raises ValueError when a field does not fit its width or the columns differ in length."""
    if _encode_entries_c is not None and type(timestamps_ms) is list and type(
            message_log_offsets) is list and type(sizes_bytes) is list and type(
            tag_blooms) is list:
        try:
            return _encode_entries_c(timestamps_ms, message_log_offsets, sizes_bytes,
                                     tag_blooms)
        except TypeError:
            pass  # a field that is not an int: the Python twin takes __index__ or words it
        except ValueError:
            # The C twin checks the columns' lengths too (a commit's path: no len() here);
            # a mismatch is worded with the lengths, a field out of range as C words it.
            _check_columns(timestamps_ms, message_log_offsets, sizes_bytes, tag_blooms)
            raise
    _check_columns(timestamps_ms, message_log_offsets, sizes_bytes, tag_blooms)
    try:
        heads = list(map(ENTRY.pack, timestamps_ms, message_log_offsets, sizes_bytes,
                         tag_blooms))
    except (struct.error, OverflowError) as exc:  # OverflowError: an __index__ int
        raise ValueError(f"consumer-log entry field out of range: {exc}") from None
    crcs = map(CRC.pack, map(zlib.crc32, heads))
    return b"".join(chain.from_iterable(zip(heads, crcs)))


def decode_entry(data: bytes | memoryview) -> Entry:
    """Decode 32 bytes; raises ValueError when the length or the CRC is wrong."""
    if len(data) != ENTRY_SIZE_BYTES:
        raise ValueError(f"entry of {len(data)} bytes, expected {ENTRY_SIZE_BYTES}")
    (crc,) = CRC.unpack_from(data, ENTRY.size)
    if zlib.crc32(data[: ENTRY.size]) != crc:
        raise ValueError("crc mismatch")
    return Entry(*ENTRY.unpack_from(data, 0))


def file_name(base_sequence: int) -> str:
    """The file name of the consumer-log file starting at ``base_sequence``."""
    return f"{base_sequence:020d}{FILE_SUFFIX}"


@dataclass(frozen=True)
class DeletedFile:
    """A consumer-log file removed by retention."""

    base_sequence: int
    path: str
    size_bytes: int


class ConsumerLog:
    """The files of one subject's consumer log. Not thread-safe: the store is its one owner.

    It keeps no descriptor of its own: every file is opened through ``files``, the store's
    ``DescriptorCache`` shared by all subjects, so the open files of a store are bounded however
    many subjects it has. A handle is used at once and never kept across calls. Files written
    since the last ``sync`` are remembered by base (``_dirty``) and fsynced through a fresh
    handle if the cache closed theirs meanwhile.
    """

    def __init__(self, directory: str, subject: str, entries_per_file: int,
                 files: DescriptorCache) -> None:
        self.directory = directory
        self.subject = subject
        self.entries_per_file = entries_per_file
        self._files = files
        self._bases: list[int] = []
        self._dirty: set[int] = set()
        self._directory_dirty = False
        self._last_path: tuple[int, str] = (-1, "")  # (base, path) last made by _file_path
        self.end = 0  # next sequence to be indexed
        self.first_sequence = 0  # first sequence whose message is still stored (kept by owner)
        self.layout_problems: list[str] = []
        os.makedirs(directory, exist_ok=True)
        self._load_layout()

    # ------------------------------------------------------------------ layout

    @property
    def begin(self) -> int:
        """The lowest sequence any file covers (holes included)."""
        return self._bases[0] if self._bases else self.end

    def _file_path(self, base: int) -> str:
        if base == self._last_path[0]:
            return self._last_path[1]  # the active file: a commit asks for it every time
        path = os.path.join(self.directory, file_name(base))
        self._last_path = (base, path)
        return path

    def _load_layout(self) -> None:
        """Find the files; cut at the first one out of place (a gap, a short middle file)."""
        per_file_bytes = self.entries_per_file * ENTRY_SIZE_BYTES
        bases = []
        for name in os.listdir(self.directory):
            stem = name[: -len(FILE_SUFFIX)]
            if name.endswith(FILE_SUFFIX) and len(stem) == 20 and stem.isdigit():
                bases.append(int(stem))
        bases.sort()
        if any(base % self.entries_per_file for base in bases):
            # Written with another entries_per_file: the index is derived, so drop it all.
            self.layout_problems.append(
                f"file bases {bases} are not multiples of entries_per_file "
                f"{self.entries_per_file}; every file dropped"
            )
            self._unlink(bases)
            bases = []
        kept: list[int] = []
        for base in bases:
            size = os.path.getsize(self._file_path(base))
            if kept and base != kept[-1] + self.entries_per_file:
                self.layout_problems.append(f"gap before file {file_name(base)}")
                break
            if size > per_file_bytes:
                self.layout_problems.append(
                    f"file {file_name(base)} holds {size} bytes, more than {per_file_bytes}"
                )
                os.truncate(self._file_path(base), per_file_bytes)
                size = per_file_bytes
            kept.append(base)
            if size < per_file_bytes:
                if base != bases[-1]:
                    self.layout_problems.append(f"file {file_name(base)} is short but not last")
                break
        self._unlink([b for b in bases if b not in kept])
        self._bases = kept
        if kept:
            size = os.path.getsize(self._file_path(kept[-1]))
            whole = size - size % ENTRY_SIZE_BYTES
            if whole != size:
                self.layout_problems.append(
                    f"torn entry: {size % ENTRY_SIZE_BYTES} trailing bytes cut from "
                    f"{file_name(kept[-1])}"
                )
                os.truncate(self._file_path(kept[-1]), whole)
            self.end = kept[-1] + whole // ENTRY_SIZE_BYTES
            self.first_sequence = kept[0]
        if self.layout_problems:
            self._fsync_directory()

    def _fsync_directory(self) -> None:
        """fsync the directory; an open that finds no descriptor left is retried after the
        cache lets go of its own."""
        self._files.retry_on_emfile(fsync_directory, self.directory)

    def _unlink(self, bases: list[int]) -> None:
        for base in bases:
            path = self._file_path(base)
            self._files.discard(path)
            self._dirty.discard(base)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass  # a cut-back file whose open failed (no descriptor left) was never made

    def _truncate_file(self, base: int, size_bytes: int) -> None:
        """Cut the file at ``base`` to ``size_bytes``: through its handle, or by path when no
        descriptor is left to open one (a batch cut back because its own open found none must
        not fail the store)."""
        try:
            handle = self._handle(base)
        except OSError as exc:
            if not out_of_descriptors(exc):
                raise
            os.truncate(self._file_path(base), size_bytes)  # not cached: the open failed
            return
        handle.truncate(size_bytes)

    def _handle(self, base: int) -> FileHandle:
        """The open handle of the file at ``base``: use it at once, before any other call that
        may open a file (the cache may close it then)."""
        return self._files.get(self._file_path(base))

    # ------------------------------------------------------------------ reading

    def entry(self, sequence: int) -> Entry:
        """The entry of ``sequence`` (``begin <= sequence < end``); raises CorruptEntry."""
        return self.entries(sequence, 1)[0]

    def entries(self, from_sequence: int, count: int) -> list[Entry]:
        """Up to ``count`` entries from ``from_sequence``, stopping at the end."""
        assert self.begin <= from_sequence <= self.end, (from_sequence, self.begin, self.end)
        out: list[Entry] = []
        sequence = from_sequence
        stop = min(self.end, from_sequence + count)
        while sequence < stop:
            base = sequence - sequence % self.entries_per_file
            take = min(stop, base + self.entries_per_file) - sequence
            handle = self._handle(base)
            data = handle.pread((sequence - base) * ENTRY_SIZE_BYTES, take * ENTRY_SIZE_BYTES)
            view = memoryview(data)
            for index in range(take):
                at = index * ENTRY_SIZE_BYTES
                try:
                    out.append(decode_entry(view[at : at + ENTRY_SIZE_BYTES]))
                except ValueError as exc:
                    raise CorruptEntry(self.subject, sequence + index, handle.path,
                                       str(exc)) from exc
            sequence += take
        return out

    def first_valid_bad_entry(self, from_sequence: int) -> int | None:
        """The first sequence at or after ``from_sequence`` whose entry fails its CRC, or None."""
        sequence = max(from_sequence, self.begin)
        while sequence < self.end:
            chunk = min(self.end - sequence, 4096)
            try:
                self.entries(sequence, chunk)
            except CorruptEntry as exc:
                return exc.sequence
            sequence += chunk
        return None

    def find_first(self, predicate) -> int:
        """The lowest sequence in [begin, end) whose entry satisfies the monotone ``predicate``
        (False...False True...True), or ``end``."""
        low, high = self.begin, self.end
        while low < high:
            middle = (low + high) // 2
            if predicate(self.entry(middle)):
                high = middle
            else:
                low = middle + 1
        return low

    # ------------------------------------------------------------------ writing

    def append_entries(self, entries: list[Entry]) -> None:
        """Write entries for sequences ``end, end+1, ...``. On failure the log is cut back to
        where it was and ``DiskFull`` or ``OutOfDescriptors`` (retriable), ``LogWriteFailed`` or
        ``StoreFailed`` raised."""
        self.append_encoded(b"".join(map(encode_entry, entries)))

    def append_columns(self, slices: list[tuple[int, int]], timestamps_ms: list[int],
                       message_log_offsets: list[int], sizes_bytes: list[int],
                       tag_blooms: list[int]) -> None:
        """``append_encoded`` of the entries of the records at ``slices`` ([start, stop) of
        the columns, in order) in one write: a commit's records of this subject, on a master
        (its write batch's columns) and on a slave (its copy's) alike."""
        if len(slices) == 1 and slices[0] == (0, len(message_log_offsets)):
            # The usual commit: one subject, one run, the whole of the columns.
            self.append_encoded(encode_entries(timestamps_ms, message_log_offsets, sizes_bytes,
                                               tag_blooms))
            return
        self.append_encoded(b"".join([
            encode_entries(timestamps_ms[start:stop], message_log_offsets[start:stop],
                           sizes_bytes[start:stop], tag_blooms[start:stop])
            for start, stop in slices]))

    def append_encoded(self, data: bytes) -> None:
        """``append_entries`` of entries already encoded (``encode_entries``), 32 bytes each."""
        assert len(data) % ENTRY_SIZE_BYTES == 0, len(data)
        count = len(data) // ENTRY_SIZE_BYTES
        start_end = self.end
        start_bases = len(self._bases)
        position = 0
        try:
            while position < count:
                base = self.end - self.end % self.entries_per_file
                if not self._bases or self._bases[-1] != base:
                    assert not self._bases or self._bases[-1] + self.entries_per_file == base
                    self._bases.append(base)
                    self._directory_dirty = True
                take = min(count - position, base + self.entries_per_file - self.end)
                handle = self._handle(base)
                self._dirty.add(base)
                if take == count:
                    handle.append(data)
                else:
                    handle.append(data[position * ENTRY_SIZE_BYTES:
                                       (position + take) * ENTRY_SIZE_BYTES])
                self.end += take
                position += take
        except OSError as exc:
            self._write_failed(start_end, start_bases, count, exc)

    def _write_failed(self, start_end: int, start_bases: int, count: int,
                      exc: OSError) -> NoReturn:
        """Cut the log back to ``start_end`` and raise what the failed write of ``count``
        entries means: DiskFull, OutOfDescriptors, LogWriteFailed (StoreFailed if the cut
        failed)."""
        path = self._file_path(self._bases[-1])
        self._cut_back(start_end, start_bases, exc)
        if exc.errno == errno.ENOSPC:
            raise DiskFull(path, count) from exc
        if out_of_descriptors(exc):
            # Nothing was written (the open failed) and the log is cut back: not sticky.
            raise OutOfDescriptors(path, exc) from exc
        raise LogWriteFailed(path, "write", exc) from exc

    def handle_for(self, count: int) -> FileHandle | None:
        """The open handle ``count`` more entries would be appended to, when they all fit the
        last file and it is open (a commit's usual case), else None: the caller writes
        through it (``SegmentedLog.append_durably_then``) and then calls ``appended``."""
        if not self._bases:
            return None
        base = self._bases[-1]
        if not base <= self.end <= base + self.entries_per_file - count:
            return None
        last_base, path = self._last_path  # the active file's, made by every earlier commit
        return self._files.cached(path if last_base == base else self._file_path(base))

    def appended(self, count: int, error: OSError | None) -> None:
        """``count`` entries were written through ``handle_for``'s handle (``error`` None), or
        that write failed: the log is cut back and the error raised as ``append_encoded``
        raises it."""
        if error is not None:
            self._write_failed(self.end, len(self._bases), count, error)
        self._dirty.add(self._bases[-1])
        self.end += count

    def _cut_back(self, end: int, bases_count: int, cause: OSError) -> None:
        try:
            self._unlink(self._bases[bases_count:])
            del self._bases[bases_count:]
            if self._bases:
                base = self._bases[-1]
                self._truncate_file(base, (end - base) * ENTRY_SIZE_BYTES)
        except OSError as exc:
            raise StoreFailed(self.directory, exc) from cause
        self.end = end

    def fill_holes(self, to_sequence: int) -> int:
        """Append hole entries up to ``to_sequence``; returns how many."""
        count = to_sequence - self.end
        if count <= 0:
            return 0
        if not self._bases:
            # Start the log at the file that holds ``to_sequence``: nothing below is needed.
            self.end = max(self.end, to_sequence - to_sequence % self.entries_per_file)
            self.first_sequence = self.end
            count = to_sequence - self.end
        self.append_entries([HOLE] * count)
        return count

    def truncate(self, sequence: int) -> int:
        """Remove every entry at or after ``sequence``; returns how many were removed."""
        sequence = max(sequence, self.begin)
        removed = self.end - sequence
        if removed <= 0:
            return 0
        doomed = [base for base in self._bases if base >= sequence]
        self._unlink(doomed)
        self._bases = [base for base in self._bases if base < sequence]
        if self._bases:
            base = self._bases[-1]
            self._truncate_file(base, (sequence - base) * ENTRY_SIZE_BYTES)
            self._dirty.add(base)
        self._directory_dirty = True
        self.end = sequence
        self.first_sequence = min(self.first_sequence, sequence)
        return removed

    def sync(self) -> None:
        """fsync every file written since the last sync (and the directory if files changed)."""
        for base in sorted(self._dirty):
            try:
                # Through the cache: the handle that wrote it may have been closed since, and
                # fsync of a fresh descriptor flushes the file's data all the same.
                self._handle(base).sync()
            except OSError as exc:
                raise StoreFailed(self._file_path(base), exc) from exc
        self._dirty.clear()
        if self._directory_dirty:
            try:
                self._fsync_directory()
            except OSError as exc:
                raise StoreFailed(self.directory, exc) from exc
            self._directory_dirty = False

    # ------------------------------------------------------------------ retention

    def delete_files_below(self, sequence: int) -> list[DeletedFile]:
        """Delete files whose every entry is below ``sequence``; never the last file."""
        deleted = []
        while len(self._bases) > 1 and self._bases[0] + self.entries_per_file <= sequence:
            base = self._bases[0]
            path = self._file_path(base)
            size = os.path.getsize(path)
            self._unlink([base])
            del self._bases[0]
            deleted.append(DeletedFile(base, path, size))
        if deleted:
            self._fsync_directory()
        return deleted

    def close(self) -> None:
        """Close this subject's files held by the cache (no fsync: the index is rebuilt from
        the message log if needed)."""
        for base in self._bases:
            self._files.discard(self._file_path(base))
