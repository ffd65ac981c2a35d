"""``Dispatcher``: sends the preload window's due entries to realtime brokers and records each
confirmed dispatch in the store's dispatch log (DESIGN.md section 9, ARCHITECTURE.md "The delay
path", step 3).

The scheduler's timer moves due entries into flight (``PreloadWindow.take_due``) and calls
``start``; up to ``DISPATCH_CONCURRENCY`` workers each take what is queued, take what the timer
had read ahead of it (``PayloadPrefetch``), read the rest in one store call and send it per
subject in batches of ``dispatch_batch_max``. A worker hands what a broker confirmed to the
recorder and sends its next batch meanwhile; what was not confirmed goes back
into the window to be retried with backoff. Only once recorded is a dispatch traced, counted
and forgotten by the window.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, TypeVar

from delayserver.broker_clocks import BrokerClocks
from delayserver.config import DelayConfig
from delayserver.handed_ids import HANDED_IDS_MAX, HELD_CANCEL_GRACE_MS, HandedMixin
from delayserver.prefetch import PayloadPrefetch
from delayserver.stats import DispatchStats
from delayserver.storage import DelayStore, ScheduleEntry
from delayserver.tracing import DelayTracer
from delayserver.window import PreloadWindow
from logstore.errors import DiskFull
from serverkit.payload_sender import HOLD_ANSWER_UNKNOWN
from wire.errors import NotSupported, QmqError
from wire.message import peek_message_id

log = logging.getLogger(__name__)
T = TypeVar("T")

Dispatch = Callable[[str, list[bytes]], Awaitable[tuple[str, list[dict[str, Any]]]]]
# A hand-off ahead of the due time: (subject, payloads, visible_at_ms per payload) -> as
# Dispatch; NotSupported when the broker does not take it (PayloadSender.send with
# visible_at_ms, the ``hold`` op).
Hold = Callable[[str, list[bytes], list[int]], Awaitable[tuple[str, list[dict[str, Any]]]]]
Io = Callable[..., Awaitable[Any]]  # runs fn(*args) on the store's delay-io thread
# Before a hold of the entries due up to a time is sent: the record of it (HandOff.recorded).
Recorded = Callable[[int, list[ScheduleEntry]], Awaitable[None]]
# (message id, deliver_at_ms, its entry in flight) -> (outcome, subject): the store's cancel of
# a message taken for dispatch (Scheduler._cancel_in_store).
CancelTaken = Callable[[str, int, ScheduleEntry], Awaitable[tuple[str, str | None]]]

DISPATCH_CONCURRENCY = 8  # dispatch requests in flight at once (the realtime side group-commits)
# A due backlog this long (a hot slot) is taken by one worker in chunks of up to
# HOT_CHUNK_ENTRIES_MAX: read in one store call (one sequential pass when the records lie close
# together, instead of a pread each), ~300 bytes of payload each while in flight (~10 MB).
HOT_BACKLOG_ENTRIES = 4_096
HOT_CHUNK_ENTRIES_MAX = 32_768
# Refusals the realtime side will repeat for ever: such a message is recorded as dispatched.
REFUSED_FOR_GOOD = ("bad_request", "too_large", "forbidden")
# Answers to a hand-off of one message that send it at its due time instead: refused for good,
# or its home group is an older server (a mixed-version route, PayloadSender.send).
HOLD_REFUSED = (*REFUSED_FOR_GOOD, NotSupported.code)


@dataclass
class _Confirmed:
    """One batch the realtime side confirmed, waiting for its dispatch-log record."""

    entries: list[ScheduleEntry]
    subject: str
    payloads: list[bytes]  # those to trace (a message refused for good is not traced)
    confirmed_at_ms: int
    handed: bool = False  # handed off ahead of the due time: the broker traces its dispatch
    # The entries of ``payloads``, in order, when some of ``entries`` were refused for good
    # (None: ``entries`` itself): what a hand-off remembers as handed.
    kept: list[ScheduleEntry] | None = None
    # A hand-off: the broker group holding each of ``payloads`` (traced as ``handed``).
    holders: list[str] | None = None


class Dispatcher(HandedMixin):
    """The dispatch workers and the recorder of one scheduler.

    Threads: every field is owned by the event loop. The store is only ever called through
    ``io`` (its delay-io thread); ``_read_each_on_io`` is the one method that runs there.

    - ``send``: the function that sends a batch to the realtime side (tests swap it);
    - ``tasks``: running workers and the recorder (``stop`` waits for them);
    - ``unrecorded``: confirmed dispatches a full disk kept from being recorded; housekeeping
      records them (``record_unrecorded``) once space returns, so they are not dispatched
      again after a restart and their buckets can be marked done;
    - ``_to_record``, ``_recording``: confirmed batches queued for the recorder, and whether
      its task runs; ``_send_slots``: requests on the wire;
    - ``prefetch``: payloads of waiting entries read ahead of their due time (the scheduler's
      timer starts the reads, a worker takes them);
    - ``hold``: the hand-off (None: every message is sent at its due time), set at start and
      never changed (a refused hand-off passes ``use_hold=False`` down, it never clears this
      field that every worker reads); ``handed``:
      message id -> (subject, deliver_at_ms, cancelled) of what may be held by a broker: set
      as its hold is sent, taken out when a broker refused it (a lost answer keeps it), kept
      until HELD_CANCEL_GRACE_MS past its due time; a cancel asks the broker about these
      only (the store records a drop, so a later cancel finds it there:
      ``DelayStore.record_dropped``); ``pending_drops``: message
      id -> deliver_at_ms of handed messages a broker dropped before their dispatch was
      recorded: the recorder marks them dropped in the store once it is; ``no_hold``: told when a broker did not
      take a hand-off (the scheduler then sends at the due time for a while); ``recorded``:
      awaited before a hold of messages due up to a time is sent (``HandOff.recorded``: the
      handed-entries record naming them); when it raises, they are sent at their due time.
    """

    def __init__(self, config: DelayConfig, clock: Callable[[], int], send: Dispatch,
                 window: PreloadWindow, store: DelayStore, io: Io, stats: DispatchStats,
                 tracer: DelayTracer, wake: Callable[[], None], hold: Hold | None = None,
                 no_hold: Callable[[], None] | None = None,
                 recorded: Recorded | None = None,
                 record_dropped: Callable[[str, int], Awaitable[str]] | None = None,
                 cancel_in_store: CancelTaken | None = None) -> None:
        self.config = config
        self.clock = clock
        self.send = send
        self.window = window
        self.store = store
        self.stats = stats
        self.tracer = tracer
        self._io = io
        self._wake = wake  # makes the scheduler's timer look at the window again
        self._send_slots = asyncio.Semaphore(DISPATCH_CONCURRENCY)
        self.tasks: set[asyncio.Task[None]] = set()
        self._to_record: list[_Confirmed] = []
        self._recording = False
        self.unrecorded: list[ScheduleEntry] = []
        self.prefetch = PayloadPrefetch(store, io)
        self.hold = hold
        self._no_hold = no_hold
        self._recorded = recorded
        # Records a broker's drop of a handed message in the store and waits for the slaves
        # (Scheduler._record_dropped, the cancel's own path): its answer
        self._record_dropped = record_dropped
        # Cancels in the store, under the loader's lock, an entry in flight that a broker
        # dropped (Scheduler._cancel_in_store with ``taken``, the cancel's own path: traced,
        # waiting for the slaves)
        self._cancel_in_store = cancel_in_store
        self.handed: dict[str, tuple[str, int, bool]] = {}
        self.pending_drops: dict[str, int] = {}
        # (deliver_at_ms, id) of every id put into ``handed``, a heap: pruning pops what is
        # due, so it costs what it prunes (a stale pair, its id gone or re-handed, is skipped)
        self._handed_due: list[tuple[int, str]] = []
        self.clocks = BrokerClocks()  # how far ahead the brokers' clocks run (hold answers)
        # delay-log offset -> (group, until_ms) of a message whose hold's answer said nothing
        # sure: sent at its due time to that group only, until then (``HandedMixin._pins``)
        self.pinned: dict[int, tuple[str, int]] = {}

    # ------------------------------------------------------------------ workers

    def start(self) -> None:
        """Start workers for what the window queued as due: running workers are all busy with
        a batch (one leaves when the queue is empty), so what is queued needs new ones, up to
        DISPATCH_CONCURRENCY; beyond that it waits and merges into larger requests."""
        idle_slots = DISPATCH_CONCURRENCY - len(self.tasks)
        batches = -(-len(self.window.due) // self.config.dispatch_batch_max)
        for _ in range(min(idle_slots, batches)):
            task = asyncio.create_task(self._worker())
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _worker(self) -> None:
        """Dispatch queued due entries until the queue is empty: a batch at a time, or, when a
        hot slot has left a backlog, a large chunk read in one go and sent in batches."""
        window, size = self.window, self.config.dispatch_batch_max
        while window.due:
            take = HOT_CHUNK_ENTRIES_MAX if len(window.due) >= HOT_BACKLOG_ENTRIES else size
            chunk = window.pop_due(take)
            try:
                await self._dispatch_chunk(chunk)
            except Exception as exc:  # our bug: the chunk must not stay in flight forever
                log.exception("dispatch of %d messages failed", len(chunk))
                self._retry(window.still_in_flight(chunk), f"{type(exc).__name__}: {exc}")

    async def _dispatch_chunk(self, chunk: list[ScheduleEntry]) -> None:
        """Take the chunk's subjects and payloads read ahead, read the rest in one store call
        (records lying close together in the delay log, as a hot slot stored in one burst
        does, share reads), then
        send them per subject in batches of ``dispatch_batch_max``, DISPATCH_CONCURRENCY
        requests on the wire at a time across all workers."""
        read = await self._read_chunk(chunk)
        if read is None:
            return
        chunk, subjects, payloads = read
        size = self.config.dispatch_batch_max
        if subjects.count(subjects[0]) == len(subjects):  # one subject: the usual hot slot
            groups = [(subjects[0], chunk, payloads)]
        else:
            positions: dict[str, list[int]] = defaultdict(list)
            for position, subject in enumerate(subjects):
                positions[subject].append(position)
            groups = [(subject, [chunk[i] for i in where], [payloads[i] for i in where])
                      for subject, where in positions.items()]

        async def one(subject: str, entries: list[ScheduleEntry], batch: list[bytes]) -> None:
            """Send one batch once a request slot is free (DISPATCH_CONCURRENCY at a time)."""
            async with self._send_slots:
                await self._dispatch_batch(subject, entries, batch)

        await asyncio.gather(*(
            one(subject, entries[start:start + size], batch[start:start + size])
            for subject, entries, batch in groups for start in range(0, len(entries), size)))

    async def _read_chunk(self, chunk: list[ScheduleEntry]
                          ) -> tuple[list[ScheduleEntry], list[str], list[bytes]] | None:
        """The subjects and payloads of ``chunk``: those read ahead (``PayloadPrefetch``), the
        rest in one store call. Returns (entries, subjects, payloads) of what read well, in
        chunk order (an unreadable record is retried alone), or None when nothing did."""
        got = await self.prefetch.take(chunk)
        if len(got) < len(chunk):
            missing = [e for e in chunk if e.delay_log_offset not in got] if got else chunk
            try:
                subjects, payloads = await self._io(self.store.read_payloads, missing)
            except Exception as exc:
                log.exception("reading %d due messages failed", len(missing))
                read = await self._read_alone(missing, exc)
                if read is None and not got:
                    return None
                missing, subjects, payloads = read or ([], [], [])
            if not got:
                return missing, subjects, payloads
            got.update(zip([e.delay_log_offset for e in missing], zip(subjects, payloads)))
            if len(got) < len(chunk):  # some did not read: they are retried alone
                chunk = [e for e in chunk if e.delay_log_offset in got]
        pairs = [got[e.delay_log_offset] for e in chunk]
        return chunk, [pair[0] for pair in pairs], [pair[1] for pair in pairs]

    async def _read_alone(self, chunk: list[ScheduleEntry], exc: Exception
                          ) -> tuple[list[ScheduleEntry], list[str], list[bytes]] | None:
        """After a failed read of ``chunk``: read its entries one by one, so a bad record is
        retried (and reported) alone instead of holding back every message of its chunk with
        it, retry after retry. Returns what read well as (entries, subjects, payloads), or
        None when nothing did."""
        if len(chunk) == 1:
            self._retry(chunk, f"read failed: {exc}")
            return None
        results = await self._io(self._read_each_on_io, chunk)
        failed = [e for e, r in zip(chunk, results) if isinstance(r, Exception)]
        if failed:
            self._retry(failed, f"read failed: {exc}")
        read = [(e, r) for e, r in zip(chunk, results) if not isinstance(r, Exception)]
        if not read:
            return None
        return [e for e, _ in read], [r[0] for _, r in read], [r[1] for _, r in read]

    def _read_each_on_io(self, chunk: list[ScheduleEntry]) -> list[tuple[str, bytes] | Exception]:
        """On the delay-io thread: (subject, payload) of each entry read alone, or the
        exception its read raised."""
        out: list[tuple[str, bytes] | Exception] = []
        for entry in chunk:
            try:
                subjects, payloads = self.store.read_payloads([entry])
                out.append((subjects[0], payloads[0]))
            except Exception as exc:
                log.error("due message at delay-log offset %d of bucket %d unreadable: %s",
                          entry.delay_log_offset, entry.bucket_ms, exc)
                out.append(exc)
        return out

    async def _dispatch_batch(self, subject: str, entries: list[ScheduleEntry],
                              payloads: list[bytes], use_hold: bool = True) -> None:
        """Send one batch of one subject and hand what the broker confirmed to the recorder
        (without waiting for its dispatch-log write, so the next batch goes out meanwhile);
        what it did not confirm is retried with backoff. A batch taken ahead of its due time
        (the scheduler's hand-off lead) is handed off (``hold``); a broker that does not take
        it gets what is due now at once (``use_hold=False``: sent with ``send``, all due) and
        the rest at its due time."""
        now_ms = self.clock()
        hold = self.hold if use_hold else None
        last_due_ms = max(e.deliver_at_ms for e in entries)
        early = hold is not None and last_due_ms > now_ms
        refusal = self._no_room_to_hold(len(entries), now_ms) if early else None
        if refusal is not None:
            await self._hold_refused(subject, entries, payloads, now_ms, refusal)
            return
        if early and self._recorded is not None:
            try:  # the handed-entries record first: a restart or failover must know of the hand-off
                await self._recorded(last_due_ms, entries)
            except Exception as exc:
                await self._hold_refused(subject, entries, payloads, now_ms,
                                         f"handed record not written: {exc}")
                return
        ids = self._may_hold(subject, entries, payloads) if early else []
        try:
            if hold is not None and early:
                # Visible by the broker's clock: later by how far ahead it may run (R9).
                held_at_ms = self.clock()  # after the handed record's write: its round trip
                shift_ms = self.clocks.ahead_ms(held_at_ms)
                group, results = await hold(subject, payloads,
                                            [e.deliver_at_ms + shift_ms for e in entries])
                self._observe_clocks(results, held_at_ms)
            else:
                # To the group a hold whose answer said nothing sure went to, when pinned
                pins = self._pins(entries, now_ms)
                args = (subject, payloads) if pins is None else (subject, payloads, None, pins)
                group, results = await self.send(*args)  # type: ignore[arg-type]
        except NotSupported as exc:
            if not early:
                raise
            self._not_held(ids)
            await self._hold_refused(subject, entries, payloads, now_ms, exc)
            return
        except QmqError as exc:
            if early and isinstance(exc, HOLD_ANSWER_UNKNOWN):
                # The home group may hold them though the answer was lost, or refused after
                # the write (NotMaster: a lease lapsed or a demotion after it): never held again
                # (a retry could hold them in a second group once the route changed, and both
                # would deliver them); sent at their due time to the group the hold went to,
                # whose de-duplication absorbs the copy (docs/REPLICATION.md 16).
                self._pin(entries, getattr(exc, "holders", None), now_ms)
                await self._hold_refused(subject, entries, payloads, now_ms, exc)
                return
            log.warning("dispatch of %d messages to %s failed, will retry: %s",
                        len(entries), subject, exc)
            # Refused (overloaded, read-only...): PayloadSender raises a hold's refusal only
            # when no group held any part (else it answers the refused part per message)
            self._not_held(ids)
            self._retry(entries, f"realtime did not take the batch: {exc}")
            return
        confirmed_at_ms = self.clock()
        # PayloadSender names the group of each held message (a route's groups share a batch)
        holders = [r.get("group", group) for r in results] if early else None
        if len(results) == len(entries) and not [r for r in results if "error" in r]:
            self._record_soon(entries, subject, payloads, confirmed_at_ms, early, None, holders)
            return
        confirmed: list[ScheduleEntry] = []
        kept: list[ScheduleEntry] = []  # confirmed and not refused: those of confirmed_payloads
        confirmed_payloads: list[bytes] = []
        kept_holders: list[str] = []
        failed: list[ScheduleEntry] = []
        refused: list[bytes] = []
        unheld: list[int] = []  # positions of hand-offs refused for good: sent when due
        for position, entry in enumerate(entries):
            result = results[position] if position < len(results) else {}
            error = result.get("error")
            if error is not None and ids:  # refused: not held (a missing answer: it may be)
                self._not_held([ids[position]])
            if error is None and result:
                confirmed.append(entry)
                kept.append(entry)
                confirmed_payloads.append(payloads[position])
                if holders is not None:
                    kept_holders.append(holders[position])
            elif error is not None and early and error.get("code") in HOLD_REFUSED:
                # A hand-off refused (say its visible_at_ms is past HOLD_AHEAD_MS_MAX by a
                # broker clock behind ours): sent at its due time instead; a message the
                # broker never takes is refused again then and given up.
                unheld.append(position)
            elif error is not None and error.get("code") in REFUSED_FOR_GOOD \
                    and not result.get("part_refused"):
                # The realtime side will never take it: record it as dispatched so it does
                # not loop forever, and say so loudly. (A refusal of its part's request, say a
                # `forbidden` access, is retried as a refused batch is: PayloadSender.send.)
                log.error("realtime refused message of %s for good (%s); dropped from the "
                          "schedule", subject, error)
                confirmed.append(entry)
                refused.append(payloads[position])
            else:
                failed.append(entry)
        self.tracer.gave_up(refused, confirmed_at_ms, "dispatch_refused")
        if confirmed:
            self._record_soon(confirmed, subject, confirmed_payloads, confirmed_at_ms, early,
                              kept if len(kept) < len(confirmed) else None, kept_holders)
        if failed:
            self._retry(failed, "realtime did not confirm")
        if unheld:
            await self._hold_refused(subject, [entries[i] for i in unheld],
                                     [payloads[i] for i in unheld], now_ms,
                                     results[unheld[0]]["error"])

    async def _hold_refused(self, subject: str, entries: list[ScheduleEntry],
                            payloads: list[bytes], now_ms: int, exc: object) -> None:
        """A broker did not take a hand-off (an older server, or it refused these messages'
        hand-off for good, or its answer was lost: ``exc`` says why): what is due now is sent at
        once, the rest waits in the window for its due time, and the scheduler stops handing
        off for a while (``no_hold``: at least twice the lead, so the rest is not taken early
        and held again before its due time)."""
        log.info("hand-off of %d messages of %s refused (%s): dispatching at the due time",
                 len(entries), subject, exc)
        if self.pending_drops:  # held after all (its answer lost), and a cancel dropped it
            entries, payloads = await self._cancel_dropped(entries, payloads)
        if self._no_hold is not None:
            self._no_hold()
        due = [i for i, e in enumerate(entries) if e.deliver_at_ms <= now_ms]
        later = [e for e in entries if e.deliver_at_ms > now_ms]
        self.window.defer(later)
        self._wake()
        if due:
            await self._dispatch_batch(subject, [entries[i] for i in due],
                                       [payloads[i] for i in due], use_hold=False)

    def _retry(self, entries: list[ScheduleEntry], why: str) -> None:
        self.window.retry(entries, self.clock())
        log.info("%d dispatches retry (%s)", len(entries), why)
        self._wake()

    # ------------------------------------------------------------------ recording

    def _record_soon(self, entries: list[ScheduleEntry], subject: str, payloads: list[bytes],
                     confirmed_at_ms: int, handed: bool = False,
                     kept: list[ScheduleEntry] | None = None,
                     holders: list[str] | None = None) -> None:
        """Queue confirmed dispatches for the recorder: everything confirmed while one
        ``record_dispatched`` call runs shares the next (one dispatch-log fsync per bucket).
        Only once recorded are they traced, counted and forgotten; until then they stay in
        flight (a cancel answers ``already_dispatched``)."""
        self._to_record.append(_Confirmed(entries, subject, payloads, confirmed_at_ms, handed,
                                          kept, holders))
        if not self._recording:
            self._recording = True
            task = asyncio.create_task(self._recorder(), name="delay-recorder")
            self.tasks.add(task)  # stop() waits for it like for a dispatch
            task.add_done_callback(self.tasks.discard)

    async def _recorder(self) -> None:
        """Record what ``_record_soon`` queued, one store call per round, until nothing is
        queued. Never raises: a failure is logged (see below)."""
        try:
            while self._to_record:
                waiting, self._to_record = self._to_record, []
                entries = [e for batch in waiting for e in batch.entries]
                subjects = [batch.subject for batch in waiting for _ in batch.entries]
                try:
                    await self._io(self.store.record_dispatched, entries, subjects)
                except DiskFull as exc:
                    # The world's fault, expected while the disk is full: no traceback.
                    log.warning("recording %d dispatches failed, disk full; will retry: %s",
                                len(entries), exc)
                    self.unrecorded.extend(entries)
                except Exception:
                    # Delivered but not recorded: a restart would dispatch them again and the
                    # broker's de-duplication absorbs it. They stay out of the wheel.
                    log.exception("recording %d dispatches failed", len(entries))
                    for batch in waiting:
                        self.tracer.gave_up(batch.payloads, batch.confirmed_at_ms,
                                            "dispatch_unrecorded")
                if self.pending_drops:
                    try:
                        await self._mark_drops(waiting)
                    except asyncio.CancelledError:  # stop(): recorded, so confirmed all the same
                        for batch in waiting:
                            self._confirmed(batch)
                        raise
                for position, batch in enumerate(waiting):
                    self._confirmed(batch)
                    if position + 1 < len(waiting):
                        await self._yield_between(waiting[position + 1:])
        finally:
            # Cancelled (stop) with batches queued: stop() records them.
            self._recording = False

    async def _mark_drops(self, waiting: list[_Confirmed]) -> None:
        """Record in the store the drops of handed messages of ``waiting`` (just recorded as
        dispatched) a broker dropped at a cancel meanwhile (``pending_drops``)."""
        for batch in waiting:
            if not batch.handed:
                continue
            for payload in batch.payloads:
                message_id = peek_message_id(payload)
                due_ms = self.pending_drops.pop(message_id, None)
                if due_ms is None:
                    continue
                await self._mark_drop(message_id, due_ms)

    async def _mark_drop(self, message_id: str, due_ms: int) -> None:
        """Record one pending drop in the store; one whose dispatch is still not recorded (a
        full disk held it back) stays pending, for ``record_unrecorded``."""
        if self._record_dropped is None:
            return
        try:
            if await self._record_dropped(message_id, due_ms) == "open":
                self.pending_drops[message_id] = due_ms
        except Exception:
            log.exception("the drop of handed message %s due at %d was not recorded",
                          message_id, due_ms)

    async def _yield_between(self, rest: list[_Confirmed]) -> None:
        """Give the event loop a turn between two recorded batches (a hot slot's round holds
        dozens: the pulls and stores sharing the loop run between them); cancelled here
        (stop), the recorded ``rest`` is still counted, traced and forgotten."""
        try:
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            for batch in rest:
                self._confirmed(batch)
            raise

    def _confirmed(self, batch: _Confirmed) -> None:
        """A recorded batch: count its lateness, trace it, forget its entries. A hand-off is
        counted apart (``handed``) and traced ``handed`` (naming the group that holds it): the
        broker traces its ``dispatched`` when it makes it visible (docs/AUDIT.md); it is
        remembered until its due time."""
        at_ms = batch.confirmed_at_ms
        if batch.handed:
            self.stats.handed += len(batch.entries)
            kept = batch.kept if batch.kept is not None else batch.entries
            self.tracer.handed_entries([e.delay_log_offset for e in kept], batch.payloads,
                                       batch.holders or [], at_ms)
            self.tracer.drop_kept([e.delay_log_offset for e in batch.entries])
        else:
            self.stats.record(at_ms, [at_ms - e.deliver_at_ms for e in batch.entries])
        if self.tracer.enabled and not batch.handed:
            self.tracer.dispatched_entries([e.delay_log_offset for e in batch.entries],
                                           batch.payloads, at_ms)
        if self.pinned:
            for entry in batch.entries:
                self.pinned.pop(entry.delay_log_offset, None)
        self.window.forget(batch.entries)
        if self.window.refill_due():
            self._wake()  # the scheduler's timer starts the refill

    async def record_unrecorded(self) -> int:
        """Record the confirmed dispatches a full disk held back; returns how many were
        recorded, 0 while the disk is still full."""
        if not self.unrecorded:
            return 0
        entries, self.unrecorded = self.unrecorded, []
        try:
            await self._io(self.store.record_dispatched, entries)
        except DiskFull:
            self.unrecorded = entries + self.unrecorded
            return 0
        log.warning("recorded %d dispatches held back by a full disk", len(entries))
        for message_id, due_ms in list(self.pending_drops.items()):  # a few at most
            del self.pending_drops[message_id]
            await self._mark_drop(message_id, due_ms)
        return len(entries)

    async def stop(self, grace_ms: int) -> None:
        """Wait up to ``grace_ms`` for the workers and the recorder, then cancel what is left;
        confirmed batches the recorder had not reached join ``unrecorded`` (the caller records
        them, or a restart would dispatch them again)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_ms / 1000
        while self.tasks and loop.time() < deadline:
            await asyncio.wait(set(self.tasks), timeout=deadline - loop.time())
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for batch in self._to_record:
            self.unrecorded.extend(batch.entries)
        self._to_record = []
        await self.prefetch.stop()


__all__ = ["DISPATCH_CONCURRENCY", "HANDED_IDS_MAX", "HELD_CANCEL_GRACE_MS", "Dispatch",
           "Dispatcher", "Hold"]
