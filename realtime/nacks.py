"""Nacks: a consumer hands pulled messages back, and each becomes a retry copy (through a delay
server) or a dead letter (stored here), per the group's retry policy (``realtime.retries``).

Order matters for "nothing lost": the copies are handed off first (the delay server answered
stored, or the dead letter is durable here), and only then are the originals acked. If the
hand-off fails, the nack fails with a retriable error and the originals stay unacked, so they
come back after the ack timeout; a crash between the two steps gives at most a duplicate retry,
which the receiving brokers' de-duplication by copy id absorbs.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from realtime.retries import RetryCopy, RetryPolicies, plan_retry
from wire.errors import (
    ConnectionLost, Internal, NoRoute, NotFound, NotSupported, Overloaded, error_from_wire,
)
from wire.protocol import Nack

if TYPE_CHECKING:
    from realtime.broker import Broker

log = logging.getLogger(__name__)

# Sends retry copies to a delay server: (retry subject, payloads) -> (delay group, results).
RetrySender = Callable[[str, list[bytes]], Awaitable[tuple[str, list[dict]]]]


class NackHandler:
    """Turns nacks into retries and dead letters for one broker.

    Owners: ``stats`` and the set of protected dead-letter subjects belong to the event loop.
    Methods ending in ``_io`` run on the I/O thread their first docstring line names (through
    the broker's runners); every other one on the event loop.
    """

    def __init__(self, broker: "Broker", policies: RetryPolicies,
                 send_retries: RetrySender | None,
                 protect_dead_subject: Callable[[str], Awaitable[object]] | None = None) -> None:
        self.broker = broker
        self.policies = policies
        self._send_retries = send_retries
        self._protect = protect_dead_subject
        self._protected: set[str] = set()
        self.stats = {"nacked": 0, "retried": 0, "dead": 0}
        # (subject as nacked, group) -> [retried, dead] copies handed off since start, for the
        # heartbeat's backlog rows (``annotate``). Event-loop only.
        self.by_group: dict[tuple[str, str], list[int]] = {}

    async def nack(self, request: Nack) -> int:
        """Hand off a copy of each nacked message, then ack the originals; returns how many."""
        broker = self.broker
        keys = broker.keys_for(request.subject, request.group, request.consumer_id)
        key, entries = await broker.on_pulllog_thread(self._held_io, request.subject, keys,
                                                request.consumer_id, request.pull_seqs)
        if not entries:
            return 0
        seqs = [cl_seq for _pull_seq, cl_seq in entries]
        payloads = await broker.on_store_thread(self._read_io, request.subject, seqs)
        now_ms = broker.clock()
        copies = [plan_retry(p, request.group, self.policies, now_ms, request.retry_after_ms)
                  for p in payloads]
        retries = [c for c in copies if not c.dead]
        dead = [c for c in copies if c.dead]
        await self._hand_off(retries, retry=True)
        await self._hand_off(dead, retry=False)
        counts = self.by_group.setdefault((request.subject, request.group), [0, 0])
        counts[0] += len(retries)
        counts[1] += len(dead)
        tracer = broker.tracer
        if tracer.enabled:
            tracer.nacked(payloads, request.group, request.consumer_id, now_ms)
            tracer.copied([c.payload for c in retries], False, request.group, now_ms)
            tracer.copied([c.payload for c in dead], True, request.group, now_ms)
        ranges = [(pull_seq, pull_seq) for pull_seq, _ in entries]
        await broker.on_pulllog_thread(self._ack_io, request.subject, key,
                                       request.consumer_id, ranges, broker.clock())
        await broker.actions_replicated()
        self.stats["nacked"] += len(entries)
        return len(entries)

    async def _hand_off(self, copies: list[RetryCopy], *, retry: bool) -> None:
        if not copies:
            return
        by_subject: dict[str, list[RetryCopy]] = {}
        for copy in copies:
            by_subject.setdefault(copy.subject, []).append(copy)
        for subject, group_copies in by_subject.items():
            payloads = [c.payload for c in group_copies]
            if retry:
                if self._send_retries is None:
                    raise NotSupported("retries need a delay server and this broker has no "
                                       "MetaServer to find one")
                try:
                    _group, results = await self._send_retries(subject, payloads)
                except (NoRoute, ConnectionLost) as exc:
                    raise Overloaded(f"no delay server reachable to hold {len(payloads)} retry "
                                     f"copies for {subject}; the originals stay unacked: "
                                     f"{exc.message}") from exc
            else:
                results = await self.broker.send(payloads)
                if subject not in self._protected and self._protect is not None:
                    await self._protect(subject)
                    self._protected.add(subject)
            for copy, result in zip(group_copies, results):
                error = result.get("error")
                if error:
                    raise error_from_wire(error["code"], f"{copy.message.id} not handed off to "
                                          f"{subject}: {error['message']}")
            self.stats["retried" if retry else "dead"] += len(group_copies)

    def annotate(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Add ``retried`` and ``dead`` (copies handed off since start) to the broker's backlog
        rows, which are per (subject, group); a pair with nacks but no row gets no row."""
        for row in rows:
            counts = self.by_group.get((row["subject"], row["group"]))
            row["retried"], row["dead"] = counts if counts is not None else (0, 0)
        return rows

    def _held_io(self, subject: str, keys: list[str], consumer: str,
                 pull_seqs: list[int]) -> tuple[str, list[tuple[int, int]]]:
        """Pull-log thread: (pull-log group, [(pull seq, consumer-log seq)]) of the nacked
        entries still held."""
        pulllog = self.broker.pulllog
        wanted = set(pull_seqs)
        known = [key for key in keys if pulllog.has_group(subject, key)]
        if not known:
            raise NotFound(f"group {keys[0]} has never pulled subject {subject} on broker "
                           f"{self.broker.config.group}")
        for key in known:
            held = [(e.pull_seq, e.consumer_log_seq)
                    for e in pulllog.unacked(subject, key, consumer) if e.pull_seq in wanted]
            if held:
                return key, held
        return known[0], []

    def _read_io(self, subject: str, seqs: list[int]) -> list[bytes]:
        """Store thread: the payloads of the nacked entries."""
        store = self.broker.store
        try:
            return [store.read(subject, seq).payload for seq in seqs]
        except Exception as exc:  # storage fault: the nack fails, the message stays unacked
            raise Internal(f"reading nacked messages of {subject} failed: {exc}") from exc

    def _ack_io(self, subject: str, key: str, consumer: str, ranges: list[tuple[int, int]],
                now_ms: int) -> int:
        """Pull-log thread: ack the nacked entries, now that their copies are handed off."""
        pulllog = self.broker.pulllog
        self.broker.tracer.forget(subject, key, consumer, [first for first, _ in ranges])
        return pulllog.record_ack(subject, key, consumer, ranges, now_ms)


__all__ = ["NackHandler"]
