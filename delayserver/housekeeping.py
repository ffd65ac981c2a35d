"""The delay server's housekeeping: the rounds that flush the store, record the dispatches a
full disk held back, move the done watermark and tell the slaves how far the done journal goes
(a copy's round: only the flush), and the stats report. The ``HousekeepingMixin`` part of
``delayserver.scheduler.Scheduler`` (split from it; the scheduler's docstring says which thread
owns each field: these run on the event loop, ``_advance_done_on_io`` on delay-io).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

from delayserver.config import DelayConfig
from delayserver.dispatch import Dispatcher
from delayserver.stats import DispatchStats
from delayserver.storage import DelayStore
from delayserver.window import PreloadWindow
from serverkit.io_thread import IoThread
from serverkit.write_replication import WriteReplication

log = logging.getLogger(__name__)

DONE_CHECK_INTERVAL_MS = 1_000  # how often the done watermark is advanced


class HousekeepingMixin:
    """The housekeeping rounds and ``report``; mixed into ``Scheduler``, which sets these
    fields in its ``__init__``."""

    config: DelayConfig
    clock: Callable[[], int]
    store: DelayStore
    window: PreloadWindow
    dispatcher: Dispatcher
    replica: WriteReplication
    stats: DispatchStats
    done_before_ms: int
    _io_thread: IoThread
    _last_done_check_ms: int
    _io: Callable[..., Awaitable[Any]]  # Scheduler's: runs a function on the delay-io thread

    # ------------------------------------------------------------------ housekeeping

    async def record_unrecorded(self) -> int:
        """Record the confirmed dispatches a full disk held back (housekeeping calls this every
        second); returns how many were recorded, 0 while the disk is still full."""
        return await self.dispatcher.record_unrecorded()

    async def advance_done(self) -> None:
        """Move the store's done watermark up as far as is safe now (housekeeping does this
        every second; tests call it directly)."""
        self.done_before_ms = await self._io(self._advance_done_on_io,
                                             self.window.done_limit_ms(self.clock()))

    def _advance_done_on_io(self, candidate_ms: int) -> int:
        """On the delay-io thread: move the store's done watermark up to ``candidate_ms`` if it
        is higher; returns the watermark."""
        store = self.store
        if candidate_ms > store.done_before():
            try:
                store.mark_done_before(candidate_ms)
            except ValueError as exc:
                # A late message was filed below the candidate after it was computed; the
                # store refuses and changes nothing. The next check sees that entry tracked.
                log.debug("done watermark stays at %d: %s", store.done_before(), exc)
        return store.done_before()

    async def _housekeeping(self) -> None:
        """A master's round, each second or flush interval: the store's flush, and each
        second the handed ids pruned, held-back records written and the done watermark moved;
        the slaves told how far the done journal goes."""
        while True:
            await asyncio.sleep(min(DONE_CHECK_INTERVAL_MS, self.config.flush_interval_ms) / 1000)
            try:
                now_ms = self.clock()
                if not (self._io_thread.idle() and self.store.tick_is_idle()):  # else no hop
                    await self._io(self.store.tick, now_ms)
                if now_ms - self._last_done_check_ms >= DONE_CHECK_INTERVAL_MS:
                    self._last_done_check_ms = now_ms
                    self.dispatcher.prune_handed(now_ms)
                    await self.record_unrecorded()
                    await self.advance_done()
                if self.replica.replicating:  # dispatch records and watermark moves
                    done = self.store.done_copy  # read here when the thread idles: no hop
                    end = (done.copy_bounds()[1] if self._io_thread.idle()
                           else await self._io(lambda: done.copy_bounds()[1]))
                    self.replica.advanced("done", end)
            except Exception:
                log.exception("delay housekeeping failed")

    async def report(self) -> dict[str, Any]:
        """Stats for heartbeats and ``qmq admin delay``: pending per hour and subject, dispatch
        rate, lateness histogram, window size."""
        pending = await self._io(self.store.pending_stats)
        now_ms = self.clock()
        return {
            "pending_total": pending.total,
            "pending_per_hour": {str(k): v for k, v in sorted(pending.per_hour.items())},
            "pending_per_subject": dict(sorted(pending.per_subject.items())),
            "in_memory": len(self.window),
            "done_before_ms": self.done_before_ms,
            **self.stats.snapshot(now_ms),
        }

    async def _copy_housekeeping(self) -> None:
        """A copy's round: the store's asynchronous flush and checkpoints."""
        while True:
            await asyncio.sleep(min(DONE_CHECK_INTERVAL_MS, self.config.flush_interval_ms) / 1000)
            try:
                if not (self._io_thread.idle() and self.store.tick_is_idle()):  # else no hop
                    await self._io(self.store.tick, self.clock())
            except Exception:
                log.exception("delay copy housekeeping failed")
