"""Pull logs: per-(subject, group) cursors, per-consumer pull sequences, acks and redelivery.

Synchronous plain classes over files; imports only ``logstore`` (and msgpack/stdlib).

- ``PullLogStore`` / ``PullLogConfig`` / ``PullLogRecovery``: the store (``pulllog.store``).
- ``PulledEntry`` / ``ConsumerState`` / ``GroupState``: read-only snapshots, ``PulledBatch`` what
  one pull handed out (``pulllog.state``).
- On-disk formats: ``pulllog.actions`` (action records), ``pulllog.snapshot`` (checkpoint payload);
  docs/FORMATS.md.
- Errors in ``pulllog.errors``.
"""

from pulllog.errors import (
    ActionLogGap,
    CorruptAction,
    CorruptCheckpoint,
    PullLogError,
    UnknownGroup,
)
from pulllog.state import ConsumerState, GroupState, PulledBatch, PulledEntry
from pulllog.config import PullLogConfig, PullLogRecovery
from pulllog.store import PullLogStore

__all__ = [
    "ActionLogGap", "ConsumerState", "CorruptAction", "CorruptCheckpoint", "GroupState",
    "PullLogConfig", "PullLogError", "PullLogRecovery", "PullLogStore", "PulledBatch",
    "PulledEntry",
    "UnknownGroup",
]
