"""``Handoffs``: a broker holding messages a delay server handed it ahead of their due time
(docs/BENCHMARKS.md "Issue 18 item 3: the hand-off ahead of the due time", docs/PROTOCOL.md
``hold`` and ``cancel_held``).

``hold`` checks a batch as a send does, writes held records (durable, de-duplicated,
replicated like any record; no consumer-log entry) and puts them in the ``HeldTimer``. The
visibility round sleeps until the earliest visible time, then makes what is due visible in
store calls of at most VISIBLE_BATCH_MAX, one after the other (a visible-message record per
message, its payload written again, and the consumer-log entries), feeds the tail, traces ``stored`` and ``dispatched`` and wakes the long
polls; a held record that no longer reads is given up (``gave_up`` ``held_unreadable``). A message is never visible before its
``visible_at_ms`` by this broker's clock. A round runs only while the broker may write, as a
send is checked (the leased, active master; ``min_insync``): else the messages wait. ``cancel`` drops held messages by id. After a
restart or a promotion, ``load`` takes the held set the store rebuilt from its records.

Record kinds (``serverkit.kind_gate``): a ``hold`` is refused ``not_supported`` before anything
is written while a slave of the group does not read every held-message record kind (a hold
needs them all: the held record, the visible-message record at its due time, the cancelled
and dropped records), and a ``cancel_held`` is refused ``unavailable`` while one does not read
the dropped record. The visibility round is not gated: the messages are held already (a slave
that cannot read their records stopped at the first of them), and they must become visible.
"""

from __future__ import annotations

import asyncio
import logging
from itertools import repeat
from operator import add, attrgetter, gt
from typing import Any, Callable, NoReturn, Sequence

from logstore import DiskFull, OutOfDescriptors
from realtime.context import BrokerContext
from realtime.held_timer import HeldTimer
from realtime.sends import DELIVER_AT_SKEW_MS_MAX
from realtime.storage.control_record import GATED_KINDS, KIND_DROPPED
from realtime.storage.held import Held
from serverkit.kind_gate import KindRefusals
from serverkit.send_check import Checked, QuickCheck
from wire.errors import BadRequest, NotSupported, QmqError, ReadOnly, TooLarge, Unavailable
from wire.limits import HOLD_AHEAD_MS_MAX  # how far ahead a held message may be visible
from wire.message import (
    ORIGIN_ID_PROPERTY, decode_message, peek_message_id, tag_hash, validate_message,
)
from wire.protocol import send_result_error, send_result_ok

log = logging.getLogger(__name__)

_TAGS_OF = attrgetter("tags")
_EXPIRE_OF = attrgetter("expire_at_ms")
_DELIVER_AT_OF = attrgetter("deliver_at_ms")

# Messages made visible per store call: a due instant of more takes several calls, one after
# the other, so consumers drain the first while the next are written (each call is one fsync).
VISIBLE_BATCH_MAX = 4_096
# The first store call of a due instant (after the round waited for it) makes at most this
# many visible: consumers get the first messages after a quarter of the work, and pull them
# while the larger calls after it are written.
VISIBLE_FIRST_BATCH_MAX = 1_024
# Payload bytes of held messages kept in memory for the tail at the due time; past it a
# message is read back from the store when made visible.
KEPT_BYTES_MAX = 64 << 20
# Visible times are rounded up to this (ms): messages due within one tick become visible in
# one store call (one fsync) instead of one call each, at most this much later (the delay
# server's tick_ms does the same for its dispatches). Never earlier.
VISIBLE_TICK_MS = 5
# A round that failed for want of space or descriptors (DiskFull, OutOfDescriptors: not
# sticky) is tried again this much later (ms) by the broker's clock.
VISIBLE_RETRY_MS = 1_000
# A round refused because this broker may not write now (not the leased master, or too few
# in-sync slaves under min_insync: what a send is refused for) looks again this much later
# (ms, event-loop time): a lease renewal or a slave catching up lets the round go on soon.
VISIBLE_REFUSED_RETRY_MS = 100
# Drops of held messages whose replication wait failed, kept (by subject and id, ~150 B each)
# until a retry of their cancel traces them: a bound for a broker whose slaves stay away.
UNTRACED_DROPS_MAX = 100_000


class Handoffs:
    """Held messages of one broker. Owner: the event loop for every field; methods ending in
    ``_io`` run on the store thread."""

    def __init__(self, ctx: BrokerContext, readonly: Callable[[], bool],
                 go_readonly: Callable[[], None]) -> None:
        self._ctx = ctx
        self._readonly = readonly  # the send path's read-only state (Sends.readonly)
        self._go_readonly = go_readonly  # Sends._go_readonly: a sticky write failure
        self._quick_check = QuickCheck()
        self.timer = HeldTimer()
        # offset -> (payload, what the check read, its trace members or None): for the tail
        # and the trace at the due time (members built at the hand-off, ahead of it)
        self._kept: dict[int, tuple[bytes, Checked, str | None]] = {}
        self._kept_bytes = 0
        self._wake = asyncio.Event()
        self.made_visible = 0  # messages made visible since start (metrics, tests)
        # Visibility rounds that failed to write (a full disk: tried again VISIBLE_RETRY_MS
        # later; any other: the held timer stops until a restart, the broker read-only):
        # qmq_realtime_held_visibility_failures.
        self.visibility_failures = 0
        # Why this broker may not write now (the server's role check: not the leased, active
        # master), or None; the server sets it, a broker without one (tests, no MetaServer)
        # is never refused by it.
        self.role_refusal: Callable[[], str | None] = lambda: None
        # Rounds put off because the broker may not write (qmq_realtime_held_rounds_refused),
        # and the reason last logged (one log line per change of reason).
        self.rounds_refused = 0
        # Hand-offs refused because the held set was full (qmq_realtime_holds_refused_full).
        self.holds_refused_full = 0
        self._refused_why: str | None = None
        # Holds and cancel_helds refused because a slave does not read the held records'
        # kinds (qmq_realtime_holds_refused_kinds), and the last reason (the admin view).
        self.kind_refusals = KindRefusals(log)
        # (subject, id) of drops not traced yet: their replication wait failed (a retry
        # answered dropped_before traces them); insertion-ordered, at most UNTRACED_DROPS_MAX
        self._untraced: dict[tuple[str, str], bool] = {}

    # ------------------------------------------------------------------ ops

    async def hold(self, payloads: list[bytes], visible_at_ms: list[int]) -> list[dict[str, Any]]:
        """Store a batch held until each message's ``visible_at_ms``; a result per message:
        ``stored`` (held), ``duplicate`` (held or stored already) or the error."""
        ctx = self._ctx
        ctx.replica.check_writable()
        self._check_kinds(GATED_KINDS, "hold", NotSupported)
        now_ms = ctx.clock()
        if len(visible_at_ms) != len(payloads):
            raise BadRequest(f"hold.visible_at_ms has {len(visible_at_ms)} entries, "
                             f"hold.messages {len(payloads)}: one each")
        results: list[Any] = [None] * len(payloads)
        slots, checks, valid, visible = self._checked(payloads, visible_at_ms, now_ms, results)
        if not checks:
            return results
        offsets, refused, log_end = await ctx.on_store_thread(self._hold_io, checks, valid,
                                                              visible, now_ms)
        ctx.replica.advanced("message", log_end)
        if refused:
            self._refuse_full(refused, checks, slots, results)
        members_of = ctx.tracer.visible_members
        timed: list[int] = []
        timed_at: list[int] = []
        for slot, checked, payload, visible_at, offset in zip(slots, checks, valid, visible,
                                                              offsets):
            if results[slot] is None:
                results[slot] = send_result_ok(checked.id, duplicate=offset is None)
            if offset is None:
                continue
            timed.append(offset)
            timed_at.append(visible_at)
            if self._kept_bytes + len(payload) <= KEPT_BYTES_MAX:
                self._kept[offset] = (payload, checked, members_of(checked))
                self._kept_bytes += len(payload)
        self.timer.add_many(timed, timed_at)
        self._wake.set()
        if ctx.replica.replicating:
            await ctx.replica.wait_replicated("message", log_end)
        return results

    def _check_kinds(self, kinds: Any, op: str, error: type[QmqError]) -> None:
        """Refuse ``op`` with ``error`` before anything is written while a slave of the group
        does not read one of the message log's ``kinds`` (``kind_refusal``): a record of it
        would stop that slave's copy. A ``hold`` is answered ``not_supported``, which a delay
        server takes as "send these at their due time" (and pauses its hand-offs), never as a
        hold that may have been written (as it must take ``not_master``)."""
        why = self._kinds_refusal(kinds)
        if why is not None:
            self._refuse_kinds(why, op, error)

    def _kinds_refusal(self, kinds: Any) -> str | None:
        """Why a record of one of the message log's ``kinds`` may not be written now, or None
        (and then no refusal is remembered)."""
        replica = self._ctx.replica
        if replica.replicating:
            for kind in sorted(kinds):
                why = replica.kind_refusal("message", kind)
                if why is not None:
                    return why
        self.kind_refusals.allowed()
        return None

    def _refuse_kinds(self, why: str, op: str, error: type[QmqError]) -> NoReturn:
        """Count and raise the refusal of ``op`` (logged once per new reason)."""
        self.kind_refusals.refuse(why, error, f"{op} refused before any write: {why}")

    def _checked(self, payloads: list[bytes], visible_at_ms: list[int], now_ms: int,
                 results: list[Any]) -> tuple[Sequence[int], list[Checked], list[bytes],
                                              list[int]]:
        """The messages of a hold that pass ``_check``, as columns: (their slots, what the
        check read, their payloads, their visible times); each one refused gets its error in
        ``results``. The usual batch (every message read by the quick check and in range, the
        broker writable) is found by whole columns, with no Python code per message; any
        other is checked message by message, which words each error."""
        quick = self._quick_check.check_many(payloads,
                                             max(visible_at_ms) + DELIVER_AT_SKEW_MS_MAX)
        if None not in quick and set(map(type, visible_at_ms)) == {int} \
                and min(visible_at_ms) >= 0 and max(visible_at_ms) <= now_ms + HOLD_AHEAD_MS_MAX:
            delivers = list(map(_DELIVER_AT_OF, quick))
            if None not in delivers and not any(map(
                    gt, delivers, map(add, visible_at_ms, repeat(DELIVER_AT_SKEW_MS_MAX)))) \
                    and not self._readonly():
                return range(len(payloads)), quick, payloads, visible_at_ms
        slots: list[int] = []
        checks: list[Checked] = []
        valid: list[bytes] = []
        visible: list[int] = []
        for slot, (payload, checked, visible_at) in enumerate(zip(payloads, quick,
                                                                  visible_at_ms)):
            try:
                checked = self._check(payload, checked, visible_at, now_ms)
            except QmqError as exc:
                results[slot] = send_result_error(peek_message_id(payload), exc)
                continue
            slots.append(slot)
            checks.append(checked)
            valid.append(payload)
            visible.append(visible_at)
        return slots, checks, valid, visible

    def _check(self, payload: bytes, checked: Checked | None, visible_at_ms: int,
               now_ms: int) -> Checked:
        """The quick check's answer, or the full check's; QmqError says what is wrong."""
        if type(visible_at_ms) is not int or not 0 <= visible_at_ms <= now_ms + HOLD_AHEAD_MS_MAX:
            raise BadRequest(f"visible_at_ms {visible_at_ms!r} is more than HOLD_AHEAD_MS_MAX "
                             f"{HOLD_AHEAD_MS_MAX} ms ahead of the broker's {now_ms}")
        if checked is None:
            validate_message(decode_message(payload), allow_internal=True, now_ms=now_ms)
            checked = _checked_of(payload)
        if checked.deliver_at_ms is not None \
                and checked.deliver_at_ms > visible_at_ms + DELIVER_AT_SKEW_MS_MAX:
            raise BadRequest(f"message {checked.id} has deliver_at_ms {checked.deliver_at_ms}, "
                             f"after its visible_at_ms {visible_at_ms} by more than "
                             f"DELIVER_AT_SKEW_MS_MAX {DELIVER_AT_SKEW_MS_MAX}")
        if self._readonly():
            raise ReadOnly(f"broker group {self._ctx.config.group} is read-only; send "
                           "elsewhere")
        return checked

    def _hold_io(self, checks: list[Checked], payloads: list[bytes], visible_at_ms: list[int],
                 now_ms: int) -> tuple[list[int | None], list[int], int]:
        """Store thread: the held records; each message's offset (None: a duplicate or
        refused), the indexes refused because the held set is full, and the message log's
        end."""
        store = self._ctx.store
        hashes = [tuple(map(tag_hash, checked.tags)) for checked in checks]
        refused: list[int] = []
        offsets = store.hold_many([c.subject for c in checks], [c.id for c in checks], hashes,
                                  now_ms, payloads, visible_at_ms, refused)
        return offsets, refused, store.copy_bounds()[1]

    def _refuse_full(self, refused: list[int], checks: list[Checked], slots: list[int],
                     results: list[Any]) -> None:
        """Answer the messages the store did not hold for want of room: ``too_large``, for
        good (the delay server sends them at their due time instead, docs/PROTOCOL.md)."""
        held_max = self._ctx.config.held_messages_max
        self.holds_refused_full += len(refused)
        log.warning("held set full: %d hand-offs refused (held_messages_max %d); the delay "
                    "server sends them at their due time", len(refused), held_max)
        for index in refused:
            results[slots[index]] = send_result_error(checks[index].id, TooLarge(
                f"message {checks[index].id} not held: broker group "
                f"{self._ctx.config.group} holds held_messages_max {held_max} messages "
                "already; send it at its due time"))

    async def cancel(self, subject: str, message_ids: list[str]
                     ) -> tuple[list[bool], list[bool]]:
        """Drop held messages of ``subject`` by id; for each, whether it was held and is now
        dropped, and whether it was dropped by an earlier cancel (remembered durably, within
        the dedup window: a retry after a lost answer). Both False: made visible already, or
        never held here. Each drop is traced ``cancelled`` (``held_cancelled``)."""
        ctx = self._ctx
        ctx.replica.check_writable()
        if self._readonly():
            raise ReadOnly(f"broker group {ctx.config.group} is read-only")
        # Ids the broker does not hold write nothing, so only a cancel that would write the
        # dropped record is refused (review rvdelay-2: every cancel of the group was).
        why = self._kinds_refusal((KIND_DROPPED,))
        now_ms = ctx.clock()
        done = await ctx.on_store_thread(self._cancel_io, subject, message_ids, now_ms,
                                         why is None)
        if done is None:
            assert why is not None
            self._refuse_kinds(why, "cancel_held", Unavailable)
        cancelled, before, offsets, log_end = done
        ctx.replica.advanced("message", log_end)
        self._forget_dropped(offsets, cancelled)
        dropped = list(dict.fromkeys(i for i, c in zip(message_ids, cancelled) if c))
        try:
            if ctx.replica.replicating:
                await ctx.replica.wait_replicated("message", log_end)
        except BaseException:
            self._untraced_drop(subject, dropped)
            raise
        # Traced once committed as a send's answer is (the in-sync slaves have it), so a
        # promoted slave never holds a message traced cancelled. A drop whose wait failed is
        # traced by the retry that finds it dropped_before and whose own wait succeeds.
        dropped += [i for i, b in zip(message_ids, before)
                    if b and self._untraced.pop((subject, i), None) is not None]
        ctx.tracer.held_cancelled(subject, dropped, now_ms)
        return cancelled, before

    def _untraced_drop(self, subject: str, message_ids: list[str]) -> None:
        """Remember drops whose replication wait failed, for a retry to trace (the oldest
        are forgotten past ``UNTRACED_DROPS_MAX``; the delay server still traces its own)."""
        for message_id in message_ids:
            self._untraced[(subject, message_id)] = True
        while len(self._untraced) > UNTRACED_DROPS_MAX:
            forgotten = next(iter(self._untraced))
            del self._untraced[forgotten]
            log.warning("drop of held message %s not traced: more than UNTRACED_DROPS_MAX "
                        "%d drops wait for a retry", forgotten, UNTRACED_DROPS_MAX)

    def _forget_dropped(self, offsets: list[int | None], cancelled: list[bool]) -> None:
        """Take dropped messages out of the timer and the kept payloads now, not at their due
        time: cancels alternating with new hand-offs never grow either past what is held."""
        for offset, dropped in zip(offsets, cancelled):
            if dropped and offset is not None:
                self.timer.remove(offset)
                found = self._kept.pop(offset, None)
                if found is not None:
                    self._kept_bytes -= len(found[0])

    def _cancel_io(self, subject: str, message_ids: list[str], now_ms: int, may_drop: bool
                   ) -> tuple[list[bool], list[bool], list[int | None], int] | None:
        """Store thread: the dropped record; (held or not per id, dropped before or not per
        id, each id's held offset before the drop, the message log's end). None, with nothing
        written, when some id is held and ``may_drop`` is False (a slave cannot read it)."""
        store = self._ctx.store
        offsets = store.held_offsets(subject, message_ids)
        if not may_drop and any(offset is not None for offset in offsets):
            return None
        before = store.dropped_before(subject, message_ids, now_ms)
        cancelled = store.cancel_held(subject, message_ids, now_ms)
        return cancelled, [b and not c for b, c in zip(before, cancelled)], offsets, \
            store.copy_bounds()[1]

    # ------------------------------------------------------------------ the visibility round

    async def load(self) -> None:
        """Hold what the store holds (at a start or a promotion): recovery rebuilt it."""
        held: list[Held] = await self._ctx.on_store_thread(self._ctx.store.held)
        for item in held:
            self.timer.add(item.offset, item.visible_at_ms)
        self._wake.set()

    def poke(self) -> None:
        """Look at the timer again now (the clock moved, or tests moved it)."""
        self._wake.set()

    def forget(self) -> None:
        """Stepping down: the new master holds what is left."""
        self.timer.clear()
        self._kept.clear()
        self._kept_bytes = 0

    async def run(self) -> None:
        """Make held messages visible as they fall due, until cancelled: one round at a time,
        each checked (the lease, min_insync: ``_may_write``) right before its store call, as
        docs/REPLICATION.md 16 says. Two rounds in flight (the next one's records written while
        the loop published the one before) had that round checked a whole round's write before
        its own store call, so a lease that ran out meanwhile did not stop it (review
        rvbroker-4); overlapping them again needs the check made where the store call is
        queued."""
        clock = self._ctx.clock
        batch_max = VISIBLE_FIRST_BATCH_MAX
        while True:
            self._wake.clear()
            next_ms = self.timer.next_due_ms()
            now_ms = clock()
            if next_ms is not None:
                next_ms = -(-next_ms // VISIBLE_TICK_MS) * VISIBLE_TICK_MS
            if next_ms is None or next_ms > now_ms:
                try:
                    async with asyncio.timeout(None if next_ms is None
                                               else (next_ms - now_ms) / 1000):
                        await self._wake.wait()
                except TimeoutError:
                    pass
                batch_max = VISIBLE_FIRST_BATCH_MAX
                continue
            if not await self._may_write():
                continue
            due = self.timer.take_due(now_ms, batch_max)
            batch_max = VISIBLE_BATCH_MAX
            # A future of its own: a stop or demote waits for it in _finish, never cancels it
            round_ = asyncio.ensure_future(self.make_visible(due, now_ms))
            if not await self._finish(due, now_ms, round_):
                return

    async def _finish(self, due: list[int], now_ms: int, round_: asyncio.Future[None]) -> bool:
        """Wait for a round; False when it failed for good (the broker read-only)."""
        try:
            try:
                await asyncio.shield(round_)
            except asyncio.CancelledError:
                # Stop or demote: wait for the round (the store thread writes it anyway), and
                # end whatever it ended with: a failure is counted, never taken for a retry
                # that would swallow the cancel (a stop that never ends).
                try:
                    await round_
                except Exception:
                    self.visibility_failures += 1
                    log.exception("making %d held messages visible failed during a stop; "
                                  "recovery or the next master holds them again", len(due))
                raise
        except (DiskFull, OutOfDescriptors) as exc:
            # Not sticky (the log cut back what it wrote, the store stays writable, as for
            # sends): the round is tried again VISIBLE_RETRY_MS later, never earlier.
            self.visibility_failures += 1
            log.warning("making %d held messages visible failed (%s); trying again in %d ms",
                        len(due), exc, VISIBLE_RETRY_MS)
            for offset in due:
                self.timer.add(offset, now_ms + VISIBLE_RETRY_MS)
        except Exception:
            self.visibility_failures += 1
            log.exception("making %d held messages visible failed; held messages are no "
                          "longer made visible and the broker is read-only until restarted "
                          "(recovery holds them again)", len(due))
            self._go_readonly()
            return False
        return True

    async def _may_write(self) -> bool:
        """Whether a round may write now, checked as a send is (the role: the leased, active
        master; the replicas: min_insync). When not, the round waits
        VISIBLE_REFUSED_RETRY_MS (or a poke) and returns False: the messages stay held, never
        made visible by a broker that may have been replaced (a second delivery) nor written
        where no slave in sync would copy them."""
        why = self.role_refusal()
        if why is None:
            try:
                self._ctx.replica.check_writable()
            except QmqError as exc:
                why = exc.message
        if why is None:
            if self._refused_why is not None:
                log.info("held messages are made visible again: the broker may write")
                self._refused_why = None
            return True
        self.rounds_refused += 1
        if why != self._refused_why:
            log.warning("held messages due now wait: this broker may not write (%s); looking "
                        "again every %d ms", why, VISIBLE_REFUSED_RETRY_MS)
            self._refused_why = why
        try:
            async with asyncio.timeout(VISIBLE_REFUSED_RETRY_MS / 1000):
                await self._wake.wait()
        except TimeoutError:
            pass
        return False

    async def make_visible(self, due: list[int], now_ms: int) -> None:
        """Make the held messages at offsets ``due`` visible, then publish them."""
        ctx = self._ctx
        kept = self._kept
        # The payloads kept from the hand-off are written again as they are; the store adds
        # those it read back from the held records.
        read = {offset: found[0] for offset, found in zip(due, map(kept.get, due))
                if found is not None}
        made, log_end, dropped = await ctx.on_store_thread(self._visible_io, due, read, now_ms)
        ctx.replica.advanced("message", log_end)
        if dropped:  # held records rotten on disk: given up, traced by id
            ctx.tracer.held_deleted([(h.subject, h.message_id) for h in dropped], now_ms,
                                    "held_unreadable")
        # Traced when visible (consumers can pull them from now on), not when taken: the
        # lateness includes the store call.
        visible_ms = ctx.clock() if ctx.tracer.enabled else now_ms
        published = 0
        for subject, first, items in made:
            self._publish(subject, first, [item.offset for item in items], read, visible_ms)
            published += len(items)
        self.made_visible += published
        if published < len(due):
            for offset in due:  # cancelled meanwhile: not made visible, not kept any longer
                found = kept.pop(offset, None)
                if found is not None:
                    self._kept_bytes -= len(found[0])

    def _publish(self, subject: str, first: int, offsets: list[int], read: dict[int, bytes],
                 visible_ms: int) -> None:
        """Feed the tail with one subject's run made visible (sequences from ``first``), trace
        it and wake its long polls. Column by column: a hot slot publishes 20k at once."""
        kept, tracer, committed = self._kept, self._ctx.tracer, self._ctx.committed
        found = list(map(kept.pop, offsets, repeat(None)))
        if None in found:  # read back from the store: checked again here
            self._kept_bytes -= sum(len(f[0]) for f in found if f is not None)
            found = [f if f is not None else self._read_back(read[offset])
                     for offset, f in zip(offsets, found)]
            payloads, checks, members = map(list, zip(*found))
        else:
            payloads, checks, members = map(list, zip(*found))
            self._kept_bytes -= sum(map(len, payloads))
        committed.add(subject, first, payloads, map(_TAGS_OF, checks), map(_EXPIRE_OF, checks),
                      sum(map(len, payloads)))
        sequences = list(range(first, first + len(offsets)))
        if tracer.enabled:
            if None in members:
                tracer.made_visible(checks, sequences, payloads, visible_ms)
            else:
                tracer.made_visible_members(subject, members, sequences,
                                            list(map(_DELIVER_AT_OF, checks)), visible_ms)
        committed.notify(subject)

    def _read_back(self, payload: bytes) -> tuple[bytes, Checked, None]:
        """(payload, what the check reads of it, no trace members) of a payload the store read
        back (not kept from the hand-off: past KEPT_BYTES_MAX, or the broker restarted)."""
        checked = self._quick_check.check_many([payload], 1 << 62)[0] or _checked_of(payload)
        return payload, checked, None

    def _visible_io(self, due: list[int], payloads: dict[int, bytes], now_ms: int
                    ) -> tuple[list[tuple[str, int, list[Held]]], int, list[Held]]:
        """Store thread: make ``due`` visible with ``payloads`` by offset (the store adds those
        it read back); (the runs, the message log's end, the held records given up as
        unreadable)."""
        store = self._ctx.store
        dropped: list[Held] = []
        made = store.make_visible(due, now_ms, payloads, dropped)
        return made, store.copy_bounds()[1], dropped


def _checked_of(payload: bytes) -> Checked:
    """The full check's fields of a stored payload the quick check left open."""
    message = decode_message(payload)
    return Checked(message.id, message.subject, message.tags, message.expire_at_ms,
                   message.deliver_at_ms, message.created_at_ms, message.retries,
                   message.properties.get(ORIGIN_ID_PROPERTY))


__all__ = ["HOLD_AHEAD_MS_MAX", "Handoffs", "KEPT_BYTES_MAX", "VISIBLE_BATCH_MAX",
           "VISIBLE_FIRST_BATCH_MAX"]
