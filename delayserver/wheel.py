"""``TimingWheel``: the in-memory level of the delay server's schedule. It never reads the clock:
the owner tells it the time with ``advance(now_ms)``.

It holds only the entries of the preload window (the buckets the server loaded from disk), so its
size is bounded by the window, not by how many messages are pending.

Structure: a hashed wheel of ``tick_ms``-wide slots (a dict: slot number -> list of items in add
order) plus a heap of the slot numbers that hold items (one heap item per slot, not per entry).
Adding is a dict lookup and a list append; ``advance`` pops whole slots, sorts each by due time
(stable, so ties keep add order) and returns the entries. A hot second of 100,000 entries costs
one heap operation per 5 ms slot instead of an O(log n) heap pop per entry, which cost ~3 us each
(tuple comparisons down a 17-level heap) and was the largest single cost of dispatching a hot
slot. Only slots that hold items are ever visited, so a clock jump of days costs nothing extra.

``tick_ms`` is the wakeup granularity: ``next_due_ms`` rounds the earliest due time UP to a
multiple of ``tick_ms``, so an owner that sleeps until then wakes at most once per tick and takes
everything due in that tick in one ``advance``. Rounding up keeps the promise that nothing is
returned early; it adds at most ``tick_ms - 1`` ms of lateness (``tick_ms=1``: exact).
``advance(now_ms)`` itself is exact: it returns every entry due at or before ``now_ms`` and none
after, splitting the slot ``now_ms`` falls in.

Removal (a cancel of a loaded entry) is lazy: the key is forgotten at once and its item is
skipped when its slot is taken; everything is rebuilt when skipped items outnumber live ones, so
memory stays O(live entries).
"""

from __future__ import annotations

import heapq
from operator import itemgetter
from typing import Any, Hashable

TICK_MS_DEFAULT = 10


class TimingWheel:
    """Entries keyed by ``key``, each returned once, never before its ``deliver_at_ms``."""

    def __init__(self, tick_ms: int = TICK_MS_DEFAULT) -> None:
        if not isinstance(tick_ms, int) or tick_ms < 1:
            raise ValueError(f"tick_ms {tick_ms!r} must be an int >= 1")
        self.tick_ms = tick_ms
        # An item is (deliver_at_ms, key, entry); it is live while _live[key] is that item.
        self._slots: dict[int, list[tuple[int, Hashable, Any]]] = {}
        self._slot_heap: list[int] = []  # slot numbers in _slots, each once
        self._slot_min: dict[int, int] = {}  # slot -> earliest deliver_at_ms added to it
        self._dirty: set[int] = set()  # slots that lost an item since _slot_min was exact
        self._live: dict[Hashable, tuple[int, Hashable, Any]] = {}
        self._stored = 0  # items in the slots, live or not

    def __len__(self) -> int:
        """Entries added and neither returned by ``advance`` nor removed."""
        return len(self._live)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._live

    def add(self, entry: Any, deliver_at_ms: int, key: Hashable | None = None) -> None:
        """Hold ``entry`` until ``deliver_at_ms`` under ``key`` (the entry itself when None; the
        preload window keys a schedule entry by its delay-log offset). Adding a key that is
        already held replaces the held entry (it is then returned once, at the new time). O(1)
        but for a new slot."""
        self.add_items([(deliver_at_ms, entry if key is None else key, entry)])

    def add_items(self, items: list[tuple[int, Hashable, Any]]) -> None:
        """``add`` of each ``(deliver_at_ms, key, entry)`` item, in order, in one call: the
        preload window tracks a commit's or a load's entries this way (a Python call per
        entry fewer on the event loop, ~0.3 us each)."""
        if not set(map(type, map(_DUE, items))) <= {int}:  # checked first: none is added
            for item in items:
                if not isinstance(item[0], int):
                    raise ValueError(f"deliver_at_ms {item[0]!r} must be an int")
        live, slots, slot_min, tick = self._live, self._slots, self._slot_min, self.tick_ms
        replaced_any = False
        for item in items:
            deliver_at_ms, key = item[0], item[1]
            replaced = live.get(key)
            if replaced is not None:
                self._dirty.add(replaced[0] // tick)
                replaced_any = True
            live[key] = item
            slot = deliver_at_ms // tick
            held = slots.get(slot)
            if held is None:
                slots[slot] = [item]
                slot_min[slot] = deliver_at_ms
                heapq.heappush(self._slot_heap, slot)
            else:
                held.append(item)
                if deliver_at_ms < slot_min[slot]:
                    slot_min[slot] = deliver_at_ms
        self._stored += len(items)
        if replaced_any:
            self._maybe_compact()

    def remove(self, key: Hashable) -> bool:
        """Forget the entry held under ``key``; False when none is held. O(1)."""
        item = self._live.pop(key, None)
        if item is None:
            return False
        self._dirty.add(item[0] // self.tick_ms)
        self._maybe_compact()
        return True

    def advance(self, now_ms: int) -> list[Any]:
        """Every held entry with ``deliver_at_ms <= now_ms``, in (deliver_at_ms, add order) order;
        they are no longer held. O(k) for k items taken, plus a sort per slot."""
        slots, heap, live = self._slots, self._slot_heap, self._live
        now_slot = now_ms // self.tick_ms
        due: list[Any] = []
        while heap and heap[0] <= now_slot:
            slot = heap[0]
            items = slots[slot]
            if slot == now_slot and self._slot_min[slot] > now_ms:
                break  # nothing of the current slot is due yet
            if slot == now_slot and max(items, key=_DUE)[0] > now_ms:
                # The slot now_ms falls in: take its due part, keep the rest (add order kept).
                keep = [item for item in items if item[0] > now_ms]
                items = [item for item in items if item[0] <= now_ms]
                slots[slot] = keep
                self._slot_min[slot] = min(item[0] for item in keep)
            else:
                heapq.heappop(heap)
                del slots[slot]
                del self._slot_min[slot]
                self._dirty.discard(slot)
            self._stored -= len(items)
            if len(items) > 1:
                items.sort(key=_DUE)  # stable: ties stay in add order
            for item in items:
                key = item[1]
                if live.get(key) is item:
                    del live[key]
                    due.append(item[2])
            if slot == now_slot:
                break
        return due

    def peek_between(self, after_ms: int, until_ms: int) -> list[Any]:
        """The held entries with ``after_ms < deliver_at_ms <= until_ms``, left held (the delay
        server reads their payloads ahead of their due time). O(slots in the span) or O(held
        slots), whichever is fewer, plus the items of the slots visited."""
        if until_ms <= after_ms:
            return []
        slots, live, tick = self._slots, self._live, self.tick_ms
        first, last = after_ms // tick, until_ms // tick
        if last - first + 1 <= len(slots):
            numbers: Any = (s for s in range(first, last + 1) if s in slots)
        else:
            numbers = sorted(s for s in slots if first <= s <= last)
        out: list[Any] = []
        for slot in numbers:
            for item in slots[slot]:
                if after_ms < item[0] <= until_ms and live.get(item[1]) is item:
                    out.append(item[2])
        return out

    def next_due_ms(self) -> int | None:
        """When the earliest held entry is due, rounded up to a multiple of ``tick_ms`` (never
        earlier than the entry); None when nothing is held."""
        slots, heap, live, tick = self._slots, self._slot_heap, self._live, self.tick_ms
        while heap:
            slot = heap[0]
            if slot in self._dirty:
                # It lost items: drop the dead ones and find its true earliest time.
                items = [item for item in slots[slot] if live.get(item[1]) is item]
                self._stored -= len(slots[slot]) - len(items)
                self._dirty.discard(slot)
                if not items:
                    heapq.heappop(heap)
                    del slots[slot]
                    del self._slot_min[slot]
                    continue
                slots[slot] = items
                self._slot_min[slot] = min(item[0] for item in items)
            at = self._slot_min[slot]
            return -(-at // tick) * tick
        return None

    def _maybe_compact(self) -> None:
        if self._stored > 64 and self._stored > 2 * len(self._live):
            live = self._live
            for slot in list(self._slots):
                items = [item for item in self._slots[slot] if live.get(item[1]) is item]
                if items:
                    self._slots[slot] = items
                    self._slot_min[slot] = min(item[0] for item in items)
                else:
                    del self._slots[slot]
                    del self._slot_min[slot]
            self._slot_heap = list(self._slots)
            heapq.heapify(self._slot_heap)
            self._dirty.clear()
            self._stored = len(live)


_DUE = itemgetter(0)  # an item's deliver_at_ms
