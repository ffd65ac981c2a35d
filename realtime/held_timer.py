"""``HeldTimer``: when the held messages of a broker fall due. Pure: told the time, reads no
clock, does no I/O; the broker's hand-off part (``realtime.handoffs``) asks it what is due and
sleeps until ``next_due_ms``."""

from __future__ import annotations

import heapq


class HeldTimer:
    """Held messages by visible time (ties in hand-off order: by message-log offset).

    A removed message stays in the heap until it reaches the top (lazy deletion): removing
    is O(1), and each entry is popped once. Owner: the event loop.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, int]] = []  # (visible_at_ms, offset)
        self._live: dict[int, int] = {}  # offset -> visible_at_ms of what is still held

    def __len__(self) -> int:
        return len(self._live)

    def add(self, offset: int, visible_at_ms: int) -> None:
        """Hold the message at ``offset`` until ``visible_at_ms`` (again: moved to that time)."""
        self._live[offset] = visible_at_ms
        heapq.heappush(self._heap, (visible_at_ms, offset))

    def remove(self, offset: int) -> None:
        """Forget a message (cancelled); unknown offsets are ignored."""
        self._live.pop(offset, None)

    def clear(self) -> None:
        """Forget every message (the broker stepped down)."""
        self._heap.clear()
        self._live.clear()

    def _drop_stale_head(self) -> None:
        heap, live = self._heap, self._live
        while heap and live.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)

    def next_due_ms(self) -> int | None:
        """The earliest visible time still held, or None when nothing is."""
        self._drop_stale_head()
        return self._heap[0][0] if self._heap else None

    def take_due(self, now_ms: int, max_count: int) -> list[int]:
        """The offsets of at most ``max_count`` messages due at ``now_ms`` (visible time at or
        before it), earliest first; they are no longer held here."""
        heap, live = self._heap, self._live
        due: list[int] = []
        while len(due) < max_count:
            self._drop_stale_head()
            if not heap or heap[0][0] > now_ms:
                break
            _visible_at, offset = heapq.heappop(heap)
            del live[offset]
            due.append(offset)
        return due


__all__ = ["HeldTimer"]
