"""Errors raised by the pull log.

Hierarchy::

    PullLogError              base; carries ``retriable``
    ├── UnknownGroup          an operation named a (subject, group) never created (subject, group)
    ├── CorruptAction         an action record passed its CRC but does not decode or does not
    │                         apply to the replayed state (offset, reason)
    ├── CorruptCheckpoint     a checkpoint passed its CRC but its payload is invalid (path, reason)
    └── ActionLogGap          the newest usable checkpoint starts before the oldest action segment,
                              so the actions in between are gone (checkpoint_offset, first_offset)

Storage faults of the action log itself (failed writes, full disk, a closed log) are logstore's
errors (``logstore.errors``) and pass through unchanged. A caller mistake that would break the
hand-out invariant (a double hand-out, an ack range with lo > hi) is a ``ValueError``.
"""

from __future__ import annotations


class PullLogError(Exception):
    """Base class of every pull-log error."""

    retriable = False


class UnknownGroup(PullLogError):
    """The (subject, group) was never created with ``ensure_group``."""

    def __init__(self, subject: str, group: str) -> None:
        self.subject = subject
        self.group = group
        super().__init__(f"unknown consumer group {group!r} of subject {subject!r}")


class CorruptAction(PullLogError):
    """A stored action is framed correctly but its body is not a valid action."""

    def __init__(self, offset: int, reason: str) -> None:
        self.offset = offset
        self.reason = reason
        super().__init__(f"action at offset {offset} of the pull log is invalid: {reason}")


class ActionLogGap(PullLogError):
    """Recovery cannot rebuild the state: actions between the checkpoint and the log are missing."""

    def __init__(self, checkpoint_offset: int, first_offset: int) -> None:
        self.checkpoint_offset = checkpoint_offset
        self.first_offset = first_offset
        super().__init__(
            f"checkpoint covers actions up to offset {checkpoint_offset} but the action log "
            f"starts at offset {first_offset}; the actions in between are lost"
        )


class CorruptCheckpoint(PullLogError):
    """A checkpoint passed its CRC but its payload is not a valid pull state."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"checkpoint {path} holds an invalid pull state: {reason}")
