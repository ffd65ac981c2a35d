"""Errors raised by the storage primitives.

Hierarchy::

    LogStoreError                 base; carries ``retriable``
    ├── CorruptRecord             a record failed its CRC, magic, version or length check (path, offset)
    │   └── UndecodableRecord     its frame and CRC hold, its body this server cannot decode (kind, version)
    ├── RecordTooLarge            an append or a stored length exceeds the record limit (size_bytes, limit)
    ├── OffsetOutOfRange          a read below the first or at/after the end offset (offset, first, end)
    ├── LogWriteFailed            a write or fsync failed; sticky until the log is reopened
    ├── DiskFull                  a write hit ENOSPC; not sticky: the unflushed appends are dropped,
    │                             the file is cut back, and a later append may succeed (retriable)
    ├── OutOfDescriptors          an open found no file descriptor left even after the store closed
    │                             its own (EMFILE/ENFILE); not sticky: the batch is refused (retriable)
    ├── LogClosed                 the log was used after close()
    └── CopyReset                 a replica's copy cannot be cut back where asked: copy it again

Storage raises these for the world's faults (bad bytes, failed syscalls); our own bugs are assertions.
"""

from __future__ import annotations


class LogStoreError(Exception):
    """Base class of every storage error."""

    retriable = False


class CorruptRecord(LogStoreError):
    """A stored record failed verification: it is never returned as data."""

    def __init__(self, path: str, offset: int, reason: str) -> None:
        self.path = path
        self.offset = offset
        self.reason = reason
        super().__init__(f"corrupt record at offset {offset} in {path}: {reason}")


class UndecodableRecord(CorruptRecord):
    """A record whose frame and CRC hold but whose body this server cannot decode: a kind or
    body version of a later release, or a writer's bug. Unlike a flipped bit, every read
    gives the same bytes, so a copy stops at it until this server is upgraded or the record
    is mended. ``kind``, ``version``: the body's own header fields, None when too short."""

    def __init__(self, path: str, offset: int, kind: int | None, version: int | None,
                 reason: str) -> None:
        self.kind = kind
        self.version = version
        super().__init__(path, offset, f"kind {kind}, body version {version}: {reason}")


class RecordTooLarge(LogStoreError):
    """A record's size exceeds ``record_size_bytes_max``."""

    def __init__(self, size_bytes: int, limit_bytes: int) -> None:
        self.size_bytes = size_bytes
        self.limit_bytes = limit_bytes
        super().__init__(
            f"record of {size_bytes} bytes exceeds record_size_bytes_max {limit_bytes}"
        )


class OffsetOutOfRange(LogStoreError):
    """A read asked for an offset the log does not hold."""

    def __init__(self, offset: int, first_offset: int, end_offset: int) -> None:
        self.offset = offset
        self.first_offset = first_offset
        self.end_offset = end_offset
        super().__init__(
            f"offset {offset} is outside the log [{first_offset}, {end_offset})"
        )


class LogWriteFailed(LogStoreError):
    """A write or fsync failed. The log refuses every later write until it is reopened,
    because after a failed fsync the kernel's page cache state is unknown."""

    def __init__(self, path: str, operation: str, cause: BaseException) -> None:
        self.path = path
        self.operation = operation
        self.cause = cause
        super().__init__(f"{operation} failed on {path}: {cause}; the log must be reopened")


class DiskFull(LogStoreError):
    """A write hit ENOSPC. Appends since the last successful flush were dropped and the file
    was cut back to its last good end; retry once space returns."""

    retriable = True

    def __init__(self, path: str, dropped_records: int) -> None:
        self.path = path
        self.dropped_records = dropped_records
        super().__init__(
            f"disk full writing {path}: {dropped_records} unflushed record(s) dropped; retry later"
        )


class OutOfDescriptors(LogStoreError):
    """Opening a file failed for want of a descriptor (EMFILE/ENFILE) even after the store
    let go of every one it could; what was written for the batch was cut back. Retry later;
    raise the open-files limit if it persists (docs/OPERATIONS.md)."""

    retriable = True

    def __init__(self, path: str, cause: BaseException) -> None:
        self.path = path
        self.cause = cause
        super().__init__(f"no file descriptor left to open {path}: {cause}; retry later")


class LogClosed(LogStoreError):
    """The log was used after ``close()``."""

    def __init__(self, path: str) -> None:
        self.path = path
        super().__init__(f"log {path} is closed")


class CopyReset(LogStoreError):
    """A replica's store cannot cut its copy back to the offset asked (it keeps no state to
    rebuild from there): its follower throws the copy away and copies the master's again."""
