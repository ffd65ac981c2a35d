"""The in-memory de-duplication index: (subject, message id) -> (sequence, timestamp_ms).

Derived data, never stored: recovery rebuilds it from the message-log records whose timestamp is
within ``dedup_window_ms`` of the time given at open. Bounded by ``ids_max``: when full, the
oldest-inserted ids are forgotten first, so a resend older than that is stored again.

The broker adds and looks up a few hundred ids per commit, so the index is a plain dict keyed by
one string per id (``keys``: the subject, length-prefixed, then the id; a str caches its hash)
and the insertion order that eviction follows is kept apart, as the keys each call
added. An id added again (stored anew after its window) leaves a stale position behind in that
order, counted in ``_stale`` and skipped when eviction reaches it: the same order as removing
the id and appending it at the end.

A value is the pair packed into one int (``sequence << 65`` plus ``timestamp_ms``), not a
``(sequence, timestamp_ms)`` tuple: an int is no object the garbage collector tracks, a tuple
is one until the first pass that sees it, so every id added counted towards the next young
pass (at 2,000 msg/s one of the two objects per message a pass found).
"""

from __future__ import annotations

from collections import deque
from itertools import repeat
from operator import add, lshift
from typing import Iterator, Sequence


# A value: (sequence << _TIMESTAMP_BITS) + timestamp_ms, for any sequence of either sign (ints
# have no width) and any timestamp in [-2**64, 2**64): 65 bits, so the store's
# whole u64 domain (TIMESTAMP_MS_MAX) and the negative ones the tests use both come back.
_TIMESTAMP_BITS = 65
_TIMESTAMP_HALF = 1 << (_TIMESTAMP_BITS - 1)
_TIMESTAMP_MASK = (1 << _TIMESTAMP_BITS) - 1


def _packed(sequence: int, timestamp_ms: int) -> int:
    return (sequence << _TIMESTAMP_BITS) + timestamp_ms


def _timestamp_ms_of(value: int) -> int:
    return ((value + _TIMESTAMP_HALF) & _TIMESTAMP_MASK) - _TIMESTAMP_HALF


def _sequence_of(value: int) -> int:
    return (value - _timestamp_ms_of(value)) >> _TIMESTAMP_BITS


def _packed_many(sequences: Sequence[int], timestamps_ms: Sequence[int]) -> Iterator[int]:
    """``_packed`` of each pair, in C loops."""
    return map(add, map(lshift, sequences, repeat(_TIMESTAMP_BITS)), timestamps_ms)


# Keys per list of the eviction order: a list per few thousand ids, so the lists are few (the
# collector tracks each) and evicting a whole list frees its memory soon.
ORDER_CHUNK_KEYS = 4096


class DedupIndex:
    """Message ids seen recently, per subject. Time is passed in."""

    def __init__(self, window_ms: int, ids_max: int) -> None:
        self.window_ms = window_ms
        self.ids_max = ids_max
        self._ids: dict[str, int] = {}  # key -> _packed(sequence, timestamp_ms)
        # Every key added, oldest first, in lists of ORDER_CHUNK_KEYS or more (each add
        # extends the last one until it is that long): not a list or tuple per add_many call,
        # an object the collector tracks until its first pass sees it, one per commit that
        # every young pass counted. _order[0][:_first] are gone already.
        self._order: deque[list[str]] = deque()
        self._first = 0
        # key -> how many of its positions in _order no longer stand for its entry
        self._stale: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._ids)

    @staticmethod
    def keys(subject: str, message_ids: Sequence[str]) -> list[str]:
        """The index keys of ``message_ids`` of ``subject``, for ``lookup_many``/``add_many``."""
        # Length-prefixed, so no (subject, id) pair shares a key with another.
        return list(map(add, repeat(f"{len(subject)}:{subject}", len(message_ids)), message_ids))

    def fresh_keys(self, subject: str, message_ids: Sequence[str], count: int
                   ) -> list[str] | None:
        """The index keys of ``message_ids`` of ``subject`` (``keys``) when there are
        ``count`` of them, none known to the index and none twice: the usual commit's run,
        every id new; None otherwise (``lookup_many`` says which are known). One call for
        ``keys``, ``lookup_many``'s usual answer and the count, without Python code per key."""
        keys = list(map(add, repeat(f"{len(subject)}:{subject}", len(message_ids)), message_ids))
        if self._ids.keys().isdisjoint(keys) and len(set(keys)) == count:
            return keys
        return None

    def clear(self) -> None:
        """Forget every id."""
        self._ids.clear()
        self._order.clear()
        self._first = 0
        self._stale.clear()

    def lookup(self, subject: str, message_id: str, timestamp_ms: int) -> int | None:
        """The stored sequence when ``message_id`` was stored for ``subject`` less than
        ``window_ms`` before ``timestamp_ms``; otherwise None."""
        found = self.lookup_many(self.keys(subject, (message_id,)), timestamp_ms)
        return found[0] if found is not None else None

    def lookup_many(self, keys: Sequence[str], timestamp_ms: int) -> list[int | None] | None:
        """``lookup`` of each key (``keys``) at ``timestamp_ms``, in order; None (not a list)
        when no key is known at all, the usual case, found without Python code per key."""
        ids = self._ids
        if ids.keys().isdisjoint(keys):
            return None
        found = list(map(ids.get, keys))
        window_ms = self.window_ms
        return [None if hit is None or timestamp_ms - _timestamp_ms_of(hit) >= window_ms
                else _sequence_of(hit) for hit in found]

    def add(self, subject: str, message_id: str, sequence: int, timestamp_ms: int) -> None:
        """Remember an id (replacing an older entry of the same id)."""
        (key,) = self.keys(subject, (message_id,))
        ids = self._ids
        if key in ids:
            self._stale[key] = self._stale.get(key, 0) + 1
        ids[key] = _packed(sequence, timestamp_ms)
        self._note_order((key,))
        if len(ids) > self.ids_max:
            self._evict(len(ids) - self.ids_max)

    def add_many(self, keys: Sequence[str], sequences: Sequence[int],
                 timestamps_ms: Sequence[int]) -> None:
        """``add`` of each key (``keys``) with its sequence and timestamp, in order."""
        if not keys:
            return
        ids = self._ids
        entries = _packed_many(sequences, timestamps_ms)
        if ids.keys().isdisjoint(keys):
            size = len(ids)
            ids.update(zip(keys, entries))
            if len(ids) != size + len(keys):  # a key twice in ``keys``: all but its last stale
                for key in keys:
                    self._stale[key] = self._stale.get(key, 0) + 1
                for key in set(keys):
                    self._drop_stale(key)
        elif all(map(ids.__contains__, keys)) and len(set(keys)) == len(keys):
            # Every key known, none twice (held ids made visible get their sequences): each
            # old position in _order goes stale, counted without Python code per key.
            stale = self._stale
            stale.update(zip(keys, map(add, map(stale.get, keys, repeat(0)), repeat(1))))
            ids.update(zip(keys, entries))
        else:
            stale = self._stale
            for key, entry in zip(keys, entries):
                if key in ids:
                    stale[key] = stale.get(key, 0) + 1
                ids[key] = entry
        self._note_order(keys)
        if len(ids) > self.ids_max:
            self._evict(len(ids) - self.ids_max)

    def add_fresh(self, keys: list[str], first_sequence: int, timestamp_ms: int) -> None:
        """``add_many`` of keys ``fresh_keys`` answered, with nothing added since (so none is
        known and none comes twice), numbered from ``first_sequence``, all at ``timestamp_ms``:
        the same index, the packed values taken from one ``range`` (consecutive sequences
        differ by ``1 << _TIMESTAMP_BITS``) and no stale counting."""
        if not keys:
            return
        ids = self._ids
        start = (first_sequence << _TIMESTAMP_BITS) + timestamp_ms
        ids.update(zip(keys, range(start, start + (len(keys) << _TIMESTAMP_BITS),
                                   1 << _TIMESTAMP_BITS)))
        order = self._order  # _note_order, inline
        if order and len(order[-1]) < ORDER_CHUNK_KEYS:
            order[-1].extend(keys)
        else:
            order.append(list(keys))
        if len(ids) > self.ids_max:
            self._evict(len(ids) - self.ids_max)

    def settle_many(self, keys: Sequence[str], sequences: Sequence[int],
                    timestamps_ms: Sequence[int]) -> None:
        """Give ids the index knows (held ids made visible) their sequences and timestamps in
        place, each keeping its position in the eviction order; ``add_many`` of them when
        any is not known any more (pruned or evicted since it was held).

        In place, a hot slot of 20k ids costs one dict update instead of add_many's stale
        counting and a second position per id. An entry whose position is older than its
        timestamp only holds ``prune`` (which stops at the first young entry) back until it
        expires: ids are remembered longer, never shorter; ``ids_max`` evicts it at its
        held position."""
        ids = self._ids
        if keys and all(map(ids.__contains__, keys)):
            ids.update(zip(keys, _packed_many(sequences, timestamps_ms)))
        else:
            self.add_many(keys, sequences, timestamps_ms)

    def _note_order(self, keys: Sequence[str]) -> None:
        """``keys`` added last, at the end of the eviction order."""
        order = self._order
        if order and len(order[-1]) < ORDER_CHUNK_KEYS:
            order[-1].extend(keys)
        else:
            order.append(list(keys))

    def _drop_stale(self, key: str) -> None:
        count = self._stale[key] - 1
        if count:
            self._stale[key] = count
        else:
            del self._stale[key]

    def _evict(self, count: int) -> None:
        """Forget the ``count`` oldest-inserted ids."""
        ids, order, stale = self._ids, self._order, self._stale
        while count > 0 and order:
            chunk = order[0]
            first = self._first
            if not stale:
                doomed = chunk[first:first + count]
                for key in doomed:
                    del ids[key]
                count -= len(doomed)
                first += len(doomed)
            else:
                while count > 0 and first < len(chunk):
                    key = chunk[first]
                    first += 1
                    if key in stale:
                        self._drop_stale(key)
                    else:
                        del ids[key]
                        count -= 1
            self._advance(first)

    def _advance(self, first: int) -> None:
        if first >= len(self._order[0]):
            self._order.popleft()
            first = 0
        self._first = first

    def forget(self, subject: str, message_id: str, sequence: int) -> None:
        """Drop an id if it still maps to ``sequence`` (recovery rewound that sequence)."""
        (key,) = self.keys(subject, (message_id,))
        value = self._ids.get(key)
        if value is not None and _sequence_of(value) == sequence:
            del self._ids[key]
            self._stale[key] = self._stale.get(key, 0) + 1  # its position in _order stays

    def prune(self, now_ms: int) -> int:
        """Forget ids stored ``window_ms`` or more before ``now_ms`` (oldest-inserted first,
        stopping at the first young one); returns how many were dropped."""
        ids, order, stale = self._ids, self._order, self._stale
        dropped = 0
        while order:
            chunk = order[0]
            first = self._first
            while first < len(chunk):
                key = chunk[first]
                if key in stale:
                    self._drop_stale(key)
                else:
                    if now_ms - _timestamp_ms_of(ids[key]) < self.window_ms:
                        self._first = first
                        return dropped
                    del ids[key]
                    dropped += 1
                first += 1
            self._advance(first)
        return dropped
