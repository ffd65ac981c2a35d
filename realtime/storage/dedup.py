"""The in-memory de-duplication index: (subject, message id) -> (sequence, timestamp_ms).

Derived data, never stored: recovery rebuilds it from the message-log records whose timestamp is
within ``dedup_window_ms`` of the time given at open. Bounded by ``ids_max``: when full, the
oldest-inserted ids are forgotten first, so a resend older than that is stored again.
"""

from __future__ import annotations

from collections import OrderedDict


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
