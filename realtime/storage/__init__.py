"""Realtime broker storage: MessageLog + per-subject ConsumerLogs behind ``MessageStore``.

Synchronous plain classes over files (no asyncio, no network); the realtime server calls
``MessageStore`` from one place. Imports only ``logstore``.

- ``MessageStore`` / ``StoreConfig`` / ``Appended`` / ``StoredMessage``: the facade (``store``);
  what it buffers until a commit, column by column, is a ``write_batch.WriteBatch``.
- ``StoreRecoveryReport``: what opening rebuilt (``recovery``); ``RetentionReport`` (``retention``).
- Formats: ``message_record`` (message-log record body), ``consumer_log`` (32-byte entries),
  ``store_checkpoint`` (checkpoint payload), ``subject_names`` (directory names).
- Errors in ``realtime.storage.errors``.
"""

from realtime.storage.config import (
    MESSAGE_ID_BYTES_MAX,
    SUBJECT_BYTES_MAX,
    TAG_HASHES_MAX,
    StoreConfig,
)
from realtime.storage.errors import (
    CorruptEntry,
    HeldSetFull,
    SequenceOutOfRange,
    StorageError,
    StoreClosed,
    StoreFailed,
)
from realtime.storage.recovery import StoreRecoveryReport, SubjectRecovery
from realtime.storage.retention import DeletedSegment, RetentionReport
from realtime.storage.store import Appended, MessageStore, StoredMessage

__all__ = [
    "Appended", "CorruptEntry", "DeletedSegment", "HeldSetFull", "MESSAGE_ID_BYTES_MAX",
    "MessageStore", "RetentionReport", "SUBJECT_BYTES_MAX", "SequenceOutOfRange", "StorageError",
    "StoreClosed", "StoreConfig", "StoreFailed", "StoreRecoveryReport", "StoredMessage",
    "SubjectRecovery", "TAG_HASHES_MAX",
]
