"""Errors raised by the delay store.

Hierarchy::

    DelayStoreError               base; carries ``retriable``
    ├── CorruptScheduleEntry      a schedule entry does not match the delay-log record it points at
    │                             (path, index, reason); never returned as data
    ├── CorruptCheckpoint         the newest checkpoint passed its CRC but its payload does not
    │                             decode (path, reason)
    ├── ConfigMismatch            the data directory was written with another ``bucket_ms``
    │                             (key, stored, configured)
    ├── StoreFailed               a write to a schedule, dispatch, cancel or touched file failed with
    │                             something other than ENOSPC; sticky until the store is reopened
    │                             (path, cause)
    └── StoreClosed               the store was used after ``close()`` (data_dir)

Failures of the delay log itself, and a full disk anywhere, are logstore's errors and pass through
unchanged: ``DiskFull`` (retriable; the batch or the dispatch/cancel record was not stored),
``LogWriteFailed`` (sticky), ``RecordTooLarge``, ``CorruptRecord``. A caller mistake (a negative
time, an empty message id, a watermark passed over pending messages) is a ``ValueError`` naming
the value and the limit.
"""

from __future__ import annotations


class DelayStoreError(Exception):
    """Base class of every delay-store error."""

    retriable = False


class CorruptScheduleEntry(DelayStoreError):
    """A schedule entry failed verification against its delay-log record."""

    def __init__(self, path: str, index: int, reason: str) -> None:
        self.path = path
        self.index = index
        self.reason = reason
        super().__init__(f"schedule entry {index} of {path} is corrupt: {reason}")


class CorruptCheckpoint(DelayStoreError):
    """A checkpoint verified by its CRC holds a payload that does not decode (a bug, not a fault
    of the disk: the CRC rules out torn writes)."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"checkpoint {path} does not decode: {reason}")


class ConfigMismatch(DelayStoreError):
    """A setting differs from the one the data directory was written with."""

    def __init__(self, key: str, stored: object, configured: object) -> None:
        self.key = key
        self.stored = stored
        self.configured = configured
        super().__init__(
            f"{key} is {configured!r} but the data directory was written with {stored!r}; "
            f"use the stored value or a new data directory"
        )


class StoreFailed(DelayStoreError):
    """A write failed (not ENOSPC); the store refuses writes until reopened, because the state
    of the file after a failed write or fsync is unknown."""

    def __init__(self, path: str, cause: BaseException) -> None:
        self.path = path
        self.cause = cause
        super().__init__(f"write failed on {path}: {cause}; the delay store must be reopened")


class StoreClosed(DelayStoreError):
    """The store was used after ``close()``."""

    def __init__(self, data_dir: str) -> None:
        self.data_dir = data_dir
        super().__init__(f"delay store {data_dir} is closed")
