"""The schedule files (``schedule_entry`` format) with their in-memory index and a write-behind
buffer.

``commit`` hands entries to ``append`` after the delay log is durable; they wait in a per-bucket
buffer (at most ``buffer_bytes_max``, default 16 MiB, i.e. 524,288 entries; a checkpoint
also flushes it) and are written with one
open/append/close per bucket by ``flush``. So a commit that spreads 1,000 messages over 1,000
buckets does not open 1,000 files, and a crash loses only buffered entries, which recovery rebuilds
from the delay log. Reads merge the file and the buffer, so a buffered entry is already visible.

``sync`` makes every written file durable before a checkpoint: fsync file by file when few were
written since the last sync, else one ``syncfs`` of the filesystem (``os.sync`` where ``syncfs``
is missing), because fsyncing tens of thousands of small files one by one costs a millisecond each.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from delayserver.storage.layout import DAY_MS, BucketIndex, Layout
from delayserver.storage.schedule_entry import (
    ENTRY_SIZE_BYTES,
    FIELDS,
    check_schedule_entry,
)
from logstore import FileHandle, Opener, fsync_directory

log = logging.getLogger(__name__)

SCHEDULE_BUFFER_BYTES_MAX = 16 << 20  # write-behind buffer before a flush (524,288 entries)
FSYNC_FILES_MAX = 256  # more files written since the last sync: one syncfs instead


class FlushFailed(Exception):
    """A schedule write failed; ``cause`` is the OSError, ``path`` the file (cut back)."""

    def __init__(self, path: str, cause: OSError) -> None:
        self.path = path
        self.cause = cause
        super().__init__(f"writing {path} failed: {cause}")


_libc_syncfs = None


def sync_filesystem(path: str) -> None:
    """Flush every dirty page of the filesystem holding ``path`` (syncfs; os.sync as fallback)."""
    global _libc_syncfs
    if _libc_syncfs is None:
        try:
            _libc_syncfs = ctypes.CDLL(None, use_errno=True).syncfs
        except (AttributeError, OSError):
            _libc_syncfs = False
    if _libc_syncfs is False:
        os.sync()
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc_syncfs(fd) != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"syncfs failed: {os.strerror(code)}", path)
    finally:
        os.close(fd)


class ScheduleFiles:
    """Every bucket's schedule file, the index of buckets and the write-behind buffer.

    ``index`` counts the entries in the files; a bucket with only buffered entries is indexed
    with 0 so that range queries see it, and ``count`` adds the buffered ones."""

    def __init__(self, layout: Layout, opener: Opener,
                 buffer_bytes_max: int = SCHEDULE_BUFFER_BYTES_MAX) -> None:
        self.layout = layout
        self.index = BucketIndex()
        self._opener = opener
        self.buffer_bytes_max = buffer_bytes_max
        self._buffer: dict[int, bytearray] = {}
        self._buffer_base: dict[int, int] = {}  # bucket -> entries in its file when buffered
        self.buffered_bytes = 0
        self._written: set[str] | None = set()  # None: too many, sync the filesystem
        self._new_dirs: set[str] = set()
        self._day_dirs: set[int] = set()

    # ------------------------------------------------------------------ writing

    def append(self, bucket_ms: int, entry: bytes) -> int:
        """Buffer one encoded entry for the bucket; returns its index."""
        return self.append_each([bucket_ms], [entry])[0]

    def append_each(self, buckets_ms: list[int], entries: list[bytes]) -> list[int]:
        """``append`` of each entry for its bucket, in order, in one call; their indexes. A
        group commit of messages due in many buckets (W1's delays) files them this way: a
        Python call per entry fewer on the delay-io thread."""
        buffer, bases = self._buffer, self._buffer_base
        indexes = []
        for bucket_ms, entry in zip(buckets_ms, entries):
            buffered = buffer.get(bucket_ms)
            if buffered is None:
                base = bases[bucket_ms] = self.index.reserve(bucket_ms, 0)
                buffer[bucket_ms] = bytearray(entry)
                indexes.append(base)
            else:
                indexes.append(bases[bucket_ms] + len(buffered) // ENTRY_SIZE_BYTES)
                buffered += entry
        self.buffered_bytes += ENTRY_SIZE_BYTES * len(indexes)
        return indexes

    def append_run(self, bucket_ms: int, entries: bytes) -> int:
        """Buffer a run of encoded entries (a multiple of 32 bytes) for one bucket, as
        ``append`` of each in turn would; returns the index of the first."""
        buffered = self._buffer.get(bucket_ms)
        self.buffered_bytes += len(entries)
        if buffered is None:
            self._buffer[bucket_ms] = bytearray(entries)
            base = self._buffer_base[bucket_ms] = self.index.reserve(bucket_ms, 0)
            return base
        index = self._buffer_base[bucket_ms] + len(buffered) // ENTRY_SIZE_BYTES
        buffered += entries
        return index

    @property
    def buffer_full(self) -> bool:
        """True when the buffer passed ``buffer_bytes_max``."""
        return self.buffered_bytes >= self.buffer_bytes_max

    def buffered(self, bucket_ms: int) -> bytes:
        """The bucket's entries not yet written."""
        return bytes(self._buffer.get(bucket_ms, b""))

    def count(self, bucket_ms: int) -> int:
        """Entries of the bucket, written and buffered."""
        buffered = self._buffer.get(bucket_ms)
        extra = len(buffered) // ENTRY_SIZE_BYTES if buffered is not None else 0
        return self.index.count(bucket_ms) + extra

    def ensure_day_dir(self, day: int) -> None:
        """Create the day's directory if needed (its parent is fsynced by the next sync)."""
        if day not in self._day_dirs:
            path = self.layout.day_dir(day)
            if not os.path.isdir(path):
                os.makedirs(path, exist_ok=True)
                self._new_dirs.add(self.layout.schedule_dir)
            self._day_dirs.add(day)

    def _note_written(self, path: str) -> None:
        if self._written is not None:
            self._written.add(path)
            if len(self._written) > FSYNC_FILES_MAX:
                self._written = None

    def write_file(self, bucket_ms: int, data: bytes | bytearray,
                   cut_from_offset: int | None = None) -> int:
        """Append ``data`` to the bucket's file, first cutting the file at its first entry whose
        ``delay_log_offset >= cut_from_offset`` (or that fails verification; entries are in
        offset order, so a binary search) when that is given. Returns the entries cut. On a write
        failure the file is cut back and ``FlushFailed`` raised. The index is not touched."""
        self.ensure_day_dir(bucket_ms // DAY_MS)
        path = self.layout.schedule_path(bucket_ms)
        created = self.index.count(bucket_ms) == 0 and not os.path.exists(path)
        handle: FileHandle | None = None
        cut = 0
        try:
            handle = self._opener(path)
            size_before = handle.size()
            if cut_from_offset is not None:
                keep = _first_at_or_after(handle, size_before, cut_from_offset)
                if keep * ENTRY_SIZE_BYTES != size_before:
                    cut = size_before // ENTRY_SIZE_BYTES - keep
                    handle.truncate(keep * ENTRY_SIZE_BYTES)
                    size_before = keep * ENTRY_SIZE_BYTES
            if data:
                try:
                    handle.append(data)
                except OSError as exc:
                    try:
                        handle.truncate(size_before)
                    except OSError:
                        pass
                    raise FlushFailed(path, exc) from exc
        except OSError as exc:
            raise FlushFailed(path, exc) from exc
        finally:
            if handle is not None:
                handle.close()
        if created:
            self._new_dirs.add(self.layout.day_dir(bucket_ms // DAY_MS))
        self._note_written(path)
        return cut

    def flush(self, bucket_ms: int | None = None) -> None:
        """Write the buffer (or one bucket's part of it) to the files; raises ``FlushFailed``
        leaving what was not written in the buffer."""
        buckets = list(self._buffer) if bucket_ms is None else (
            [bucket_ms] if bucket_ms in self._buffer else [])
        for bucket in buckets:
            data = self._buffer[bucket]
            self.write_file(bucket, data)
            self.index.reserve(bucket, len(data) // ENTRY_SIZE_BYTES)
            del self._buffer[bucket]
            del self._buffer_base[bucket]
            self.buffered_bytes -= len(data)

    def sync(self) -> None:
        """fsync everything written since the last sync (files and new directory entries)."""
        assert not self._buffer, "flush before sync"
        if self._written is None:
            sync_filesystem(self.layout.data_dir)
        else:
            for path in sorted(self._written):
                handle = self._opener(path)
                try:
                    handle.sync()
                finally:
                    handle.close()
            for directory in sorted(self._new_dirs):
                fsync_directory(directory)
        self._written = set()
        self._new_dirs = set()

    # ------------------------------------------------------------------ reading

    def disk_count(self, bucket_ms: int) -> int:
        """Entries the bucket's file should hold."""
        return self.index.count(bucket_ms)

    def read_file(self, bucket_ms: int) -> bytes:
        """The bucket's file bytes (empty when there is no file)."""
        return read_whole(self.layout.schedule_path(bucket_ms))

    # ------------------------------------------------------------------ cutting

    def cut_from_offset(self, bucket_ms: int, from_offset: int) -> int:
        """Cut the bucket's file at its first entry at or past ``from_offset`` (or bad); returns
        the entries removed and sets the index to what is left."""
        assert bucket_ms not in self._buffer
        if not os.path.exists(self.layout.schedule_path(bucket_ms)):
            self.index.remove(bucket_ms)
            return 0
        cut = self.write_file(bucket_ms, b"", cut_from_offset=from_offset)
        self.index.set_count(bucket_ms, self.index.count(bucket_ms) - cut)
        return cut

    def truncate_bucket(self, bucket_ms: int) -> int:
        """Empty the bucket's file (a rebuild follows); returns the entries removed."""
        assert bucket_ms not in self._buffer
        path = self.layout.schedule_path(bucket_ms)
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            size = 0
        if size:
            os.truncate(path, 0)
            self._note_written(path)
        self.index.set_count(bucket_ms, 0)
        return size // ENTRY_SIZE_BYTES

    def forget(self, bucket_ms: int) -> None:
        """Drop the bucket from the index and the buffer (its files are being deleted)."""
        data = self._buffer.pop(bucket_ms, None)
        if data is not None:
            self.buffered_bytes -= len(data)
            del self._buffer_base[bucket_ms]
        self.index.remove(bucket_ms)
        # Retiring a day's last files removes the day directory too; a later bucket of the same
        # day must create it again rather than trust that it exists.
        self._day_dirs.discard(bucket_ms // DAY_MS)


def _first_at_or_after(handle: FileHandle, size: int, from_offset: int) -> int:
    """Index of the first entry of the file whose delay_log_offset >= ``from_offset`` or that
    fails verification (the number of whole entries when none does)."""
    whole = size // ENTRY_SIZE_BYTES
    if whole == 0:
        return 0

    def keeps(i: int) -> bool:
        data = handle.pread(i * ENTRY_SIZE_BYTES, ENTRY_SIZE_BYTES)
        return check_schedule_entry(data) is None and FIELDS.unpack_from(data, 0)[1] < from_offset

    if keeps(whole - 1):  # the common case: nothing at or past the offset
        return whole
    low, high = 0, whole - 1
    while low < high:
        middle = (low + high) // 2
        if keeps(middle):
            low = middle + 1
        else:
            high = middle
    return low


def read_whole(path: str) -> bytes:
    """Every byte of ``path``; empty when it does not exist."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return b""
    try:
        size = os.fstat(fd).st_size
        chunks = []
        at = 0
        while at < size:
            chunk = os.pread(fd, size - at, at)
            if not chunk:
                break
            chunks.append(chunk)
            at += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def is_enospc(exc: BaseException) -> bool:
    """True when ``exc`` (or what it wraps) is ENOSPC."""
    cause = getattr(exc, "cause", exc)
    return isinstance(cause, OSError) and cause.errno == errno.ENOSPC
