"""Errors raised by the realtime message store.

Hierarchy::

    StorageError                  base; carries ``retriable``
    ├── SequenceOutOfRange        a read below first_sequence or at/after end_sequence
    │                             (subject, sequence, first_sequence, end_sequence)
    ├── CorruptEntry              a consumer-log entry or the message it points at failed
    │                             verification on read (subject, sequence, path, reason)
    ├── HeldSetFull               a hold would pass held_messages_max (held, max, refused)
    ├── StoreFailed               an index write failed after the message log accepted a batch;
    │                             sticky until the store is reopened (recovery rebuilds the index)
    └── StoreClosed               the store was used after close()

Bad arguments (the server's contract) raise ``ValueError`` naming the value and the limit.
Failures of the message log itself propagate as ``logstore`` errors (``DiskFull``,
``LogWriteFailed``, ``CorruptRecord``).
"""

from __future__ import annotations


class StorageError(Exception):
    """Base class of every message-store error."""

    retriable = False


class SequenceOutOfRange(StorageError):
    """A read asked for a subject sequence the store does not hold (deleted or not yet written)."""

    def __init__(self, subject: str, sequence: int, first_sequence: int, end_sequence: int) -> None:
        self.subject = subject
        self.sequence = sequence
        self.first_sequence = first_sequence
        self.end_sequence = end_sequence
        if sequence < first_sequence:
            why = "was deleted by retention or never stored"
        else:
            why = "has not been written yet"
        super().__init__(
            f"sequence {sequence} of subject {subject!r} is outside the stored range "
            f"[{first_sequence}, {end_sequence}): it {why}"
        )


class CorruptEntry(StorageError):
    """A stored consumer-log entry or its message failed verification; never returned as data."""

    def __init__(self, subject: str, sequence: int, path: str, reason: str) -> None:
        self.subject = subject
        self.sequence = sequence
        self.path = path
        self.reason = reason
        super().__init__(
            f"corrupt entry for sequence {sequence} of subject {subject!r} in {path}: {reason}"
        )


class HeldSetFull(StorageError):
    """A hold would make the held set pass ``held_messages_max`` (``hold_many`` without a
    ``refused`` list to report the messages it did not hold)."""

    def __init__(self, held: int, held_messages_max: int, refused: int) -> None:
        self.held = held
        self.held_messages_max = held_messages_max
        self.refused = refused
        super().__init__(f"{refused} held messages more would pass held_messages_max "
                         f"{held_messages_max} ({held} held now)")


class StoreFailed(StorageError):
    """A write to an index failed; the store refuses writes until reopened."""

    def __init__(self, path: str, cause: BaseException) -> None:
        self.path = path
        self.cause = cause
        super().__init__(f"index write failed on {path}: {cause}; the store must be reopened")


class StoreClosed(StorageError):
    """The store was used after ``close()``."""

    def __init__(self, data_dir: str) -> None:
        self.data_dir = data_dir
        super().__init__(f"message store {data_dir} is closed")
