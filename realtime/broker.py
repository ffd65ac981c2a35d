"""The realtime broker's logic over its storage: sends with group commit, pulls with long
polling, acks, ack timeouts and consumer expiry.

Storage (``MessageStore``, ``PullLogStore``) is synchronous and single-owner, so every storage
call runs on one dedicated I/O thread (``_io``): the event loop never blocks on a read or an
fsync, and storage never sees two callers at once. Sends queue up while a commit is running and
the next commit takes them all: many sends share one fsync.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from logstore.errors import DiskFull, LogStoreError, LogWriteFailed
from logstore.fileio import Opener, OsFile
from pulllog import PullLogConfig, PullLogStore
from realtime.config import RealtimeConfig
from realtime.storage import MessageStore, StoreConfig
from sdk.errors import BadRequest, Internal, NotFound, Overloaded, QmqError, ReadOnly
from sdk.limits import MAX_BODY_BYTES, MAX_FRAME_BYTES
from sdk.message import Message, decode_message, tag_hash, validate_message
from sdk.protocol import Ack, Heartbeat, Pull

log = logging.getLogger(__name__)
T = TypeVar("T")

# A pull response stops growing at this many payload bytes so the frame stays under
# MAX_FRAME_BYTES with room for the envelope; one message always fits (bodies <= MAX_BODY_BYTES).
PULL_RESPONSE_PAYLOAD_BYTES_MAX = MAX_FRAME_BYTES - MAX_BODY_BYTES // 2

# A message stamped a little in the future is clock skew between hosts and is stored now;
# further ahead it belongs to a delay server and is refused rather than delivered early.
DELIVER_AT_SKEW_MS_MAX = 5_000


def wall_clock_ms() -> int:
    """Milliseconds since the epoch (the default clock)."""
    return time.time_ns() // 1_000_000


def group_key(group: str, consumer_id: str, broadcast: bool) -> str:
    """The pull-log group a consumer reads: broadcast consumers each get their own cursor.

    ``#`` cannot occur in a group name, so ``group#consumer`` never collides with a real group.
    """
    return f"{group}#{consumer_id}" if broadcast else group


@dataclass
class _PendingSend:
    message: Message
    payload: bytes
    future: asyncio.Future[dict[str, Any]]


class Broker:
    """One realtime broker: owns the storage of its data dir and answers the data-plane ops."""

    def __init__(
        self,
        config: RealtimeConfig,
        clock: Callable[[], int] = wall_clock_ms,
        opener: Opener = OsFile,
    ) -> None:
        self.config = config
        self.clock = clock
        self._opener = opener  # tests pass logstore.faults.FaultPlan.opener
        self.readonly = False  # set by the MetaServer (draining) or after a sticky write failure
        self.store: MessageStore | None = None
        self.pulllog: PullLogStore | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="realtime-io")
        self._pending: list[_PendingSend] = []
        self._commit_wakeup = asyncio.Event()
        self._subject_events: dict[str, asyncio.Event] = {}
        # (subject, pull-log group) -> consumer id -> last pull or heartbeat, in ms
        self._last_seen: dict[tuple[str, str], dict[str, int]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._started_ms = 0
        self.stats = {"sent": 0, "duplicates": 0, "pulled": 0, "acked": 0, "redelivered": 0}

    # ------------------------------------------------------------------ lifecycle

    async def _io(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def start(self) -> None:
        """Open (and recover) the storage, then start the background loops."""
        self._started_ms = self.clock()
        await self._io(self._open_storage, self._started_ms)
        self._tasks = [
            asyncio.create_task(self._committer(), name="realtime-committer"),
            asyncio.create_task(self._expiry_loop(), name="realtime-expiry"),
            asyncio.create_task(self._retention_loop(), name="realtime-retention"),
            # Runs in both flush modes: the pull log is always flushed asynchronously.
            asyncio.create_task(self._flush_loop(), name="realtime-flush"),
        ]

    def _open_storage(self, now_ms: int) -> None:
        cfg = self.config
        store_config = StoreConfig(
            segment_size_bytes_max=cfg.segment_size_bytes_max,
            flush_mode=cfg.flush,
            flush_interval_ms=cfg.flush_interval_ms,
            consumer_log_entries_per_file=cfg.consumer_log_entries_per_file,
            dedup_window_ms=cfg.dedup_window_ms,
            retention_ms=cfg.retention_ms,
        )
        self.store = MessageStore(cfg.data_dir, store_config, opener=self._opener, now_ms=now_ms)
        self.pulllog = PullLogStore(
            os.path.join(cfg.data_dir, "pulllog"),
            PullLogConfig(flush_interval_ms=cfg.flush_interval_ms),
        )
        log.info("storage open: %s; %s", self.store.recovery, self.pulllog.recovery)

    async def stop(self) -> None:
        """Stop the loops, commit what is queued, checkpoint and close the storage."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._pending:
            await self._commit_batch()
        await self._io(self._close_storage)
        self._executor.shutdown(wait=True)

    def _close_storage(self) -> None:
        if self.pulllog is not None:
            self.pulllog.close()
        if self.store is not None:
            self.store.close()

    # ------------------------------------------------------------------ send

    async def send(self, payloads: list[bytes]) -> list[dict[str, Any]]:
        """Validate and store a batch; each result says stored, duplicate or the error.

        Replies only once the batch is durable under the flush mode.
        """
        results: list[Any] = []
        loop = asyncio.get_running_loop()
        now_ms = self.clock()
        for payload in payloads:
            try:
                message = decode_message(payload)
                validate_message(message, allow_internal=True, now_ms=now_ms)
                if (message.deliver_at_ms or 0) > now_ms + DELIVER_AT_SKEW_MS_MAX:
                    raise BadRequest(
                        f"message {message.id} has deliver_at_ms {message.deliver_at_ms}, "
                        f"{message.deliver_at_ms - now_ms} ms ahead: send delayed messages to a "
                        "delay server"
                    )
                if self.readonly:
                    raise ReadOnly(f"broker group {self.config.group} is read-only; send elsewhere")
            except QmqError as exc:
                message_id = _peek_id(payload)
                results.append({"id": message_id, "error": exc.to_wire()})
                continue
            future: asyncio.Future[dict[str, Any]] = loop.create_future()
            self._pending.append(_PendingSend(message, payload, future))
            results.append(future)
        self._commit_wakeup.set()
        return [await r if isinstance(r, asyncio.Future) else r for r in results]

    async def _committer(self) -> None:
        while True:
            await self._commit_wakeup.wait()
            self._commit_wakeup.clear()
            if self._pending:
                await self._commit_batch()

    async def _commit_batch(self) -> None:
        batch, self._pending = self._pending, []
        try:
            outcomes = await self._io(self._append_and_commit, batch, self.clock())
        except DiskFull as exc:
            error = Overloaded(f"broker {self.config.group} disk full, send refused: {exc}")
            outcomes = [{"id": p.message.id, "error": error.to_wire()} for p in batch]
        except LogWriteFailed as exc:
            log.error("write failure, broker goes read-only until restarted: %s", exc)
            self.readonly = True
            error = Internal(f"broker {self.config.group} storage write failed: {exc}")
            outcomes = [{"id": p.message.id, "error": error.to_wire()} for p in batch]
        except Exception as exc:  # a bug: fail the batch loudly, keep the broker up
            log.exception("commit failed")
            error = Internal(f"commit failed: {type(exc).__name__}: {exc}")
            outcomes = [{"id": p.message.id, "error": error.to_wire()} for p in batch]
        subjects = set()
        for pending, outcome in zip(batch, outcomes):
            if not pending.future.done():
                pending.future.set_result(outcome)
            if outcome.get("status") == "stored":
                subjects.add(pending.message.subject)
        for subject in subjects:
            self._notify(subject)

    def _append_and_commit(self, batch: list[_PendingSend], now_ms: int) -> list[dict[str, Any]]:
        assert self.store is not None
        appended = []
        for pending in batch:
            msg = pending.message
            appended.append(
                self.store.append(
                    msg.subject, msg.id, [tag_hash(t) for t in msg.tags], now_ms, pending.payload
                )
            )
        self.store.commit()
        outcomes = []
        for result in appended:
            if result.duplicate:
                self.stats["duplicates"] += 1
                outcomes.append({"id": result.message_id, "status": "duplicate"})
            else:
                self.stats["sent"] += 1
                outcomes.append({"id": result.message_id, "status": "stored"})
        return outcomes

    # ------------------------------------------------------------------ pull

    def _event(self, subject: str) -> asyncio.Event:
        event = self._subject_events.get(subject)
        if event is None:
            event = self._subject_events[subject] = asyncio.Event()
        return event

    def _notify(self, subject: str) -> None:
        event = self._subject_events.pop(subject, None)
        if event is not None:
            event.set()

    def _touch(self, subject: str, key: str, consumer_id: str) -> None:
        self._last_seen.setdefault((subject, key), {})[consumer_id] = self.clock()

    async def pull(self, request: Pull) -> list[dict[str, Any]]:
        """Hand the group's next entries (redeliveries first) to the pulling consumer.

        With ``wait_ms`` it waits until something arrives or the wait ends (long polling).
        """
        key = group_key(request.group, request.consumer_id, request.broadcast)
        deadline = asyncio.get_running_loop().time() + request.wait_ms / 1000
        tags = frozenset(request.tags)
        while True:
            event = self._event(request.subject)
            self._touch(request.subject, key, request.consumer_id)
            messages = await self._io(self._pull_io, request, key, tags, self.clock())
            if messages:
                self._touch(request.subject, key, request.consumer_id)
                return messages
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return []
            try:
                await asyncio.wait_for(event.wait(), remaining)
            except asyncio.TimeoutError:
                return []

    def _pull_io(
        self, request: Pull, key: str, tags: frozenset[str], now_ms: int
    ) -> list[dict[str, Any]]:
        store, pulllog = self.store, self.pulllog
        assert store is not None and pulllog is not None
        subject = request.subject
        if not pulllog.has_group(subject, key):
            start = (
                store.end_sequence(subject) if request.start == "latest"
                else store.first_sequence(subject)
            )
            pulllog.ensure_group(subject, key, start, now_ms)
        chosen: list[int] = []
        payloads: dict[int, bytes] = {}
        for seq in pulllog.take_redeliveries(subject, key, request.max_count):
            try:
                payloads[seq] = store.read(subject, seq).payload
            except LogStoreError as exc:
                # Deleted by retention's hard cap or damaged: it cannot be delivered again.
                log.error("redelivery of %s seq %d impossible: %s", subject, seq, exc)
                payloads[seq] = b""
            chosen.append(seq)
        cursor = pulllog.cursor(subject, key)
        new_cursor = cursor
        remaining = request.max_count - len(chosen)
        if remaining > 0 and cursor < store.end_sequence(subject):
            start = max(cursor, store.first_sequence(subject))
            hashes = [tag_hash(t) for t in tags] if tags else None
            found, new_cursor = store.scan(subject, start, remaining, hashes)
            budget_bytes = PULL_RESPONSE_PAYLOAD_BYTES_MAX - sum(map(len, payloads.values()))
            for stored in found:
                if chosen and len(stored.payload) > budget_bytes:
                    new_cursor = stored.sequence  # the rest waits for the next pull
                    break
                if self._deliverable(stored.payload, tags, now_ms):
                    chosen.append(stored.sequence)
                    payloads[stored.sequence] = stored.payload
                    budget_bytes -= len(stored.payload)
        if not chosen and new_cursor == cursor:
            return []
        entries = pulllog.record_pull(subject, key, request.consumer_id, chosen, new_cursor, now_ms)
        out = []
        for entry in entries:
            payload = payloads[entry.consumer_log_seq]
            if not payload:
                # Not deliverable: ack it at once so it does not come back forever.
                pulllog.record_ack(subject, key, request.consumer_id,
                                   [(entry.pull_seq, entry.pull_seq)], now_ms)
                continue
            if entry.redelivered:
                self.stats["redelivered"] += 1
            out.append({"pull_seq": entry.pull_seq, "payload": payload,
                        "redelivered": entry.redelivered})
        self.stats["pulled"] += len(out)
        return out

    @staticmethod
    def _deliverable(payload: bytes, tags: frozenset[str], now_ms: int) -> bool:
        """Exact tag match (the consumer log's bloom mask is only a pre-filter) and not expired."""
        try:
            message = decode_message(payload)
        except QmqError:
            return False
        if tags and not tags.intersection(message.tags):
            return False
        if message.expire_at_ms is not None and message.expire_at_ms <= now_ms:
            return False
        return True

    # ------------------------------------------------------------------ ack / heartbeat

    async def ack(self, request: Ack) -> int:
        """Record acks of pull-log ranges; returns how many entries became acked."""
        for key in self._keys_for(request.subject, request.group, request.consumer_id):
            self._touch(request.subject, key, request.consumer_id)
        return await self._io(self._ack_io, request, self.clock())

    def _keys_for(self, subject: str, group: str, consumer_id: str) -> list[str]:
        keys = [group]
        broadcast_key = group_key(group, consumer_id, True)
        if (subject, broadcast_key) in self._last_seen:
            keys.append(broadcast_key)
        return keys

    def _ack_io(self, request: Ack, now_ms: int) -> int:
        assert self.pulllog is not None
        acked = 0
        known = False
        for key in self._keys_for(request.subject, request.group, request.consumer_id):
            if self.pulllog.has_group(request.subject, key):
                known = True
                acked += self.pulllog.record_ack(
                    request.subject, key, request.consumer_id, request.ranges, now_ms
                )
        if not known:
            raise NotFound(
                f"group {request.group} has never pulled subject {request.subject} on broker "
                f"{self.config.group}"
            )
        self.stats["acked"] += acked
        return acked

    def heartbeat(self, request: Heartbeat) -> None:
        """Keep a consumer online for the (subject, group) pairs it names."""
        for subject, group in request.subscriptions:
            for key in self._keys_for(subject, group, request.consumer_id):
                self._touch(subject, key, request.consumer_id)

    # ------------------------------------------------------------------ background loops

    async def _expiry_loop(self) -> None:
        interval_s = self.config.expiry_check_interval_ms / 1000
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.expire_now()
            except Exception:
                log.exception("expiry check failed")

    async def expire_now(self) -> int:
        """Release timed-out and offline consumers' entries to the others; returns how many."""
        released_by_subject = await self._io(self._expire_io, self.clock())
        for subject in released_by_subject:
            self._notify(subject)
        return sum(released_by_subject.values())

    def _expire_io(self, now_ms: int) -> dict[str, int]:
        pulllog = self.pulllog
        assert pulllog is not None
        released: dict[str, int] = {}
        for subject, key in pulllog.groups():
            group = key.split("#", 1)[0]
            count = len(pulllog.release_expired(
                subject, key, self.config.ack_timeout_ms_for(group), now_ms
            ))
            seen = self._last_seen.get((subject, key), {})
            for consumer in pulllog.consumers(subject, key):
                last_ms = seen.get(consumer.consumer, self._started_ms)
                if now_ms - last_ms > self.config.consumer_expiry_ms and consumer.unacked_count:
                    count += len(pulllog.remove_consumer(subject, key, consumer.consumer, now_ms))
                    seen.pop(consumer.consumer, None)
            if count:
                released[subject] = released.get(subject, 0) + count
        return released

    async def _flush_loop(self) -> None:
        interval_s = self.config.flush_interval_ms / 1000
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self._io(self._tick_io, self.clock())
            except Exception:
                log.exception("async flush failed")

    def _tick_io(self, now_ms: int) -> None:
        assert self.store is not None and self.pulllog is not None
        self.store.tick(now_ms)
        self.pulllog.tick(now_ms)

    async def _retention_loop(self) -> None:
        interval_s = self.config.retention_check_interval_ms / 1000
        while True:
            await asyncio.sleep(interval_s)
            try:
                report = await self._io(self._retention_io, self.clock())
                if report:
                    log.info("retention: %s", report)
            except Exception:
                log.exception("retention failed")

    def _retention_io(self, now_ms: int) -> Any:
        assert self.store is not None and self.pulllog is not None
        keep: dict[str, int] = {}
        for subject, key in self.pulllog.groups():
            needed = self.pulllog.lowest_needed_sequence(subject, key)
            keep[subject] = min(keep.get(subject, needed), needed)
        return self.store.apply_retention(now_ms, keep)

    # ------------------------------------------------------------------ reporting

    async def backlog(self) -> list[dict[str, Any]]:
        """Per (subject, group): messages not yet acked (lag) and consumers holding entries."""
        return await self._io(self._backlog_io)

    def _backlog_io(self) -> list[dict[str, Any]]:
        store, pulllog = self.store, self.pulllog
        assert store is not None and pulllog is not None
        rows = []
        for subject, key in pulllog.groups():
            if key.startswith("%"):
                continue  # a reserved group (realtime.admin's %admin watermark), not consumers
            end = store.end_sequence(subject)
            lag = max(0, end - pulllog.cursor(subject, key))
            lag += pulllog.held_count(subject, key) + pulllog.redelivery_count(subject, key)
            consumers = len(self._last_seen.get((subject, key), {}))
            rows.append({"subject": subject, "group": key.split("#", 1)[0], "lag": lag,
                         "consumers": consumers})
        return rows


def _peek_id(payload: bytes) -> str:
    """The message id of an undecodable payload, if it can be read at all (for error results)."""
    try:
        import msgpack

        data = msgpack.unpackb(payload, raw=False)
        value = data.get("i") if isinstance(data, dict) else None
        return value if isinstance(value, str) else ""
    except Exception:
        return ""


__all__ = ["Broker", "group_key", "wall_clock_ms"]
