"""The file handle the logs write through, so tests can inject faults (see ``logstore.faults``).

A ``FileHandle`` is a positional file: ``append`` writes at the end, ``pread`` reads anywhere,
``sync`` is fdatasync. ``OsFile`` is the real one over ``os`` calls. An ``Opener`` makes handles; every
storage class takes one so a test can swap in ``FaultyFile``.

``OsFile.allocate`` sets the file's size ahead of its data (``posix_fallocate``), so a log can
write into space allocated before (docs/FORMATS.md, "Space allocated ahead"): the handle's
``size`` is then where its data ends, not the file's size.

``sync`` is ``fdatasync``: on Linux it writes the data and every piece of metadata needed to
read it back (the size when it changed, the extents written into allocated space), and skips
the times alone; a log allocated ahead then writes no inode per commit (docs/BENCHMARKS.md,
session 21, "prealloc"). Only a file's mtime may be older after a power cut.

``OsFile.append_and_sync`` is ``append`` then ``sync`` with the GIL released once for both (the C
twin ``logstore._framing.write_sync``): a group commit's thread then waits once, not twice, to
take the GIL back from an event loop running Python meanwhile. A handle without it (a test's
``FaultyFile``) gets the two calls. ``durable_write_done`` counts such a write and maps its
errnos to errors, also for a caller that made it itself (``realtime.storage._codecs.write_run``,
through ``SegmentedLog.framed_target``); ``write_sync_python`` is the write's Python twin.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from typing import Callable, Protocol

from logstore.twins import c_twin

# pwrite + fsync in one GIL release (logstore/_framing.c); optional, chosen by logstore.twins.
_write_sync_c = c_twin("logstore._framing", "write_sync")


class FsyncFailed(OSError):
    """``append_and_sync``: every byte was written, the fsync failed (its errno is this one's)."""


class FileHandle(Protocol):
    """What storage classes need from a file."""

    path: str

    def append(self, data: bytes | bytearray | memoryview) -> None:
        """Write all of ``data`` at the end of the file (raises OSError on failure)."""

    def pread(self, offset: int, size: int) -> bytes:
        """Read up to ``size`` bytes at ``offset``; shorter only at end of file."""

    def size(self) -> int:
        """The file's current size in bytes."""

    def truncate(self, size: int) -> None:
        """Cut the file to ``size`` bytes; later appends continue there."""

    def sync(self) -> None:
        """fdatasync the file: its data and the metadata needed to read it back."""

    def close(self) -> None:
        """Close the handle; further calls are errors."""


Opener = Callable[[str], FileHandle]


class OsFile:
    """A ``FileHandle`` over a real file, opened read-write and created if missing."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        self._end = os.fstat(self._fd).st_size
        # The file's size as this handle last set it (open, allocate, truncate); appends past
        # it make the file longer, so allocated_bytes() takes the larger of it and _end.
        self._allocated = self._end
        # Of the last append_and_sync: the fsync's own seconds (no wait for the GIL in them)
        # and the CLOCK_MONOTONIC ns at which it returned (a probe's mark for that wait), the
        # latter only from the C twin, which reads it outside the GIL: storage itself reads no
        # clock, so without the C twin it stays 0, "not known" (the probe then skips it).
        self.fsync_s = 0.0
        self.synced_at_ns = 0

    def append(self, data: bytes | bytearray | memoryview) -> None:
        """Write all of ``data`` at the end, looping over short writes."""
        if type(data) is bytes:
            # The usual case (a group commit makes two of these calls): no view to take.
            written = os.pwrite(self._fd, data, self._end)
            self._end += written
            if written == len(data):
                return
            data = data[written:]  # a short write: the rest through the loop below
        # The views are released even when pwrite raises: the traceback keeps this frame alive,
        # and a live view of the caller's bytearray would make its ``clear()`` (the segment log
        # dropping its buffer after ENOSPC) fail with BufferError.
        with memoryview(data) as whole:
            done = 0
            while done < len(whole):
                with whole[done:] as rest:
                    written = os.pwrite(self._fd, rest, self._end)
                self._end += written
                done += written

    def append_and_sync(self, data: bytes, then: tuple[OsFile, bytes] | None = None,
                        ) -> OSError | None:
        """``append(data)`` then ``sync()``, the GIL released once for both when the C twin is
        built; with ``then`` (another file, bytes), after a good fsync also ``append`` those
        bytes to that file in the same release. A write failure raises OSError (what was
        written before it counts, as in ``append``), a failed fsync ``FsyncFailed``; the
        ``then`` write's failure is returned, not raised (this file's data is durable by then).
        ``fsync_s`` and ``synced_at_ns`` say how long the fsync took and when it returned
        (the latter with the C twin only; 0 otherwise)."""
        if then is not None and (type(then[0]) is not OsFile or type(then[1]) is not bytes):
            # Not a real file (a test's FaultyFile) or not bytes: its append after this call.
            self.append_and_sync(data)
            return append_then(then)
        if _write_sync_c is None or type(data) is not bytes:
            self.append(data)
            started_s = time.perf_counter()
            try:
                os.fdatasync(self._fd)
            except OSError as exc:
                raise FsyncFailed(exc.errno, exc.strerror, self.path) from exc
            self.fsync_s = time.perf_counter() - started_s
            self.synced_at_ns = 0  # not known without the C twin (see __init__)
            return append_then(then)
        if then is None:
            outcome = _write_sync_c(self._fd, data, self._end)
            return durable_write_done(self, None, outcome + (0, 0))
        other, other_data = then
        return durable_write_done(self, other, _write_sync_c(
            self._fd, data, self._end, other._fd, other_data, other._end))

    def pread(self, offset: int, size: int) -> bytes:
        """Read up to ``size`` bytes at ``offset``."""
        return os.pread(self._fd, size, offset)

    def size(self) -> int:
        """Bytes in the file, counting what this handle appended."""
        return self._end

    def allocated_bytes(self) -> int:
        """The file's size: its data and any space allocated ahead of it (``allocate``)."""
        return max(self._allocated, self._end)

    def allocate(self, size_bytes: int) -> None:
        """Make the file ``size_bytes`` long ahead of its data, its blocks allocated
        (``posix_fallocate``, which sets the size): later appends up to there change no size
        and allocate nothing. The data's end (``size``) does not move; the space reads as zeros.
        Raises the OSError: ENOSPC (part of the space may be allocated, the size set that far:
        ``truncate`` gives it back), EOPNOTSUPP or EINVAL where the filesystem cannot (glibc
        writes zeros instead of raising EOPNOTSUPP: docs/FORMATS.md, "Space allocated ahead")."""
        allocated = self.allocated_bytes()
        if size_bytes <= allocated:
            return
        try:
            os.posix_fallocate(self._fd, allocated, size_bytes - allocated)
        except OSError:
            # A partial allocation (ENOSPC) may have moved the size: ask the file.
            self._allocated = os.fstat(self._fd).st_size
            raise
        self._allocated = size_bytes

    def truncate(self, size: int) -> None:
        """Cut the file to ``size`` bytes (space allocated ahead included)."""
        os.ftruncate(self._fd, size)
        self._end = self._allocated = size

    def sync(self) -> None:
        """fdatasync the file (see the module docstring)."""
        os.fdatasync(self._fd)

    def close(self) -> None:
        """Close the descriptor (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def durable_write_done(file: OsFile, then: OsFile | None,
                       outcome: tuple[int, int, int, int, int, int, int]) -> OSError | None:
    """After a durable write of ``file`` (and ``then``) made at their ends (descriptor and
    offset: ``_fd``, ``_end``; ``SegmentedLog.framed_target`` reads them) by ``write_sync`` or
    a call with its contract (``outcome``: written, write_errno, fsync_errno,
    fsync_ns, synced_at_ns, then_written, then_errno; ``write_sync_python`` is the contract's
    Python twin): count the bytes written, then raise or return as ``append_and_sync`` does (a
    write failure OSError, a failed fsync ``FsyncFailed``, the ``then`` write's failure
    returned)."""
    written, write_errno, fsync_errno, fsync_ns, synced_at_ns, then_written, then_errno = outcome
    file._end += written
    if then is not None:
        then._end += then_written
    if write_errno:
        raise OSError(write_errno, os.strerror(write_errno), file.path)
    file.fsync_s = fsync_ns / 1e9
    file.synced_at_ns = synced_at_ns
    if fsync_errno:
        raise FsyncFailed(fsync_errno, os.strerror(fsync_errno), file.path)
    if then_errno:
        return OSError(then_errno, os.strerror(then_errno), then.path)  # type: ignore[union-attr]
    return None


def write_sync_python(fd: int, data: bytes, offset: int, then_fd: int = -1,
                      then_data: bytes | None = None, then_offset: int = 0,
                      ) -> tuple[int, int, int, int, int, int, int]:
    """The Python twin of the durable write of ``logstore._framing.write_sync`` (and of
    ``realtime.storage._codecs.write_run``; logstore/_framing.h): ``data`` written at
    ``offset`` of ``fd`` (looping over short writes), fsynced, then ``then_data`` at
    ``then_offset`` of ``then_fd``. (written, write_errno, fsync_errno, fsync_ns,
    synced_at_ns, then_written, then_errno): an OS error is its errno, not raised; a failed
    write skips the fsync, a failed fsync the ``then`` write. ``synced_at_ns`` is 0, "not
    known" (storage reads no clock; see ``OsFile.__init__``)."""
    written, write_errno = _pwrite_all(fd, data, offset)
    if write_errno:
        return written, write_errno, 0, 0, 0, 0, 0
    started_s = time.perf_counter()
    fsync_errno = 0
    try:
        os.fdatasync(fd)
    except OSError as exc:
        fsync_errno = exc.errno or errno.EIO  # an OSError without one still failed
    fsync_ns = int((time.perf_counter() - started_s) * 1e9)
    if fsync_errno or then_data is None:
        return written, 0, fsync_errno, fsync_ns, 0, 0, 0
    then_written, then_errno = _pwrite_all(then_fd, then_data, then_offset)
    return written, 0, 0, fsync_ns, 0, then_written, then_errno


def _pwrite_all(fd: int, data: bytes, offset: int) -> tuple[int, int]:
    """``data`` written at ``offset`` of ``fd``, looping over short writes: (bytes written,
    0), or (bytes written, the errno of the pwrite that failed after them)."""
    written = 0
    while written < len(data):
        try:
            written += os.pwrite(fd, data[written:] if written else data, offset + written)
        except OSError as exc:
            return written, exc.errno or errno.EIO  # an OSError without one still failed
    return written, 0


def append_then(then: tuple[FileHandle, bytes] | None) -> OSError | None:
    """After a good fsync, ``append`` the bytes of ``then`` (a file, bytes) to its file, if any:
    that write's failure is returned, not raised (what was fsynced before it is durable)."""
    if then is None:
        return None
    try:
        then[0].append(then[1])
    except OSError as exc:
        return exc
    return None


def fsync_directory(path: str) -> None:
    """fsync a directory so a create, rename or delete inside it is durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomically(path: str, data: bytes) -> None:
    """Replace ``path`` whole: write a temp file, fsync it, rename over, fsync the directory."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp_path = f"{path}.tmp"
    fd = os.open(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            with memoryview(data) as whole:
                done = 0
                while done < len(whole):
                    with whole[done:] as rest:
                        done += os.write(fd, rest)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        # A half-written temp file would hold on to the space a full disk needs back.
        with contextlib.suppress(OSError):
            os.unlink(tmp_path)
        raise
    os.replace(tmp_path, path)
    fsync_directory(directory)
