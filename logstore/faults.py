"""A fault-injecting ``FileHandle`` for tests: failed writes and fsyncs, short writes, full disk.

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
    disk_capacity_bytes: int | None = None  # appends past this many bytes in all files: ENOSPC
    writes: int = 0  # appends seen so far
    syncs: int = 0  # fsyncs seen so far
    bytes_written: int = 0  # bytes appended so far, all files
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

    def append(self, data: bytes | bytearray | memoryview) -> None:
        """Append, unless the plan says this write fails, is short, or finds the disk full."""
        plan = self._plan
        plan.writes += 1
        if plan.fail_write_at == plan.writes:
            raise OSError(errno.EIO, f"injected write failure #{plan.writes}", self.path)
        if plan.short_write_at == plan.writes:
            half = bytes(data[: len(data) // 2])
            self._inner.append(half)
            plan.bytes_written += len(half)
            raise OSError(errno.EIO, f"injected short write #{plan.writes}", self.path)
        if plan.disk_capacity_bytes is not None:
            room = plan.disk_capacity_bytes - plan.bytes_written
            if len(data) > room:
                # A real full disk writes what fits, then fails.
                partial = bytes(data[: max(0, room)])
                self._inner.append(partial)
                plan.bytes_written += len(partial)
                raise OSError(errno.ENOSPC, "injected: no space left on device", self.path)
        self._inner.append(data)
        plan.bytes_written += len(data)

    def pread(self, offset: int, size: int) -> bytes:
        """Read as the real file does."""
        return self._inner.pread(offset, size)

    def size(self) -> int:
        """The real file's size."""
        return self._inner.size()

    def truncate(self, size: int) -> None:
        """Truncate the real file; freed bytes count as free space again."""
        freed = self._inner.size() - size
        self._inner.truncate(size)
        if freed > 0:
            self._plan.bytes_written -= freed

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
