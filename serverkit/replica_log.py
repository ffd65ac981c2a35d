"""One replicated log as the data plane drives it, on both sides of a ``fetch``
(docs/REPLICATION.md 8): the synchronous steps, each run on the thread that owns the log's
store (``ReplicatedLog.run``), and the store API they need (``CopyStore``).

Master: ``answer_fetch_io`` checks the fetching slave's position against the epoch history and
reads whole records; ``read_range`` reads a commit back for the tailing slaves, ``snapshot_io``
part of a checkpoint. Slave: ``position_io`` says where to fetch from, ``apply_io`` appends what
came (the epoch history first, then the records), ``cut_io`` drops a diverging tail,
``reset_io`` starts the copy at the master's log start. Both: ``seal_io`` opens an epoch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Protocol

from logstore import CopyReset
from logstore.epoch_history import EpochEnd, EpochHistory
from serverkit.kind_gate import RecordKinds
from wire.replication import FetchAnswer, SnapshotAnswer

Runner = Callable[..., Awaitable[Any]]  # ``await run(fn, *args)``: fn(*args) on one thread


class CopyStore(Protocol):
    """What a store offers replication (MessageStore, PullLogStore, DelayStore's two logs)."""

    def copy_bounds(self) -> tuple[int, int]:
        """(first offset, end offset a copy may read)."""

    def read_copy(self, offset: int, max_bytes: int) -> bytes:
        """Whole records from ``offset``, as stored."""

    def append_copy(self, offset: int, data: bytes) -> int:
        """A slave: append copied records at ``offset`` (its end); the new end."""

    def truncate_copy(self, offset: int) -> int:
        """A slave: cut the copy at ``offset``; bytes cut. May raise ``CopyReset``."""

    def reset_copy(self, offset: int) -> None:
        """A slave: throw the copy away and start it empty at ``offset``."""

    def verify_copy(self, offset: int, max_bytes: int) -> tuple[int, int | None]:
        """Scrub from ``offset``: (where to go on, first bad record's offset or None)."""


@dataclass(frozen=True)
class ReplicatedLog:
    """One log of a server that slaves copy: its name on the wire, its store, its epoch
    history, and the runner of the thread that owns both. ``requires`` names the logs whose
    records this one's records refer to (a pull-log action to messages, a done record to a
    delayed message): a slave applies this log only as far as its copies of those go."""

    name: str
    store: CopyStore
    history: EpochHistory  # touched only on the owner thread (read on the loop while master)
    run: Runner
    requires: tuple[str, ...] = ()
    snapshots: bool = False  # the store can ship and install whole checkpoints (actions)
    # A store that keeps two logs together (a delay store's delay log and done journal): a
    # reset of this log's copy empties the copies of ``empties`` too, so their histories are
    # forgotten with it; a copy of this log that cannot be cut back (``CopyReset``) is thrown
    # away by resetting ``reset_with`` (which empties this one) instead of this log alone.
    empties: tuple[str, ...] = ()
    reset_with: str | None = None
    # The log's gated record kinds (``serverkit.kind_gate``): a slave says it reads them in its
    # fetches, a master serves and writes them only to and with slaves that read them.
    kinds: RecordKinds | None = None


# --------------------------------------------------------------------- the master's side


def answer_fetch_io(log: ReplicatedLog, epoch: int, offset: int, last_epoch: int,
                    max_bytes: int) -> FetchAnswer:
    """Owner thread: the answer to a fetch of ``log`` at ``offset`` whose last record is of
    ``last_epoch``: the records from there, or where the slave must cut (``diverging``), or no
    data and ``log_start`` past ``offset`` (the slave starts again there)."""
    start, end = log.store.copy_bounds()
    history = log.history
    if offset < start:
        return FetchAnswer(epoch, log.name, offset, b"", offset, start, end,
                           _pairs(history.entries_between(start, start)), None)
    diverging = history.diverging(last_epoch, offset, end)
    if diverging is not None:
        return FetchAnswer(epoch, log.name, offset, b"", offset, start, end, (), tuple(diverging))
    data = log.store.read_copy(offset, max_bytes) if offset < end else b""
    next_offset = offset + len(data)
    return FetchAnswer(epoch, log.name, offset, data, next_offset, start, end,
                       _pairs(history.entries_between(offset, next_offset)), None)


def _pairs(entries) -> tuple[tuple[int, int], ...]:
    return tuple((entry.epoch, entry.start_offset) for entry in entries)


def end_io(log: ReplicatedLog) -> int:
    """Owner thread: where the log ends as a fetch may read it."""
    return log.store.copy_bounds()[1]


def seal_io(log: ReplicatedLog, epoch: int) -> int:
    """Owner thread: a new master opens ``epoch`` at its log's end (durably, before it accepts
    a write); returns that offset. Nothing is written when the history already has it."""
    end = log.store.copy_bounds()[1]
    if epoch > log.history.last_epoch:
        log.history.append(epoch, end)
    return end


# --------------------------------------------------------------------- the slave's side


def position_io(log: ReplicatedLog) -> tuple[int, int]:
    """Owner thread: (the offset to fetch from, the ``last_epoch`` to send with it)."""
    first, end = log.store.copy_bounds()
    return end, log.history.fetch_epoch(end, first)


def apply_io(log: ReplicatedLog, offset: int, data: bytes,
             epochs: tuple[tuple[int, int], ...]) -> int:
    """Owner thread: record the epochs the answer names (before the records, so a record is
    never attributed to an older epoch), then append the records. Returns the new end."""
    history = log.history
    for epoch, start in epochs:
        if epoch > history.last_epoch:
            history.append(epoch, start)
    if not data:
        return log.store.copy_bounds()[1]
    return log.store.append_copy(offset, data)


def apply_position_io(log: ReplicatedLog, offset: int, data: bytes,
                      epochs: tuple[tuple[int, int], ...]) -> tuple[int, tuple[int, int]]:
    """Owner thread: ``apply_io``, then ``position_io`` in the same call: (the new end, the
    next fetch's offset and ``last_epoch``), so the next fetch needs no trip to this thread."""
    end = apply_io(log, offset, data, epochs)
    return end, position_io(log)


def cut_io(log: ReplicatedLog, diverging: tuple[int, int]) -> int:
    """Owner thread: the master said ``diverging`` (epoch E ended at X there): cut the copy
    where the histories agree and forget the epochs that began there or later. Returns the
    cut offset. Raises CopyReset when the store cannot cut there."""
    first, end = log.store.copy_bounds()
    point = max(first, log.history.truncation_point(EpochEnd(*diverging), end))
    log.store.truncate_copy(point)
    log.history.truncate(point)
    return point


def reset_io(log: ReplicatedLog, start: int, epochs: tuple[tuple[int, int], ...],
             emptied: tuple[ReplicatedLog, ...] = ()) -> None:
    """Owner thread: start the copy empty at ``start`` (the master's log start), with the
    epoch in force there as the whole history. ``emptied`` are the logs whose copies the store
    empties with this one (``ReplicatedLog.empties``, same owner thread): their histories are
    forgotten too, so no entry outlives the records it described."""
    log.store.reset_copy(start)
    log.history.truncate(0)
    for other in emptied:
        other.history.truncate(0)
    for epoch, entry_start in epochs:
        if epoch > log.history.last_epoch:
            log.history.append(epoch, entry_start)


def scrub_io(log: ReplicatedLog, offset: int, max_bytes: int) -> tuple[int, int | None]:
    """Owner thread: check about ``max_bytes`` of the copy from ``offset``; a rotten record
    found is cut (with everything after it) so the follower fetches it again. Returns (where
    the next scrub goes on, the offset cut at or None)."""
    first, end = log.store.copy_bounds()
    if not first <= offset < end:
        offset = first  # the copy moved (cut, reset) or the last pass ended: start a new one
    next_offset, bad = log.store.verify_copy(offset, max_bytes)
    if bad is None:
        return (first if next_offset >= end else next_offset), None
    log.store.truncate_copy(bad)
    log.history.truncate(bad + 1)  # keep an epoch that began at the cut: its start stands
    return bad, bad


def read_range(store: CopyStore, start: int, end: int) -> bytes:
    """Owner thread: the log's bytes [start, end) exactly (a read stops at a segment's end: a
    commit that rolled the log over takes two). ValueError when they do not end at ``end``."""
    parts = []
    offset = start
    while offset < end:
        data = store.read_copy(offset, end - offset)
        if not data:
            raise ValueError(f"the log ends at {offset}, before the commit's end {end}")
        parts.append(data)
        offset += len(data)
    if offset != end:
        raise ValueError(f"records from {start} end at {offset}, past the commit's end {end}")
    return parts[0] if len(parts) == 1 else b"".join(parts)


def snapshot_io(log_: ReplicatedLog, epoch: int, sequence: int, position: int,
                 max_bytes: int) -> SnapshotAnswer | None:
    """Owner thread: bytes of the newest checkpoint (or checkpoint ``sequence``) of the log."""
    found = log_.store.newest_checkpoint(sequence)  # type: ignore[attr-defined]
    if found is None:
        return None
    checkpoint, covers = found
    checkpoint_bytes = checkpoint.payload
    data = checkpoint_bytes[position:position + max_bytes]
    in_force = log_.history.in_force(covers)
    epochs = ((in_force.epoch, in_force.start_offset),) if in_force is not None else ()
    return SnapshotAnswer(epoch, log_.name, checkpoint.sequence, covers, len(checkpoint_bytes),
                          position, data, epochs)


__all__ = ["CopyReset", "CopyStore", "ReplicatedLog", "Runner", "answer_fetch_io", "apply_io",
           "apply_position_io",
           "cut_io", "end_io", "position_io", "read_range", "reset_io", "scrub_io", "seal_io",
           "snapshot_io"]
