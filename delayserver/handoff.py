"""``HandOff``: the delay server's side of the hand-off ahead of the due time
(docs/ARCHITECTURE.md "The delay path", step 3; docs/REPLICATION.md 16): which entries the
scheduler's timer takes ``handoff_lead_ms`` early (the hot steps), the pause after a broker
refused a hand-off, the durable record of what may be handed, and cancels of messages a broker
may hold.

The dispatcher sends what is taken early with ``hold`` (the broker keeps it invisible until its
due time) and remembers what it may have handed in ``Dispatcher.handed`` (from the moment the
hold is sent); a cancel of such a message asks the broker, of no other one of this run. Before
a hold is sent, a handed-entries record (the done journal's kind 6, replicated as the rest of
the store) names its entries; while some slave does not read kind 6 none is written, the
batch is sent at its due time and the hand-off pauses (this release writes no handed record,
kind 4: a slave lacking kind 6 lacks kind 4 too, review s12 rvdelay-3). After a restart or a
failover, a cancel of a stored message such a record written before the run began names (or
that a handed record of an earlier release covers) asks the broker first (a broker that
cannot be asked fails the cancel with nothing recorded), then the store:
the broker's drop of one the store had recorded as dispatched answers ``cancelled`` and is
recorded (``DelayStore.record_dropped``). Any other cancel never asks a broker (with the
hand-off off, none does).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from operator import attrgetter
from typing import Awaitable, Callable

from delayserver.config import DelayConfig
from delayserver.dispatch import HELD_CANCEL_GRACE_MS, Dispatcher, Hold
from delayserver.storage import ScheduleEntry
from delayserver.tracing import DelayTracer
from serverkit.payload_sender import HELD_DROPPED
from wire.errors import NotSupported, Unavailable
from delayserver.window import PreloadWindow

log = logging.getLogger(__name__)

# After a broker did not take a hand-off (an older server), dispatch at the due time for this
# long (at least twice the lead) before handing off again.
NO_HOLD_PAUSE_MS = 30_000
# Hand-offs are taken on a grid of this many ms (at most half the lead): entries whose
# hand-off time falls within one step go in one request (and one dispatch-log record), not
# one per wheel tick; they are still most of the lead ahead of their due time.
HANDOFF_STEP_MS = 250
# (subject, message ids) -> for each id, whether a broker held it and dropped it now
# (HELD_DROPPED), dropped it at an earlier cancel (HELD_DROPPED_BEFORE) or neither ("")
# (PayloadSender.cancel_held_answers, the ``cancel_held`` op); raises when a broker cannot
# be asked.
CancelHeld = Callable[[str, list[str]], Awaitable[list[str]]]
# The store's part of a cancel: (message id, deliver_at_ms) -> (outcome, subject or None).
StoreCancel = Callable[[str, int], Awaitable[tuple[str, str | None]]]
# The store's subject and state of a message and whether a handed-entries record names it
# (DelayStore.handed_state): (message id, deliver_at_ms) -> (subject, "pending" or "done",
# named), (None, None, False): not stored.
StoreSubject = Callable[[str, int], Awaitable[tuple[str | None, str | None, bool]]]
# Writes handed-entries records, one per hand-off (DelayStore.record_handed_entries, then
# waits for the slaves a sync write waits for): [(latest due time, entries)] -> None; raises
# NotSupported when some slave does not read them yet, any error when they were not written
# (then nothing is handed off).
RecordHandedIds = Callable[[list[tuple[int, list[ScheduleEntry]]]], Awaitable[None]]
# Records durably that a broker dropped a handed message at a cancel (DelayStore.record_dropped,
# then waits for the slaves a sync write waits for): (message id, deliver_at_ms) -> its answer.
RecordDropped = Callable[[str, int], Awaitable[str]]
CANCELLED = ("cancelled", "already_cancelled")


def step_end_ms(due_ms: int, step: int) -> int:
    """The end of the hand-off step (of ``step`` ms) that ``due_ms`` falls in: the next
    multiple of ``step`` at or after it."""
    return -(-due_ms // step) * step


_due_of = attrgetter("deliver_at_ms")


def step_ms(lead_ms: int) -> int:
    """The hand-off grid for ``lead_ms`` (> 0): HANDOFF_STEP_MS, at most half the lead."""
    return max(1, min(HANDOFF_STEP_MS, lead_ms // 2))


def take_at_ms(due_ms: int, lead_ms: int, now_ms: int) -> int:
    """When to look at the entry due at ``due_ms`` next: when its hand-off step comes within
    the lead (to count it), or, once counted (a cold step: a hot one was taken already), at
    its due time."""
    if not lead_ms:
        return due_ms
    step_at = step_end_ms(due_ms, step_ms(lead_ms)) - lead_ms
    return min(due_ms, step_at) if step_at > now_ms else due_ms


class HandOff:
    """The hand-off's plan and its cancels, for one scheduler (see the module docstring).

    Threads: every field is owned by the event loop (the scheduler's timer, its loader and
    cancels call it). ``hold``, ``cancel_held``, ``config``, ``clock`` and ``tracer`` are not
    changed after construction.

    - ``_no_hold_until_ms``: a broker refused a hand-off; none before this time;
    - ``_step_seen_ms``: hand-off steps ending up to this were counted (hot or not); 0 after a
      bucket load (what it loaded may make a counted step hot);
    - ``_hot_until_ms``: what is due up to this is taken early (the end of a hot step);
    - ``_cold_counts``: step end -> messages due in it, of the steps counted cold (fewer than
      ``handoff_min_messages``) and not yet due: commits add to them (``placed``), so a step
      whose burst was still arriving as it came within the lead turns hot then;
    - ``_cancelling``: (message id, deliver_at_ms) -> the answer of the cancel of it under way;
      a cancel of the same message meanwhile waits for it (None: it failed);
    - ``prior_handed_until_ms``: the store's highest handed record (kind 4, written by an
      earlier release) when this run began (at start and promotion): what an earlier run or
      master may have handed, known by no id;
      ``prior_handed_ids_until_ms``: its highest handed-entries record then (the entries an
      earlier run or master handed are known by the store, ``StoreSubject``);
    - ``_naming``: hand-offs waiting for their handed-entries record, with the futures their
      senders wait on; ``_namer``: the task writing them (all waiting share one write).
    """

    def __init__(self, config: DelayConfig, clock: Callable[[], int], hold: Hold | None,
                 cancel_held: CancelHeld | None, tracer: DelayTracer,
                 record_dropped: RecordDropped | None = None,
                 record_handed_ids: RecordHandedIds | None = None) -> None:
        self.config = config
        self.clock = clock
        self.hold = hold if config.handoff_lead_ms > 0 else None  # on when given and lead > 0
        self.cancel_held = cancel_held
        self.tracer = tracer
        self.record_dropped = record_dropped
        self.record_handed_ids = record_handed_ids
        self._naming: list[tuple[int, list[ScheduleEntry], asyncio.Future[None]]] = []
        self._namer: asyncio.Task[None] | None = None
        self._no_hold_until_ms = 0
        self._step_seen_ms = 0
        self._hot_until_ms = 0
        self._cold_counts: dict[int, int] = {}
        self._cancelling: dict[tuple[str, int], asyncio.Future[str | None]] = {}
        self.prior_handed_until_ms = 0
        self.prior_handed_ids_until_ms = 0

    # ------------------------------------------------------------------ the plan

    def no_hold(self) -> None:
        """A broker did not take a hand-off: dispatch at the due time for a while."""
        self._no_hold_until_ms = self.clock() + max(NO_HOLD_PAUSE_MS,
                                                    2 * self.config.handoff_lead_ms)

    def lead_ms(self, now_ms: int) -> int:
        """How far ahead of its due time a message is taken now (0: at its due time)."""
        if self.hold is None or now_ms < self._no_hold_until_ms:
            return 0
        return self.config.handoff_lead_ms

    def forget_counted(self) -> None:
        """A bucket was loaded: count the steps within the lead again."""
        self._step_seen_ms = 0
        self._cold_counts.clear()

    def placed(self, entries: list[ScheduleEntry]) -> bool:
        """A commit's entries just entered the window: those due in a step already counted
        cold are added to its count. True when that made a step hot (the caller wakes the
        timer, which takes it now): a burst still arriving as its step came within the lead,
        counted before most of it was stored, is handed off all the same (it was sent at its
        due time: the closing sitting of session 13, W2's run 1, 0.49 s)."""
        seen = self._step_seen_ms
        if self.hold is None or not seen:
            return False
        low = self._hot_until_ms
        step = step_ms(self.config.handoff_lead_ms)
        counts, minimum = self._cold_counts, self.config.handoff_min_messages
        hot_end = 0
        for due in map(_due_of, entries):
            if low < due <= seen:  # in a step counted already, and not taken early yet
                end = step_end_ms(due, step)
                count = counts[end] = counts.get(end, 0) + 1
                if count >= minimum and end > hot_end:
                    hot_end = end
        if not hot_end:
            return False
        self._hot_until_ms = max(low, hot_end)
        return True

    async def recorded(self, until_ms: int, entries: list[ScheduleEntry]) -> None:
        """Before a hold of ``entries``, due up to ``until_ms``, is sent: a handed-entries
        record names them (hand-offs waiting meanwhile share one write). Raises when it was
        not written (NotSupported while some slave does not read kind 6): then the dispatcher
        sends them at their due time and pauses the hand-off."""
        if self.record_handed_ids is not None:
            await self._named(until_ms, entries)

    async def _named(self, until_ms: int, entries: list[ScheduleEntry]) -> None:
        """Wait until a handed-entries record names ``entries``: one task writes what waits,
        so the batches of a hot step sent at once share a write and an fsync."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._naming.append((until_ms, entries, future))
        if self._namer is None or self._namer.done():
            self._namer = asyncio.create_task(self._name_waiting(), name="delay-handed-ids")
        await asyncio.shield(future)

    async def stop(self) -> None:
        """A stop or demote, once the dispatcher stopped: end the task writing handed-entries
        records (its senders are gone; left running, it would write or wait on a store being
        closed). A record it had not written is not needed: nothing was held without it."""
        namer, self._namer = self._namer, None
        if namer is not None and not namer.done():
            namer.cancel()
            await asyncio.gather(namer, return_exceptions=True)
        waiting, self._naming = self._naming, []  # queued behind the write it was in
        for _until, _entries, future in waiting:
            future.cancel()

    async def _name_waiting(self) -> None:
        """Write the waiting hand-offs' handed-entries records until none waits; each
        waiter's future gets the outcome of the write that took it."""
        assert self.record_handed_ids is not None
        while self._naming:
            taken, self._naming = self._naming, []
            try:
                await self.record_handed_ids([(until, entries) for until, entries, _ in taken])
            except BaseException as exc:
                for _until, _entries, future in taken:
                    if future.done():
                        continue
                    if isinstance(exc, Exception):
                        future.set_exception(exc)
                        future.exception()  # its sender may be gone (stop): no warning
                    else:
                        # A stop: the waiting hand-offs are cancelled too, nothing else is
                        # written for them (an error here would be a refusal to fall back on)
                        future.cancel()
                if not isinstance(exc, Exception):
                    raise
            else:
                for _until, _entries, future in taken:
                    if not future.done():
                        future.set_result(None)

    def next_count_ms(self, lead_ms: int) -> int | None:
        """When the next hand-off step comes within ``lead_ms`` and is to be counted (None:
        the hand-off is not on): the timer wakes then, so a hot step gets the full lead
        rather than waiting for the timer's next look for another reason."""
        if not lead_ms:
            return None
        return self._step_seen_ms + step_ms(lead_ms) - lead_ms

    def take_until_ms(self, window: PreloadWindow, now_ms: int, lead_ms: int) -> int:
        """What is due up to this is taken now. Each hand-off step (a span of HANDOFF_STEP_MS
        of due times) is counted once, as it comes within the lead, on its own (a timer that
        wakes late, or a recount after a load, counts many steps at once, each apart; a
        commit adds to a step counted cold, ``placed``): a hot
        one (at least ``handoff_min_messages`` due in it) is taken whole, ahead of its due
        time, with whatever is due before it; otherwise messages are taken at their due time
        (spread-out due times gain nothing from a hand-off and cost the broker a second
        write)."""
        if not lead_ms:
            return now_ms
        step = step_ms(lead_ms)
        horizon = (now_ms + lead_ms) // step * step
        if horizon > self._step_seen_ms:
            waiting = window.waiting_between(max(self._step_seen_ms, now_ms), horizon)
            per_step = Counter(step_end_ms(e.deliver_at_ms, step) for e in waiting)
            minimum = self.config.handoff_min_messages
            hot = [end for end, count in per_step.items() if count >= minimum]
            if hot:
                self._hot_until_ms = max(self._hot_until_ms, min(max(hot), horizon))
            self._step_seen_ms = horizon
            counts = self._cold_counts
            for end in [end for end in counts if end <= now_ms]:  # due: nothing to add to
                del counts[end]
            counts.update((end, count) for end, count in per_step.items() if count < minimum)
        return max(now_ms, min(self._hot_until_ms, horizon))

    # ------------------------------------------------------------------ cancels

    async def cancel(self, message_id: str, deliver_at_ms: int, dispatcher: Dispatcher,
                     in_store: StoreCancel, subject_of: StoreSubject) -> str:
        """Cancel a message (see ``Scheduler.cancel``): a handed one through its broker, any
        other in the store (``in_store``); one a broker may hold (``_may_be_held``) through
        the broker first, then the store. Two cancels of one message at once: the second
        waits for the first and says what it found ("cancelled" becomes
        "already_cancelled")."""
        key = (message_id, deliver_at_ms)
        while (pending := self._cancelling.get(key)) is not None:
            answer = await asyncio.shield(pending)
            if answer is not None:  # None: the first failed; this one tries again, unless
                return "already_cancelled" if answer in CANCELLED else answer  # another did
        future: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._cancelling[key] = future
        answer: str | None = None
        try:
            answer = await self._cancel(message_id, deliver_at_ms, dispatcher, in_store,
                                        subject_of)
            return answer
        finally:
            future.set_result(answer)
            if self._cancelling.get(key) is future:
                del self._cancelling[key]

    async def _cancel(self, message_id: str, deliver_at_ms: int, dispatcher: Dispatcher,
                      in_store: StoreCancel, subject_of: StoreSubject) -> str:
        """``cancel`` alone (no other cancel of the message under way)."""
        handed = dispatcher.handed.get(message_id)
        if handed is not None and handed[1] == deliver_at_ms:
            if handed[2]:
                return "already_cancelled"
            return await self._cancel_handed(dispatcher, message_id, handed[0], deliver_at_ms,
                                             in_store)
        subject, state, named = await subject_of(message_id, deliver_at_ms) \
            if self._may_be_held(deliver_at_ms) else (None, None, False)
        if not named and deliver_at_ms > self.prior_handed_until_ms:
            subject = None  # no record of an earlier run names it or covers its due time
        if state == "done" and self.clock() - HELD_CANCEL_GRACE_MS >= deliver_at_ms:
            subject = None  # dispatched, and made visible by now whoever held it
        if subject is None:
            return (await in_store(message_id, deliver_at_ms))[0]
        # Handed before a restart or failover, its dispatch recorded or not (a kill -9
        # between the broker's answer and the record): the broker first, so one that cannot
        # be asked fails the cancel with nothing recorded (the client cancels again).
        dropped = await self._ask(subject, message_id)
        if not dropped and state == "pending":
            # Maybe handed by an earlier run whose dispatch record was lost, to a group no
            # broker of which is online (not asked, not in the route): cancelled here, that
            # group would deliver it when it comes back. Nothing is recorded; this run
            # dispatches it (a hand-off again: a cancel then asks its group; or a send at its
            # due time: already_dispatched) and the client cancels again (review s10 N4).
            raise Unavailable(
                f"message {message_id} due at {deliver_at_ms} may be held by a broker group "
                f"that could not be asked (handed before a restart or failover: "
                + ("named by a handed-entries record" if named else
                   f"due by the handed record's {self.prior_handed_until_ms}")
                + "); cancel again once it is dispatched")
        outcome, _subject = await in_store(message_id, deliver_at_ms)
        if not dropped or outcome != "already_dispatched":
            # Not held (made visible, or never handed: the store's answer stands), or held
            # and the store cancelled it too (it traced that).
            return outcome
        await self._dropped(dispatcher, message_id, subject, deliver_at_ms)
        return "cancelled" if dropped == HELD_DROPPED else "already_cancelled"

    async def _dropped(self, dispatcher: Dispatcher, message_id: str, subject: str,
                       deliver_at_ms: int, in_store: StoreCancel | None = None) -> None:
        """A broker dropped the handed message at a cancel: recorded durably in the store
        (a later cancel, after a restart or failover too, answers "already_cancelled"),
        remembered until its due time, traced ``cancelled``, also when the broker answered
        ``dropped_before`` (a broker restarted or promoted since the drop may never have
        traced it, review s11 rvho-8; a second ``cancelled`` line is one for the audit, which
        takes the max over a message's lines). One whose dispatch is
        not recorded: with ``in_store``, cancelled in the store when it is back in the
        schedule (its hold's answer was lost or said nothing sure: it waits for a plain send
        at its due time, review s11 rvho-1); one in flight is marked once its dispatch is
        recorded (``pending_drops``). A failed record is logged: the broker dropped it, so the
        answer "cancelled" stands (a later cancel may then say already_dispatched)."""
        dispatcher.note_handed(message_id, subject, deliver_at_ms, True)
        if await self._recorded_open(message_id, deliver_at_ms):
            if in_store is not None and await self._cancelled_in_store(
                    in_store, message_id, deliver_at_ms):
                return  # the store's cancel traced it
            dispatcher.pending_drops[message_id] = deliver_at_ms
        self.tracer.cancelled(message_id, subject, deliver_at_ms, self.clock())

    async def _recorded_open(self, message_id: str, deliver_at_ms: int) -> bool:
        """``record_dropped``: whether it answered "open" (the dispatch is not recorded);
        a failure is logged and answers False."""
        if self.record_dropped is None:
            return False
        try:
            return await self.record_dropped(message_id, deliver_at_ms) == "open"
        except NotSupported as exc:  # the gate: a world state, counted where it refused
            log.warning("the drop of handed message %s due at %d was not recorded: %s",
                        message_id, deliver_at_ms, exc)
            return False
        except Exception:
            log.exception("the drop of handed message %s due at %d was not recorded",
                          message_id, deliver_at_ms)
            return False

    @staticmethod
    async def _cancelled_in_store(in_store: StoreCancel, message_id: str,
                                  deliver_at_ms: int) -> bool:
        """Cancel in the store a dropped message whose dispatch is not recorded: True when it
        was waiting in the schedule and is cancelled now (never sent); False when it is in
        flight (its drop is marked once its dispatch is recorded) or the store failed."""
        try:
            return (await in_store(message_id, deliver_at_ms))[0] == "cancelled"
        except Exception:
            log.exception("the cancel in the store of dropped message %s due at %d failed",
                          message_id, deliver_at_ms)
            return False

    def _may_be_held(self, deliver_at_ms: int) -> bool:
        """Whether a broker may hold the message due at ``deliver_at_ms``, handed off by an
        earlier run or master of this store (this run's are known by id: ``Dispatcher.handed``):
        it can be asked and a handed record written before this run began covers its due
        time, or a handed-entries record may name it (the store says whether one does; one
        still in the schedule past its due time was not made visible by an online group: an
        offline one may hold it)."""
        return self.cancel_held is not None and deliver_at_ms <= max(
            self.prior_handed_until_ms, self.prior_handed_ids_until_ms)

    async def _cancel_handed(self, dispatcher: Dispatcher, message_id: str, subject: str,
                             deliver_at_ms: int, in_store: StoreCancel) -> str:
        """Cancel a message handed off ahead of its due time: the broker holding it drops it
        ("cancelled", once it confirmed: replicated as its writes are) unless it made it
        visible already ("already_dispatched"). A broker that cannot be asked raises (the
        client may cancel again)."""
        dropped = await self._ask(subject, message_id)
        if not dropped:
            # Made visible, or dropped at an earlier cancel whose record the store has.
            return (await in_store(message_id, deliver_at_ms))[0]
        # Recorded in the store: a repeated cancel (an answer lost on the way), after a
        # restart or failover too, says already_cancelled.
        await self._dropped(dispatcher, message_id, subject, deliver_at_ms, in_store=in_store)
        return "cancelled" if dropped == HELD_DROPPED else "already_cancelled"

    async def _ask(self, subject: str, message_id: str) -> str:
        """The broker's answer for one id: HELD_DROPPED, HELD_DROPPED_BEFORE or "" (not held
        now, or nobody to ask); raises when a broker cannot be asked."""
        if self.cancel_held is None:
            return ""
        return (await self.cancel_held(subject, [message_id]))[0] or ""


__all__ = ["HANDOFF_STEP_MS", "HELD_CANCEL_GRACE_MS", "NO_HOLD_PAUSE_MS", "CancelHeld",
           "HandOff", "RecordDropped", "RecordHandedIds", "step_end_ms", "step_ms", "take_at_ms"]
