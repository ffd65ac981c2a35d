"""A fault-injecting ``FileHandle`` for tests: failed writes and fsyncs, short writes, full disk,
allocating ahead that fails (a full disk, a filesystem that cannot).

``FaultPlan`` says what goes wrong; ``FaultyFile`` wraps a real ``OsFile`` and obeys it. One plan can
be shared by every file a log opens (``plan.opener``), so "the 3rd write anywhere fails" works
across segment rolls. ``flip_bit`` damages a file on disk to simulate bit rot.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field

from logstore.fileio import OsFile


@dataclass
class FaultPlan:
    """Which operations fail. Counts are 1-based and counted across every file of the plan."""

    fail_write_at: int | None = None  # the Nth append raises EIO without writing
    fail_sync_at: int | None = None  # the Nth fsync raises EIO
    short_write_at: int | None = None  # the Nth append writes half its bytes, then raises EIO
    disk_capacity_bytes: int | None = None  # files past this many bytes in all: ENOSPC
    allocate_unsupported: bool = False  # every allocate raises EOPNOTSUPP, as on a FUSE mount
    writes: int = 0  # appends seen so far
    syncs: int = 0  # fsyncs seen so far
    allocations: int = 0  # allocate calls seen so far
    bytes_written: int = 0  # bytes the files take on the disk, all files (allocated included)
    files: list["FaultyFile"] = field(default_factory=list)

    def opener(self, path: str) -> "FaultyFile":
        """Open ``path`` as a ``FaultyFile`` governed by this plan (use as a log's opener)."""
        handle = FaultyFile(path, self)
        self.files.append(handle)
        return handle

    def free_space(self, extra_bytes: int) -> None:
        """Give the simulated disk ``extra_bytes`` more room (space returns)."""
        if self.disk_capacity_bytes is not None:
            self.disk_capacity_bytes += extra_bytes


class FaultyFile:
    """An ``OsFile`` that fails as its ``FaultPlan`` says."""

    def __init__(self, path: str, plan: FaultPlan) -> None:
        self.path = path
        self._inner = OsFile(path)
        self._plan = plan
        # The bytes this file takes on the simulated disk: its data and any space allocated
        # ahead of it (what a write into that space needs no more room for).
        self._extent = self._inner.allocated_bytes()

    def append(self, data: bytes | bytearray | memoryview) -> None:
        """Append, unless the plan says this write fails, is short, or finds the disk full."""
        plan = self._plan
        plan.writes += 1
        if plan.fail_write_at == plan.writes:
            raise OSError(errno.EIO, f"injected write failure #{plan.writes}", self.path)
        if plan.short_write_at == plan.writes:
            half = bytes(data[: len(data) // 2])
            self._write(half)
            raise OSError(errno.EIO, f"injected short write #{plan.writes}", self.path)
        if plan.disk_capacity_bytes is not None:
            room = plan.disk_capacity_bytes - plan.bytes_written
            # Bytes written into space allocated ahead need no room.
            fits = max(0, self._extent + room - self._inner.size())
            if len(data) > fits:
                # A real full disk writes what fits, then fails.
                self._write(bytes(data[:fits]))
                raise OSError(errno.ENOSPC, "injected: no space left on device", self.path)
        self._write(data)

    def _write(self, data: bytes | bytearray | memoryview) -> None:
        """Append for real, counting what the file grew on the simulated disk."""
        self._inner.append(data)
        grown = self._inner.allocated_bytes() - self._extent
        if grown > 0:
            self._extent += grown
            self._plan.bytes_written += grown

    def allocated_bytes(self) -> int:
        """The real file's size (its data and the space allocated ahead)."""
        return self._inner.allocated_bytes()

    def allocate(self, size_bytes: int) -> None:
        """Allocate ahead as the real file does, unless the plan says the filesystem cannot
        (EOPNOTSUPP) or the disk fills: then, as ext4 does, what fits is allocated (the
        size set that far) before ENOSPC is raised."""
        plan = self._plan
        plan.allocations += 1
        if plan.allocate_unsupported:
            raise OSError(errno.EOPNOTSUPP, "injected: operation not supported", self.path)
        need = size_bytes - self._extent
        if need <= 0:
            return
        if plan.disk_capacity_bytes is not None:
            room = max(0, plan.disk_capacity_bytes - plan.bytes_written)
            if need > room:
                if room:
                    self._inner.allocate(self._extent + room)
                    self._extent += room
                    plan.bytes_written += room
                raise OSError(errno.ENOSPC, "injected: no space left on device", self.path)
        self._inner.allocate(size_bytes)
        self._extent = size_bytes
        plan.bytes_written += need

    def pread(self, offset: int, size: int) -> bytes:
        """Read as the real file does."""
        return self._inner.pread(offset, size)

    def size(self) -> int:
        """The real file's size."""
        return self._inner.size()

    def truncate(self, size: int) -> None:
        """Truncate the real file; freed bytes count as free space again."""
        self._inner.truncate(size)
        freed = self._extent - size
        if freed > 0:
            self._plan.bytes_written -= freed
        self._extent = size

    def sync(self) -> None:
        """fsync, unless the plan says this one fails."""
        self._plan.syncs += 1
        if self._plan.fail_sync_at == self._plan.syncs:
            raise OSError(errno.EIO, f"injected fsync failure #{self._plan.syncs}", self.path)
        self._inner.sync()

    def close(self) -> None:
        """Close the real file."""
        self._inner.close()


def flip_bit(path: str, byte_offset: int, bit: int = 0) -> None:
    """Flip one bit of the file at ``path`` in place (simulated bit rot)."""
    with open(path, "r+b") as f:
        f.seek(byte_offset)
        value = f.read(1)[0]
        f.seek(byte_offset)
        f.write(bytes([value ^ (1 << bit)]))
        f.flush()
        os.fsync(f.fileno())
