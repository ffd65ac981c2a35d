"""The hand-off's bookkeeping of a ``Dispatcher`` (``delayserver.dispatch``), a mixin: which
message ids a broker may hold (``handed``, bounded by HANDED_IDS_MAX and pruned by due time
through a heap), whether a hand-off may be sent now (that bound, and how far ahead the brokers'
clocks run: ``delayserver.broker_clocks``), and the drops a cancel got while a hold was in
flight (``pending_drops``). The ``Dispatcher`` owns every field used here (its docstring); same
thread (the event loop).
"""

from __future__ import annotations

import heapq
import logging
from itertools import repeat
from operator import itemgetter
from typing import TYPE_CHECKING, Any

from delayserver.broker_clocks import HOLD_CLOCK_AHEAD_MS_MAX
from delayserver.storage import ScheduleEntry
from wire.message import peek_message_id

if TYPE_CHECKING:
    from delayserver.dispatch import Dispatcher

log = logging.getLogger(__name__)

# A broker makes a held message visible at its due time, give or take its timer's lateness: a
# cancel this soon after the due time still asks it (it may drop the message yet).
HELD_CANCEL_GRACE_MS = 1_000
# Message ids remembered at once as maybe held by a broker (``Dispatcher.handed``, about
# 280 bytes each: ~28 MB): a hand-off that would pass it is sent at its due time instead and
# the hand-off pauses (NO_HOLD_PAUSE_MS) while the ids due by then are forgotten.
HANDED_IDS_MAX = 100_000
# How long past its due time a message whose hold's answer said nothing sure waits for the
# group the hold went to (failing over, or gone from the route) before it is sent to its home
# over the route then: the realtime broker's default de-duplication window, after which that
# group would not absorb the copy anyway.
PINNED_WAIT_MS = 600_000
# ``prune_handed`` pops due entries off the heap one by one while they are fewer than
# 1/PRUNE_POPS_SHARE of it; past that, it takes the rest in one pass over the heap.
PRUNE_POPS_SHARE = 8

_ID_OF = itemgetter(1)  # the message id of a (due_ms, message_id) heap entry


class HandedMixin:
    """The hand-off side of ``Dispatcher`` (module docstring)."""

    def _no_room_to_hold(self: Dispatcher, count: int, now_ms: int) -> str | None:
        """Why ``count`` messages may not be handed off now (None: they may): the handed ids
        would pass HANDED_IDS_MAX, or a broker's clock runs too far ahead."""
        if len(self._handed_due) + count > HANDED_IDS_MAX:
            return (f"{len(self._handed_due)} handed ids remembered, {count} more would pass "
                    f"HANDED_IDS_MAX {HANDED_IDS_MAX}")
        ahead_ms = self.clocks.surely_ahead_ms(now_ms)
        if ahead_ms > HOLD_CLOCK_AHEAD_MS_MAX:
            return (f"a broker clock runs at least {ahead_ms} ms ahead of ours, over "
                    f"HOLD_CLOCK_AHEAD_MS_MAX {HOLD_CLOCK_AHEAD_MS_MAX}")
        return None

    def _observe_clocks(self: Dispatcher, results: list[dict[str, Any]], held_at_ms: int) -> None:
        """Note each answering group's clock (``broker_now_ms``, PayloadSender) against the
        round trip from ``held_at_ms`` to now; a broker clock certainly far ahead pauses the
        hand-off at once."""
        seen: dict[str, int] = {}
        for result in results:
            broker_now_ms = result.get("broker_now_ms")
            if type(broker_now_ms) is int:
                seen[result.get("group", "")] = broker_now_ms
        if not seen:
            return
        now_ms = self.clock()
        for group, broker_now_ms in seen.items():
            self.clocks.observe(group, held_at_ms, broker_now_ms, now_ms)
        ahead_ms = self.clocks.surely_ahead_ms(now_ms)
        if ahead_ms > HOLD_CLOCK_AHEAD_MS_MAX:
            log.warning("a broker clock runs at least %d ms ahead of ours (over "
                        "HOLD_CLOCK_AHEAD_MS_MAX %d): dispatching at the due time", ahead_ms,
                        HOLD_CLOCK_AHEAD_MS_MAX)
            if self._no_hold is not None:
                self._no_hold()

    async def _cancel_dropped(self: Dispatcher, entries: list[ScheduleEntry], payloads: list[bytes]
                              ) -> tuple[list[ScheduleEntry], list[bytes]]:
        """Of a hand-off whose answer was lost: those a broker dropped at a cancel meanwhile
        (``pending_drops``; the cancel answered "cancelled") are cancelled in the store (the
        cancel's own path: under the loader's lock, traced, waiting for the slaves) and
        forgotten, never sent at their due time; the others are returned."""
        keep: list[int] = []
        for position, payload in enumerate(payloads):
            message_id = peek_message_id(payload)
            due_ms = self.pending_drops.pop(message_id, None)
            if due_ms is None:
                keep.append(position)
                continue
            entry = entries[position]
            try:
                if self._cancel_in_store is not None:
                    await self._cancel_in_store(message_id, due_ms, entry)
            except Exception:
                log.exception("the cancel of dropped message %s was not recorded", message_id)
            self.window.forget([entry])  # the broker dropped it: never sent, whatever the store said
        return [entries[i] for i in keep], [payloads[i] for i in keep]

    def _pin(self: Dispatcher, entries: list[ScheduleEntry], holders: list[str] | None,
             now_ms: int) -> None:
        """A hold of ``entries`` whose answer said nothing sure went to ``holders`` (one group
        per entry, PayloadSender's ``holders``; None: not known): their due-time send goes
        there (``_pins``), not to their home over the route then (review s11: after a route
        change a second group delivered them too)."""
        if holders is None or len(holders) != len(entries):
            return
        for entry, group in zip(entries, holders):
            if group:
                self.pinned[entry.delay_log_offset] = (
                    group, max(now_ms, entry.deliver_at_ms) + PINNED_WAIT_MS)

    def _pins(self: Dispatcher, entries: list[ScheduleEntry], now_ms: int
              ) -> list[str | None] | None:
        """The group each of ``entries`` must be sent to (None: its home; None for all: no
        pins). A pin older than PINNED_WAIT_MS past its due time is dropped: its group was
        gone or refused that long, and the message goes to its home over the route now (it
        may be delivered twice, if that group comes back holding it)."""
        if not self.pinned:
            return None
        groups: list[str | None] = []
        for entry in entries:
            pin = self.pinned.get(entry.delay_log_offset)
            if pin is not None and pin[1] < now_ms:
                log.warning("message at delay-log offset %d waited %d ms past its due time for "
                            "broker group %s, which may hold it: sent to its home over the "
                            "route now", entry.delay_log_offset, PINNED_WAIT_MS, pin[0])
                del self.pinned[entry.delay_log_offset]
                pin = None
            groups.append(pin[0] if pin is not None else None)
        return groups if any(groups) else None

    def _may_hold(self: Dispatcher, subject: str, entries: list[ScheduleEntry],
                  payloads: list[bytes]) -> list[str]:
        """Before a hold is sent: its messages may be held from now on (``handed``; a cancel
        asks the broker about them, and only about them); their ids."""
        ids = list(map(peek_message_id, payloads))
        for message_id, entry in zip(ids, entries):
            if message_id not in self.handed:  # one a cancel found dropped stays so
                self.note_handed(message_id, subject, entry.deliver_at_ms, False)
        return ids

    def note_handed(self: Dispatcher, message_id: str, subject: str, deliver_at_ms: int,
                    cancelled: bool) -> None:
        """Remember ``message_id`` as maybe held (``handed``) until its due time passes;
        ``cancelled``: a broker dropped it at a cancel."""
        known = self.handed.get(message_id)
        self.handed[message_id] = (subject, deliver_at_ms, cancelled)
        if known is None or known[1] != deliver_at_ms:
            heapq.heappush(self._handed_due, (deliver_at_ms, message_id))

    def _not_held(self: Dispatcher, ids: list[str]) -> None:
        """A broker refused these hand-offs: it holds none of them, a cancel need not ask."""
        handed = self.handed
        for message_id in ids:
            known = handed.get(message_id)
            if known is not None and not known[2]:
                del handed[message_id]

    def prune_handed(self: Dispatcher, now_ms: int) -> int:
        """Forget the handed messages whose due time passed HELD_CANCEL_GRACE_MS ago (a
        cancel of one is too late; one a broker dropped is known to the store), in time
        proportional to how many; returns how many."""
        now_ms -= HELD_CANCEL_GRACE_MS
        heap, handed, gone = self._handed_due, self.handed, 0
        popped_max = len(heap) // PRUNE_POPS_SHARE
        while heap and heap[0][0] <= now_ms and popped_max > 0:
            due_ms, message_id = heapq.heappop(heap)
            popped_max -= 1
            known = handed.get(message_id)
            if known is not None and known[1] == due_ms:
                del handed[message_id]
                gone += 1
        if heap and heap[0][0] <= now_ms:
            # A hot slot: at least 1/PRUNE_POPS_SHARE of the heap is due. One pass over it
            # (at most PRUNE_POPS_SHARE times what it prunes) and a heapify cost ~1/3 of
            # popping each (20,000 due: ~15 ms instead of ~48, a stall of the event loop).
            due = [entry for entry in heap if entry[0] <= now_ms]
            heap[:] = [entry for entry in heap if entry[0] > now_ms]
            heapq.heapify(heap)
            # An id re-handed at another due time has an entry per time; only the entry of
            # its current one forgets it.
            found = map(handed.get, map(_ID_OF, due))
            forgotten = list(dict.fromkeys(
                message_id for (due_ms, message_id), known in zip(due, found)
                if known is not None and known[1] == due_ms))
            list(map(handed.pop, forgotten, repeat(None)))
            gone += len(forgotten)
        if self.pinned:  # a few: holds whose answers were lost; cancelled ones end here
            gone_ms = now_ms - PINNED_WAIT_MS  # long after ``_pins`` would have dropped it
            for offset in [o for o, (_g, until) in self.pinned.items() if until < gone_ms]:
                del self.pinned[offset]
        # A drop whose hold was never recorded (its answer lost): nothing left to mark.
        if self.pending_drops:  # a few: cancels that raced a hold
            for message_id in [i for i, due in self.pending_drops.items() if due <= now_ms]:
                del self.pending_drops[message_id]
        return gone


__all__ = ["HANDED_IDS_MAX", "HELD_CANCEL_GRACE_MS", "PINNED_WAIT_MS", "PRUNE_POPS_SHARE",
           "HandedMixin"]
