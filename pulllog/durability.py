"""Writing a ``PullLogStore``'s actions to disk: flush, fsync (``sync``, async mode's
``tick``), checkpoints, the clean close, and what a write failure does; the
``DurabilityMixin`` part of ``pulllog.store.PullLogStore`` (split from it).

A full disk (``DiskFull``) in async mode is not a failure of the store: the actions the log
dropped are already applied in memory, so the store goes on *unlogged*: changes are applied in
memory only (pulls and acks keep working), and ``tick`` tries every ``DISK_FULL_RETRY_MS`` to write
a checkpoint of the whole state, which covers what the log lost; once one is written, actions are
logged again. A crash while unlogged loses those changes exactly as a crash loses unsynced
actions (redelivery, never loss) and starts a new epoch. Any other write error (``LogWriteFailed``),
and a full disk in sync mode, make the store refuse every later change until it is reopened: the
memory state may be ahead of the disk. Synchronous, one owner thread, no clock.
"""

from __future__ import annotations

import errno
import logging
from typing import TYPE_CHECKING

from logstore import DiskFull, LogClosed, LogStoreError
from pulllog.actions import Closed, encode_action
from pulllog.snapshot import encode_snapshot

if TYPE_CHECKING:  # the attributes the mixin uses, defined by PullLogStore
    from logstore import CheckpointStore, SegmentedLog
    from pulllog.config import PullLogConfig
    from pulllog.state import PullState

log = logging.getLogger(__name__)

# While unlogged (disk full): how often tick() tries the checkpoint that ends it. Each try writes
# the whole state, so not every flush interval.
DISK_FULL_RETRY_MS = 1_000


class DurabilityMixin:
    """The durability calls of ``PullLogStore`` (module docstring)."""

    directory: str
    config: PullLogConfig
    _log: SegmentedLog
    _state: PullState
    _checkpoints: CheckpointStore
    _kept_offsets: list[int]
    _actions_since_checkpoint: int
    _follower: bool
    _closed: bool
    _failed: LogStoreError | None
    _unlogged: DiskFull | None
    _unlogged_retry_at_ms: int

    # ------------------------------------------------------------------ failures

    def _fail(self, exc: LogStoreError) -> None:
        if not isinstance(exc, LogClosed):
            self._failed = exc
        raise exc

    def _go_unlogged(self, exc: DiskFull) -> None:
        """Keep the state in memory only until a checkpoint can be written (async mode); in
        sync mode a caller was promised durability, so the failure is sticky."""
        if self.config.flush_mode == "sync":
            self._fail(exc)
        if self._unlogged is None:
            log.warning("pull log %s: %s; pulls and acks are kept in memory until a checkpoint "
                        "can be written", self.directory, exc)
        self._unlogged = exc

    def _checkpoint_unless_full(self) -> bool:
        """Write a checkpoint; on a full disk go (or stay) unlogged instead. True if written."""
        try:
            self.checkpoint()
        except DiskFull as exc:
            self._go_unlogged(exc)
            return False
        if self._unlogged is not None:
            log.warning("pull log %s: space is back, checkpoint written; logging actions again",
                        self.directory)
            self._unlogged = None
        return True

    @property
    def unlogged(self) -> bool:
        """True while a full disk keeps changes in memory only (see the module docstring)."""
        return self._unlogged is not None

    def _guarded(self, operation, *, full_goes_unlogged: bool = False):
        """``operation()``, a call of the log: a failure is sticky (``_fail``), but with
        ``full_goes_unlogged`` a full disk makes the store unlogged instead (async mode; sticky
        in sync mode, ``_go_unlogged``) and is re-raised."""
        if self._failed is not None:
            raise self._failed
        try:
            return operation()
        except DiskFull as exc:
            if full_goes_unlogged:
                self._go_unlogged(exc)
                raise
            self._fail(exc)
        except LogStoreError as exc:
            self._fail(exc)

    # ------------------------------------------------------------------ durability

    def flush(self) -> None:
        """Write buffered actions to the OS (a process crash no longer loses them). Raises
        ``DiskFull`` while unlogged."""
        if self._unlogged is not None:
            raise self._unlogged
        self._guarded(self._log.flush, full_goes_unlogged=True)

    def sync(self) -> None:
        """Flush and fsync every recorded action. Raises ``DiskFull`` while unlogged."""
        if self._unlogged is not None:
            raise self._unlogged
        self._guarded(self._log.sync, full_goes_unlogged=True)

    def tick(self, now_ms: int) -> bool:
        """Async mode: fsync if ``flush_interval_ms`` passed with actions pending; while unlogged,
        try a checkpoint every ``DISK_FULL_RETRY_MS``. True if it wrote something durable."""
        if self._failed is not None:
            raise self._failed
        if self._unlogged is not None:
            if now_ms < self._unlogged_retry_at_ms:
                return False
            self._unlogged_retry_at_ms = now_ms + DISK_FULL_RETRY_MS
            return self._checkpoint_unless_full()
        try:
            return bool(self._guarded(lambda: self._log.tick(now_ms),
                                        full_goes_unlogged=True))
        except DiskFull:
            if self._failed is not None:  # sync mode: sticky
                raise
            return False  # unlogged now; the next ticks try the checkpoint

    def checkpoint(self) -> None:
        """Write the whole state as a checkpoint and delete action segments no checkpoint needs.
        A full disk raises ``DiskFull`` and changes nothing."""
        offset = self._guarded(self._log.sync, full_goes_unlogged=True)
        assert offset == self._log.end_offset
        kept = (self._kept_offsets + [offset])[-self.config.checkpoints_kept:]
        try:
            self._checkpoints.write(encode_snapshot(self._state, offset, kept[:-1]))
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            raise DiskFull(self._checkpoints.directory, 0) from exc
        self._kept_offsets = kept
        self._actions_since_checkpoint = 0
        self._log.delete_segments_before(kept[0])

    def close(self) -> None:
        """Record a clean close (so the next open keeps the epoch), fsync and close the files."""
        if self._closed:
            return
        try:
            # While unlogged, CLOSED may be recorded only once a checkpoint covers what the log
            # lost; without it the next open starts a new epoch, as after a crash. A follower
            # records nothing of its own (its copy ends as the master's does).
            if self._follower:
                if self._failed is None:
                    self._log.sync()
            elif self._failed is None and (self._unlogged is None
                                           or self._checkpoint_unless_full()):
                try:
                    self._log.append(encode_action(Closed()))
                    self._log.sync()
                except DiskFull as exc:
                    log.warning("pull log %s: closed without a clean-close record: %s",
                                self.directory, exc)
        finally:
            self._log.close()
            self._closed = True
