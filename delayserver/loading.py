"""The delay server's loader and timer: filling the preload window from the store's buckets, and
the timer that moves due entries into flight (and reads payloads ahead of a hot slot). The
``LoadingMixin`` part of ``delayserver.scheduler.Scheduler`` (split from it; the scheduler's
docstring says which thread owns each field: all of these run on the event loop).
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from delayserver.config import DelayConfig
from delayserver.dispatch import Dispatcher
from delayserver.handoff import HandOff, take_at_ms
from delayserver.prefetch import PREFETCH_AHEAD_MS, PREFETCH_LOOKS_PER_AHEAD
from delayserver.storage import DelayStore
from delayserver.tracing import DelayTracer
from delayserver.window import PreloadWindow

TRACK_SLICE_ENTRIES = 2_000  # loaded entries put into the window per event-loop turn


class LoadingMixin:
    """The window's loader (``preload``) and the timer (``_timer``); mixed into ``Scheduler``,
    which sets these fields in its ``__init__``."""

    config: DelayConfig
    clock: Callable[[], int]
    store: DelayStore
    tracer: DelayTracer
    handoff: HandOff
    window: PreloadWindow
    dispatcher: Dispatcher
    _wakeup: asyncio.Event
    _timer_wake_at_ms: int | None
    _timer_idle: bool
    _prefetched_to_ms: int
    _preload_lock: asyncio.Lock
    _preload_task: asyncio.Task[None] | None
    _io: Callable[..., Awaitable[Any]]  # Scheduler's: runs a function on the delay-io thread

    # ------------------------------------------------------------------ the window's loader

    async def preload(self) -> None:
        """Fill the window: first the rest of buckets loaded only in part, then every bucket up
        to ``preload_buckets`` ahead of now that is not loaded yet, oldest first (buckets whose
        time passed while the server was down included), while the window holds fewer than
        ``wheel_entries_max`` entries. A bucket larger than the room left is loaded in part and
        continued, in disk order, as dispatching drains the window; later buckets wait for it.
        """
        async with self._preload_lock:
            await self._preload_locked()

    async def _preload_locked(self) -> None:
        """``preload``, holding the loader's lock (a cancel holds it too)."""
        window = self.window
        while (refill := window.take_refill()) is not None:
            await self._load_slice(*refill)
        if window.resume_at:
            return  # still full: what is due first is on disk in the part-loaded bucket
        horizon_ms = window.horizon_ms(self.clock())
        while window.next_bucket_wanted(horizon_ms):
            buckets = await self._io(self.store.buckets_with_pending, window.next_load_ms,
                                     horizon_ms)
            if not buckets:
                window.nothing_pending_until(horizon_ms)
                break
            bucket_ms = buckets[0]
            window.begin_load(bucket_ms)  # in the same turn as the listing returned
            complete = False
            try:
                await self._load_slice(bucket_ms, 0)
                complete = True
            finally:
                window.end_load(bucket_ms, complete=complete)
            if window.part_loaded(bucket_ms):
                break

    async def _load_slice(self, bucket_ms: int, from_offset: int) -> None:
        """Load what fits of the bucket from ``from_offset`` into the window and note where to
        resume if not all of it fitted. Commits into the bucket meanwhile track themselves
        while there is room (a bucket being loaded counts as loaded), or note their own resume
        point; the earlier of the two wins, and the loader skips what is tracked already."""
        entries, resume_offset = await self._io(self.store.load_bucket_slice, bucket_ms,
                                                from_offset, self.window.slice_entries_max())
        # In slices, yielding between them: tracking a 50,000-entry bucket in one go would
        # hold the event loop (and every due dispatch) for a quarter second.
        for start in range(0, len(entries), TRACK_SLICE_ENTRIES):
            self.window.track(entries[start:start + TRACK_SLICE_ENTRIES])
            self._wakeup.set()
            await asyncio.sleep(0)
        self.window.loaded(bucket_ms, resume_offset)
        self.handoff.forget_counted()  # what it loaded may make a counted step hot

    # ------------------------------------------------------------------ the timer

    async def _timer(self) -> None:
        """Start loads, move due entries into flight and start workers for them, then sleep
        until the next due time, the next bucket or a wakeup, whichever comes first."""
        window = self.window
        while True:
            now_ms = self.clock()
            if not self._preloading() and window.load_wanted(now_ms):
                # Loading runs beside dispatching: what is due keeps going while a bucket
                # ahead is read and tracked.
                self._preload_task = asyncio.create_task(self.preload(), name="delay-preload")
            # With the hand-off, entries are taken handoff_lead_ms ahead of their due time
            # (the broker holds them until then); the read-ahead moves with them.
            lead_ms = self.handoff.lead_ms(now_ms)
            if window.take_due(self.handoff.take_until_ms(window, now_ms, lead_ms)):
                self.dispatcher.start()
            self._wakeup.clear()
            next_due = window.next_due_ms()
            next_bucket_ms = window.bucket_of(now_ms) + self.config.bucket_ms
            wake_at = next_bucket_ms if next_due is None else min(
                take_at_ms(next_due, lead_ms, now_ms), next_bucket_ms,
                self._read_ahead(now_ms + lead_ms, next_due) - lead_ms,
                self.handoff.next_count_ms(lead_ms) or next_bucket_ms)
            delay_s = max(0, wake_at - self.clock()) / 1000
            self._timer_wake_at_ms = wake_at
            self._timer_idle = next_due is None  # asleep until the next bucket starts
            # Not asyncio.wait_for: on Python 3.11 it swallows a cancel that arrives in the turn
            # the wakeup is set, and stop() then waits for this task for ever.
            try:
                async with asyncio.timeout(delay_s):
                    await self._wakeup.wait()
            except TimeoutError:
                pass

    def _read_ahead(self, now_ms: int, next_due_ms: int) -> int:
        """Start reading the payloads of the entries due within PREFETCH_AHEAD_MS that were not
        handed to the prefetch yet (a hot slot then starts sending at its due instant); returns
        when to look again: once the earliest waiting entry is that close, then a few times
        per PREFETCH_AHEAD_MS while entries wait that close (later ones come into reach)."""
        until_ms = now_ms + PREFETCH_AHEAD_MS
        if next_due_ms > until_ms:
            return next_due_ms - PREFETCH_AHEAD_MS
        after_ms = max(self._prefetched_to_ms, now_ms)
        if until_ms > after_ms:
            soon = self.window.waiting_between(after_ms, until_ms)
            self._prefetched_to_ms = until_ms
            if soon:
                self.dispatcher.prefetch.start(soon)
                if self.tracer.enabled:
                    self.tracer.prepare([e.delay_log_offset for e in soon])
        return now_ms + PREFETCH_AHEAD_MS // PREFETCH_LOOKS_PER_AHEAD

    def _preloading(self) -> bool:
        return self._preload_task is not None and not self._preload_task.done()
