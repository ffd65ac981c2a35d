"""Cancels and the done journal's hand-off records: ``cancel`` (the store's part under the
loader's lock, the broker's through ``HandOff``), the handed-entries and dropped records
with the replication gate asked first, and the wait for the slaves to have the journal. The
``CancelsMixin`` part of ``delayserver.scheduler.Scheduler`` (split from it; all of these run on
the event loop, the store calls on the delay-io thread).
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from typing import Any, Awaitable, Callable

from delayserver.dispatch import Dispatcher
from delayserver.handoff import HandOff
from delayserver.stats import DispatchStats
from delayserver.storage import DelayStore, ScheduleEntry
from delayserver.storage.done_journal import KIND_DROPPED, KIND_HANDED_IDS
from delayserver.tracing import DelayTracer
from delayserver.window import PreloadWindow
from serverkit.write_replication import WriteReplication
from wire.errors import NotSupported

log = logging.getLogger(__name__)


class CancelsMixin:
    """Cancels and the done journal's hand-off records; mixed into ``Scheduler``, which sets
    these fields in its ``__init__``."""

    clock: Callable[[], int]
    store: DelayStore
    tracer: DelayTracer
    handoff: HandOff
    window: PreloadWindow
    dispatcher: Dispatcher
    replica: WriteReplication
    stats: DispatchStats
    done_before_ms: int
    _wakeup: asyncio.Event
    _preload_lock: asyncio.Lock
    _io: Callable[..., Awaitable[Any]]  # Scheduler's: runs a function on the delay-io thread
    bucket_of: Callable[[int], int]
    # The delay log's end after the last answered commit (event loop), and placing the
    # answered commits still waiting for the window (Scheduler's).
    answered_delay_end: int
    _place_unplaced: Callable[[], None]

    # ------------------------------------------------------------------ cancel

    async def cancel(self, message_id: str, deliver_at_ms: int) -> str:
        """Cancel a pending message: "cancelled", "already_dispatched", "already_cancelled",
        "already_past" (its bucket is finished: too late) or "unknown". A cancelled message is
        never delivered."""
        # Not while a bucket is being loaded: a load that read the message as pending before
        # the cancel was recorded would put it into the wheel after this looked there, and it
        # would be delivered although the answer was "cancelled".
        self.replica.check_writable()
        return await self.handoff.cancel(
            message_id, deliver_at_ms, self.dispatcher, self._cancel_in_store,
            lambda message_id, due_ms: self._io(self.store.handed_state, message_id, due_ms))

    async def _cancel_in_store(self, message_id: str, deliver_at_ms: int,
                               taken: ScheduleEntry | None = None) -> tuple[str, str | None]:
        """The store's part of ``cancel``: (outcome, the message's subject when found).
        ``taken``: an entry of the message the dispatcher holds in flight and gives up (a
        hand-off a broker dropped while its answer was lost): cancelled as if waiting."""
        async with self._preload_lock:
            outcome, subject = await self._cancel_unloading(message_id, deliver_at_ms, taken)
        if outcome == "cancelled" and self.replica.replicating:
            await self.journal_replicated()
        return outcome, subject

    async def _record_handed_ids(self, hand_offs: list[tuple[int, list[ScheduleEntry]]]
                                 ) -> None:
        """Handed-entries records of ``hand_offs`` (``HandOff.recorded``), on the slaves too;
        NotSupported, nothing written, while some slave does not read them (the gate, asked
        right before the write: the dispatcher then sends them at their due time and pauses
        the hand-off; no handed record, kind 4, is tried: a slave of a release before
        ``fetch.reads`` reads neither)."""
        self._check_kind(KIND_HANDED_IDS)
        await self._io(self.store.record_handed_entries, hand_offs)
        if self.replica.replicating:
            await self.journal_replicated()

    async def _record_dropped(self, message_id: str, deliver_at_ms: int) -> str:
        """A broker dropped a handed message (``HandOff``): recorded in the store
        (``DelayStore.record_dropped``), on the slaves too; its answer. NotSupported, with
        nothing written, while a slave does not read it (``HandOff`` logs it; the broker's
        drop stands)."""
        self._check_kind(KIND_DROPPED)
        answer = await self._io(self.store.record_dropped, message_id, deliver_at_ms)
        if answer == "dropped" and self.replica.replicating:
            await self.journal_replicated()
        return answer

    def _check_kind(self, kind: int) -> None:
        """Raise NotSupported while a slave does not read done-journal ``kind`` (a record of it
        would stop its copy, serverkit.kind_gate); counted and logged once per reason."""
        why = self.replica.kind_refusal("done", kind)
        if why is None:
            self.stats.kind_refusals.allowed()
            return
        self.stats.kind_refusals.refuse(why, NotSupported,
                                        f"done journal kind {kind} not written: {why}")

    async def journal_replicated(self) -> None:
        """Wait until the slaves a ``sync`` write waits for have the done journal so far (a
        cancel: a new master must not deliver what was answered "cancelled")."""
        end = await self._io(lambda: self.store.done_copy.copy_bounds()[1])
        await self.replica.wait_replicated("done", end)

    async def _cancel_unloading(self, message_id: str, deliver_at_ms: int,
                                taken: ScheduleEntry | None = None) -> tuple[str, str | None]:
        """``_cancel_in_store``, holding the loader's lock."""
        bucket_ms = max(self.bucket_of(deliver_at_ms), self.done_before_ms)
        # The cancel takes effect now, in this loop step: it covers every send whose commit
        # was answered (placed in the window first, so it is held below), and none still
        # being committed. The store's part runs on the I/O thread after such a commit and
        # would find its entry stored, while the commit's placement into the window comes
        # after this looked there: answered "cancelled", the entry would still be sent. So
        # the store leaves alone what lies past the answered commits' end (that send is
        # ordered after the cancel: "unknown" when nothing else of the message was stored).
        self._place_unplaced()
        offset_end = self.answered_delay_end
        # Take candidates out of the wheel first, so the timer cannot send one while the
        # cancel is being recorded; put back those that turn out to be another message.
        held, in_flight = self.window.hold_for_cancel(
            zlib.crc32(message_id.encode("utf-8")), bucket_ms)
        store = self.store
        cancelled: set[int] = set()
        subject: str | None = None
        try:
            ids = await self._io(lambda: [store.read(e).message_id for e in held + in_flight])
            mine = {e.delay_log_offset for e, i in zip(held + in_flight, ids) if i == message_id}
            ours = {e.delay_log_offset for e in held}
            if taken is not None:
                ours.add(taken.delay_log_offset)
            if mine and not mine & ours:
                outcome = "already_dispatched"
            else:
                outcome, subject = await self._io(store.cancel_detail, message_id,
                                                  deliver_at_ms, offset_end)
                if outcome == "cancelled":  # what the store cancelled: below offset_end
                    cancelled = {offset for offset in mine if offset < offset_end}
                    self.tracer.cancelled(message_id, subject, deliver_at_ms, self.clock())
        finally:
            if taken is not None and taken.delay_log_offset in cancelled:
                self.window.forget([taken])
            self.window.release_held(held, cancelled, self.clock())
            self.tracer.drop_kept(cancelled)
            self.dispatcher.prefetch.drop(cancelled)
            self._wakeup.set()
        return outcome, subject


__all__ = ["CancelsMixin"]
