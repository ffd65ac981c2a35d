"""``TimingWheel``: the in-memory level of the delay server's schedule. It never reads the clock:
the owner tells it the time with ``advance(now_ms)``.

It holds only the entries of the preload window (the buckets the server loaded from disk), so its
size is bounded by the window, not by how many messages are pending.

Why a heap and not a hashed wheel of ``tick_ms`` slots: a hashed wheel's O(1) insert pays off for
millions of timers in C, where a slot is a pointer bump. Here every operation is Python, the window
holds at most a few buckets' worth of entries (~10^5), and ``heapq`` is implemented in C, so an
O(log n) push or pop is a few hundred nanoseconds, cheaper than a Python-level slot walk that has to
visit empty slots on every tick. A heap also returns entries exactly in ``deliver_at_ms`` order
without sorting a slot, and it has no overflow level for entries beyond one rotation.

``tick_ms`` is the wakeup granularity: ``next_due_ms`` rounds the earliest due time UP to a
multiple of ``tick_ms``, so an owner that sleeps until then wakes at most once per tick and takes
everything due in that tick in one ``advance``. Rounding up keeps the promise that nothing is
returned early; it adds at most ``tick_ms - 1`` ms of lateness (``tick_ms=1``: exact).

Removal (a cancel of a loaded entry) is lazy: the key is forgotten at once and its heap item is
skipped when it surfaces; the heap is rebuilt when skipped items outnumber live ones, so memory
stays O(live entries).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any, Hashable

TICK_MS_DEFAULT = 10


class TimingWheel:
    """Entries keyed by ``key``, each returned once, never before its ``deliver_at_ms``."""

    def __init__(self, tick_ms: int = TICK_MS_DEFAULT) -> None:
        if not isinstance(tick_ms, int) or tick_ms < 1:
            raise ValueError(f"tick_ms {tick_ms!r} must be an int >= 1")
        self.tick_ms = tick_ms
        self._heap: list[tuple[int, int, Hashable, Any]] = []
        self._live: dict[Hashable, int] = {}  # key -> sequence of its current heap item
        self._sequence = itertools.count()

    def __len__(self) -> int:
        """Entries added and neither returned by ``advance`` nor removed."""
        return len(self._live)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._live

    @staticmethod
    def key_of(entry: Any) -> Hashable:
        """An entry's default key: ``entry.key`` when it has one (``ScheduleEntry``'s is
        (bucket_ms, index)), else the entry itself."""
        key = getattr(entry, "key", None)
        return entry if key is None else key

    def add(self, entry: Any, deliver_at_ms: int, key: Hashable | None = None) -> None:
        """Hold ``entry`` until ``deliver_at_ms``. Adding a key that is already held replaces the
        held entry (it is then returned once, at the new time). O(log n)."""
        if not isinstance(deliver_at_ms, int):
            raise ValueError(f"deliver_at_ms {deliver_at_ms!r} must be an int")
        if key is None:
            key = self.key_of(entry)
        sequence = next(self._sequence)
        self._live[key] = sequence
        heapq.heappush(self._heap, (deliver_at_ms, sequence, key, entry))
        self._maybe_compact()

    def remove(self, key: Hashable) -> bool:
        """Forget the entry held under ``key``; False when none is held. O(1)."""
        if self._live.pop(key, None) is None:
            return False
        self._maybe_compact()
        return True

    def advance(self, now_ms: int) -> list[Any]:
        """Every held entry with ``deliver_at_ms <= now_ms``, in (deliver_at_ms, add order) order;
        they are no longer held. O(k log n) for k entries returned or skipped."""
        heap, live = self._heap, self._live
        due = []
        while heap and heap[0][0] <= now_ms:
            _at, sequence, key, entry = heapq.heappop(heap)
            if live.get(key) == sequence:
                del live[key]
                due.append(entry)
        return due

    def next_due_ms(self) -> int | None:
        """When the earliest held entry is due, rounded up to a multiple of ``tick_ms`` (never
        earlier than the entry); None when nothing is held."""
        heap, live = self._heap, self._live
        while heap and live.get(heap[0][2]) != heap[0][1]:
            heapq.heappop(heap)  # a removed or replaced entry
        if not heap:
            return None
        at = heap[0][0]
        return -(-at // self.tick_ms) * self.tick_ms

    def _maybe_compact(self) -> None:
        heap = self._heap
        if len(heap) > 64 and len(heap) > 2 * len(self._live):
            live = self._live
            self._heap = [item for item in heap if live.get(item[2]) == item[1]]
            heapq.heapify(self._heap)
