"""What settles an entry a consumer held, traced: ``acked`` (named from what the pull remembered,
or from the stored payloads for entries pulled before a restart), ``nacked``, ``retried`` and
``dead`` copies, ``expired``, and the bookkeeping of held entries (``prune``, ``forget``,
``consumers``): the ``SettledTracing`` part of ``realtime.tracing.BrokerTracer`` (split from
it; the owners of its fields are written there).
"""

from __future__ import annotations

import bisect
from itertools import repeat
from typing import Iterable, Sequence

from tracelog.events import consumer_members
from tracelog.peek import peek_trace_members
from tracelog.writer import TraceWriter

_peek = peek_trace_members


class SettledTracing:
    """Acks, nacks, copies, expiries and the held entries' bookkeeping; mixed into
    ``BrokerTracer``, which sets the fields below in its ``__init__`` and documents their
    owners."""

    writer: TraceWriter | None
    enabled: bool
    _held: dict[tuple[str, str, str], dict[int, tuple[str, int] | int]]
    _released: dict[tuple[str, str], dict[int, str]]

    def acked(self, subject: str, key: str, consumer: str,
              ranges: Sequence[tuple[int, int]], now_ms: int) -> list[int]:
        """Trace the held entries in ``ranges`` as acked (a pull-log call). Returns the
        consumer-log sequences of acked entries pulled before a restart that are still unnamed:
        the caller reads their payloads from the store and passes them to ``acked_payloads``
        (and those it cannot read to ``acks_unreadable``)."""
        if not self.enabled:
            return []
        held = self._held.get((subject, key, consumer))
        if not held:
            return []
        writer = self.writer
        assert writer is not None
        if len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
            # One entry acked (a consumer acking each message as it comes, issue 18): the
            # general path's walk below, without its lists and merges.
            member = held.pop(ranges[0][0], None)
            if not held:
                del self._held[(subject, key, consumer)]
            if type(member) is tuple:
                writer.emit_framed("acked", now_ms, [member[0]], (key, consumer))
                return []
            return [member] if type(member) is int else []
        firsts = _merged(sorted(ranges))  # a client may send them overlapping or nested
        span = sum(last - first + 1 for first, last in firsts)
        found: list[tuple[str, int] | int | None]
        if span <= 2 * len(held):
            # Walk the acked sequences: the cost follows the ack, not what the consumer holds
            # (a consumer with many in flight acks a few at a time).
            pop = held.pop
            found = [member for first, last in firsts
                     for member in map(pop, range(first, last + 1), repeat(None))]
        else:  # wide ranges over few holdings: walk the holdings
            starts = [first for first, _ in firsts]
            found = [held.pop(s) for s in [s for s in held if _in_ranges(s, firsts, starts)]]
        named = [member[0] for member in found if type(member) is tuple]
        from_store = [member for member in found if type(member) is int]
        if not held:
            del self._held[(subject, key, consumer)]
        writer.emit_framed("acked", now_ms, named, (key, consumer))  # frame: writer's thread
        return from_store

    def _emit_all(self, kind: str, payloads: Iterable[bytes], now_ms: int,
                  group: str, consumer: str | None = None) -> None:
        if not self.enabled:
            return
        writer = self.writer
        assert writer is not None
        extra = consumer_members(group, consumer)
        lines = []
        for payload in payloads:
            peeked = _peek(payload)
            if peeked is not None:
                lines.append(writer.line(kind, now_ms, peeked.members, extra))
        writer.emit_lines(lines)

    def acked_payloads(self, payloads: Iterable[bytes], key: str, consumer: str,
                       now_ms: int) -> None:
        """Trace acks of entries pulled before a restart, from their stored payloads."""
        self._emit_all("acked", payloads, now_ms, key, consumer)

    def nacked(self, payloads: Iterable[bytes], group: str, consumer: str, now_ms: int) -> None:
        """Messages a consumer handed back."""
        self._emit_all("nacked", payloads, now_ms, group, consumer)

    def copied(self, payloads: Iterable[bytes], dead: bool, group: str, now_ms: int) -> None:
        """Retry copies handed to a delay server (``retried``) or dead letters stored here."""
        self._emit_all("dead" if dead else "retried", payloads, now_ms, group)

    def expired(self, payloads: Iterable[bytes], key: str, now_ms: int) -> None:
        """Messages a group passed over because their expire_at had passed."""
        self._emit_all("expired", payloads, now_ms, key)

    def prune(self, subject: str, key: str, consumer: str, still_held: set[int]) -> None:
        """Forget entries of ``consumer`` no longer held (released to others); their names are
        kept by consumer-log seq until they are handed out again (a pull-log call)."""
        held = self._held.get((subject, key, consumer))
        if held:
            released = self._released.setdefault((subject, key), {})
            for pull_seq in [s for s in held if s not in still_held]:
                value = held.pop(pull_seq)
                if type(value) is tuple and value[1] >= 0:
                    released[value[1]] = value[0]
            if not released:
                del self._released[(subject, key)]
            if not held:
                del self._held[(subject, key, consumer)]

    def forget(self, subject: str, key: str, consumer: str, pull_seqs: Iterable[int]) -> None:
        """Drop entries settled other than by an ack (nacked) without an ``acked`` event."""
        held = self._held.get((subject, key, consumer))
        if held:
            for pull_seq in pull_seqs:
                held.pop(pull_seq, None)
            if not held:
                del self._held[(subject, key, consumer)]

    def consumers(self, subject: str, key: str) -> list[str]:
        """Consumers of (subject, key) with remembered entries."""
        return [c for (s, k, c) in self._held if s == subject and k == key]


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted inclusive ranges made disjoint, so each sequence is walked once and a bisect on
    their starts finds the one range that holds a value."""
    merged: list[tuple[int, int]] = []
    for first, last in ranges:
        if merged and first <= merged[-1][1]:
            if last > merged[-1][1]:
                merged[-1] = (merged[-1][0], last)
        else:
            merged.append((first, last))
    return merged


def _in_ranges(value: int, ranges: list[tuple[int, int]], starts: list[int]) -> bool:
    """Whether ``value`` lies in one of the sorted, disjoint ``ranges`` (``starts`` their
    firsts)."""
    index = bisect.bisect_right(starts, value) - 1
    return index >= 0 and ranges[index][0] <= value <= ranges[index][1]
