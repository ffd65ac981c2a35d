"""The delay server's acceptance of delayed messages and their group commit: ``schedule``
checks a send's payloads (the quick check, else the full one) and queues them as one
``_PendingCall`` for the ``GroupCommitter``, whose commit appends and commits them on delay-io
(``_append_and_commit``); a committed batch is answered, then its entries placed in the window
a loop turn later (``_committed_batch``, ``_place_unplaced``). ``schedule_soon``, the server's
send, queues with no task: its commit's store call makes no future (``IoThread.submit_then``)
and the call, the request's ``Later``, is told in the store thread's hand-back (``on_done``).
The ``AcceptingMixin`` part of ``delayserver.scheduler.Scheduler`` (split from it; the
scheduler's docstring says which thread owns each field: these run on the event loop,
``_append_and_commit`` on delay-io).
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from itertools import chain
from operator import itemgetter
from typing import Any, Awaitable, Callable, ContextManager, Sequence

from delayserver.config import DelayConfig
from delayserver.handoff import HandOff
from delayserver.prefetch import PREFETCH_AHEAD_MS
from delayserver.storage import DelayStore, ScheduleEntry
from delayserver.tracing import DelayTracer
from delayserver.window import PreloadWindow
from serverkit.committer import GroupCommitter
from serverkit.io_thread import IoThread
from serverkit.later import Later
from serverkit.send_check import Checked, QuickCheck
from serverkit.write_replication import WriteReplication
from wire.errors import DelayOutOfRange, QmqError, ReadOnly
from wire.message import decode_message, peek_message_id, validate_message
from wire.protocol import delayed_send_result, send_result_error

log = logging.getLogger(__name__)
# A send's access check (``Gate.check_send`` with the connection's grant): (payloads, the
# quick check's answer per payload) -> None, or raises Forbidden.
CheckAccess = Callable[[list[bytes], list[Checked | None]], None]


class _PendingCall(Later):
    """One ``schedule`` call's accepted messages waiting for the group commit, as columns: one
    object per request, not per message (they always share a commit). A call of ``schedule``
    is woken through ``future``; one of ``schedule_soon`` has none (``future`` None) and is
    its request's ``Later``: ``on_done(call)`` is told once its commit ended (issue 18)."""

    __slots__ = ("ids", "subjects", "dues", "payloads", "checks", "slots", "results", "future",
                 "compact", "delay_end", "on_done", "error")

    def __init__(self, ids: list[str], subjects: list[str], dues: list[int],
                 payloads: list[bytes], checks: list[Checked | None], slots: list[int] | None,
                 results: list[Any],
                 future: asyncio.Future[list[dict[str, Any]] | int] | None,
                 compact: bool = False) -> None:
        # The Later's own fields, unbound and not answered (as ``Later.__init__`` sets them),
        # set here: no second __init__ call per send.
        self._server = self._connection = self._request = self._outcome = None
        self._given_once = False
        self.ids = ids
        self.subjects = subjects
        self.dues = dues  # deliver_at_ms, a message without one due at its arrival
        self.payloads = payloads
        # What the quick check read of each (None: the full check took it; the tracer peeks
        # the payload): its scheduled line is built from these fields.
        self.checks = checks
        self.slots = slots  # index in ``results`` of each message; None: all, in order
        self.results = results  # one answer per payload; the accepted ones filled on commit
        self.future = future  # ``schedule``'s; None: ``on_done`` is told instead
        # All passed the quick check and the caller takes a count for "all stored" (a
        # compact send): on commit no result is made per message and the answer is the count.
        self.compact = compact
        # The delay log's end after the commit that stored these (0 until then, or when it
        # failed): what a ``sync`` answer waits for the slaves to have.
        self.delay_end = 0
        # ``schedule_soon``: called with this call once its commit ended (stored or refused).
        self.on_done: Callable[[_PendingCall], None] | None = None
        # The error this call ends with instead of its results (a refused ``sync`` wait:
        # NotMaster), for ``on_done``; None: ``results`` (or the count) answer it.
        self.error: BaseException | None = None


# What a group commit returns: the stored entries and the delay log's end after it.
_Committed = tuple[list[ScheduleEntry], int]

# Columns of a batch of Checked tuples, taken by ``map`` in C rather than a loop per message.
_ids_of = itemgetter(0)
_subjects_of = itemgetter(1)
_dues_of = itemgetter(4)
_entry_due_of = itemgetter(2)  # a ScheduleEntry's deliver_at_ms


class AcceptingMixin:
    """``schedule`` and the group commit of what it accepts; mixed into ``Scheduler``, which
    sets these fields in its ``__init__``."""

    config: DelayConfig
    clock: Callable[[], int]
    store: DelayStore
    window: PreloadWindow
    replica: WriteReplication
    tracer: DelayTracer
    handoff: HandOff
    readonly: bool
    write_failed: bool
    answered_delay_end: int
    _io_thread: IoThread
    _wakeup: asyncio.Event
    _timer_wake_at_ms: int | None
    _timer_idle: bool
    _quick_check: QuickCheck
    _commits: GroupCommitter[_PendingCall, _Committed]
    _unplaced: list[tuple[list[ScheduleEntry], Sequence[Checked | None] | None]]
    answers_together: ContextManager[None]

    # ------------------------------------------------------------------ accepting

    async def schedule(self, payloads: list[bytes], compact: bool = False,
                       check_access: CheckAccess | None = None) -> list[dict[str, Any]] | int:
        """Store delayed messages durably and answer one result per payload; with ``compact``,
        the number of payloads (an int) instead when every one was stored.

        A message without ``deliver_at_ms``, or with one in the past, is due at once. One later
        than now + ``max_delay_ms`` is refused with ``delay_out_of_range``, never clamped.
        ``check_access`` (the connection's grant: ``Gate.check_send``) refuses the whole
        request before anything else is checked or written, given what the quick check read.
        """
        call = self._accept(payloads, compact, check_access,
                            asyncio.get_running_loop().create_future())
        if type(call) is not _PendingCall:
            return call  # type: ignore[return-value]  # nothing valid: the results
        self._commits.pending.append(call)
        # In this task when no commit runs (no committer wake-up, no hop back to this task:
        # two task steps and two loop turns fewer per commit), else by the committer task.
        await self._commits.commit_now()
        answered = await call.future  # type: ignore[misc]
        if call.delay_end:  # not waited with its commit (``_park_answers``): NotMaster now
            await self.replica.wait_replicated("delay", call.delay_end)
        return answered

    def schedule_soon(self, payloads: list[bytes], compact: bool, check_access: CheckAccess
                      | None, done: Callable[[_PendingCall], None]) -> _PendingCall | list[Any]:
        """``schedule`` with no task: the results now when no payload is valid (nothing to
        commit), else the call, queued, and ``done(call)`` once its commit ended (stored,
        refused, or its ``sync`` wait refused: ``error``), in the store thread's hand-back
        itself (``GroupCommitter.commit_soon``, ``IoThread.submit_then``): no future and no
        task step per commit (issue 18). The call is a ``Later`` the handler returns for its
        answer; ``delay_end`` still set when ``done`` is told means the slaves are still to be
        waited for (NotMaster, as in ``schedule``). Raises as ``schedule`` does before its
        commit."""
        call = self._accept(payloads, compact, check_access, None)
        if type(call) is not _PendingCall:
            return call  # type: ignore[return-value]
        call.on_done = done
        commits = self._commits
        commits.pending.append(call)
        commits.commit_soon()
        return call

    def _accept(self, payloads: list[bytes], compact: bool, check_access: CheckAccess | None,
                future: asyncio.Future[list[dict[str, Any]] | int] | None
                ) -> _PendingCall | list[Any]:
        """The checks of ``schedule``: the accepted messages as a call, not queued yet (woken
        through ``future``, or, None, told through ``on_done``), or the results when none
        was accepted."""
        now_ms = self.clock()
        # The quick check (serverkit.send_check; for a batch, one C call where it is built)
        # accepts our producers' payloads without building a Message, due by now +
        # max_delay_ms; in the usual case all pass and the request goes to the committer as
        # columns, with no loop here. Anything it is unsure of gets the full check, which
        # decides and words the error.
        payloads = list(payloads)
        checks = self._quick_check.check_many(payloads, now_ms + self.config.max_delay_ms)
        if check_access is not None:
            check_access(payloads, checks)
        self.replica.check_writable()
        results: list[Any] = [None] * len(payloads)
        if None not in checks and not self.readonly:
            ids = list(map(_ids_of, checks))
            subjects = list(map(_subjects_of, checks))
            dues = list(map(_dues_of, checks))
            if None in dues:
                dues = [now_ms if due is None else due for due in dues]
            return _PendingCall(ids, subjects, dues, payloads, checks, None, results, future,
                                compact)
        call = self._full_checks(payloads, checks, results, now_ms, future)
        if not call.ids:
            return results
        return call

    def _full_checks(self, payloads: list[bytes], checks: list[Checked | None],
                     results: list[Any], now_ms: int,
                     future: asyncio.Future[list[dict[str, Any]] | int] | None
                     ) -> _PendingCall:
        """The full check of every payload the quick check did not accept (all of them when
        read-only): the accepted messages as a pending call (woken through ``future``, or
        told through ``on_done``); errors go to ``results``."""
        call = _PendingCall([], [], [], [], [], [], results, future)
        assert call.slots is not None
        max_delay_ms = self.config.max_delay_ms
        for slot, (payload, checked) in enumerate(zip(payloads, checks)):
            try:
                if checked is not None:
                    message_id, subject, deliver_at_ms = (checked.id, checked.subject,
                                                          checked.deliver_at_ms)
                else:
                    message = decode_message(payload)
                    validate_message(message, allow_internal=True)
                    message_id, subject, deliver_at_ms = (message.id, message.subject,
                                                          message.deliver_at_ms)
                if deliver_at_ms is None:
                    deliver_at_ms = now_ms
                ahead_ms = deliver_at_ms - now_ms
                if ahead_ms > max_delay_ms:
                    raise DelayOutOfRange(
                        f"message {message_id} deliver_at_ms {deliver_at_ms} is {ahead_ms} ms "
                        f"ahead, exceeds max_delay_ms {max_delay_ms}"
                    )
                if self.readonly:
                    raise ReadOnly(f"delay group {self.config.group} is read-only")
            except QmqError as exc:
                results[slot] = send_result_error(peek_message_id(payload), exc)
                continue
            call.ids.append(message_id)
            call.subjects.append(subject)
            call.dues.append(deliver_at_ms)
            call.payloads.append(payload)
            call.checks.append(checked)
            call.slots.append(slot)
        return call

    def _commit_io_call(self, batch: list[_PendingCall]) -> Awaitable[_Committed]:
        """The group commit's store call: ``_append_and_commit`` on the I/O thread, as a future
        a cancel does not cancel (a stop or demote still places what it stored)."""
        return self._io_thread.submit(self._append_and_commit, batch)

    def _commit_io_then(self, batch: list[_PendingCall],
                        then: Callable[[_Committed | None, BaseException | None], None]
                        ) -> None:
        """``_commit_io_call`` with no future, for a ``commit_soon`` commit (``schedule_soon``):
        ``then(committed, error)`` on the event loop once delay-io ran it, in the thread's
        hand-back itself (``IoThread.submit_then``)."""
        self._io_thread.submit_then(then, self._append_and_commit, batch)

    def _go_readonly(self) -> None:
        """A sticky write failure: refuse sends until restarted."""
        self.readonly = self.write_failed = True

    def _committed_batch(self, batch: list[_PendingCall], committed: _Committed) -> None:
        """Answer a committed batch (under ``sync`` replication once the slaves have it:
        ``_park_answers``), then put its entries of loaded buckets into the window one loop
        turn later (``_place_committed``); the slaves' fetches are woken in this turn, before
        the callers resume."""
        entries, delay_end = committed
        self.answered_delay_end = delay_end  # answered below, in this step: a cancel covers it
        if self.replica.replicating:
            self.replica.advanced("delay", delay_end)
            for call in batch:
                call.delay_end = delay_end
        checks: Sequence[Checked | None] | None = None
        tracing = self.tracer.enabled
        if tracing:
            if len(batch) == 1:
                checks, payloads = batch[0].checks, batch[0].payloads
            else:
                checks = list(chain.from_iterable(call.checks for call in batch))
                payloads = list(chain.from_iterable(call.payloads for call in batch))
            self.tracer.scheduled_soon(checks, payloads, self.clock())  # after the answers
        for call in batch:
            if call.compact:  # every message stored: answered by their count
                continue
            # Each entry's deliver_at_ms is the due time it was appended with (a late one is
            # filed in a later bucket, its time unchanged), so the answers come from the call.
            stored = list(map(delayed_send_result, call.ids, call.dues))
            if call.slots is None:
                call.results[:] = stored
            else:
                for slot, result in zip(call.slots, stored):
                    call.results[slot] = result
        if not (self.replica.replicating and self._park_answers(batch, delay_end)):
            self._answer(batch)
        # The window's placement (2-4 us per message on the loop: dict and wheel inserts)
        # comes a loop turn after the answers: the requests woken here run first in that turn
        # and write at once (serverkit.frame_server), so a round trip no longer waits for it.
        # A cancel places what waits first (``CancelsMixin._cancel_unloading``), so it finds
        # these; a load skips what is tracked either way; the store refuses a done watermark
        # past a bucket a late entry was just filed in. A bug path that raised above never gets here:
        # ``_restore_batch`` places them.
        self._unplaced.append((entries, checks))
        if len(self._unplaced) == 1:
            asyncio.get_running_loop().call_soon(self._place_unplaced)

    def _place_unplaced(self) -> None:
        """Place every committed batch still waiting (``_place_committed``), in commit order,
        then build their ``scheduled`` trace lines (``DelayTracer.scheduled_soon``): one loop
        callback per commit for both."""
        unplaced, self._unplaced = self._unplaced, []
        for entries, checks in unplaced:
            try:
                self._place_committed(entries, checks)
            except Exception:  # a bug in the tracing or the wake-up: the next batches still go
                log.exception("delay group %s: placing %d committed messages failed after "
                              "the window took them", self.config.group, len(entries))
        try:
            self.tracer.build_deferred()
        except Exception:  # a bug in the tracing: the placement above stands
            log.exception("delay group %s: building the scheduled trace lines of %d commits "
                          "failed", self.config.group, len(unplaced))

    def _place_committed(self, entries: list[ScheduleEntry],
                         checks: Sequence[Checked | None] | None) -> None:
        """Put committed entries of loaded buckets into the window (``checks``: what the quick
        check read of each, kept for their dispatched lines when tracing), and wake the timer
        if one is due before it wakes by itself. Should the placement raise (a bug), their
        buckets are noted part-loaded from their first entry, so the loader reads them from
        the store: a stored entry of a loaded bucket in no window would never be dispatched
        while this server runs, and its bucket would hold back the done watermark (review s11
        rvho-2)."""
        window = self.window
        try:
            window.place_committed(entries)
        except Exception:
            log.exception("delay group %s could not place %d committed messages in its "
                          "window; they are read from the store instead", self.config.group,
                          len(entries))
            firsts: dict[int, int] = {}
            for entry in entries:
                if window.is_loaded(entry.bucket_ms):
                    first = firsts.get(entry.bucket_ms)
                    if first is None or entry.delay_log_offset < first:
                        firsts[entry.bucket_ms] = entry.delay_log_offset
            for bucket_ms, offset in firsts.items():
                window.loaded(bucket_ms, offset)
        if checks is not None:  # what the quick check read serves the dispatched line too
            self.tracer.keep([e.delay_log_offset for e in entries], checks, window.tracked)
        turned_hot = self.handoff.placed(entries)  # a step counted cold within the lead
        wake_at_ms = self._timer_wake_at_ms
        if wake_at_ms is None or turned_hot or window.resume_at:
            self._wakeup.set()
            return
        first_due_ms = min(map(_entry_due_of, entries), default=wake_at_ms)
        if first_due_ms < wake_at_ms:
            self._wakeup.set()
        elif self._timer_idle:
            # Asleep until the next bucket starts (nothing waited): the timer looks at an
            # entry its lead and the read-ahead before its due time (its hand-off step's
            # count, the payload reads). Compared with the due time alone, a slot due just
            # past that start was taken at the start, with less lead or none (s15 hotslot).
            # While entries wait, a timer with the hand-off on looks at least once per
            # hand-off step anyway, so this adds no wake-up to a steady load's commits.
            look_ms = self.handoff.lead_ms(self.clock()) + PREFETCH_AHEAD_MS
            if first_due_ms - look_ms < wake_at_ms:
                self._wakeup.set()

    def _restore_batch(self, batch: list[_PendingCall], committed: _Committed) -> str:
        """``_committed_batch`` raised for a stored batch (a bug): its entries go into the
        window (again: ``place_committed`` skips those it tracks already), so the stored copy
        is dispatched at its due time; what a resend does, for the answer."""
        self.window.place_committed(committed[0])
        self._wakeup.set()
        return ("scheduled all the same (dispatched at its due time); a resend schedules a "
                "second copy, which the realtime broker de-duplicates only within its dedup "
                "window of the first")

    def _fail_batch(self, batch: list[_PendingCall], error: QmqError) -> None:
        for call in batch:
            call.compact = False  # failed: a result per message, each naming the error
            slots = call.slots if call.slots is not None else range(len(call.results))
            for slot, message_id in zip(slots, call.ids):
                call.results[slot] = send_result_error(message_id, error)
        self._answer(batch)

    def _park_answers(self, batch: list[_PendingCall], delay_end: int) -> bool:
        """Under ``sync`` replication: True when the batch's answers wait for the slaves,
        parked with the replication (one wait per commit, no coroutine or future per send;
        ``_replicated`` answers them); False when nothing waits (each call's ``delay_end`` is
        cleared: ``schedule`` waits no more). A master no longer serving keeps ``delay_end``:
        ``schedule``'s ``wait_replicated`` raises its NotMaster, as before."""
        replica = self.replica
        try:
            waits = not replica.replicated_now("delay", delay_end)
        except QmqError:
            return False
        for call in batch:
            call.delay_end = 0
        if waits:
            replica.park_replicated("delay", delay_end, partial(self._replicated, batch))
        return waits

    def _replicated(self, batch: list[_PendingCall], error: BaseException | None) -> None:
        """The slaves have the batch's commit (``error`` None): answered; or the wait was
        refused (NotMaster): each call raises it (a ``schedule_soon`` call is told it)."""
        if error is None:
            self._answer(batch)
            return
        for call in batch:
            if call.future is None:
                call.error = error
            elif not call.future.done():
                call.future.set_exception(error)
        self._answer(batch)  # the ``schedule_soon`` calls, told their error

    def _answer(self, batch: list[_PendingCall]) -> None:
        """Wake each call of ``batch``: every one of its messages is answered now. A call of
        ``schedule`` through its future; one of ``schedule_soon`` by its ``on_done``, called
        here, inside ``answers_together`` so that a commit's answers leave in one write per
        connection."""
        soon = False
        for call in batch:
            future = call.future
            if future is None:
                soon = True
            elif not future.done():  # a caller gone (cancelled) needs no answer
                future.set_result(len(call.ids) if call.compact else call.results)
        if not soon:
            return
        with self.answers_together:
            for call in batch:
                on_done = call.on_done
                if on_done is None:
                    continue
                call.on_done = None
                try:
                    on_done(call)
                except Exception:  # a server bug: the batch's other calls still hear
                    log.exception("delay group %s: answering a send of %d messages failed",
                                  self.config.group, len(call.ids))

    def _append_and_commit(self, batch: list[_PendingCall]) -> _Committed:
        """On the delay-io thread: append ``batch`` to the store and commit it; the entries
        and the delay log's end as a slave's fetch may read it."""
        append_many = self.store.append_many
        for call in batch:
            append_many(call.ids, call.subjects, call.dues, call.payloads)
        entries = self.store.commit()
        replica = self.replica
        if replica.replicating:
            replica.wrote_io("delay")  # a tailing slave's fetch ships it from memory
        return entries, self.store.delay_end()


__all__ = ["AcceptingMixin", "CheckAccess"]
