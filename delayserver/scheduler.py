"""The delay server's scheduling core: accepts delayed messages, keeps the preload window
(``PreloadWindow``) filled from the store, hands due messages to the ``Dispatcher`` and moves the
done watermark.

Two levels (DESIGN.md section 9): every pending message is on disk in the ``DelayStore``; only
entries of the buckets up to ``preload_buckets`` ahead of now are in memory, in the window. All
storage calls run on one I/O thread (``delay-io``), so the event loop never blocks on disk. The
window is a pure state machine told the time; this module is the async orchestration around it:
accepting sends and their group commit (``delayserver.accepting``, ``AcceptingMixin``), the
loader and the timer that takes due entries (``delayserver.loading``, ``LoadingMixin``),
housekeeping (``delayserver.housekeeping``, ``HousekeepingMixin``), and
cancels with the done journal's hand-off records (``delayserver.cancels``, ``CancelsMixin``).

Invariants:
- nothing is dispatched before its ``deliver_at_ms`` (the wheel never returns an entry early and
  the clock is the only source of "now");
- a dispatch is recorded only after a realtime broker confirmed it (stored or duplicate), so a
  crash re-dispatches at most what was sent and not yet recorded, and the broker's
  de-duplication by message id absorbs that resend;
- the done watermark passed to ``mark_done_before`` never passes a bucket with an entry that is
  still loaded, in flight or waiting to be retried (``PreloadWindow.done_limit_ms``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Callable, ContextManager, Sequence, TypeVar

from delayserver.accepting import AcceptingMixin, _Committed, _PendingCall
from delayserver.cancels import CancelsMixin
from delayserver.config import DelayConfig
from delayserver.dispatch import Dispatch, Dispatcher, Hold
from delayserver.handoff import CancelHeld, HandOff
from delayserver.housekeeping import HousekeepingMixin
from delayserver.loading import LoadingMixin
from delayserver.stats import DispatchStats
from delayserver.tracing import DelayTracer
from delayserver.storage import DelayStore, DelayStoreConfig, ScheduleEntry
from delayserver.window import PreloadWindow, WindowLimits
from logstore.fileio import Opener, OsFile
from serverkit.committer import GroupCommitter
from serverkit.io_thread import IoThread
from serverkit.write_replication import NoWriteReplication, WriteReplication
from serverkit.send_check import Checked, QuickCheck

log = logging.getLogger(__name__)
T = TypeVar("T")


def open_store_on_io(config: DelayConfig, now_ms: int, opener: Opener,
                     on_fsync: Callable[[float], None] | None) -> DelayStore:
    """On the delay-io thread: open (and recover) the store of ``config``; ``on_fsync`` (if
    given) is called after each delay-log fsync, on that thread."""
    store_config = DelayStoreConfig(bucket_ms=config.bucket_ms, flush_mode=config.flush,
                                    flush_interval_ms=config.flush_interval_ms,
                                    preallocate_step_bytes=config.preallocate_step_bytes)
    store = DelayStore(config.data_dir, store_config, opener=opener, now_ms=now_ms)
    if on_fsync is not None:
        store.observe_fsync(on_fsync)
    log.info("delay store open: %s", store.recovery)
    return store


def _open_noted(opened: list[DelayStore], *args: Any) -> DelayStore:
    """On the delay-io thread: ``open_store_on_io(*args)``, the store also put in ``opened``
    (its caller may be gone by then: ``_close_opened``)."""
    store = open_store_on_io(*args)
    opened.append(store)
    return store


def _close_opened(opened: list[DelayStore]) -> None:
    """On the delay-io thread, after ``Scheduler.open`` was cancelled or failed: close the
    store its open made (queued after it, so it runs once the open ends), so none of its files
    stays open."""
    for store in opened:
        try:
            store.close()
        except Exception:
            log.exception("closing the delay store of a failed or cancelled open failed")


def delay_log_end(store: DelayStore) -> int:
    """Delay-io thread: the delay log's end as a slave's fetch may read it (after a commit:
    everything committed so far)."""
    return store.delay_end()


class Scheduler(AcceptingMixin, LoadingMixin, CancelsMixin, HousekeepingMixin):
    """Owns an open ``DelayStore``, the preload window and the dispatcher; see the module
    docstring. Built by ``open``, which opens the store first; ``start`` begins dispatching.

    Threads: the store is called only on the delay-io thread (``_io_thread``, through ``_io``;
    housekeeping reads it on the loop while that thread is idle, no call queued or running);
    methods that run there say so in their first line. Every other field is owned by the event
    loop: ``window``, ``dispatcher``, ``stats``, ``readonly`` and ``write_failed`` (set by the
    MetaServer's state callback and by a commit's sticky write failure), ``done_before_ms``
    (the store's done watermark as the last call that could move it returned it), the group
    commit (``_commits``), the tasks and the loader's lock. ``config``, ``clock`` and ``tracer``
    are not changed after ``open``.
    """

    def __init__(self, config: DelayConfig, clock: Callable[[], int], dispatch: Dispatch,
                 store: DelayStore, io_thread: IoThread, *, done_before_ms: int,
                 tracer: DelayTracer | None = None, replica: WriteReplication | None = None,
                 follower: bool = False, hold: Hold | None = None,
                 cancel_held: CancelHeld | None = None, answered_delay_end: int = 0) -> None:
        self.config = config
        self.clock = clock
        self.store = store
        # Replication (docs/REPLICATION.md 8): sync waits and min_insync refusals of a master;
        # ``follower``: the store is a copy, filled by the data plane, and nothing here runs
        # but its flush until ``promote`` (event loop).
        self.replica = replica or NoWriteReplication()
        self.follower = follower
        self._dispatch = dispatch
        self._io_thread = io_thread
        self.tracer = tracer if tracer is not None else DelayTracer(None)
        # The hand-off ahead of the due time (docs/ARCHITECTURE.md "The delay path", step 3):
        # on when a hold function is given and handoff_lead_ms > 0 (event loop; see HandOff).
        self.handoff = HandOff(config, clock, hold, cancel_held, self.tracer,
                               self._record_dropped, self._record_handed_ids)
        self.readonly = False  # set by the MetaServer (draining) or after a sticky write failure
        self.write_failed = False  # a sticky write failure: read-only until restarted
        self.done_before_ms = done_before_ms
        self.stats = DispatchStats()
        self.window = PreloadWindow(WindowLimits.from_config(config), done_before_ms)
        self._wakeup = asyncio.Event()  # the timer re-checks the window
        # When the sleeping timer wakes by itself (ms; None while it runs): a commit of
        # nothing due before then, into a window with room, need not wake it.
        self._timer_wake_at_ms: int | None = None
        self._timer_idle = False  # the timer sleeps until the next bucket: nothing waited
        self.dispatcher = self._new_dispatcher()
        self._quick_check = QuickCheck()
        self._commits: GroupCommitter[_PendingCall, _Committed] = GroupCommitter(
            f"delay group {config.group}", self._commit_io_call, self._committed_batch,
            self._fail_batch, self._go_readonly, self._restore_batch,
            commit_then=self._commit_io_then)
        # Around the answers of a ``schedule_soon`` commit: the block the server's
        # ``FrameServer.answers_together()`` gives (set by the server), so they leave in one
        # write per connection (event loop).
        self.answers_together: ContextManager[None] = contextlib.nullcontext()
        # Answered commits whose entries wait for the next loop turn to enter the window
        # (``_committed_batch``): (entries, quick-check fields when tracing) each.
        self._unplaced: list[tuple[list[ScheduleEntry], Sequence[Checked | None] | None]] = []
        # The delay log's end after the last answered commit (event loop): what a cancel
        # covers (CancelsMixin._cancel_unloading). At open, the store's end: all recovered.
        self.answered_delay_end = answered_delay_end
        self._tasks: list[asyncio.Task[None]] = []
        self._last_done_check_ms = 0
        self._preload_lock = asyncio.Lock()
        self._preload_task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle

    def _new_dispatcher(self) -> Dispatcher:
        self._prefetched_to_ms = 0  # due times up to this were handed to the new prefetch
        return Dispatcher(self.config, self.clock, self._dispatch, self.window, self.store,
                          self._io, self.stats, self.tracer, self._wakeup.set,
                          self.handoff.hold, self.handoff.no_hold, self.handoff.recorded,
                          self._record_dropped, self._cancel_in_store)

    @classmethod
    async def open(cls, config: DelayConfig, clock: Callable[[], int], dispatch: Dispatch,
                   opener: Opener = OsFile, *, tracer: DelayTracer | None = None,
                   on_fsync: Callable[[float], None] | None = None,
                   replica: WriteReplication | None = None,
                   follower: bool = False, hold: Hold | None = None,
                   cancel_held: CancelHeld | None = None) -> Scheduler:
        """Open (and recover) the store on a new delay-io thread, then build the scheduler
        over it (``start`` loads the window and begins dispatching)."""
        # An IoThread, not a ThreadPoolExecutor: a call costs a C queue put and its result
        # comes back with others finished meanwhile in one loop wake-up, where
        # run_in_executor made a concurrent future, a chained asyncio future and a
        # call_soon_threadsafe per call (every group commit and dispatch goes through here).
        io_thread = IoThread("delay-io")
        opened: list[DelayStore] = []
        try:
            store = await io_thread.call(_open_noted, opened, config, clock(), opener, on_fsync)
            done_before_ms = await io_thread.call(store.done_before)
            delay_end = await io_thread.call(delay_log_end, store)
        except BaseException:
            io_thread.submit(_close_opened, opened)  # after the open, which may still run
            io_thread.close(wait=False)
            raise
        return cls(config, clock, dispatch, store, io_thread, done_before_ms=done_before_ms,
                   tracer=tracer, replica=replica, follower=follower, hold=hold,
                   cancel_held=cancel_held, answered_delay_end=delay_end)

    async def _io(self, fn: Callable[..., T], *args: Any) -> T:
        return await self._io_thread.call(fn, *args)

    async def on_io(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the delay-io thread, the store's owner (replication's runner)."""
        return await self._io(fn, *args)

    async def start(self) -> None:
        """Load the window, start committing and dispatching (a copy: only its flush)."""
        if self.follower:
            self._tasks = [asyncio.create_task(self._copy_housekeeping(),
                                               name="delay-copy-housekeeping")]
            return
        # Hand-offs of earlier runs (or the old master) are known by the handed-entries
        # records, or, an earlier release's, only by this bound; this run's by id
        # (Dispatcher.handed), so a cancel asks a broker only about those.
        self.handoff.prior_handed_until_ms = await self._io(self.store.handed_until_ms)
        self.handoff.prior_handed_ids_until_ms = await self._io(self.store.handed_ids_until_ms)
        await self.preload()
        self._tasks = [
            asyncio.create_task(self._commits.run(), name="delay-committer"),
            asyncio.create_task(self._timer(), name="delay-dispatcher"),
            asyncio.create_task(self._housekeeping(), name="delay-housekeeping"),
        ]

    async def _stop_tasks(self) -> None:
        tasks = self._tasks + ([self._preload_task] if self._preload_task is not None else [])
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks, self._preload_task = [], None

    async def _finish_master_work(self) -> None:
        """Commit queued sends, wait for in-flight dispatches and record them."""
        await self._commits.commit_pending()
        await self.dispatcher.stop(self.config.shutdown_grace_ms)
        await self.handoff.stop()  # no handed-entries record is written after this
        if not self.write_failed:  # a failed store refuses writes until reopened
            await self.record_unrecorded()
            await self.advance_done()

    async def stop(self) -> None:
        """Stop dispatching, commit queued sends, wait for in-flight dispatches, close the store."""
        await self._stop_tasks()
        if not self.follower:
            await self._finish_master_work()
        self.tracer.build_deferred()  # before the server closes the trace writer
        await self._io(self.store.close)
        self._io_thread.close()

    async def promote(self) -> None:
        """The copy becomes the master (docs/REPLICATION.md 8.5): the window and dispatcher are
        built afresh from the store (the copied schedule, bucket files and watermark), then it
        loads and dispatches what is due, as after a restart."""
        await self._stop_tasks()
        self.done_before_ms = await self._io(self.store.done_before)
        # Everything the old master copied here counts as answered (a cancel covers it).
        self.answered_delay_end = await self._io(delay_log_end, self.store)
        self.window = PreloadWindow(WindowLimits.from_config(self.config), self.done_before_ms)
        self.tracer.forget_kept()  # kept for the old window; its offsets may mean others now
        self.dispatcher = self._new_dispatcher()
        self.follower = False
        await self.start()

    async def settle(self) -> None:
        """A master handing over: nothing to flush (the delay log and the done journal are
        written to the OS, and told, in each commit)."""

    async def demote(self) -> None:
        """The master steps down (writes are refused already): queued sends are committed and
        in-flight dispatches finished and recorded, then only the copy's flush runs."""
        await self._stop_tasks()
        await self._finish_master_work()
        self.tracer.forget_kept()  # a copy's store may be thrown away and its offsets reused
        self.follower = True
        await self.start()

    # ------------------------------------------------------------------ the timer's wake-up

    def poke(self) -> None:
        """Make the dispatcher look at the clock now (after a fake clock moved, or a config change)."""
        self._wakeup.set()

    def bucket_of(self, deliver_at_ms: int) -> int:
        """The start of the bucket ``deliver_at_ms`` falls in."""
        return self.window.bucket_of(deliver_at_ms)


__all__ = ["Dispatch", "Scheduler"]
