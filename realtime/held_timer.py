"""``HeldTimer``: when the held messages of a broker fall due. Pure: told the time, reads no
clock, does no I/O; the broker's hand-off part (``realtime.handoffs``) asks it what is due and
sleeps until ``next_due_ms``."""

from __future__ import annotations

import heapq

# Stale entries a bucket may keep beyond its live ones before it is compacted, and distinct
# times the heap may keep beyond twice the buckets before it is rebuilt.
STALE_SLACK = 16


class HeldTimer:
    """Held messages by visible time (ties in hand-off order: by message-log offset).

    Messages are kept in one bucket per visible time, and a heap holds the distinct times: a
    hot slot (20k messages due at one instant) is one bucket, taken in slices, not 20k heap
    pops of (time, offset) tuples (about 3 us each, paid on the loop before the first of them
    could be made visible). A removed or moved message stays in its old bucket until that
    bucket is taken (lazy deletion, checked against ``_live``) or compacted (``_left``: at
    most about twice its live messages); ``_counts`` says how many live messages each bucket
    has, so an emptied bucket never reports a due time. Owner: the event loop.
    """

    def __init__(self) -> None:
        self._times: list[int] = []  # heap of the visible times with a bucket (and some without)
        self._buckets: dict[int, list[int]] = {}  # visible_at_ms -> offsets (some stale)
        self._counts: dict[int, int] = {}  # visible_at_ms -> live offsets in its bucket
        self._live: dict[int, int] = {}  # offset -> visible_at_ms of what is still held

    def __len__(self) -> int:
        return len(self._live)

    def add(self, offset: int, visible_at_ms: int) -> None:
        """Hold the message at ``offset`` until ``visible_at_ms`` (again: moved to that time)."""
        before = self._live.get(offset)
        if before == visible_at_ms:
            return
        self._live[offset] = visible_at_ms
        if before is not None:
            self._left(before)
        bucket = self._buckets.get(visible_at_ms)
        if bucket is None:
            self._buckets[visible_at_ms] = [offset]
            self._counts[visible_at_ms] = 1
            heapq.heappush(self._times, visible_at_ms)
            if len(self._times) > 2 * len(self._buckets) + STALE_SLACK:
                # times of buckets dropped by _left: rebuilt, so the heap stays within bounds
                self._times = list(self._buckets)
                heapq.heapify(self._times)
        else:
            bucket.append(offset)
            self._counts[visible_at_ms] += 1

    def add_many(self, offsets: list[int], visible_at_ms: list[int]) -> None:
        """``add`` of each offset with its visible time, in order. A hand-off batch due at one
        instant (the usual case: new offsets, one time) joins its bucket in one step."""
        live = self._live
        if len(set(visible_at_ms)) == 1 and len(set(offsets)) == len(offsets) \
                and live.keys().isdisjoint(offsets):
            visible_at = visible_at_ms[0]
            live.update(zip(offsets, visible_at_ms))
            bucket = self._buckets.get(visible_at)
            if bucket is not None:
                bucket.extend(offsets)
                self._counts[visible_at] += len(offsets)
                return
            first, rest = offsets[0], offsets[1:]
            del live[first]
            self.add(first, visible_at)  # a new bucket: as one add does (the heap's time)
            self._buckets[visible_at].extend(rest)
            self._counts[visible_at] += len(rest)
            return
        for offset, visible_at in zip(offsets, visible_at_ms):
            self.add(offset, visible_at)

    def remove(self, offset: int) -> None:
        """Forget a message (cancelled); unknown offsets are ignored."""
        visible_at_ms = self._live.pop(offset, None)
        if visible_at_ms is not None:
            self._left(visible_at_ms)

    def _left(self, visible_at_ms: int) -> None:
        """A live message of the bucket ``visible_at_ms`` was removed or moved: count it, and
        compact the bucket once its stale entries outnumber its live ones (by STALE_SLACK), or
        drop an emptied one, so cancels and moves never grow the timer past what is held
        (its time stays in the heap until it comes first or the heap is rebuilt)."""
        count = self._counts[visible_at_ms] - 1
        if count == 0:
            del self._buckets[visible_at_ms], self._counts[visible_at_ms]
            return
        self._counts[visible_at_ms] = count
        bucket = self._buckets[visible_at_ms]
        if len(bucket) > 2 * count + STALE_SLACK:
            live = self._live
            bucket[:] = [offset for offset in bucket if live.get(offset) == visible_at_ms]

    def clear(self) -> None:
        """Forget every message (the broker stepped down)."""
        self._times.clear()
        self._buckets.clear()
        self._counts.clear()
        self._live.clear()

    def _drop_empty_head(self) -> None:
        times, counts = self._times, self._counts
        while times and counts.get(times[0], 0) == 0:  # emptied, or dropped by _left
            visible_at_ms = heapq.heappop(times)
            self._buckets.pop(visible_at_ms, None)
            counts.pop(visible_at_ms, None)

    def next_due_ms(self) -> int | None:
        """The earliest visible time still held, or None when nothing is."""
        self._drop_empty_head()
        return self._times[0] if self._times else None

    def take_due(self, now_ms: int, max_count: int) -> list[int]:
        """The offsets of at most ``max_count`` messages due at ``now_ms`` (visible time at or
        before it), earliest first; they are no longer held here."""
        times, live = self._times, self._live
        due: list[int] = []
        while len(due) < max_count:
            self._drop_empty_head()
            if not times or times[0] > now_ms:
                break
            visible_at_ms = times[0]
            bucket = self._buckets[visible_at_ms]
            bucket.sort()  # hand-off order; a no-op pass when already sorted
            wanted = max_count - len(due)
            taken = 0
            for index, offset in enumerate(bucket):
                if live.get(offset) != visible_at_ms:
                    continue  # removed, moved or taken already (a duplicate entry)
                del live[offset]
                due.append(offset)
                taken += 1
                if taken == wanted:
                    del bucket[:index + 1]
                    break
            else:
                bucket.clear()
            self._counts[visible_at_ms] -= taken
        return due


__all__ = ["HeldTimer"]
