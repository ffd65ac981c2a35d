"""``Holdings``: what a realtime broker's consumers hold, settled or released. Acks settle
pulled entries; heartbeats keep a consumer online; a consumer's leave (its ``close()``), an ack
timeout or the consumer's expiry release what it holds into its group's redelivery queue, for
the next consumer that pulls. Nothing held by a dead or departed consumer is dropped.

Presence and the decision who is offline are the ``ConsumerBook``'s (event loop); the pull log
applies the releases on its own thread, judging by an ``OfflineView`` copy of the book.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Coroutine

from logstore.errors import LogStoreError
from realtime.consumers import ConsumerKey, Group, OfflineView
from realtime.context import BrokerContext
from realtime.storage.errors import StorageError
from wire.errors import NotFound
from wire.protocol import Ack, Heartbeat, Leave

log = logging.getLogger(__name__)

# (subject, pull-log group, consumer id, the last-seen time it was judged offline by)
Removed = tuple[str, str, str, int]


class Holdings:
    """Acks, heartbeats, leaves and the expiry round of one broker.

    Owners: it keeps no mutable state of its own; ``stats["acked"]`` is written only by
    ``_ack_io`` (a pull-log call: on its thread, or on the event loop while that thread is
    idle, ``ack_now``), read by metrics at scrape time. Methods ending in ``_io`` run on
    the I/O thread their first docstring line names; every other one on the event loop.
    """

    def __init__(self, ctx: BrokerContext,
                 pulllog_quick_now: Callable[[], bool] = lambda: False) -> None:
        self._ctx = ctx
        # Whether a pull-log call made now would run on the loop (``Broker._pulllog_quick_now``;
        # never, by default: then every ack's record goes to the pull-log thread).
        self._pulllog_quick_now = pulllog_quick_now

    # ------------------------------------------------------------------ acks and heartbeats

    async def ack(self, request: Ack) -> int:
        """Record acks of pull-log ranges; returns how many entries became acked."""
        out = self.ack_now(request)
        if type(out) is int:
            return out
        return await out  # type: ignore[misc]

    def ack_now(self, request: Ack) -> int | Coroutine[Any, Any, int]:
        """``ack`` as far as it goes without suspending: how many entries became acked, when
        the pull log records the ack here on the loop (its thread idle, its next write in
        memory), no acked entry is to be traced from the store and no slave is waited for;
        else the coroutine that goes on with it, to await. The realtime server's ack: no
        coroutine for the usual one (issue 18: three a request, each stepped and ended).
        Raises NotFound at once, as ``ack`` does, for a group that never pulled."""
        ctx = self._ctx
        subject, consumer_id = request.subject, request.consumer_id
        book = ctx.book
        keys = book.keys_for(subject, request.group, consumer_id)
        now_ms = ctx.clock()
        for key in keys:
            book.seen(subject, key, consumer_id, now_ms)
        if not self._pulllog_quick_now():
            return self._ack_on_thread(request, keys, now_ms)
        acked, from_store = self._ack_io(request, keys, now_ms)
        if from_store or (acked and ctx.replica.waits()):
            return self._ack_settled(request, acked, from_store, now_ms)
        return acked

    async def _ack_on_thread(self, request: Ack, keys: list[str], now_ms: int) -> int:
        """``ack_now``'s record on the pull-log thread (busy, or its next write does I/O)."""
        acked, from_store = await self._ctx.on_pulllog_thread(self._ack_io, request, keys,
                                                              now_ms)
        return await self._ack_settled(request, acked, from_store, now_ms)

    async def _ack_settled(self, request: Ack, acked: int,
                           from_store: list[tuple[str, list[int]]], now_ms: int) -> int:
        """An ack recorded: the entries acked that were pulled before a restart traced from
        the store, then (when some became acked) the slaves a ``sync`` write waits for."""
        ctx = self._ctx
        subject, consumer_id = request.subject, request.consumer_id
        for key, seqs in from_store:
            payloads, unreadable = await ctx.on_store_thread(self._payloads_io, subject, seqs)
            ctx.tracer.acked_payloads(payloads, key, consumer_id, now_ms)
            ctx.tracer.acks_unreadable(subject, key, consumer_id, unreadable, now_ms)
        if acked:
            await ctx.actions_replicated()
        return acked

    def _ack_io(self, request: Ack, keys: list[str], now_ms: int,
                ) -> tuple[int, list[tuple[str, list[int]]]]:
        """Pull log (its thread, or the event loop while that is idle: ``ack_now``):
        record the ack in each of ``keys`` the subject has. Returns how many
        entries became acked, and per key the consumer-log sequences of acked entries pulled
        before a restart (to trace from the store)."""
        ctx = self._ctx
        pulllog, tracer = ctx.pulllog, ctx.tracer
        subject, consumer_id = request.subject, request.consumer_id
        acked = 0
        known = False
        from_store: list[tuple[str, list[int]]] = []
        for key in keys:
            if pulllog.has_group(subject, key):
                known = True
                if tracer.enabled:
                    seqs = tracer.acked(subject, key, consumer_id, request.ranges, now_ms)
                    if seqs:
                        from_store.append((key, seqs))
                acked += pulllog.record_ack(subject, key, consumer_id, request.ranges, now_ms)
        if not known:
            raise NotFound(
                f"group {request.group} has never pulled subject {subject} on broker "
                f"{ctx.config.group}"
            )
        ctx.stats["acked"] += acked
        return acked, from_store

    def _payloads_io(self, subject: str, seqs: list[int]) -> tuple[list[bytes], list[int]]:
        """Store thread: the stored payloads of ``seqs`` still readable, and the seqs not."""
        store = self._ctx.store
        out, unreadable = [], []
        for seq in seqs:
            try:
                out.append(store.read(subject, seq).payload)
            except (LogStoreError, StorageError):
                unreadable.append(seq)
        return out, unreadable

    def heartbeat(self, request: Heartbeat) -> None:
        """Keep a consumer online for the (subject, group) pairs it names."""
        book, now_ms = self._ctx.book, self._ctx.clock()
        for subject, group in request.subscriptions:
            for key in book.keys_for(subject, group, request.consumer_id):
                book.seen(subject, key, request.consumer_id, now_ms)

    # ------------------------------------------------------------------ releases

    async def leave(self, request: Leave) -> int:
        """A consumer closing: hand everything it holds of the pairs it names to the others of
        its groups now, and end its waiting long polls. Returns how many entries it released."""
        book = self._ctx.book
        consumers = [(subject, key, request.consumer_id)
                     for subject, group in request.subscriptions
                     for key in book.keys_for(subject, group, request.consumer_id)]
        book.left(consumers, asyncio.get_running_loop().time() * 1000)
        for subject, _key, _consumer_id in consumers:
            self._ctx.committed.notify(subject)  # its long polls wake and see the leave
        self._ctx.tracer.unsubscribed(consumers, self._ctx.clock(), "left")
        released = await self.release(consumers)
        if released:
            await self._ctx.actions_replicated()
        return released

    async def release(self, consumers: list[ConsumerKey]) -> int:
        """Hand what these consumers hold to the others of their groups; they are gone.
        Returns how many entries were released."""
        ctx = self._ctx
        ctx.book.forget(consumers)
        released = await ctx.on_pulllog_thread(self._remove_consumers_io, consumers, ctx.clock())
        self._after_release(released)
        return sum(released.values())

    def _remove_consumers_io(self, consumers: list[ConsumerKey],
                             now_ms: int) -> dict[Group, int]:
        """Pull-log thread: remove the consumers, their holdings going to the redelivery
        queues. Returns the entries released per group."""
        pulllog = self._ctx.pulllog
        released: dict[Group, int] = {}
        for subject, key, consumer_id in consumers:
            if not pulllog.has_group(subject, key):
                continue
            count = len(pulllog.remove_consumer(subject, key, consumer_id, now_ms))
            if count:
                released[(subject, key)] = released.get((subject, key), 0) + count
                self._prune_traced_io(subject, key)
        return released

    async def expire_now(self) -> int:
        """Release timed-out and offline consumers' entries to the others; returns how many."""
        ctx = self._ctx
        now_ms = ctx.clock()
        released, removed = await ctx.on_pulllog_thread(self._expire_io, now_ms,
                                                        ctx.book.offline_view(now_ms))
        ctx.book.forget_offline(removed)
        self._after_release(released)
        ctx.tracer.expire_subscriptions(ctx.book.last_seen(), now_ms,
                                        ctx.config.consumer_expiry_ms)
        return sum(released.values())

    def _expire_io(self, now_ms: int, offline: OfflineView,
                   ) -> tuple[dict[Group, int], list[Removed]]:
        """Pull-log thread: release entries not acked within their group's ack timeout, and
        everything held by consumers ``offline`` says are offline. Returns the entries released
        per group and the consumers removed."""
        pulllog, config = self._ctx.pulllog, self._ctx.config
        released: dict[Group, int] = {}
        removed: list[Removed] = []
        for subject, key in pulllog.groups():
            if not pulllog.held_count(subject, key):
                # Nothing held: no ack timeout to run out, no offline consumer's entries to
                # hand on. Most groups of a broker with thousands, each second (issue 19).
                continue
            group = key.split("#", 1)[0]
            count = len(pulllog.release_expired(
                subject, key, config.ack_timeout_ms_for(group), now_ms
            ))
            for consumer in pulllog.consumers(subject, key):
                if consumer.unacked_count and offline.offline(subject, key, consumer.consumer):
                    count += len(pulllog.remove_consumer(subject, key, consumer.consumer, now_ms))
                    removed.append((subject, key, consumer.consumer,
                                    offline.last_seen_ms(subject, key, consumer.consumer)))
            if count:
                released[(subject, key)] = count
                self._prune_traced_io(subject, key)
        return released, removed

    def _after_release(self, released: dict[Group, int]) -> None:
        """Entries went back to the redelivery queues of these groups: the next pulls must ask
        the pull log (not the tail), and waiting long polls wake to take them."""
        self._ctx.book.released(released)
        for subject, _key in released:
            self._ctx.committed.notify(subject)

    def _prune_traced_io(self, subject: str, key: str) -> None:
        """Pull-log thread, after a release: the tracer forgets the entries no consumer of the
        group holds any more."""
        tracer, pulllog = self._ctx.tracer, self._ctx.pulllog
        if tracer.enabled:
            for consumer_id in tracer.consumers(subject, key):
                tracer.prune(subject, key, consumer_id, {
                    e.pull_seq for e in pulllog.unacked(subject, key, consumer_id)})


__all__ = ["Holdings"]
