"""A pull log as a replica (docs/REPLICATION.md 8): the master's side (copy bounds, raw reads
of the action log, its newest checkpoint for a ``snapshot``) and the slave's (a *follower*
store that applies copied actions and writes none of its own; cutting a copy back, installing
a snapshot, promotion and stepping down).

Part of ``PullLogStore`` (mixed in): synchronous, one owner thread, no clock.

A follower's action log holds exactly the master's bytes, so its offsets are the master's and a
fetch offset acknowledges them. Promotion starts a new pull-seq epoch unless the copy ends with
the master's clean close: a copy can lack PULLs the master recorded but had not shipped, and
the consumers that were handed those pull seqs may ack them at the new master.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from logstore import Checkpoint, CopyReset, LogStoreError
from logstore.record import HEADER_SIZE_BYTES
from pulllog.actions import Closed, decode_action
from pulllog.errors import CorruptAction, CorruptCheckpoint, PullLogError
from pulllog.snapshot import decode_snapshot, encode_snapshot
from pulllog.state import PullState

if TYPE_CHECKING:  # the attributes the mixin uses, defined by PullLogStore
    from logstore import CheckpointStore, SegmentedLog

log = logging.getLogger(__name__)


class NeedsSnapshot(CopyReset, PullLogError):
    """A follower cannot rebuild its state at an offset from what it holds (no checkpoint at
    or below it whose actions are still there): it must copy again, from the master's newest
    checkpoint when the master's log no longer starts at 0."""

    def __init__(self, offset: int, first_offset: int) -> None:
        self.offset = offset
        self.first_offset = first_offset
        super().__init__(f"no pull-log checkpoint at or below offset {offset} with its actions "
                         f"still held (the action log starts at {first_offset}): take the "
                         f"master's snapshot")


class CopyingMixin:
    """The replication calls of ``PullLogStore`` (module docstring)."""

    _log: SegmentedLog
    _state: PullState
    _checkpoints: CheckpointStore
    _kept_offsets: list[int]
    _actions_since_checkpoint: int
    _follower: bool
    _clean_end: bool
    _failed: LogStoreError | None

    # ------------------------------------------------------------------ both sides

    @property
    def follower(self) -> bool:
        """True while this store copies a master's actions and records none of its own."""
        return self._follower

    def copy_bounds(self) -> tuple[int, int]:
        """(first offset, end offset) of the action log as a copy may read it: what was
        written to the OS (``flush`` first for what was just recorded)."""
        return self._log.first_offset, self._log.flushed_offset

    def read_copy(self, offset: int, max_bytes: int) -> bytes:
        """Whole action records from ``offset`` as stored (``SegmentedLog.read_raw``)."""
        return self._log.read_raw(offset, max_bytes)

    def newest_checkpoint(self, sequence: int = 0) -> tuple[Checkpoint, int] | None:
        """The master's side of ``snapshot``: its newest checkpoint (or the one numbered
        ``sequence`` while it is kept) and the action offset it covers; None when none."""
        for checkpoint in self._checkpoints.load_all():
            if sequence in (0, checkpoint.sequence):
                return checkpoint, decode_snapshot(checkpoint.payload)[1]
        return None

    # ------------------------------------------------------------------ a follower

    def append_copy(self, offset: int, data: bytes) -> int:
        """Apply actions copied from the master's action log at ``offset`` (this log's end):
        every record is checked first (nothing is appended otherwise), then the records are
        appended and made durable per the flush mode, then decoded and applied in order.
        Returns the new end. On a full disk (DiskFull) the log is cut back to ``offset`` and
        the state has taken nothing, so the same actions can be copied again. An action the
        state refuses is an inconsistent copy: the store fails (sticky) rather than diverge."""
        assert self._follower, "only a follower appends copied actions"
        if self._failed is not None:
            raise self._failed
        # Durable (per the flush mode) before the state takes the actions: a full disk
        # leaves no action applied that the log lacks. In sync mode with nothing buffered
        # the master's bytes are written themselves, not framed again; in async mode (a
        # realtime broker's pull log) they are framed into the buffer and flushed, as before.
        bodies = self._log.append_raw_durably(offset, data)
        at = offset
        action = None
        try:
            for body in bodies:
                action = decode_action(body)
                self._state.check(action)
                self._state.apply(action)
                at += HEADER_SIZE_BYTES + len(body)
        except ValueError as exc:
            failure = CorruptAction(at, f"copied action: {exc}")
            self._failed = failure  # type: ignore[assignment]
            raise failure from exc
        if action is not None:
            self._clean_end = isinstance(action, Closed)
        self._actions_since_checkpoint += len(bodies)
        if self._actions_since_checkpoint >= self.config.checkpoint_every_actions:  # type: ignore[attr-defined]
            self.checkpoint()  # type: ignore[attr-defined]
        return self._log.end_offset

    def truncate_copy(self, offset: int) -> int:
        """Cut the action log at ``offset`` (a record boundary) and rebuild the state there from
        the newest checkpoint at or below it, replaying what lies between. Checkpoints past the
        cut are deleted. NeedsSnapshot when no checkpoint can serve (the log's start moved past
        every one). Returns the bytes cut."""
        assert self._follower, "step down (demote) before cutting a pull log"
        end = self._log.end_offset
        if offset >= end:
            return 0
        base = self._base_at(offset)
        if base is None:
            raise NeedsSnapshot(offset, self._log.first_offset)
        state, base_offset, sequence = base
        cut = self._log.truncate(offset)
        self._log.sync()
        self._checkpoints.delete_after(sequence)
        self._state = state
        self._clean_end = False
        replayed = 0
        for at, body in self._log.iterate(base_offset):
            try:
                action = decode_action(body)
                state.check(action)
            except ValueError as exc:
                raise CorruptAction(at, str(exc)) from exc
            state.apply(action)
            replayed += 1
        self._kept_offsets = [o for o in self._kept_offsets if o <= offset] or [base_offset]
        self._actions_since_checkpoint = replayed
        self.checkpoint()  # type: ignore[attr-defined]
        log.warning("pull log %s: cut %d bytes of copied actions at offset %d (state rebuilt "
                    "from offset %d)", self.directory, cut, offset, base_offset)  # type: ignore[attr-defined]
        return cut

    def _base_at(self, offset: int) -> tuple[PullState, int, int] | None:
        """(state, its action offset, checkpoint sequence) of the newest checkpoint at or below
        ``offset`` whose actions the log still holds; the empty state at 0 when the log starts
        there; else None."""
        first = self._log.first_offset
        for checkpoint in self._checkpoints.load_all():
            try:
                state, covered, _retained = decode_snapshot(checkpoint.payload)
            except ValueError as exc:
                log.warning("pull log checkpoint %s unusable: %s", checkpoint.path, exc)
                continue
            if first <= covered <= offset:
                return state, covered, checkpoint.sequence
        return (PullState(), 0, 0) if first == 0 else None

    def install_snapshot(self, payload: bytes, covers_offset: int) -> None:
        """Take the master's checkpoint ``payload`` (covering its actions up to
        ``covers_offset``) as this follower's whole state, with an empty action log starting
        there, and checkpoint it."""
        assert self._follower, "only a follower installs the master's snapshot"
        try:
            state, covered, _retained = decode_snapshot(payload)
        except ValueError as exc:
            raise CorruptCheckpoint("<master snapshot>", str(exc)) from exc
        if covered != covers_offset:
            raise CorruptCheckpoint("<master snapshot>", f"covers offset {covered}, the "
                                    f"answer said {covers_offset}")
        self._log.reset(covers_offset)
        self._checkpoints.delete_after(0)
        self._state = state
        self._clean_end = False
        self._kept_offsets = []
        self._actions_since_checkpoint = 0
        self._checkpoints.write(encode_snapshot(state, covers_offset, []))
        self._kept_offsets = [covers_offset]

    def reset_copy(self, offset: int) -> None:
        """Throw the copy away: an empty state, an empty action log starting at ``offset``,
        no checkpoint (the follower then copies from the master's start or its snapshot)."""
        assert self._follower, "only a follower's copy is thrown away"
        self._log.reset(offset)
        self._checkpoints.delete_after(0)
        self._state = PullState()
        self._clean_end = False
        self._kept_offsets = []
        self._actions_since_checkpoint = 0

    def verify_copy(self, offset: int, max_bytes: int) -> tuple[int, int | None]:
        """Scrub about ``max_bytes`` of the action log from ``offset``: (where to go on, the
        offset of the first record that fails its checks or None)."""
        next_offset, problem = self._log.verify(offset, max_bytes)
        return next_offset, problem.offset if problem is not None else None

    def promote(self) -> None:
        """The slave becomes master: start writing (a new pull-seq epoch unless the copy ends
        with a clean close, then OPENED, fsynced)."""
        if not self._follower:
            return
        self._follower = False
        self._begin_session()  # type: ignore[attr-defined]

    def demote(self) -> None:
        """The master steps down: from now on it only copies (writes are refused). What it
        recorded that its new master lacks is cut by ``truncate_copy``."""
        if self._follower:
            return
        self._log.sync()
        self._follower = True
        self._clean_end = False


__all__ = ["CopyingMixin", "NeedsSnapshot"]
