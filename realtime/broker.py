"""The realtime broker: its two stores, each on its own I/O thread, and the parts that answer
the data-plane ops over them.

Storage is synchronous and single-owner, so each store has one dedicated I/O thread: the
``MessageStore`` is only ever called on the store thread, the ``PullLogStore`` only on the
pull-log thread, except that a pull or an ack that only records in memory is made on the event
loop while the pull-log thread is idle (``Broker.on_pulllog_quick``, or a caller that asked
``_pulllog_quick_now`` first: a direct pull, an ack; it saves two thread hand-offs, the larger
part of such a call's CPU). The event loop never blocks on a read or an
fsync, no store sees two callers at once, and a pull or an ack never queues behind the fsync of
a group commit. ``Broker.open`` opens
(and recovers) both stores on their threads before anything that uses them is built.

The parts, each in its own module, share what the event loop knows:

- ``Sends`` (``realtime.sends``): checks, group commit (``serverkit.committer``), publishing;
- ``Pulls`` (``realtime.pulls``): pulls and long polls, from the tail or the store;
- ``Holdings`` (``realtime.holdings``): acks, heartbeats, leaves, ack timeouts and expiry;
- ``Committed`` (``realtime.committed``): committed ends and firsts per subject, the in-memory
  tail of recent messages (``TAIL_BYTES_MAX``) and the long polls' wake-ups;
- ``ConsumerBook`` (``realtime.consumers``): presence, leaves and known cursors, a pure class
  told the time.

The broker itself runs the background loops (expiry, retention, the asynchronous flush) and
reports the backlog.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Coroutine

from logstore.fileio import Opener, OsFile
from pulllog import PullLogConfig, PullLogStore
from realtime.committed import Committed
from realtime.config import RealtimeConfig
from realtime.consumers import ConsumerBook
from realtime.context import BrokerContext
from realtime.handoffs import Handoffs
from realtime.holdings import Holdings
from realtime.pulls import Connection, ParkedPull, Pulled, Pulls
from realtime.sends import SendRequest, Sends
from realtime.storage import MessageStore, StoreConfig
from realtime.tail import Tail
from realtime.tracing import BrokerTracer
from serverkit.io_thread import IoThread
from serverkit.open_files import files_cached_budget
from serverkit.periodic import run_every
from serverkit.write_replication import NoWriteReplication, WriteReplication
from wire.clock import wall_clock_ms
from wire.protocol import Ack, Heartbeat, Leave, Pull

log = logging.getLogger(__name__)

# Payload bytes of recently committed messages kept in memory for pulls (all subjects).
TAIL_BYTES_MAX = 64 << 20
# Under flush=sync the message store's ``tick`` only prunes the dedup index, which frees memory
# and nothing else (a lookup checks the window itself): the flush round asks it this often
# rather than every round, one store-thread hop a second instead of ten (issue 18: idle CPU).
SYNC_STORE_TICK_INTERVAL_MS = 1_000


@dataclass(frozen=True)
class OpenStores:
    """The broker's two stores, open and recovered, each with the one thread it is called on,
    and what the message store held when it opened."""

    store: MessageStore  # called on store_thread only
    store_thread: IoThread
    pulllog: PullLogStore  # called on pulllog_thread, or on the loop while it is idle (quick)
    pulllog_thread: IoThread
    opened_at_ms: int  # the broker's clock when the stores were opened
    ends: dict[str, int]  # subject -> sequence after its last stored message
    firsts: dict[str, int]  # subject -> its first sequence retention kept


def _open_store_io(config: RealtimeConfig, opener: Opener, now_ms: int,
                   ) -> tuple[MessageStore, dict[str, int], dict[str, int]]:
    """Store thread: open (and recover) the message store; its end and first sequences."""
    store = MessageStore(config.data_dir, StoreConfig(
        segment_size_bytes_max=config.segment_size_bytes_max,
        flush_mode=config.flush,
        flush_interval_ms=config.flush_interval_ms,
        consumer_log_entries_per_file=config.consumer_log_entries_per_file,
        consumer_log_files_open_max=(config.consumer_log_files_open_max
                                     or files_cached_budget()),
        dedup_window_ms=config.dedup_window_ms,
        retention_ms=config.retention_ms,
        held_messages_max=config.held_messages_max,
        preallocate_step_bytes=config.preallocate_step_bytes,
    ), opener=opener, now_ms=now_ms)
    log.info("message store open: %s", store.recovery)
    return store, store.end_sequences(), _first_sequences(store)


def _first_sequences(store: MessageStore) -> dict[str, int]:
    """Store thread: the first sequence retention kept, per subject."""
    return {subject: store.first_sequence(subject) for subject in store.subjects()}


def _open_pulllog_io(config: RealtimeConfig, follower: bool) -> PullLogStore:
    """Pull-log thread: open (and replay) the pull log (as a copy that writes nothing until it
    is promoted, when ``follower``)."""
    pulllog = PullLogStore(os.path.join(config.data_dir, "pulllog"),
                           PullLogConfig(flush_interval_ms=config.flush_interval_ms),
                           follower=follower)
    log.info("pull log open: %s", pulllog.recovery)
    return pulllog


class Broker:
    """One realtime broker: owns the storage of its data dir and answers the data-plane ops.

    Made by ``await Broker.open(...)``, ended by ``await stop()``. Owners:

    - event loop: ``committed``, ``book``, the parts' state (their docstrings say which), the
      background tasks;
    - store thread: ``store`` (only ever called there, through ``on_store_thread``);
    - pull-log thread: ``pulllog`` (only through ``on_pulllog_thread``, or ``on_pulllog_quick``,
      which makes a call that only records in memory on the event loop while the thread is
      idle, as a direct pull does under the same test (``_pulllog_quick_now``), and the flush
      round's reads while the thread is idle: one call at a time, in submission order);
    - ``stats``: one writer per key: ``sent``/``duplicates`` the store thread,
      ``pulled``/``redelivered``/``acked`` the pull log's calls; metrics read it at scrape time
      (an int read is atomic);
    - ``redelivered_by_group``: (subject, pull-log group) -> entries handed out again since
      start: the pull log's calls write it (``Pulls``) and read it (``_backlog_io``).

    Methods ending in ``_io`` run on the I/O thread their first docstring line names; every
    other one on the event loop.
    """

    def __init__(self, config: RealtimeConfig, clock: Callable[[], int], stores: OpenStores,
                 tracer: BrokerTracer, replica: WriteReplication | None = None) -> None:
        self.config = config
        self.clock = clock
        self.store = stores.store
        self.pulllog = stores.pulllog
        self._store_thread = stores.store_thread
        self._pulllog_thread = stores.pulllog_thread
        # Runners: ``await broker.on_store_thread(fn, *args)`` is fn(*args) on the store thread.
        self.on_store_thread = stores.store_thread.call
        self.on_pulllog_thread = stores.pulllog_thread.call
        self._tracer = tracer
        self._store_ticked_ms: int | None = None  # the flush round's last store tick (sync)
        self.stats = {"sent": 0, "duplicates": 0, "pulled": 0, "acked": 0, "redelivered": 0}
        self.redelivered_by_group: dict[tuple[str, str], int] = {}
        self.committed = Committed(Tail(TAIL_BYTES_MAX), stores.ends, stores.firsts)
        self.book = ConsumerBook(stores.opened_at_ms, config.consumer_expiry_ms)
        self.replica = replica or NoWriteReplication()
        ctx = BrokerContext(config, clock, self.store, self.pulllog, self.on_store_thread,
                            self.on_pulllog_thread, self.on_pulllog_quick, self.committed,
                            self.book, tracer, self.stats, self.redelivered_by_group,
                            self.replica, stores.store_thread.submit,
                            stores.store_thread.submit_then)
        self._ctx = ctx
        self.sends = Sends(ctx)
        self.handoffs = Handoffs(ctx, lambda: self.sends.readonly, self.sends._go_readonly)
        self.holdings = Holdings(ctx, self._pulllog_quick_now)
        self.pulls = Pulls(ctx, self.holdings.release, self._pulllog_quick_now)
        self._tasks: list[asyncio.Task[None]] = []

    async def on_pulllog_quick(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the pull log, for a call that only records in memory (a pull served
        from the tail): here on the event loop when the pull-log thread is idle (it then
        runs after every call submitted before it and beside none) and the pull log's next
        write does no I/O (``PullLogStore.writes_stay_in_memory``); else on the thread. A hop to
        the thread and back costs more CPU than such a call (issue 18: one of each per message
        at low rates)."""
        if self._pulllog_thread.idle() and self.pulllog.writes_stay_in_memory():
            return fn(*args)
        return await self.on_pulllog_thread(fn, *args)

    def _pulllog_quick_now(self) -> bool:
        """Whether ``on_pulllog_quick`` called now would run its call here on the loop: a
        direct pull (``Pulls``) and an ack (``Holdings.ack_now``) ask it, then make their
        pull-log call here with no coroutine, or go on in one to the thread."""
        return self._pulllog_thread.idle() and self.pulllog.writes_stay_in_memory()

    @classmethod
    async def open(cls, config: RealtimeConfig, clock: Callable[[], int] = wall_clock_ms,
                   opener: Opener = OsFile, tracer: BrokerTracer | None = None,
                   replica: WriteReplication | None = None, follower: bool = False) -> Broker:
        """Open (and recover) both stores on their threads, build the broker over them and
        start its background loops. ``opener``: tests pass ``logstore.faults.FaultPlan.opener``;
        ``tracer``: the server's, with its ``TraceWriter`` (default: tracing off);
        ``replica``: the sync waits of a replicated group; ``follower``: open as a copy that
        writes nothing until ``promote`` (a server whose role the MetaServer decides)."""
        store_thread = IoThread("realtime-store-io")
        pulllog_thread = IoThread("realtime-pulllog-io")
        store: MessageStore | None = None
        pulllog: PullLogStore | None = None
        try:
            opened_at_ms = clock()
            store, ends, firsts = await store_thread.call(_open_store_io, config, opener,
                                                          opened_at_ms)
            pulllog = await pulllog_thread.call(_open_pulllog_io, config, follower)
            broker = cls(config, clock, OpenStores(store, store_thread, pulllog, pulllog_thread,
                                                   opened_at_ms, ends, firsts),
                         tracer or BrokerTracer(None), replica)
            if not follower:
                await broker.on_pulllog_thread(broker._seed_tracer_io)
            await broker.on_store_thread(broker._tracer.name_from_store, broker._read_payload_io)
        except BaseException:
            if pulllog is not None:
                await pulllog_thread.call(pulllog.close)
            if store is not None:
                await store_thread.call(store.close)
            pulllog_thread.close()
            store_thread.close()
            raise
        if not follower:
            await broker.handoffs.load()
        broker._start_rounds(master=not follower)
        return broker

    def _start_rounds(self, master: bool) -> None:
        """Start the background rounds: a copy's (the asynchronous flush, retention), and a
        master's on top (the committer, the expiry of consumers and ack timeouts, which write
        to the pull log)."""
        config = self.config
        self._tasks = [
            asyncio.create_task(run_every(config.retention_check_interval_ms,
                                          self._retention_round, log, "retention"),
                                name="realtime-retention"),
            # Runs in both flush modes: the pull log is always flushed asynchronously.
            asyncio.create_task(run_every(config.flush_interval_ms, self._flush_round, log,
                                          "async flush"), name="realtime-flush"),
        ]
        if master:
            self._tasks += [
                asyncio.create_task(self.sends.commits.run(), name="realtime-committer"),
                asyncio.create_task(self.handoffs.run(), name="realtime-held"),
                asyncio.create_task(run_every(config.expiry_check_interval_ms, self.expire_now,
                                              log, "expiry check"), name="realtime-expiry"),
            ]

    async def _stop_rounds(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def promote(self) -> None:
        """A copy becomes the master (docs/REPLICATION.md 8.5): the pull log starts writing (a
        new pull-seq epoch unless the copy ended with a clean close), the event loop's view of
        what is committed and who consumes is taken afresh from the stores, and the master's
        rounds start. Consumers' held entries stay held and come back after the ack timeout or
        the consumer expiry, counted from now."""
        await self._stop_rounds()
        await self.on_pulllog_thread(self.pulllog.promote)
        ends, firsts = await self.on_store_thread(
            lambda: (self.store.end_sequences(), _first_sequences(self.store)))
        self.committed.restart(ends, firsts)
        self.book.restart(self.clock())
        await self.on_pulllog_thread(self._seed_tracer_io)
        # As at a start: what consumers held is named from the copy's records, so a later
        # ack or an unreadable redelivery of it is traced by message id.
        await self.on_store_thread(self._tracer.name_from_store, self._read_payload_io)
        self.handoffs.forget()
        await self.handoffs.load()  # what the copy holds: made visible on time from now on
        self._start_rounds(master=True)

    async def demote(self) -> None:
        """The master steps down (writes are refused already): what is queued is committed
        (its senders are refused: it was never replicated), long polls end, the pull log
        becomes a copy and only the copy's rounds go on."""
        await self._stop_rounds()
        await self.sends.commits.commit_pending()
        self.committed.end_long_polls()
        await self.on_pulllog_thread(self.pulllog.demote)
        self.handoffs.forget()
        self._start_rounds(master=False)

    def _seed_tracer_io(self) -> None:
        """Pull-log thread: tell the tracer what consumers held before this start (their acks
        are traced later)."""
        pulllog, tracer = self.pulllog, self._tracer
        if not tracer.enabled:
            return
        for subject, key in pulllog.groups():
            for consumer in pulllog.consumers(subject, key):
                if consumer.unacked_count:
                    tracer.held_before_restart(subject, key, consumer.consumer, {
                        e.pull_seq: e.consumer_log_seq
                        for e in pulllog.unacked(subject, key, consumer.consumer)})
            queued = pulllog.redelivery_count(subject, key)
            if queued:
                tracer.queued_before_restart(
                    subject, key, pulllog.take_redeliveries(subject, key, queued))

    def _read_payload_io(self, subject: str, seq: int) -> bytes:
        """Store thread: one stored payload (raises LogStoreError when it cannot be read)."""
        return self.store.read(subject, seq).payload

    def end_long_polls(self) -> None:
        """Answer every waiting long poll now (with what is there, often nothing) instead of
        at its deadline, so a shutdown does not wait out consumers' ``wait_ms``."""
        self.committed.end_long_polls()

    async def stop(self) -> None:
        """Stop the loops, commit what is queued, checkpoint and close the storage."""
        await self._stop_rounds()
        if not self.pulllog.follower:
            await self.sends.commits.commit_pending()
        await self.on_pulllog_thread(self.pulllog.close)
        await self.on_store_thread(self.store.close)
        self._pulllog_thread.close()
        self._store_thread.close()

    # ------------------------------------------------------------------ the data-plane ops

    async def send(self, payloads: list[bytes], compact: bool = False
                   ) -> list[dict[str, Any]] | int:
        """Validate and store a batch (``Sends.send``); answered once durable."""
        return await self.sends.send(payloads, compact)

    def send_soon(self, payloads: list[bytes], compact: bool,
                  done: Callable[[SendRequest], None]
                  ) -> SendRequest | list[dict[str, Any]]:
        """``send`` answered by callback, with no task (``Sends.send_soon``): the request
        queued, or the results when nothing is valid."""
        return self.sends.send_soon(payloads, compact, done)

    async def hold(self, payloads: list[bytes], visible_at_ms: list[int]
                   ) -> list[dict[str, Any]]:
        """Store messages held until their visible times (``Handoffs.hold``)."""
        return await self.handoffs.hold(payloads, visible_at_ms)

    async def cancel_held(self, subject: str, message_ids: list[str]
                          ) -> tuple[list[bool], list[bool]]:
        """Drop held messages by id: (dropped now, dropped before) per id
        (``Handoffs.cancel``)."""
        return await self.handoffs.cancel(subject, message_ids)

    def pull(self, request: Pull, connection: Connection | None = None,
             direct: bool = False) -> Coroutine[Any, Any, Pulled | ParkedPull]:
        """Hand the group's next entries to the pulling consumer (``Pulls.pull``; with
        ``direct``, a long poll that waits is parked with no task and returned). Its coroutine
        itself, to await: no second coroutine per pull to step (issue 18)."""
        return self.pulls.pull(request, connection, direct)

    async def ack(self, request: Ack) -> int:
        """Record acks of pull-log ranges (``Holdings.ack``); returns how many became acked."""
        return await self.holdings.ack(request)

    def heartbeat(self, request: Heartbeat) -> None:
        """Keep a consumer online for the (subject, group) pairs it names."""
        self.holdings.heartbeat(request)

    async def actions_replicated(self) -> None:
        """Wait until the slaves a ``sync`` write waits for have every pull-log action so far
        (after an ack, a nack, a leave)."""
        await self._ctx.actions_replicated()

    async def settle(self) -> None:
        """A master handing over: every pull-log action so far readable by the slaves'
        fetches (the message log is: a send is answered after its commit)."""
        await self._ctx.actions_flushed()

    async def leave(self, request: Leave) -> int:
        """A consumer closing: release what it holds now (``Holdings.leave``)."""
        return await self.holdings.leave(request)

    async def expire_now(self) -> int:
        """Release timed-out and offline consumers' entries to the others; returns how many."""
        return await self.holdings.expire_now()

    def keys_for(self, subject: str, group: str, consumer_id: str) -> list[str]:
        """The pull-log groups an ack or nack of ``group`` by this consumer may mean."""
        return self.book.keys_for(subject, group, consumer_id)

    # ------------------------------------------------------------------ what the server reads

    @property
    def tracer(self) -> BrokerTracer:
        """The tracer given to ``open`` (fixed for the broker's life)."""
        return self._tracer

    @property
    def readonly(self) -> bool:
        """Sends are refused: the MetaServer drains the group, or a sticky write failure."""
        return self.sends.readonly

    @readonly.setter
    def readonly(self, value: bool) -> None:
        self.sends.readonly = value

    @property
    def write_failed(self) -> bool:
        """A sticky write failure happened: read-only until restarted."""
        return self.sends.write_failed

    @property
    def on_commit(self) -> Callable[[int], None] | None:
        """Told each group commit's message count (a metrics histogram)."""
        return self.sends.on_commit

    @on_commit.setter
    def on_commit(self, callback: Callable[[int], None] | None) -> None:
        self.sends.on_commit = callback

    @property
    def sent_by_subject(self) -> dict[str, list[int]]:
        """[messages, payload bytes] stored per subject (metrics)."""
        return self.sends.sent_by_subject

    @property
    def message_errors(self) -> dict[str, int]:
        """Messages of send batches refused, per error code (metrics)."""
        return self.sends.message_errors

    @property
    def waiting_pulls(self) -> int:
        """Long polls waiting now (metrics)."""
        return self.pulls.waiting_pulls

    # ------------------------------------------------------------------ background rounds

    async def _flush_round(self) -> None:
        """The asynchronous flush: each store's ``tick`` on its thread (a failure of one does
        not keep the other from its flush); the slaves' long polls on the pull log wake.
        Under flush=sync the message store's tick (its dedup pruning) runs every
        SYNC_STORE_TICK_INTERVAL_MS only, and the pull log's tick and its end for the slaves
        are one call on its thread, and none when that thread is idle with nothing to flush
        (``PullLogStore.tick_is_idle``; its end, for the slaves, is then read here): an idle
        server's round makes no hop (issue 18: idle CPU)."""
        now_ms = self.clock()
        last = self._store_ticked_ms
        if (self.store.config.flush_mode != "sync" or last is None
                or not 0 <= now_ms - last < SYNC_STORE_TICK_INTERVAL_MS):
            self._store_ticked_ms = now_ms
            try:
                await self.on_store_thread(self.store.tick, now_ms)
            except Exception:
                log.exception("async flush of the message store failed")
        replicating = self.replica.replicating
        if self._pulllog_thread.idle() and self.pulllog.tick_is_idle():
            end = self._pulllog_end(replicating)
        else:
            end = await self.on_pulllog_thread(self._pulllog_flush_io, now_ms, replicating)
        if end is not None:
            self.replica.advanced("actions", end)

    def _pulllog_flush_io(self, now_ms: int, replicating: bool) -> int | None:
        """Pull-log thread: the flush round's tick (a failure is logged, and the end is still
        told); the pull log's end when a master's slaves copy it, else None."""
        try:
            self.pulllog.tick(now_ms)
        except Exception:
            log.exception("async flush of the pull log failed")
        return self._pulllog_end(replicating)

    def _pulllog_end(self, replicating: bool) -> int | None:
        """The pull log's end when a master's slaves copy it, else None (its thread, or the
        loop while that thread is idle)."""
        if replicating and not self.pulllog.follower:
            return self.pulllog.copy_bounds()[1]
        return None

    async def _retention_round(self) -> None:
        """Delete what every pull-log group is past and retention lets go."""
        keep = await self.on_pulllog_thread(self._retention_keep_io)
        now_ms = self.clock()
        report, firsts = await self.on_store_thread(self._retention_io, now_ms, keep)
        self.committed.retained(firsts)
        if report:
            log.info("retention: %s", report)
        if report.unconsumed_deleted:  # a give-up: traced with its reason
            log.error("retention's hard cap deleted %d messages a consumer group had not "
                      "consumed", report.unconsumed_deleted)
            self._tracer.retention_deleted(report.unconsumed_deleted, report.unconsumed_names,
                                          now_ms, report.unconsumed_unnamed)
        if report.held_deleted:  # a give-up: traced with its reason
            log.error("retention's hard cap deleted %d held messages before they were "
                      "visible", len(report.held_deleted))
            self._tracer.held_deleted(report.held_deleted, now_ms)

    def _retention_keep_io(self) -> dict[str, int]:
        """Pull-log thread: per subject, the lowest sequence some pull-log group still needs."""
        pulllog = self.pulllog
        keep: dict[str, int] = {}
        for subject, key in pulllog.groups():
            needed = pulllog.lowest_needed_sequence(subject, key)
            keep[subject] = min(keep.get(subject, needed), needed)
        return keep

    def _retention_io(self, now_ms: int, keep: dict[str, int]) -> tuple[Any, dict[str, int]]:
        """Store thread: apply retention, keeping what ``keep`` says is needed; the report and
        the first sequences after it."""
        name = self._tracer.members_of if self._tracer.enabled else None
        report = self.store.apply_retention(now_ms, keep, name)
        return report, _first_sequences(self.store)

    # ------------------------------------------------------------------ reporting

    async def backlog(self) -> list[dict[str, Any]]:
        """Per (subject, group): messages not yet acked (lag), consumers the broker knows, and
        entries handed out again since start (``redelivered``)."""
        return await self.on_pulllog_thread(self._backlog_io, dict(self.committed.ends),
                                            self.book.consumer_counts())

    def _backlog_io(self, ends: dict[str, int],
                    consumers: dict[tuple[str, str], int]) -> list[dict[str, Any]]:
        """Pull-log thread: the backlog rows, from the ends and consumer counts the event loop
        knew when it asked."""
        pulllog = self.pulllog
        rows = []
        for subject, key in pulllog.groups():
            if key.startswith("%"):
                continue  # a reserved group (realtime.admin's %admin watermark), not consumers
            lag = max(0, ends.get(subject, 0) - pulllog.cursor(subject, key))
            lag += pulllog.held_count(subject, key) + pulllog.redelivery_count(subject, key)
            rows.append({"subject": subject, "group": key.split("#", 1)[0], "lag": lag,
                         "consumers": consumers.get((subject, key), 0),
                         "redelivered": self.redelivered_by_group.get((subject, key), 0)})
        return rows


__all__ = ["Broker", "OpenStores", "TAIL_BYTES_MAX"]
