"""The delay server's storage: delayed messages on disk, a schedule split into time buckets,
dispatch and cancel records, checkpoints (synchronous; the server wraps it).

- ``DelayStore`` / ``DelayStoreConfig`` / ``ScheduleEntry``: the facade (``store``).
- ``DelayedRecord``: a message read back (``delay_record``).
- ``PendingStats``: pending counts per hour and subject (``stats``).
- ``DelayRecoveryReport``: what opening the store found (``recovery``).
- Errors in ``errors``; on-disk formats in ``delay_record``, ``schedule_entry``, ``done_record``,
  ``touched_record``, ``delay_checkpoint`` and docs/FORMATS.md.
"""

from delayserver.storage.delay_record import DelayedRecord
from delayserver.storage.errors import (
    ConfigMismatch,
    CorruptCheckpoint,
    CorruptScheduleEntry,
    DelayStoreError,
    StoreClosed,
    StoreFailed,
)
from delayserver.storage.recovery import DelayRecoveryReport
from delayserver.storage.stats import PendingStats
from delayserver.storage.store import (
    CANCEL_OUTCOMES,
    DelayStore,
    DelayStoreConfig,
    ScheduleEntry,
)

__all__ = [
    "CANCEL_OUTCOMES", "ConfigMismatch", "CorruptCheckpoint", "CorruptScheduleEntry",
    "DelayRecoveryReport", "DelayStore", "DelayStoreConfig", "DelayStoreError", "DelayedRecord",
    "PendingStats", "ScheduleEntry", "StoreClosed", "StoreFailed",
]
