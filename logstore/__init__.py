"""Storage primitives: segmented append-only logs with CRC-framed records, checkpoints, retention.

Synchronous plain classes over files: no asyncio, no network, and nothing of ours is imported.

- ``SegmentedLog`` / ``LogConfig``: the segmented log (``logstore.segment_log``).
- ``CheckpointStore``: atomic checkpoint files (``logstore.checkpoint``).
- ``OsFile`` / ``FileHandle`` / ``write_file_atomically``: file access (``logstore.fileio``);
  ``DescriptorCache``: a bounded set of open files shared by a store (``logstore.descriptors``).
- ``FaultPlan`` / ``FaultyFile`` / ``flip_bit``: fault injection for tests (``logstore.faults``).
- Errors in ``logstore.errors``.
"""

from logstore.checkpoint import Checkpoint, CheckpointStore
from logstore.errors import (
    CopyReset,
    CorruptRecord,
    DiskFull,
    LogClosed,
    LogStoreError,
    LogWriteFailed,
    OffsetOutOfRange,
    OutOfDescriptors,
    RecordTooLarge,
    UndecodableRecord,
)
from logstore.fileio import FileHandle, Opener, OsFile, fsync_directory, write_file_atomically
from logstore.segment_log import LogConfig, RecoveryReport, SegmentedLog, SegmentInfo, Truncation

__all__ = [
    "Checkpoint", "CheckpointStore", "CopyReset", "CorruptRecord", "DiskFull", "FileHandle", "LogClosed",
    "LogConfig", "LogStoreError", "LogWriteFailed", "OffsetOutOfRange", "Opener", "OsFile",
    "OutOfDescriptors", "RecordTooLarge", "RecoveryReport", "SegmentInfo", "SegmentedLog",
    "Truncation", "UndecodableRecord",
    "fsync_directory", "write_file_atomically",
]
