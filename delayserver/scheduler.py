"""The delay server's scheduling core: accepts delayed messages, keeps the preload window in the
timing wheel, dispatches due messages to realtime brokers and records each confirmed dispatch.

Two levels (DESIGN.md section 9): every pending message is on disk in the ``DelayStore``; only
entries of the buckets up to ``preload_buckets`` ahead of now are in memory, in the
``TimingWheel``. All storage calls run on one I/O thread, so the event loop never blocks on disk.

Invariants:
- nothing is dispatched before its ``deliver_at_ms`` (the wheel never returns an entry early and
  the clock is the only source of "now");
- a dispatch is recorded only after a realtime broker confirmed it (stored or duplicate), so a
  crash re-dispatches at most what was sent and not yet recorded, and the broker's
  de-duplication by message id absorbs that resend;
- the done watermark passed to ``mark_done_before`` never passes a bucket with an entry that is
  still loaded, in flight or waiting to be retried.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections import defaultdict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, TypeVar

from delayserver.config import DelayConfig
from delayserver.stats import DispatchStats
from delayserver.tracing import DelayTracer
from delayserver.storage import DelayStore, DelayStoreConfig, ScheduleEntry
from delayserver.wheel import TimingWheel
from logstore.errors import DiskFull
from logstore.fileio import Opener, OsFile
from wire.errors import DelayOutOfRange, QmqError, ReadOnly
from tracelog.peek import TracePeek, trace_members
from wire.message import decode_message, peek_message_id, validate_message
from serverkit.committer import GroupCommitter
from wire.protocol import delayed_send_result, send_result_error
from serverkit.send_check import QuickCheck

log = logging.getLogger(__name__)
T = TypeVar("T")

Dispatch = Callable[[str, list[bytes]], Awaitable[tuple[str, list[dict[str, Any]]]]]

DISPATCH_CONCURRENCY = 8  # dispatch requests in flight at once (the realtime side group-commits)
DONE_CHECK_INTERVAL_MS = 1_000  # how often the done watermark is advanced
TRACK_SLICE_ENTRIES = 2_000  # loaded entries put into the wheel per event-loop turn
WINDOW_REFILL_PARTS = 4  # a part-loaded bucket is continued once 1/4 of the window is free
# A due backlog this long (a hot slot) is taken by one worker in chunks of up to
# HOT_CHUNK_ENTRIES_MAX: read in one store call (one sequential pass when the records lie close
# together, instead of a pread each), ~300 bytes of payload each while in flight (~10 MB).
HOT_BACKLOG_ENTRIES = 4_096
HOT_CHUNK_ENTRIES_MAX = 32_768


@dataclass
class _PendingCall:
    """One ``schedule`` call waiting for its commit: one future for all of its messages (they
    always go into the same commit batch), not one per message."""

    results: list[Any]  # one answer per payload; the accepted ones are filled in on commit
    future: asyncio.Future[list[dict[str, Any]]]


@dataclass
class _PendingSend:
    message_id: str
    subject: str
    payload: bytes
    deliver_at_ms: int
    call: _PendingCall
    index: int  # of this message's answer in call.results
    # Its trace members from what the quick check read (None: the tracer peeks the payload).
    trace: TracePeek | None = None


@dataclass
class _Confirmed:
    """One batch the realtime side confirmed, waiting for its dispatch-log record."""

    entries: list[ScheduleEntry]
    subject: str
    payloads: list[bytes]  # those to trace (a message refused for good is not traced)
    confirmed_at_ms: int


class Scheduler:
    """Owns a ``DelayStore`` and the in-memory window; see the module docstring."""

    def __init__(
        self,
        config: DelayConfig,
        clock: Callable[[], int],
        dispatch: Dispatch,
        opener: Opener = OsFile,
    ) -> None:
        self.config = config
        self.clock = clock
        self._dispatch_fn = dispatch
        self._opener = opener
        self.tracer = DelayTracer(None)  # the server installs one with its TraceWriter
        self.store: DelayStore | None = None
        self.readonly = False  # set by the MetaServer (draining) or after a sticky write failure
        self.write_failed = False  # a sticky write failure: read-only until restarted
        self.stats = DispatchStats()
        self.wheel = TimingWheel(config.tick_ms)
        self._quick_check = QuickCheck()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="delay-io")
        self._commits: GroupCommitter[_PendingSend, list[ScheduleEntry]] = GroupCommitter(
            f"delay group {config.group}", self._commit_io_call, self._committed_batch,
            self._fail_batch, self._go_readonly)
        self._wakeup = asyncio.Event()  # the dispatcher re-checks the wheel
        self._next_load_ms = 0  # first bucket not yet loaded into the wheel
        self._loading_bucket_ms: int | None = None
        # Buckets loaded only in part because the window was full (wheel_entries_max): bucket
        # -> delay-log offset of its first entry not loaded. Everything of the bucket from
        # there on is on disk only, and is loaded, in disk order, as the window drains.
        self._resume_at: dict[int, int] = {}
        # Every loaded entry until it is confirmed or cancelled, keyed by its delay-log offset
        # (unique per message, and an int: hashing it costs nothing, unlike a tuple key).
        self._tracked: dict[int, ScheduleEntry] = {}
        self._bucket_counts: dict[int, int] = defaultdict(int)
        # id hash -> the key of the tracked entry with that hash (any bucket), or a list of
        # keys when several share it: how a cancel finds a loaded entry. A bare key for the
        # usual single one saves a list (~90 bytes) per entry.
        self._by_id: dict[int, int | list[int]] = {}
        self._in_flight: set[int] = set()
        self._retry_ms: dict[int, int] = {}
        # Due entries wait here for a dispatch worker; a worker takes everything queued (up to
        # dispatch_batch_max), so while workers are busy small ticks merge into one request.
        self._due: deque[ScheduleEntry] = deque()
        self._send_slots = asyncio.Semaphore(DISPATCH_CONCURRENCY)
        self._dispatch_tasks: set[asyncio.Task[None]] = set()
        # Confirmed dispatches waiting to be recorded: one record_dispatched call (one dispatch
        # log fsync per bucket) for everything confirmed while the previous call ran.
        self._to_record: list[_Confirmed] = []
        self._recording = False
        # Confirmed dispatches a full disk kept from being recorded; housekeeping records them
        # once space returns, so they are not dispatched again after a restart and their
        # buckets can be marked done.
        self._unrecorded: list[ScheduleEntry] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._last_done_check_ms = 0
        self._preload_lock = asyncio.Lock()
        self._preload_task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle

    async def _io(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def start(self) -> None:
        """Open (and recover) the store, load the window, start dispatching."""
        await self._io(self._open_store)
        assert self.store is not None
        self._next_load_ms = self.store.done_before()
        await self.preload()
        self._tasks = [
            asyncio.create_task(self._commits.run(), name="delay-committer"),
            asyncio.create_task(self._dispatcher(), name="delay-dispatcher"),
            asyncio.create_task(self._housekeeping(), name="delay-housekeeping"),
        ]

    def _open_store(self) -> None:
        cfg = self.config
        store_config = DelayStoreConfig(
            bucket_ms=cfg.bucket_ms, flush_mode=cfg.flush, flush_interval_ms=cfg.flush_interval_ms
        )
        self.store = DelayStore(cfg.data_dir, store_config, opener=self._opener,
                                now_ms=self.clock())
        log.info("delay store open: %s", self.store.recovery)

    async def stop(self) -> None:
        """Stop dispatching, commit queued sends, wait for in-flight dispatches, close the store."""
        tasks = self._tasks + ([self._preload_task] if self._preload_task is not None else [])
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._commits.commit_pending()
        # Dispatch workers hand what was confirmed to a recorder task they start, so wait
        # until none of either is left (or the grace time is over).
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.shutdown_grace_ms / 1000
        while self._dispatch_tasks and loop.time() < deadline:
            await asyncio.wait(set(self._dispatch_tasks), timeout=deadline - loop.time())
        for task in self._dispatch_tasks:
            task.cancel()
        await asyncio.gather(*self._dispatch_tasks, return_exceptions=True)
        # Confirmed batches the recorder had not reached when the grace time ran out: record
        # them below with the rest, or a restart would dispatch them again.
        for batch in self._to_record:
            self._unrecorded.extend(batch.entries)
        self._to_record = []
        if self.store is not None:
            if not self.write_failed:  # a failed store refuses writes until reopened
                await self.record_unrecorded()
                await self.advance_done()
            await self._io(self.store.close)
        self._executor.shutdown(wait=True)

    # ------------------------------------------------------------------ accepting

    def poke(self) -> None:
        """Make the dispatcher look at the clock now (after a fake clock moved, or a config change)."""
        self._wakeup.set()

    def bucket_of(self, deliver_at_ms: int) -> int:
        """The start of the bucket ``deliver_at_ms`` falls in."""
        return deliver_at_ms - deliver_at_ms % self.config.bucket_ms

    async def schedule(self, payloads: list[bytes]) -> list[dict[str, Any]]:
        """Store delayed messages durably and answer one result per payload.

        A message without ``deliver_at_ms``, or with one in the past, is due at once. One later
        than now + ``max_delay_ms`` is refused with ``delay_out_of_range``, never clamped.
        """
        now_ms = self.clock()
        results: list[Any] = []
        call = _PendingCall(results, asyncio.get_running_loop().create_future())
        accepted = 0
        deliver_at_max_ms = now_ms + self.config.max_delay_ms
        tracing = self.tracer.enabled
        # The quick check (serverkit.send_check; for a batch, one C call where it is built) accepts
        # our producers' payloads without building a Message; anything it is unsure of gets
        # the full check, which decides and words the error.
        checks = self._quick_check.check_many(list(payloads), deliver_at_max_ms)
        for payload, checked in zip(payloads, checks):
            trace = None
            try:
                if checked is not None:
                    message_id, subject, deliver_at_ms = (checked.id, checked.subject,
                                                          checked.deliver_at_ms)
                    if tracing:  # saves the tracer decoding the payload again
                        trace = trace_members(message_id, subject, origin_id=checked.origin_id,
                                              created_at_ms=checked.created_at_ms,
                                              deliver_at_ms=deliver_at_ms,
                                              retries=checked.retries, tags=checked.tags)
                else:
                    message = decode_message(payload)
                    validate_message(message, allow_internal=True)
                    message_id, subject, deliver_at_ms = (message.id, message.subject,
                                                          message.deliver_at_ms)
                if deliver_at_ms is None:
                    deliver_at_ms = now_ms
                ahead_ms = deliver_at_ms - now_ms
                if ahead_ms > self.config.max_delay_ms:
                    raise DelayOutOfRange(
                        f"message {message_id} deliver_at_ms {deliver_at_ms} is {ahead_ms} ms "
                        f"ahead, exceeds max_delay_ms {self.config.max_delay_ms}"
                    )
                if self.readonly:
                    raise ReadOnly(f"delay group {self.config.group} is read-only")
            except QmqError as exc:
                results.append(send_result_error(peek_message_id(payload), exc))
                continue
            self._commits.pending.append(_PendingSend(message_id, subject, payload,
                                                      deliver_at_ms, call, len(results), trace))
            results.append(None)  # filled in by the commit
            accepted += 1
        if not accepted:
            return results
        self._commits.wake()
        return await call.future

    def _commit_io_call(self, batch: list[_PendingSend]) -> Awaitable[list[ScheduleEntry]]:
        """The group commit's store call: ``_append_and_commit`` on the I/O thread."""
        return self._io(self._append_and_commit, batch)

    def _go_readonly(self) -> None:
        """A sticky write failure: refuse sends until restarted."""
        self.readonly = self.write_failed = True

    def _committed_batch(self, batch: list[_PendingSend], entries: list[ScheduleEntry]) -> None:
        """Answer a committed batch and put its entries of loaded buckets into the window."""
        if self.tracer.enabled:
            self.tracer.scheduled_peeked([(p.trace, p.payload) for p in batch], self.clock())
        window_max = self.config.wheel_entries_max
        for pending, entry in zip(batch, entries):
            bucket_ms = entry.bucket_ms
            if self._is_loaded(bucket_ms) and bucket_ms not in self._resume_at:
                if len(self._tracked) < window_max:
                    self._track(entry)
                else:
                    # The window is full: the entry stays on disk, and so does everything
                    # committed into this bucket after it; the loader resumes here.
                    self._resume_at[bucket_ms] = entry.delay_log_offset
            pending.call.results[pending.index] = delayed_send_result(pending.message_id,
                                                                      entry.deliver_at_ms)
        self._answer(batch)
        self._wakeup.set()

    def _fail_batch(self, batch: list[_PendingSend], error: QmqError) -> None:
        for pending in batch:
            pending.call.results[pending.index] = send_result_error(pending.message_id, error)
        self._answer(batch)

    @staticmethod
    def _answer(batch: list[_PendingSend]) -> None:
        """Wake each call of ``batch``: every one of its messages is answered now."""
        for call in {id(p.call): p.call for p in batch}.values():
            if not call.future.done():  # a caller gone (cancelled) needs no answer
                call.future.set_result(call.results)

    def _append_and_commit(self, batch: list[_PendingSend]) -> list[ScheduleEntry]:
        assert self.store is not None
        for pending in batch:
            self.store.append(pending.message_id, pending.subject,
                              pending.deliver_at_ms, pending.payload)
        return self.store.commit()

    # ------------------------------------------------------------------ the window

    def _is_loaded(self, bucket_ms: int) -> bool:
        return bucket_ms < self._next_load_ms or bucket_ms == self._loading_bucket_ms

    def _track(self, entry: ScheduleEntry) -> None:
        key = entry.delay_log_offset
        if key in self._tracked:
            return
        self._tracked[key] = entry
        self._bucket_counts[entry.bucket_ms] += 1
        same_hash = self._by_id.get(entry.id_hash)
        if same_hash is None:
            self._by_id[entry.id_hash] = key
        elif type(same_hash) is list:
            same_hash.append(key)
        else:
            self._by_id[entry.id_hash] = [same_hash, key]
        self.wheel.add(entry, entry.deliver_at_ms, key)

    def _keys_of_hash(self, id_hash: int) -> list[int]:
        keys = self._by_id.get(id_hash)
        return [] if keys is None else keys if type(keys) is list else [keys]

    def _forget_hash(self, id_hash: int, key: int) -> None:
        keys = self._by_id.get(id_hash)
        if keys == key:
            del self._by_id[id_hash]
        elif type(keys) is list and key in keys:
            keys.remove(key)
            if len(keys) == 1:
                self._by_id[id_hash] = keys[0]

    def _untrack(self, key: int) -> None:
        self._untrack_many([self._tracked[key]] if key in self._tracked else [])

    def _untrack_many(self, entries: list[ScheduleEntry]) -> None:
        """Forget confirmed or cancelled entries, with the lookups bound once (this runs per
        dispatched batch)."""
        tracked_pop, in_flight, by_id = self._tracked.pop, self._in_flight, self._by_id
        retry_ms = self._retry_ms
        per_bucket: dict[int, int] = {}
        for entry in entries:
            key = entry.delay_log_offset
            if tracked_pop(key, None) is None:
                continue  # cancelled meanwhile
            if key in in_flight:  # in flight: advance already took it out of the wheel
                in_flight.discard(key)
            else:
                self.wheel.remove(key)
            if retry_ms:
                retry_ms.pop(key, None)
            bucket_ms = entry.bucket_ms
            per_bucket[bucket_ms] = per_bucket.get(bucket_ms, 0) + 1
            if by_id.get(entry.id_hash) == key:
                del by_id[entry.id_hash]
            else:
                self._forget_hash(entry.id_hash, key)
        bucket_counts = self._bucket_counts
        for bucket_ms, done in per_bucket.items():
            count = bucket_counts[bucket_ms] - done
            if count:
                bucket_counts[bucket_ms] = count
            else:
                del bucket_counts[bucket_ms]

    async def preload(self) -> None:
        """Fill the window: first the rest of buckets loaded only in part, then every bucket up
        to ``preload_buckets`` ahead of now that is not loaded yet, oldest first (buckets whose
        time passed while the server was down included), while the window holds fewer than
        ``wheel_entries_max`` entries. A bucket larger than the room left is loaded in part and
        continued, in disk order, as dispatching drains the window; later buckets wait for it.
        """
        assert self.store is not None
        async with self._preload_lock:
            await self._preload_locked()

    def _window_room(self) -> int:
        return self.config.wheel_entries_max - len(self._tracked)

    async def _preload_locked(self) -> None:
        assert self.store is not None
        while self._resume_at and self._refill_due():
            bucket_ms = min(self._resume_at)
            await self._load_slice(bucket_ms, self._resume_at.pop(bucket_ms))
        if self._resume_at:
            return  # still full: what is due first is on disk in the part-loaded bucket
        horizon_ms = self.bucket_of(self.clock()) + self.config.preload_buckets * self.config.bucket_ms
        while self._next_load_ms <= horizon_ms and self._window_room() > 0:
            buckets = await self._io(self.store.buckets_with_pending, self._next_load_ms, horizon_ms)
            if not buckets:
                self._next_load_ms = horizon_ms + self.config.bucket_ms
                break
            bucket_ms = buckets[0]
            # The buckets before it had nothing when listed: count them as loaded now, in the
            # same turn, so a message committed into one after the listing tracks itself
            # (otherwise it stayed on disk, below _next_load_ms, and was never dispatched).
            self._next_load_ms = bucket_ms
            self._loading_bucket_ms = bucket_ms
            try:
                await self._load_slice(bucket_ms, 0)
                self._next_load_ms = bucket_ms + self.config.bucket_ms
            finally:
                self._loading_bucket_ms = None
            if bucket_ms in self._resume_at:
                break

    async def _load_slice(self, bucket_ms: int, from_offset: int) -> None:
        """Load what fits of the bucket from ``from_offset`` into the window and note where to
        resume if not all of it fitted. Commits into the bucket meanwhile track themselves
        while there is room (a bucket being loaded counts as loaded), or note their own resume
        point; the earlier of the two wins, and the loader skips what is tracked already."""
        assert self.store is not None
        entries, resume_offset = await self._io(self.store.load_bucket_slice, bucket_ms,
                                                from_offset, max(1, self._window_room()))
        # In slices, yielding between them: tracking a 50,000-entry bucket in one go would
        # hold the event loop (and every due dispatch) for a quarter second.
        for start in range(0, len(entries), TRACK_SLICE_ENTRIES):
            for entry in entries[start:start + TRACK_SLICE_ENTRIES]:
                self._track(entry)
            self._wakeup.set()
            await asyncio.sleep(0)
        if resume_offset is not None:
            noted = self._resume_at.get(bucket_ms)
            self._resume_at[bucket_ms] = (resume_offset if noted is None
                                          else min(noted, resume_offset))

    # ------------------------------------------------------------------ dispatching

    async def _dispatcher(self) -> None:
        while True:
            now_ms = self.clock()
            if (not self._preloading()
                    and (self.bucket_of(now_ms) + self.config.preload_buckets
                         * self.config.bucket_ms >= self._next_load_ms
                         or self._refill_due())):
                # Loading runs beside dispatching: what is due keeps going while a bucket
                # ahead is read and tracked.
                self._preload_task = asyncio.create_task(self.preload(), name="delay-preload")
            due = self.wheel.advance(now_ms)
            if due:
                self._start_dispatch(due)
            self._wakeup.clear()
            next_due = self.wheel.next_due_ms()
            next_bucket_ms = self.bucket_of(now_ms) + self.config.bucket_ms
            wake_at = next_bucket_ms if next_due is None else min(next_due, next_bucket_ms)
            delay_s = max(0, wake_at - self.clock()) / 1000
            # Not asyncio.wait_for: on Python 3.11 it swallows a cancel that arrives in the turn
            # the wakeup is set, and stop() then waits for this task for ever.
            try:
                async with asyncio.timeout(delay_s):
                    await self._wakeup.wait()
            except TimeoutError:
                pass

    def _refill_due(self) -> bool:
        """A part-loaded bucket waits and the window drained enough to load a good slice of
        it (a quarter of the window), so refills are few and large."""
        return bool(self._resume_at) and (
            self._window_room() >= max(1, self.config.wheel_entries_max // WINDOW_REFILL_PARTS))

    def _preloading(self) -> bool:
        return self._preload_task is not None and not self._preload_task.done()

    def _start_dispatch(self, due: list[ScheduleEntry]) -> None:
        self._in_flight.update([e.delay_log_offset for e in due])
        self._due.extend(due)
        size = self.config.dispatch_batch_max
        # Running workers are all busy with a batch (one leaves when the queue is empty), so
        # what is queued needs new ones, up to DISPATCH_CONCURRENCY; beyond that it waits and
        # merges into larger requests.
        idle_slots = DISPATCH_CONCURRENCY - len(self._dispatch_tasks)
        for _ in range(min(idle_slots, -(-len(self._due) // size))):
            task = asyncio.create_task(self._dispatch_worker())
            self._dispatch_tasks.add(task)
            task.add_done_callback(self._dispatch_tasks.discard)

    async def _dispatch_worker(self) -> None:
        """Dispatch queued due entries until the queue is empty: a batch at a time, or, when a
        hot slot has left a backlog, a large chunk read in one go and sent in batches."""
        due, size = self._due, self.config.dispatch_batch_max
        while due:
            take = HOT_CHUNK_ENTRIES_MAX if len(due) >= HOT_BACKLOG_ENTRIES else size
            chunk = [due.popleft() for _ in range(min(take, len(due)))]
            try:
                await self._dispatch_chunk(chunk)
            except Exception as exc:  # our bug: the chunk must not stay in flight forever
                log.exception("dispatch of %d messages failed", len(chunk))
                self._retry([e for e in chunk if e.delay_log_offset in self._in_flight],
                            f"{type(exc).__name__}: {exc}")

    async def _dispatch_chunk(self, chunk: list[ScheduleEntry]) -> None:
        """Read the chunk's subjects and payloads in one store call (records lying close
        together in the delay log, as a hot slot stored in one burst does, share reads), then
        send them per subject in batches of ``dispatch_batch_max``, DISPATCH_CONCURRENCY
        requests on the wire at a time across all workers."""
        assert self.store is not None
        try:
            subjects, payloads = await self._io(self.store.read_payloads, chunk)
        except Exception as exc:
            log.exception("reading %d due messages failed", len(chunk))
            if len(chunk) == 1:
                self._retry(chunk, f"read failed: {exc}")
                return
            # Read them one by one, so a bad record is retried (and reported) alone instead of
            # holding back every message of its chunk with it, retry after retry.
            results = await self._io(self._read_each, chunk)
            failed = [e for e, r in zip(chunk, results) if isinstance(r, Exception)]
            if failed:
                self._retry(failed, f"read failed: {exc}")
            read = [(e, r) for e, r in zip(chunk, results) if not isinstance(r, Exception)]
            if not read:
                return
            chunk = [e for e, _ in read]
            subjects = [r[0] for _, r in read]
            payloads = [r[1] for _, r in read]
        size = self.config.dispatch_batch_max
        if subjects.count(subjects[0]) == len(subjects):  # one subject: the usual hot slot
            groups = [(subjects[0], chunk, payloads)]
        else:
            positions: dict[str, list[int]] = defaultdict(list)
            for position, subject in enumerate(subjects):
                positions[subject].append(position)
            groups = [(subject, [chunk[i] for i in where], [payloads[i] for i in where])
                      for subject, where in positions.items()]

        async def one(subject: str, entries: list[ScheduleEntry], batch: list[bytes]) -> None:
            async with self._send_slots:
                await self._dispatch_batch(subject, entries, batch)

        await asyncio.gather(*(
            one(subject, entries[start:start + size], batch[start:start + size])
            for subject, entries, batch in groups for start in range(0, len(entries), size)))

    def _read_each(self, chunk: list[ScheduleEntry]) -> list[tuple[str, bytes] | Exception]:
        """(subject, payload) of each entry read alone, or the exception its read raised."""
        assert self.store is not None
        out: list[tuple[str, bytes] | Exception] = []
        for entry in chunk:
            try:
                subjects, payloads = self.store.read_payloads([entry])
                out.append((subjects[0], payloads[0]))
            except Exception as exc:
                log.error("due message at delay-log offset %d of bucket %d unreadable: %s",
                          entry.delay_log_offset, entry.bucket_ms, exc)
                out.append(exc)
        return out

    async def _dispatch_batch(self, subject: str, entries: list[ScheduleEntry],
                              payloads: list[bytes]) -> None:
        """Send one batch of one subject and hand what the broker confirmed to the recorder
        (without waiting for its dispatch-log write, so the next batch goes out meanwhile);
        what it did not confirm is retried with backoff."""
        try:
            _group, results = await self._dispatch_fn(subject, payloads)
        except QmqError as exc:
            log.warning("dispatch of %d messages to %s failed, will retry: %s",
                        len(entries), subject, exc)
            self._retry(entries, f"realtime did not take the batch: {exc}")
            return
        confirmed_at_ms = self.clock()
        if len(results) == len(entries) and not [r for r in results if "error" in r]:
            self._record_soon(entries, subject, payloads, confirmed_at_ms)
            return
        confirmed: list[ScheduleEntry] = []
        confirmed_payloads: list[bytes] = []
        failed: list[ScheduleEntry] = []
        refused: list[bytes] = []
        for position, entry in enumerate(entries):
            result = results[position] if position < len(results) else {}
            error = result.get("error")
            if error is None and result:
                confirmed.append(entry)
                confirmed_payloads.append(payloads[position])
            elif error is not None and error.get("code") in ("bad_request", "too_large",
                                                             "forbidden"):
                # The realtime side will never take it: record it as dispatched so it does
                # not loop forever, and say so loudly.
                log.error("realtime refused message of %s for good (%s); dropped from the "
                          "schedule", subject, error)
                confirmed.append(entry)
                refused.append(payloads[position])
            else:
                failed.append(entry)
        self.tracer.gave_up(refused, confirmed_at_ms, "dispatch_refused")
        if confirmed:
            self._record_soon(confirmed, subject, confirmed_payloads, confirmed_at_ms)
        if failed:
            self._retry(failed, "realtime did not confirm")

    def _record_soon(self, entries: list[ScheduleEntry], subject: str, payloads: list[bytes],
                     confirmed_at_ms: int) -> None:
        """Queue confirmed dispatches for the recorder: everything confirmed while one
        ``record_dispatched`` call runs shares the next (one dispatch-log fsync per bucket).
        Only once recorded are they traced, counted and forgotten; until then they stay in
        flight (a cancel answers ``already_dispatched``)."""
        self._to_record.append(_Confirmed(entries, subject, payloads, confirmed_at_ms))
        if not self._recording:
            self._recording = True
            task = asyncio.create_task(self._recorder(), name="delay-recorder")
            self._dispatch_tasks.add(task)  # stop() waits for it like for a dispatch
            task.add_done_callback(self._dispatch_tasks.discard)

    async def _recorder(self) -> None:
        """Record what ``_record_soon`` queued, one store call per round, until nothing is
        queued. Never raises: a failure is logged (see below)."""
        try:
            while self._to_record:
                waiting, self._to_record = self._to_record, []
                entries = [e for batch in waiting for e in batch.entries]
                subjects = [batch.subject for batch in waiting for _ in batch.entries]
                try:
                    await self._io(self.store.record_dispatched,  # type: ignore[union-attr]
                                   entries, subjects)
                except DiskFull as exc:
                    # The world's fault, expected while the disk is full: no traceback.
                    log.warning("recording %d dispatches failed, disk full; will retry: %s",
                                len(entries), exc)
                    self._unrecorded.extend(entries)
                except Exception:
                    # Delivered but not recorded: a restart would dispatch them again and the
                    # broker's de-duplication absorbs it. They stay out of the wheel.
                    log.exception("recording %d dispatches failed", len(entries))
                    for batch in waiting:
                        self.tracer.gave_up(batch.payloads, batch.confirmed_at_ms,
                                            "dispatch_unrecorded")
                for batch in waiting:
                    self._confirmed(batch)
        finally:
            # Cancelled (stop) with batches queued: stop() records them.
            self._recording = False

    def _confirmed(self, batch: _Confirmed) -> None:
        """A recorded batch: count its lateness, trace it, forget its entries."""
        at_ms = batch.confirmed_at_ms
        self.stats.record(at_ms, [at_ms - e.deliver_at_ms for e in batch.entries])
        if self.tracer.enabled:
            self.tracer.dispatched(batch.payloads, at_ms)
        self._untrack_many(batch.entries)
        if self._resume_at and self._refill_due():
            self._wakeup.set()  # the dispatcher starts the refill

    def _retry(self, entries: list[ScheduleEntry], why: str) -> None:
        now_ms = self.clock()
        for entry in entries:
            key = entry.delay_log_offset
            if key not in self._tracked:
                continue  # cancelled meanwhile
            self._in_flight.discard(key)
            delay_ms = min(self.config.dispatch_retry_ms_max,
                           self._retry_ms.get(key, self.config.dispatch_retry_ms_min // 2) * 2)
            self._retry_ms[key] = delay_ms
            self.wheel.add(entry, now_ms + delay_ms, key)
        log.info("%d dispatches retry (%s)", len(entries), why)
        self._wakeup.set()

    # ------------------------------------------------------------------ cancel

    async def cancel(self, message_id: str, deliver_at_ms: int) -> str:
        """Cancel a pending message: "cancelled", "already_dispatched", "already_cancelled",
        "already_past" (its bucket is finished: too late) or "unknown". A cancelled message is
        never delivered."""
        assert self.store is not None
        # Not while a bucket is being loaded: a load that read the message as pending before
        # the cancel was recorded would put it into the wheel after this looked there, and it
        # would be delivered although the answer was "cancelled".
        async with self._preload_lock:
            return await self._cancel_unloading(message_id, deliver_at_ms)

    async def _cancel_unloading(self, message_id: str, deliver_at_ms: int) -> str:
        assert self.store is not None
        bucket_ms = max(self.bucket_of(deliver_at_ms), self.store.done_before())
        id_hash = zlib.crc32(message_id.encode("utf-8"))
        keys = [k for k in self._keys_of_hash(id_hash) if self._tracked[k].bucket_ms == bucket_ms]
        # Take candidates out of the wheel first, so the dispatcher cannot send one while the
        # cancel is being recorded; put back those that turn out to be another message.
        held = [k for k in keys if k not in self._in_flight]
        for key in held:
            self.wheel.remove(key)
        in_flight = [k for k in keys if k in self._in_flight]
        entries = [self._tracked[k] for k in held + in_flight]
        ids = await self._io(lambda: [self.store.read(e).message_id for e in entries])  # type: ignore[union-attr]
        mine = {e.delay_log_offset for e, i in zip(entries, ids) if i == message_id}
        if mine & set(in_flight) and not (mine & set(held)):
            outcome = "already_dispatched"
        else:
            outcome, subject = await self._io(self.store.cancel_detail, message_id, deliver_at_ms)
            if outcome == "cancelled":
                self.tracer.cancelled(message_id, subject, deliver_at_ms, self.clock())
        for key in held:
            if key in mine and outcome == "cancelled":
                self._untrack(key)
            else:
                entry = self._tracked[key]
                self.wheel.add(entry, self._retry_at(key, entry), key)
        self._wakeup.set()
        return outcome

    def _retry_at(self, key: int, entry: ScheduleEntry) -> int:
        return entry.deliver_at_ms if key not in self._retry_ms else self.clock()

    # ------------------------------------------------------------------ housekeeping

    def _done_candidate(self) -> int:
        """The highest bucket start below which nothing is loaded, in flight or retrying.

        Never past the bucket of now: messages for the current and later buckets may still
        arrive, and the store files a message for a done bucket into the watermark's bucket;
        a watermark in the future would file a message due now into an unloaded bucket.
        """
        candidate = min(self._next_load_ms, self.bucket_of(self.clock()))
        if self._resume_at:  # a part-loaded bucket still has entries on disk only
            candidate = min(candidate, min(self._resume_at))
        if self._bucket_counts:
            candidate = min(candidate, min(self._bucket_counts))
        return candidate

    async def record_unrecorded(self) -> int:
        """Record the confirmed dispatches a full disk held back (housekeeping calls this every
        second); returns how many were recorded, 0 while the disk is still full."""
        if not self._unrecorded or self.store is None:
            return 0
        entries, self._unrecorded = self._unrecorded, []
        try:
            await self._io(self.store.record_dispatched, entries)
        except DiskFull:
            self._unrecorded = entries + self._unrecorded
            return 0
        log.warning("recorded %d dispatches held back by a full disk", len(entries))
        return len(entries)

    async def advance_done(self) -> None:
        """Move the store's done watermark up as far as is safe now (housekeeping does this
        every second; tests call it directly)."""
        await self._io(self._advance_done_io, self._done_candidate())

    def _advance_done_io(self, candidate_ms: int) -> None:
        assert self.store is not None
        if candidate_ms > self.store.done_before():
            try:
                self.store.mark_done_before(candidate_ms)
            except ValueError as exc:
                # A late message was filed below the candidate after it was computed; the
                # store refuses and changes nothing. The next check sees that entry tracked.
                log.debug("done watermark stays at %d: %s", self.store.done_before(), exc)

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(min(DONE_CHECK_INTERVAL_MS, self.config.flush_interval_ms) / 1000)
            try:
                now_ms = self.clock()
                await self._io(self.store.tick, now_ms)  # type: ignore[union-attr]
                if now_ms - self._last_done_check_ms >= DONE_CHECK_INTERVAL_MS:
                    self._last_done_check_ms = now_ms
                    await self.record_unrecorded()
                    await self.advance_done()
            except Exception:
                log.exception("delay housekeeping failed")

    async def report(self) -> dict[str, Any]:
        """Stats for heartbeats and ``qmq admin delay``: pending per hour and subject, dispatch
        rate, lateness histogram, window size."""
        assert self.store is not None
        pending = await self._io(self.store.pending_stats)
        now_ms = self.clock()
        return {
            "pending_total": pending.total,
            "pending_per_hour": {str(k): v for k, v in sorted(pending.per_hour.items())},
            "pending_per_subject": dict(sorted(pending.per_subject.items())),
            "in_memory": len(self._tracked),
            "done_before_ms": self.store.done_before(),
            **self.stats.snapshot(now_ms),
        }


__all__ = ["Scheduler"]
