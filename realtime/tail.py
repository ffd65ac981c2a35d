"""``Tail``: the messages committed last, kept in memory so that pulls of fresh messages do not
read the message store.

Per subject, a run of entries contiguous by sequence; all subjects together hold at most
``bytes_max`` payload bytes, the oldest commits evicted first. Per message it holds what a pull needs
to filter and deliver without decoding: the payload (byte-identical to what the store holds),
its tags and its ``expire_at_ms`` (or None), each in a column of its own. Derived data: it starts empty and is never persisted;
whatever is not in it is read from the store. Owned by the event loop (not thread-safe).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterable

Entry = tuple[bytes, tuple[str, ...], "int | None"]

_NEVER_EXPIRES = {None}


@dataclass
class SubjectTail:
    """One subject's run: sequences [first, end) are at ``[evicted:]`` of its three columns,
    one item per message: the payload, the tags, the expiry (ms, or None).

    Columns, not an ``(payload, tags, expire_at_ms)`` tuple per message: a tuple is an object
    the garbage collector tracks until its first pass sees it, so each one held counted
    towards the next young pass (at 2,000 msg/s, half of what a pass found); bytes, ints and
    the empty tuple are not tracked at all."""

    start: int  # sequence of payloads[0]
    payloads: list[bytes] = field(default_factory=list)
    tags: list[tuple[str, ...]] = field(default_factory=list)
    expiries: list[int | None] = field(default_factory=list)  # expire_at_ms, or None
    evicted: int = 0  # entries at the front already evicted, deleted in bulk later

    @property
    def first(self) -> int:
        return self.start + self.evicted

    @property
    def end(self) -> int:
        return self.start + len(self.payloads)

    def entry(self, sequence: int) -> Entry:
        """``(payload, tags, expire_at_ms)`` of ``sequence`` (``first <= sequence < end``)."""
        at = sequence - self.start
        return self.payloads[at], self.tags[at], self.expiries[at]

    def take(self, cursor: int, stop: int, count: int, tags: frozenset[str], now_ms: int,
             budget_bytes: int, payloads: dict[int, bytes], chosen: list[int],
             expired: list[bytes] | None = None) -> int:
        """Pick up to ``count`` deliverable entries in [cursor, stop) into ``chosen`` and
        ``payloads``: with one of ``tags`` (if any), not expired at ``now_ms``, and within
        ``budget_bytes`` of payload (past ``chosen``'s first). Entries passed over because they
        expired go to ``expired`` (for tracing). Returns the new cursor: the sequence after the
        last entry looked at."""
        held, start = self.payloads, self.start
        stop = min(stop, start + len(held))  # self.end, without a property call per pull
        if not tags and cursor < stop and count > 0:
            # The usual pull: no tag filter. When nothing in the window expires and it fits the
            # budget, every entry is taken: done with C loops instead of a test per entry.
            end = min(stop, cursor + count)
            window_payloads = held[cursor - start:end - start]
            if (set(self.expiries[cursor - start:end - start]) == _NEVER_EXPIRES
                    and sum(map(len, window_payloads)) <= budget_bytes):
                taken = range(cursor, end)
                chosen.extend(taken)
                payloads.update(zip(taken, window_payloads))
                return end
        all_tags, expiries = self.tags, self.expiries
        seq = cursor
        while seq < stop and count > 0:
            at = seq - start
            payload, message_tags, expire_at_ms = held[at], all_tags[at], expiries[at]
            if ((not tags or not tags.isdisjoint(message_tags))
                    and (expire_at_ms is None or expire_at_ms > now_ms)):
                if chosen and len(payload) > budget_bytes:
                    break  # the rest waits for the next pull
                chosen.append(seq)
                payloads[seq] = payload
                budget_bytes -= len(payload)
                count -= 1
            elif expired is not None and expire_at_ms is not None and expire_at_ms <= now_ms and (
                    not tags or not tags.isdisjoint(message_tags)):
                expired.append(payload)
            seq += 1
        return seq


class Tail:
    """The last ``bytes_max`` payload bytes committed, per subject."""

    def __init__(self, bytes_max: int) -> None:
        self.bytes_max = bytes_max
        self._subjects: dict[str, SubjectTail] = {}
        # Per subject per commit, oldest first (the eviction order): its run, entries and bytes.
        # Three deques, not one of (run, entries, bytes) tuples: a tuple holding a run stays
        # tracked by the garbage collector as long as the commit is held, one object per commit
        # that every gen-0 pass promotes and every older pass scans again.
        self._chunk_runs: deque[SubjectTail] = deque()
        self._chunk_entries: deque[int] = deque()
        self._chunk_bytes: deque[int] = deque()
        self._bytes = 0

    @property
    def size_bytes(self) -> int:
        """Payload bytes held (evicted entries no longer count)."""
        return self._bytes

    def add(self, subject: str, first_sequence: int, payloads: list[bytes],
            tags: Iterable[tuple[str, ...]], expiries: Iterable[int | None],
            size_bytes: int) -> None:
        """Append committed messages from ``first_sequence`` (a gap starts the subject anew),
        given as columns: their payloads, and as many tags and expiries (ms, or None)."""
        run = self._subjects.get(subject)
        # run.end != first_sequence, without a property call per commit
        if run is None or run.start + len(run.payloads) != first_sequence:
            run = self._subjects[subject] = SubjectTail(first_sequence)
        run.payloads.extend(payloads)
        run.tags.extend(tags)
        run.expiries.extend(expiries)
        assert len(run.tags) == len(run.payloads) == len(run.expiries), (
            subject, len(run.payloads), len(run.tags), len(run.expiries))
        self._chunk_runs.append(run)
        self._chunk_entries.append(len(payloads))
        self._chunk_bytes.append(size_bytes)
        self._bytes += size_bytes
        while self._bytes > self.bytes_max and self._chunk_runs:
            old = self._chunk_runs.popleft()
            self._bytes -= self._chunk_bytes.popleft()
            old.evicted += self._chunk_entries.popleft()
            if old.evicted * 2 >= len(old.payloads):  # delete in bulk: O(1) per entry overall
                del old.payloads[:old.evicted]
                del old.tags[:old.evicted]
                del old.expiries[:old.evicted]
                old.start += old.evicted
                old.evicted = 0

    def covering(self, subject: str, sequence: int) -> SubjectTail | None:
        """The subject's run if it holds ``sequence`` or ends right before it."""
        run = self._subjects.get(subject)
        # run.first <= sequence <= run.end, without two property calls per pull
        if run is not None and run.start + run.evicted <= sequence <= run.start + len(run.payloads):
            return run
        return None

    def get(self, subject: str, sequence: int) -> Entry | None:
        """The entry of ``sequence``, or None when it is not held."""
        run = self._subjects.get(subject)
        if run is None or not run.first <= sequence < run.end:
            return None
        return run.entry(sequence)

    def drop_below(self, subject: str, sequence: int) -> None:
        """Retention deleted the subject's messages below ``sequence``: forget its run if it
        holds any of them (its bytes stay counted until its commits are evicted)."""
        run = self._subjects.get(subject)
        if run is not None and run.first < sequence:
            del self._subjects[subject]


__all__ = ["Entry", "SubjectTail", "Tail"]
