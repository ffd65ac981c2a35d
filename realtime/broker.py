"""The realtime broker's logic over its storage: sends with group commit, pulls with long
polling, acks, ack timeouts and consumer expiry.

Storage is synchronous and single-owner, so each store has one dedicated I/O thread: the
``MessageStore`` is only ever called on the store thread, the ``PullLogStore`` only on the
pull-log thread. The event loop never blocks on a read or an fsync, no store sees two callers,
and a pull or an ack never queues behind the fsync of a group commit. Sends queue up while a
commit is running and the next commit takes them all: many sends share one fsync.

Messages just committed are also kept in a bounded in-memory tail (``TAIL_BYTES_MAX``) with the
tags and expiry decoded at send time, so a consumer that keeps up is served from memory: a pull
asks the pull-log thread for its group's cursor, takes the entries from the tail, and records
them on the pull-log thread. Only a consumer behind the tail (or a redelivery of an old message)
reads the message store.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from itertools import chain
from operator import itemgetter
from typing import Any, Awaitable, Callable, NamedTuple, Sequence, TypeVar

from logstore.errors import LogStoreError
from logstore.fileio import Opener, OsFile
from pulllog import PullLogConfig, PullLogStore
from realtime.config import RealtimeConfig
from realtime.tracing import BrokerTracer
from serverkit.committer import GroupCommitter
from serverkit.io_thread import IoThread
from serverkit.send_check import Checked, QuickCheck
from realtime.storage import MessageStore, StoreConfig
from realtime.tail import Entry, Tail
from wire.errors import BadRequest, NotFound, QmqError, ReadOnly
from wire.limits import MAX_BODY_BYTES, MAX_FRAME_BYTES, MAX_PULL_WAIT_MS
from wire.message import (
    KEY_EXPIRE_AT_MS,
    ORIGIN_ID_PROPERTY,
    decode_message,
    peek_message_id,
    tag_hash,
    validate_message,
)
from wire.clock import wall_clock_ms
from wire.protocol import (
    Ack,
    Heartbeat,
    Leave,
    Pull,
    send_result_error,
    send_result_ok,
    send_results_stored,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

# A pull response stops growing at this many payload bytes so the frame stays under
# MAX_FRAME_BYTES with room for the envelope; one message always fits (bodies <= MAX_BODY_BYTES).
PULL_RESPONSE_PAYLOAD_BYTES_MAX = MAX_FRAME_BYTES - MAX_BODY_BYTES // 2

# A message stamped a little in the future is clock skew between hosts and is stored now;
# further ahead it belongs to a delay server and is refused rather than delivered early.
DELIVER_AT_SKEW_MS_MAX = 5_000

# Payload bytes of recently committed messages kept in memory for pulls (all subjects).
TAIL_BYTES_MAX = 64 << 20

# Consumer-log entries one pull looks at (after tag and expiry filtering) before it answers.
PULL_SCAN_ENTRIES_MAX = 10_000

# The msgpack bytes the payload key KEY_EXPIRE_AT_MS (one byte, "x") can take: a fixstr of 1
# byte, as our encoder writes it (b"\xa1x"), or a str 8/16/32 of length 1 from another encoder
# (msgpack allows each), which all end in b"\x01x". A payload that contains none of them has no
# expiry, so a pull without tags need not decode it.
_EXPIRE_KEY = b"\xa1" + KEY_EXPIRE_AT_MS.encode()
_EXPIRE_KEY_LONGHAND_END = b"\x01" + KEY_EXPIRE_AT_MS.encode()
_EXPIRE_KEYS_LONGHAND = tuple(kind + _EXPIRE_KEY_LONGHAND_END
                              for kind in (b"\xd9", b"\xda\x00", b"\xdb\x00\x00\x00"))


def _may_expire(payload: bytes) -> bool:
    """False only when ``payload`` certainly has no expire_at_ms (no encoding of its key)."""
    # Every longhand form ends alike: one search rules them all out in the usual case.
    return _EXPIRE_KEY in payload or (
        _EXPIRE_KEY_LONGHAND_END in payload and any(key in payload for key in _EXPIRE_KEYS_LONGHAND))


class Pulled(NamedTuple):
    """What a pull hands out, as the columns of the pull response (docs/PROTOCOL.md): entry i
    is ``payloads[i]`` under pull seq ``pull_seqs[i]``, handed out ``redelivered[i]`` times
    before."""

    pull_seqs: Sequence[int]
    payloads: Sequence[bytes]
    redelivered: Sequence[int]


NOTHING_PULLED = Pulled((), (), ())


def group_key(group: str, consumer_id: str, broadcast: bool) -> str:
    """The pull-log group a consumer reads: broadcast consumers each get their own cursor.

    ``#`` cannot occur in a group name, so ``group#consumer`` never collides with a real group.
    """
    return f"{group}#{consumer_id}" if broadcast else group


@dataclass
class _SendRequest:
    """One ``send`` request's valid messages, waiting for the next group commit."""

    messages: list[Checked]
    payloads: list[bytes]
    slots: list[int] | None  # index in ``results`` of each message; None: all of them, in order
    results: list[Any]
    future: asyncio.Future[None]


# Columns of a batch of Checked tuples, taken by ``map`` in C rather than a loop per message.
_ids_of = itemgetter(0)
_subjects_of = itemgetter(1)
_tags_of = itemgetter(2)
_expiries_of = itemgetter(3)


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
        self.write_failed = False  # a sticky write failure: read-only until restarted
        self.store: MessageStore | None = None
        self.pulllog: PullLogStore | None = None
        self._store_thread = IoThread("realtime-store-io")
        self._pull_thread = IoThread("realtime-pulllog-io")
        self._quick_check = QuickCheck()
        self._commits: GroupCommitter[_SendRequest, list[int | None]] = GroupCommitter(
            f"broker group {config.group}", self._commit_io_call, self._publish_committed,
            self._fail_batch, self._go_readonly)
        self._subject_events: dict[str, asyncio.Event] = {}
        # (subject, pull-log group) -> consumer id -> last pull or heartbeat, in ms
        self._last_seen: dict[tuple[str, str], dict[str, int]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._started_ms = 0
        self._stopping = False  # end_long_polls() was called: waiting pulls answer at once
        # The event loop's view of the store: committed end and first sequence per subject.
        self._ends: dict[str, int] = {}
        self._firsts: dict[str, int] = {}
        self._tail = Tail(TAIL_BYTES_MAX)
        # Pulls of one (subject, pull-log group) run one at a time: cursor -> entries -> record.
        self._group_locks: dict[tuple[str, str], asyncio.Lock] = {}
        # The group's cursor after its last pull, while its redelivery queue is known empty: a
        # pull then takes from the tail and records in one trip to the pull-log thread, or
        # answers without any when cursor == end.
        self._known_cursors: dict[tuple[str, str], int] = {}
        self._release_rounds = 0  # expiry rounds that released something; see _pull_once
        # (subject, pull-log group, consumer id) -> event-loop time of its last leave: a long
        # poll that began before it ends empty instead of taking entries for a consumer that is
        # gone. Forgotten once no pull can be that old (MAX_PULL_WAIT_MS).
        self._left_at_s: dict[tuple[str, str, str], float] = {}
        self.stats = {"sent": 0, "duplicates": 0, "pulled": 0, "acked": 0, "redelivered": 0}
        # For metrics, read at scrape time: [messages, payload bytes] stored per subject (counted
        # per commit and subject, not per message), messages refused per error code, long polls
        # waiting now, and a callback told each group commit's message count.
        self.sent_by_subject: dict[str, list[int]] = {}
        self.message_errors: dict[str, int] = {}
        self.waiting_pulls = 0
        self.on_commit: Callable[[int], None] | None = None
        self.tracer = BrokerTracer(None)  # the server installs one with its TraceWriter

    # ------------------------------------------------------------------ lifecycle

    async def _store_io(self, fn: Callable[..., T], *args: Any) -> T:
        return await self._store_thread.call(fn, *args)

    async def _pulllog_io(self, fn: Callable[..., T], *args: Any) -> T:
        return await self._pull_thread.call(fn, *args)

    async def start(self) -> None:
        """Open (and recover) the storage, then start the background loops."""
        self._started_ms = self.clock()
        self._ends, self._firsts = await self._store_io(self._open_store, self._started_ms)
        await self._pulllog_io(self._open_pulllog)
        await self._pulllog_io(self._seed_tracer_io)
        await self._store_io(self.tracer.name_from_store, self._read_payload_io)
        self._tasks = [
            asyncio.create_task(self._commits.run(), name="realtime-committer"),
            asyncio.create_task(self._expiry_loop(), name="realtime-expiry"),
            asyncio.create_task(self._retention_loop(), name="realtime-retention"),
            # Runs in both flush modes: the pull log is always flushed asynchronously.
            asyncio.create_task(self._flush_loop(), name="realtime-flush"),
        ]

    def _open_store(self, now_ms: int) -> tuple[dict[str, int], dict[str, int]]:
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
        log.info("message store open: %s", self.store.recovery)
        return self._sequences_io()

    def _sequences_io(self) -> tuple[dict[str, int], dict[str, int]]:
        store = self.store
        assert store is not None
        return store.end_sequences(), {s: store.first_sequence(s) for s in store.subjects()}

    def _open_pulllog(self) -> None:
        self.pulllog = PullLogStore(
            os.path.join(self.config.data_dir, "pulllog"),
            PullLogConfig(flush_interval_ms=self.config.flush_interval_ms),
        )
        log.info("pull log open: %s", self.pulllog.recovery)

    def _seed_tracer_io(self) -> None:
        """Tell the tracer what consumers held before this start (their acks are traced later)."""
        pulllog = self.pulllog
        if not self.tracer.enabled or pulllog is None:
            return
        for subject, key in pulllog.groups():
            for consumer in pulllog.consumers(subject, key):
                if consumer.unacked_count:
                    self.tracer.held_before_restart(subject, key, consumer.consumer, {
                        e.pull_seq: e.consumer_log_seq
                        for e in pulllog.unacked(subject, key, consumer.consumer)})
            queued = pulllog.redelivery_count(subject, key)
            if queued:
                self.tracer.queued_before_restart(
                    subject, key, pulllog.take_redeliveries(subject, key, queued))

    def _read_payload_io(self, subject: str, seq: int) -> bytes:
        """Store thread: one stored payload (raises LogStoreError when it cannot be read)."""
        assert self.store is not None
        return self.store.read(subject, seq).payload

    def end_long_polls(self) -> None:
        """Answer every waiting long poll now (with what is there, often nothing) instead of
        at its deadline, so a shutdown does not wait out consumers' ``wait_ms``."""
        self._stopping = True
        for subject in list(self._subject_events):
            self._notify(subject)

    async def stop(self) -> None:
        """Stop the loops, commit what is queued, checkpoint and close the storage."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._commits.commit_pending()
        if self.pulllog is not None:
            await self._pulllog_io(self.pulllog.close)
        if self.store is not None:
            await self._store_io(self.store.close)
        self._pull_thread.close()
        self._store_thread.close()

    # ------------------------------------------------------------------ send

    async def send(self, payloads: list[bytes]) -> list[dict[str, Any]]:
        """Validate and store a batch; each result says stored, duplicate or the error.

        Replies only once the batch is durable under the flush mode.
        """
        now_ms = self.clock()
        # Every payload through the quick check in one call (C when built); in the usual case
        # all pass and the request goes to the committer as it came, with no loop here.
        checks = self._quick_check.check_many(payloads, now_ms + DELIVER_AT_SKEW_MS_MAX)
        results: list[Any] = [None] * len(payloads)
        if None not in checks and not self.readonly:
            messages, valid, slots = checks, payloads, None
        else:
            messages, valid, slots = self._full_checks(payloads, checks, results, now_ms)
        if messages:
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._commits.pending.append(_SendRequest(messages, valid, slots, results, future))
            self._commits.wake()
            await future
        return results

    def _full_checks(self, payloads: list[bytes], checks: list[Checked | None],
                     results: list[Any], now_ms: int,
                     ) -> tuple[list[Checked], list[bytes], list[int]]:
        """The full check of every payload the quick check did not accept (all of them when
        read-only): the valid messages, their payloads and slots; errors go to ``results``."""
        messages: list[Checked] = []
        valid: list[bytes] = []
        slots: list[int] = []
        readonly = self.readonly
        for slot, (payload, checked) in enumerate(zip(payloads, checks)):
            if checked is None or readonly:
                try:
                    checked = self._full_check(payload, now_ms)
                except QmqError as exc:
                    results[slot] = send_result_error(peek_message_id(payload), exc)
                    self._count_error(exc.code, 1)
                    continue
            messages.append(checked)
            valid.append(payload)
            slots.append(slot)
        return messages, valid, slots

    def _full_check(self, payload: bytes, now_ms: int) -> Checked:
        """Decode and validate with wire.message; the QmqError says what is wrong."""
        message = decode_message(payload)
        validate_message(message, allow_internal=True, now_ms=now_ms)
        deliver_at_ms = message.deliver_at_ms
        if deliver_at_ms is not None and deliver_at_ms > now_ms + DELIVER_AT_SKEW_MS_MAX:
            raise BadRequest(
                f"message {message.id} has deliver_at_ms {message.deliver_at_ms}, "
                f"{message.deliver_at_ms - now_ms} ms ahead, exceeds DELIVER_AT_SKEW_MS_MAX "
                f"{DELIVER_AT_SKEW_MS_MAX}: send delayed messages to a delay server"
            )
        if self.readonly:
            raise ReadOnly(f"broker group {self.config.group} is read-only; send elsewhere")
        return Checked(message.id, message.subject, message.tags, message.expire_at_ms,
                       message.deliver_at_ms, message.created_at_ms, message.retries,
                       message.properties.get(ORIGIN_ID_PROPERTY))

    def _commit_io_call(self, batch: list[_SendRequest]) -> Awaitable[list[int | None]]:
        """The group commit's store call: ``_append_and_commit`` on the store thread."""
        return self._store_io(self._append_and_commit, batch, self.clock())

    def _go_readonly(self) -> None:
        """A sticky write failure: refuse sends until restarted."""
        self.readonly = self.write_failed = True

    def _fail_batch(self, batch: list[_SendRequest], error: QmqError) -> None:
        """Answer every message of a batch whose commit failed with ``error``."""
        self._count_error(error.code, sum(len(request.messages) for request in batch))
        for request in batch:
            slots = request.slots if request.slots is not None else range(len(request.results))
            for slot, message in zip(slots, request.messages):
                request.results[slot] = send_result_error(message.id, error)
        self._answer(batch)

    def _publish_committed(self, batch: list[_SendRequest], outcomes: list[int | None]) -> None:
        """Answer a committed batch, feed the tail and the metrics, wake the pulls."""
        self._publish(batch, outcomes)
        if self.on_commit is not None:
            self.on_commit(len(outcomes))
        self._answer(batch)

    @staticmethod
    def _answer(batch: list[_SendRequest]) -> None:
        for request in batch:
            if not request.future.done():
                request.future.set_result(None)

    def _publish(self, batch: list[_SendRequest], sequences: list[int | None]) -> None:
        """Fill in the results, put what was stored in the tail and wake the subjects' pulls.

        ``sequences`` has one entry per message of the batch, in order: its sequence if stored,
        None for a duplicate."""
        tracing = self.tracer.enabled
        now_ms = self.clock() if tracing else 0
        messages = (batch[0].messages if len(batch) == 1
                    else list(chain.from_iterable(request.messages for request in batch)))
        subjects = set(map(_subjects_of, messages))
        if (len(subjects) == 1 and None not in sequences
                and sequences[-1] - sequences[0] == len(sequences) - 1):
            # The usual commit: one subject, every message stored, in one run. Its requests
            # are published together: one tail run, one call to the tracer.
            subject = next(iter(subjects))
            self._publish_run(subject, batch, messages, sequences)
            if tracing:
                self.tracer.stored(messages, sequences, now_ms)
            self._notify(subject)
            return
        position = 0
        for request in batch:
            count = len(request.messages)
            request_sequences = sequences[position:position + count]
            position += count
            request_subjects = set(map(_subjects_of, request.messages))
            if (len(request_subjects) == 1 and None not in request_sequences
                    and request_sequences[-1] - request_sequences[0] == count - 1):
                self._publish_run(next(iter(request_subjects)), [request], request.messages,
                                  request_sequences)
            else:
                self._publish_each(request, request_sequences)
            if tracing:
                self.tracer.stored(request.messages, request_sequences, now_ms)
        for subject in subjects:
            self._notify(subject)

    def _publish_run(self, subject: str, batch: list[_SendRequest], messages: list[Checked],
                     sequences: list[int]) -> None:
        """``_publish`` of a commit whose messages all went to ``subject`` in one run."""
        stored = send_results_stored(map(_ids_of, messages))
        position = 0
        for request in batch:
            count = len(request.messages)
            if request.slots is None:
                request.results[:] = stored[position:position + count]
            else:
                for slot, result in zip(request.slots, stored[position:position + count]):
                    request.results[slot] = result
            position += count
        payloads = (batch[0].payloads if len(batch) == 1
                    else list(chain.from_iterable(request.payloads for request in batch)))
        entries: list[Entry] = list(zip(payloads, map(_tags_of, messages),
                                        map(_expiries_of, messages)))
        self._tail_add(subject, (sequences[0], entries, [sum(map(len, payloads))]))

    def _publish_each(self, request: _SendRequest, sequences: list[int | None]) -> None:
        """``_publish`` of a request with duplicates or several subjects, message by message."""
        stored: dict[str, tuple[int, list[Entry], list[int]]] = {}
        results = request.results
        slots = request.slots if request.slots is not None else range(len(results))
        for slot, message, payload, sequence in zip(slots, request.messages, request.payloads,
                                                    sequences):
            if sequence is None:
                results[slot] = send_result_ok(message.id, duplicate=True)
                continue
            results[slot] = send_result_ok(message.id)
            subject = message.subject
            run = stored.get(subject)
            if run is None or run[0] + len(run[1]) != sequence:
                if run is not None:  # not contiguous (never expected): keep the later run
                    self._tail_add(subject, run)
                run = stored[subject] = (sequence, [], [0])
            run[1].append((payload, message.tags, message.expire_at_ms))
            run[2][0] += len(payload)
        for subject, run in stored.items():
            self._tail_add(subject, run)

    def _count_error(self, code: str, count: int) -> None:
        self.message_errors[code] = self.message_errors.get(code, 0) + count

    def _tail_add(self, subject: str, run: tuple[int, list[Entry], list[int]]) -> None:
        first, entries, size = run
        sent = self.sent_by_subject.get(subject)
        if sent is None:
            sent = self.sent_by_subject[subject] = [0, 0]
        sent[0] += len(entries)
        sent[1] += size[0]
        self._tail.add(subject, first, entries, size[0])
        self._ends[subject] = max(self._ends.get(subject, 0), first + len(entries))
        self._firsts.setdefault(subject, first)

    def _append_and_commit(self, batch: list[_SendRequest], now_ms: int) -> list[int | None]:
        """Store thread: append every request's messages (column by column) and commit them."""
        store = self.store
        assert store is not None
        try:
            # The requests' messages as one set of columns: the store takes a run of one
            # subject at a time, so requests of the same subject are checked, numbered and
            # encoded together.
            if len(batch) == 1:
                messages, payloads = batch[0].messages, batch[0].payloads
            else:
                messages = list(chain.from_iterable(request.messages for request in batch))
                payloads = list(chain.from_iterable(request.payloads for request in batch))
            tags = list(map(_tags_of, messages))
            if any(tags):
                # Messages of a batch share a few tag sets: hash each distinct set once.
                hashes_of = {message_tags: tuple(map(tag_hash, message_tags))
                             for message_tags in set(tags)}
                hashes: list[Any] = list(map(hashes_of.__getitem__, tags))
            else:
                hashes = [()] * len(messages)
            store.append_many(list(map(_subjects_of, messages)), list(map(_ids_of, messages)),
                              hashes, now_ms, payloads)
            sequences = store.commit_sequences()
        except BaseException:
            store.discard()  # no request of a failed commit may ride along with the next one
            raise
        duplicates = sequences.count(None)
        self.stats["duplicates"] += duplicates
        self.stats["sent"] += len(sequences) - duplicates
        return sequences

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

    async def pull(self, request: Pull, gone: Callable[[], bool] | None = None,
                   ) -> Pulled:
        """Hand the group's next entries (redeliveries first) to the pulling consumer.

        With ``wait_ms`` it waits until something arrives or the wait ends (long polling).
        ``gone`` tells whether the consumer's connection has ended: a long poll that wakes for
        a consumer killed meanwhile returns nothing, instead of recording entries as held by a
        consumer nobody answers for (they would wait for its expiry before anyone else got them).
        """
        key = group_key(request.group, request.consumer_id, request.broadcast)
        loop = asyncio.get_running_loop()
        started_s = loop.time()
        deadline = started_s + request.wait_ms / 1000
        tags = frozenset(request.tags)
        self.tracer.subscribed(request.subject, key, request.consumer_id, tags, self.clock())
        leave_key = (request.subject, key, request.consumer_id)
        left_at_s = self._left_at_s
        while True:
            if (gone is not None and gone()) or left_at_s.get(leave_key, -1.0) >= started_s:
                return NOTHING_PULLED
            event = self._event(request.subject)
            self._touch(request.subject, key, request.consumer_id)
            pulled = await self._pull_once(request, key, tags)
            if pulled.payloads and left_at_s.get(leave_key, -1.0) >= started_s:
                # The consumer left while this pull was recording entries for it: hand them
                # on like the leave did with the rest.
                await self._release_consumer([leave_key])
                return NOTHING_PULLED
            if pulled.payloads:
                self._touch(request.subject, key, request.consumer_id)
                return pulled
            remaining = deadline - loop.time()
            if remaining <= 0 or self._stopping:
                return NOTHING_PULLED
            self.waiting_pulls += 1
            try:
                async with asyncio.timeout(remaining):
                    await event.wait()
            except TimeoutError:
                return NOTHING_PULLED
            finally:
                self.waiting_pulls -= 1

    async def _pull_once(self, request: Pull, key: str, tags: frozenset[str],
                         ) -> Pulled:
        subject = request.subject
        group = (subject, key)
        if self._known_cursors.get(group, -1) >= self._ends.get(subject, 0):
            return NOTHING_PULLED  # caught up and nothing to redeliver: no need to ask the pull log
        lock = self._group_locks.get(group)
        if lock is None:
            lock = self._group_locks[group] = asyncio.Lock()
        async with lock:
            release_rounds = self._release_rounds
            known = self._known_cursors.pop(group, None)
            out = None
            if known is not None:
                out, new_cursor = await self._pull_from_tail(request, key, tags, known)
            if out is None:
                out, new_cursor, drained = await self._pull_planned(request, key, tags)
                if not drained:
                    return out
            if release_rounds == self._release_rounds:
                # The redelivery queue is empty (only the lock holder takes from it) and no
                # expiry round has put anything back since: the next pull may skip the plan.
                self._known_cursors[group] = new_cursor
            return out

    async def _pull_from_tail(self, request: Pull, key: str, tags: frozenset[str],
                              cursor: int) -> tuple[Pulled | None, int]:
        """One trip to the pull-log thread: entries from the tail after the cursor the group had
        at its last pull. None when the tail does not reach back to it, or when the pull log
        says the cursor moved or entries wait for redelivery after all."""
        subject = request.subject
        end = self._ends.get(subject, 0)
        if cursor >= end:
            return NOTHING_PULLED, cursor
        tail = self._tail.covering(subject, cursor)
        if tail is None:
            return None, cursor
        now_ms = self.clock()
        payloads: dict[int, bytes] = {}
        chosen: list[int] = []
        expired: list[bytes] | None = [] if self.tracer.enabled else None
        new_cursor = tail.take(cursor, min(end, cursor + PULL_SCAN_ENTRIES_MAX), request.max_count,
                               tags, now_ms, PULL_RESPONSE_PAYLOAD_BYTES_MAX, payloads, chosen,
                               expired)
        if new_cursor == cursor:
            return None, cursor  # the tail does not reach what the store says is committed
        out = await self._pulllog_io(self._record_pull_io, request, key, chosen, new_cursor,
                                     payloads, now_ms, cursor)
        if out is not None and expired:
            self.tracer.expired(expired, key, now_ms)
        return out, new_cursor

    async def _pull_planned(self, request: Pull, key: str, tags: frozenset[str],
                            ) -> tuple[Pulled, int, bool]:
        """Ask the pull log for the group's redeliveries and cursor, take the entries (tail or
        store) and record them. Returns them, the new cursor, and whether the redelivery queue
        was drained."""
        subject = request.subject
        start = (self._ends if request.start == "latest" else self._firsts).get(subject, 0)
        redeliveries, cursor = await self._pulllog_io(
            self._plan_pull_io, subject, key, start, request.max_count, self.clock())
        drained = len(redeliveries) < request.max_count
        end = self._ends.get(subject, 0)
        if not redeliveries and cursor >= end:
            return NOTHING_PULLED, cursor, drained
        now_ms = self.clock()
        payloads: dict[int, bytes] = {}
        missing = []
        for seq in redeliveries:
            cached = self._tail.get(subject, seq)
            if cached is None:
                missing.append(seq)
            else:
                payloads[seq] = cached[0]
        remaining = request.max_count - len(redeliveries)
        tail = self._tail.covering(subject, cursor) if remaining > 0 else None
        expired: list[bytes] | None = [] if self.tracer.enabled else None
        if missing or (remaining > 0 and cursor < end and tail is None):
            # Behind the tail: read the message store (queued behind any commit).
            found, new_cursor = await self._store_io(
                self._read_io, subject, missing, cursor if tail is None else end, end,
                remaining, tags, now_ms, expired)
            payloads.update(found)
            scanned = [seq for seq in found if seq not in redeliveries]
        else:
            scanned, new_cursor = [], cursor
        chosen = list(redeliveries) + scanned
        if tail is not None:
            budget_bytes = PULL_RESPONSE_PAYLOAD_BYTES_MAX - sum(map(len, payloads.values()))
            new_cursor = tail.take(cursor, min(end, cursor + PULL_SCAN_ENTRIES_MAX), remaining,
                                   tags, now_ms, budget_bytes, payloads, chosen, expired)
        if not chosen and new_cursor == cursor:
            return NOTHING_PULLED, cursor, drained
        out = await self._pulllog_io(self._record_pull_io, request, key, chosen, new_cursor,
                                     payloads, now_ms, None)
        assert out is not None  # no expected cursor: never refused
        if expired:
            self.tracer.expired(expired, key, now_ms)
        return out, new_cursor, drained

    def _plan_pull_io(self, subject: str, key: str, start: int, max_count: int,
                      now_ms: int) -> tuple[list[int], int]:
        pulllog = self.pulllog
        assert pulllog is not None
        if not pulllog.has_group(subject, key):
            pulllog.ensure_group(subject, key, start, now_ms)
        return pulllog.take_redeliveries(subject, key, max_count), pulllog.cursor(subject, key)

    def _read_io(self, subject: str, seqs: list[int], cursor: int, end: int, count: int,
                 tags: frozenset[str], now_ms: int, expired: list[bytes] | None = None,
                 ) -> tuple[dict[int, bytes], int]:
        """Store thread: the payloads of ``seqs`` (b"" when unreadable), then up to ``count``
        deliverable messages from ``cursor``; returns them and the new cursor. Messages passed
        over because they expired go to ``expired`` (for tracing)."""
        store = self.store
        assert store is not None
        payloads: dict[int, bytes] = {}
        for seq in seqs:
            try:
                payloads[seq] = store.read(subject, seq).payload
            except LogStoreError as exc:
                # Deleted by retention's hard cap or damaged: it cannot be delivered again.
                log.error("redelivery of %s seq %d impossible: %s", subject, seq, exc)
                payloads[seq] = b""
        new_cursor = cursor
        if count > 0 and cursor < end:
            start = max(cursor, store.first_sequence(subject))
            hashes = [tag_hash(t) for t in tags] if tags else None
            found, new_cursor = store.scan(subject, start, count, hashes)
            budget_bytes = PULL_RESPONSE_PAYLOAD_BYTES_MAX - sum(map(len, payloads.values()))
            for stored in found:
                if payloads and len(stored.payload) > budget_bytes:
                    new_cursor = stored.sequence  # the rest waits for the next pull
                    break
                if not tags and not _may_expire(stored.payload):
                    # Nothing to check without a decode: no tag filter, and the payload has no
                    # expire_at_ms (its key's bytes do not occur in it). It was validated when
                    # it was sent and its CRC verified on this read.
                    payloads[stored.sequence] = stored.payload
                    budget_bytes -= len(stored.payload)
                elif self._deliverable(stored.payload, tags, now_ms):
                    payloads[stored.sequence] = stored.payload
                    budget_bytes -= len(stored.payload)
                elif expired is not None and self._deliverable(stored.payload, tags, None):
                    expired.append(stored.payload)  # it matched; only its expiry kept it back
        return payloads, new_cursor

    def _record_pull_io(self, request: Pull, key: str, chosen: list[int], new_cursor: int,
                        payloads: dict[int, bytes], now_ms: int,
                        expected_cursor: int | None) -> Pulled | None:
        """Record the pull; None (nothing recorded) if ``expected_cursor`` is given and the
        group's cursor is not there or entries wait for redelivery. The answer is built as
        columns straight from the recorded batch: nothing is built per message."""
        pulllog = self.pulllog
        assert pulllog is not None
        subject = request.subject
        if expected_cursor is not None and (
                pulllog.cursor(subject, key) != expected_cursor
                or pulllog.redelivery_count(subject, key)):
            return None
        consumer_id = request.consumer_id
        batch = pulllog.record_pull(subject, key, consumer_id, chosen, new_cursor, now_ms)
        log_seqs = batch.consumer_log_seqs
        if not log_seqs:
            return NOTHING_PULLED
        first = batch.first_pull_seq
        pull_seqs: list[int] = list(range(first, first + len(log_seqs)))
        chosen_payloads = list(map(payloads.__getitem__, log_seqs))
        redelivered = batch.redelivered
        if b"" in chosen_payloads:
            # Not deliverable (a redelivery whose message is gone): ack it at once so it does
            # not come back forever. Rare: the columns are rebuilt without those entries.
            keep = [i for i, payload in enumerate(chosen_payloads) if payload]
            for i in range(len(log_seqs)):
                if not chosen_payloads[i]:
                    pulllog.record_ack(subject, key, consumer_id,
                                       [(pull_seqs[i], pull_seqs[i])], now_ms)
            self.tracer.redeliveries_unreadable(  # a give-up: traced with its reason
                subject, key, [s for s, p in zip(log_seqs, chosen_payloads) if not p], now_ms)
            pull_seqs = [pull_seqs[i] for i in keep]
            log_seqs = tuple(log_seqs[i] for i in keep)
            chosen_payloads = [chosen_payloads[i] for i in keep]
            if redelivered is not None:
                redelivered = [redelivered[i] for i in keep]
        if redelivered is None:
            times = [0] * len(pull_seqs)
        else:
            times = redelivered
            self.stats["redelivered"] += len(redelivered) - redelivered.count(0)
        self.stats["pulled"] += len(pull_seqs)
        if self.tracer.enabled:
            self.tracer.pulled_columns(subject, key, consumer_id, pull_seqs, chosen_payloads,
                                       redelivered, now_ms, log_seqs)
        return Pulled(pull_seqs, chosen_payloads, times)

    @staticmethod
    def _deliverable(payload: bytes, tags: frozenset[str], now_ms: int | None) -> bool:
        """Exact tag match (the consumer log's bloom mask is only a pre-filter) and not expired
        at ``now_ms`` (None: ignore expiry)."""
        try:
            message = decode_message(payload)
        except QmqError:
            return False
        if tags and not tags.intersection(message.tags):
            return False
        if now_ms is not None and message.expire_at_ms is not None and message.expire_at_ms <= now_ms:
            return False
        return True

    # ------------------------------------------------------------------ ack / heartbeat

    async def ack(self, request: Ack) -> int:
        """Record acks of pull-log ranges; returns how many entries became acked."""
        for key in self._keys_for(request.subject, request.group, request.consumer_id):
            self._touch(request.subject, key, request.consumer_id)
        now_ms = self.clock()
        acked, from_store = await self._pulllog_io(self._ack_io, request, now_ms)
        for key, seqs in from_store:
            payloads, unreadable = await self._store_io(self._payloads_io, request.subject, seqs)
            self.tracer.acked_payloads(payloads, key, request.consumer_id, now_ms)
            self.tracer.acks_unreadable(request.subject, key, request.consumer_id, unreadable,
                                        now_ms)
        return acked

    def _payloads_io(self, subject: str, seqs: list[int]) -> tuple[list[bytes], list[int]]:
        """Store thread: the stored payloads of ``seqs`` still readable, and the seqs not."""
        assert self.store is not None
        out, unreadable = [], []
        for seq in seqs:
            try:
                out.append(self.store.read(subject, seq).payload)
            except LogStoreError:
                unreadable.append(seq)
        return out, unreadable

    def _keys_for(self, subject: str, group: str, consumer_id: str) -> list[str]:
        keys = [group]
        broadcast_key = group_key(group, consumer_id, True)
        if (subject, broadcast_key) in self._last_seen:
            keys.append(broadcast_key)
        return keys

    def _ack_io(self, request: Ack, now_ms: int) -> tuple[int, list[tuple[str, list[int]]]]:
        assert self.pulllog is not None
        acked = 0
        known = False
        from_store: list[tuple[str, list[int]]] = []
        for key in self._keys_for(request.subject, request.group, request.consumer_id):
            if self.pulllog.has_group(request.subject, key):
                known = True
                if self.tracer.enabled:
                    seqs = self.tracer.acked(request.subject, key, request.consumer_id,
                                             request.ranges, now_ms)
                    if seqs:
                        from_store.append((key, seqs))
                acked += self.pulllog.record_ack(
                    request.subject, key, request.consumer_id, request.ranges, now_ms
                )
        if not known:
            raise NotFound(
                f"group {request.group} has never pulled subject {request.subject} on broker "
                f"{self.config.group}"
            )
        self.stats["acked"] += acked
        return acked, from_store

    def heartbeat(self, request: Heartbeat) -> None:
        """Keep a consumer online for the (subject, group) pairs it names."""
        for subject, group in request.subscriptions:
            for key in self._keys_for(subject, group, request.consumer_id):
                self._touch(subject, key, request.consumer_id)

    async def leave(self, request: Leave) -> int:
        """A consumer closing: hand everything it holds of the pairs it names to the others of
        its groups now, and end its waiting long polls. Returns how many entries it released."""
        consumers = [(subject, key, request.consumer_id)
                     for subject, group in request.subscriptions
                     for key in self._keys_for(subject, group, request.consumer_id)]
        now_s = asyncio.get_running_loop().time()
        left_at_s = self._left_at_s
        for old in [k for k, at_s in left_at_s.items() if at_s < now_s - MAX_PULL_WAIT_MS / 1000]:
            del left_at_s[old]  # no pull that began before it can still be waiting
        for leave_key in consumers:
            left_at_s[leave_key] = now_s
            self._notify(leave_key[0])  # its long polls wake and see the leave
        self.tracer.unsubscribed(consumers, self.clock(), "left")
        return await self._release_consumer(consumers)

    async def _release_consumer(self, consumers: list[tuple[str, str, str]]) -> int:
        released = await self._pulllog_io(self._remove_consumers_io, consumers, self.clock())
        self._after_release(released)
        return sum(released.values())

    def _remove_consumers_io(self, consumers: list[tuple[str, str, str]],
                             now_ms: int) -> dict[tuple[str, str], int]:
        pulllog = self.pulllog
        assert pulllog is not None
        released: dict[tuple[str, str], int] = {}
        for subject, key, consumer_id in consumers:
            self._last_seen.get((subject, key), {}).pop(consumer_id, None)
            if not pulllog.has_group(subject, key):
                continue
            count = len(pulllog.remove_consumer(subject, key, consumer_id, now_ms))
            if count:
                released[(subject, key)] = released.get((subject, key), 0) + count
                self._prune_traced(subject, key)
        return released

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
        now_ms = self.clock()
        released = await self._pulllog_io(self._expire_io, now_ms)
        self._after_release(released)
        self.tracer.expire_subscriptions(self._last_seen, now_ms, self.config.consumer_expiry_ms)
        return sum(released.values())

    def _after_release(self, released: dict[tuple[str, str], int]) -> None:
        """Entries went back to the redelivery queues of these groups: the next pulls must ask
        the pull log (not the tail), and waiting long polls wake to take them."""
        if released:
            self._release_rounds += 1
        for subject, key in released:
            self._known_cursors.pop((subject, key), None)
            self._notify(subject)

    def _expire_io(self, now_ms: int) -> dict[tuple[str, str], int]:
        pulllog = self.pulllog
        assert pulllog is not None
        released: dict[tuple[str, str], int] = {}
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
                released[(subject, key)] = count
                self._prune_traced(subject, key)
        return released

    def _prune_traced(self, subject: str, key: str) -> None:
        """After a release (pull-log thread): the tracer forgets the entries no consumer of the
        group holds any more."""
        if self.tracer.enabled:
            pulllog = self.pulllog
            assert pulllog is not None
            for consumer_id in self.tracer.consumers(subject, key):
                self.tracer.prune(subject, key, consumer_id, {
                    e.pull_seq for e in pulllog.unacked(subject, key, consumer_id)})

    async def _flush_loop(self) -> None:
        interval_s = self.config.flush_interval_ms / 1000
        while True:
            await asyncio.sleep(interval_s)
            now_ms = self.clock()
            for name, io, tick in (("message store", self._store_io, self._tick_store_io),
                                   ("pull log", self._pulllog_io, self._tick_pulllog_io)):
                try:
                    await io(tick, now_ms)
                except Exception:
                    log.exception("async flush of the %s failed", name)

    def _tick_store_io(self, now_ms: int) -> None:
        assert self.store is not None
        self.store.tick(now_ms)

    def _tick_pulllog_io(self, now_ms: int) -> None:
        assert self.pulllog is not None
        self.pulllog.tick(now_ms)

    async def _retention_loop(self) -> None:
        interval_s = self.config.retention_check_interval_ms / 1000
        while True:
            await asyncio.sleep(interval_s)
            try:
                keep = await self._pulllog_io(self._retention_keep_io)
                report, firsts = await self._store_io(self._retention_io, self.clock(), keep)
                for subject, first in firsts.items():
                    self._firsts[subject] = first
                    self._tail.drop_below(subject, first)
                if report:
                    log.info("retention: %s", report)
            except Exception:
                log.exception("retention failed")

    def _retention_keep_io(self) -> dict[str, int]:
        assert self.pulllog is not None
        keep: dict[str, int] = {}
        for subject, key in self.pulllog.groups():
            needed = self.pulllog.lowest_needed_sequence(subject, key)
            keep[subject] = min(keep.get(subject, needed), needed)
        return keep

    def _retention_io(self, now_ms: int, keep: dict[str, int]) -> tuple[Any, dict[str, int]]:
        assert self.store is not None
        report = self.store.apply_retention(now_ms, keep)
        return report, self._sequences_io()[1]

    # ------------------------------------------------------------------ reporting

    async def backlog(self) -> list[dict[str, Any]]:
        """Per (subject, group): messages not yet acked (lag) and consumers holding entries."""
        return await self._pulllog_io(self._backlog_io, dict(self._ends))

    def _backlog_io(self, ends: dict[str, int]) -> list[dict[str, Any]]:
        pulllog = self.pulllog
        assert pulllog is not None
        rows = []
        for subject, key in pulllog.groups():
            if key.startswith("%"):
                continue  # a reserved group (realtime.admin's %admin watermark), not consumers
            lag = max(0, ends.get(subject, 0) - pulllog.cursor(subject, key))
            lag += pulllog.held_count(subject, key) + pulllog.redelivery_count(subject, key)
            consumers = len(self._last_seen.get((subject, key), {}))
            rows.append({"subject": subject, "group": key.split("#", 1)[0], "lag": lag,
                         "consumers": consumers})
        return rows


__all__ = ["Broker", "NOTHING_PULLED", "Pulled", "group_key"]
