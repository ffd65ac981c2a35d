"""The in-memory de-duplication index: (subject, message id) -> (sequence, timestamp_ms).

Derived data, never stored: recovery rebuilds it from the message-log records whose timestamp is
within ``dedup_window_ms`` of the time given at open. Bounded by ``ids_max``: when full, the
oldest-inserted ids are forgotten first, so a resend older than that is stored again.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence


class DedupIndex:
    """Message ids seen recently, per subject. Time is passed in."""

    def __init__(self, window_ms: int, ids_max: int) -> None:
        self.window_ms = window_ms
        self.ids_max = ids_max
        self._ids: OrderedDict[tuple[str, str], tuple[int, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._ids)

    def clear(self) -> None:
        """Forget every id."""
        self._ids.clear()

    def lookup(self, subject: str, message_id: str, timestamp_ms: int) -> int | None:
        """The stored sequence when ``message_id`` was stored for ``subject`` less than
        ``window_ms`` before ``timestamp_ms``; otherwise None."""
        found = self._ids.get((subject, message_id))
        if found is None:
            return None
        sequence, stored_ms = found
        if timestamp_ms - stored_ms >= self.window_ms:
            return None
        return sequence

    def lookup_many(self, keys: Sequence[tuple[str, str]], timestamp_ms: int,
                    ) -> list[int | None] | None:
        """``lookup`` of each (subject, message id) at ``timestamp_ms``, in order; None (not a
        list) when no key is known at all, the usual case, found without Python code per key."""
        found = list(map(self._ids.get, keys))
        if found.count(None) == len(found):
            return None
        window_ms = self.window_ms
        return [None if hit is None or timestamp_ms - hit[1] >= window_ms else hit[0]
                for hit in found]

    def add_many(self, keys: Sequence[tuple[str, str]], sequences: Sequence[int],
                 timestamps_ms: Sequence[int]) -> None:
        """``add`` of each (subject, message id) with its sequence and timestamp, in order."""
        ids = self._ids
        size = len(ids)
        ids.update(zip(keys, zip(sequences, timestamps_ms)))
        if len(ids) != size + len(keys):
            # Some keys were there already (an id stored again after its window) and update()
            # left them where they were: move each to the end as add() does, so the oldest
            # entries stay first for prune() and the ids_max cut.
            for key, sequence, timestamp_ms in zip(keys, sequences, timestamps_ms):
                ids.pop(key, None)
                ids[key] = (sequence, timestamp_ms)
        while len(ids) > self.ids_max:
            ids.popitem(last=False)

    def add(self, subject: str, message_id: str, sequence: int, timestamp_ms: int) -> None:
        """Remember an id (replacing an older entry of the same id)."""
        key = (subject, message_id)
        self._ids.pop(key, None)
        self._ids[key] = (sequence, timestamp_ms)
        while len(self._ids) > self.ids_max:
            self._ids.popitem(last=False)

    def forget(self, subject: str, message_id: str, sequence: int) -> None:
        """Drop an id if it still maps to ``sequence`` (recovery rewound that sequence)."""
        key = (subject, message_id)
        if self._ids.get(key, (None,))[0] == sequence:
            del self._ids[key]

    def prune(self, now_ms: int) -> int:
        """Forget ids stored ``window_ms`` or more before ``now_ms`` (oldest-inserted first,
        stopping at the first young one); returns how many were dropped."""
        dropped = 0
        while self._ids:
            key, (_, stored_ms) = next(iter(self._ids.items()))
            if now_ms - stored_ms < self.window_ms:
                break
            del self._ids[key]
            dropped += 1
        return dropped
