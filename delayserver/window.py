"""``PreloadWindow``: the in-memory level of the delay server's schedule, as a pure state machine.

It never reads the clock and does no I/O: the scheduler tells it the time (``now_ms``) and what
the store returned, and asks it what to load, what is due and how far the done watermark may
move. It owns every structure of the window and keeps them consistent:

- **loaded** (``tracked``): every entry read from disk or committed into a loaded bucket, keyed
  by its delay-log offset, until it is confirmed or cancelled. Loaded buckets are those below
  ``next_load_ms`` and the one being loaded; a bucket is loaded in part when it had more than
  the window's room (``entries_max``), and then ``resume_at`` holds the delay-log offset of its
  first entry left on disk. Everything of such a bucket from there on, including what is
  committed into it later, is on disk only until the window drains by a quarter
  (``refill_due``) and the next slice is loaded from that offset; later buckets wait for it.
- Every loaded entry is in exactly one of: **waiting** in the timing wheel for its due time (or
  for its retry time), **in flight** (taken by ``take_due``: queued for a dispatch worker, or
  being sent, or confirmed and waiting to be recorded), or **held** by a cancel that is reading
  its id. ``due`` is the in-flight entries no worker has taken yet, in due order.
- **awaiting retry** (``retry_ms``): the backoff of an entry whose dispatch failed; it doubles
  from ``retry_ms_min`` up to ``retry_ms_max`` and is forgotten with the entry.
- **done limit** (``done_limit_ms``): the highest bucket start below which nothing is loaded,
  in flight, held, awaiting retry or left on disk by a part load, and never past the bucket
  of now. The done watermark may move up to it.

Entries are keyed by their delay-log offset: unique per message, stable across a part load
and its resume (an offset, unlike a schedule-file index, says where to resume), and an int,
whose hash costs nothing. A cancel finds loaded entries by the CRC-32 of the message id
(``by_id``), which may be shared by several messages.

Not thread-safe: one owner (the scheduler, on its event loop) calls it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterable, Sequence

from delayserver.config import DelayConfig
from delayserver.storage import ScheduleEntry
from delayserver.wheel import TimingWheel

WINDOW_REFILL_PARTS = 4  # a part-loaded bucket is continued once 1/4 of the window is free


@dataclass(frozen=True)
class WindowLimits:
    """The window's settings (``DelayConfig``'s, by ``from_config``); every one a positive int."""

    bucket_ms: int  # width of one schedule bucket
    preload_buckets: int  # buckets ahead of the bucket of now that are loaded
    entries_max: int  # most loaded entries (DelayConfig.wheel_entries_max)
    tick_ms: int  # the timing wheel's slot width
    retry_ms_min: int  # first dispatch retry delay
    retry_ms_max: int  # dispatch retry delay cap

    @classmethod
    def from_config(cls, config: DelayConfig) -> WindowLimits:
        """The limits a delay server's config sets."""
        return cls(config.bucket_ms, config.preload_buckets, config.wheel_entries_max,
                   config.tick_ms, config.dispatch_retry_ms_min, config.dispatch_retry_ms_max)


class PreloadWindow:
    """The loaded entries of the buckets up to ``preload_buckets`` ahead of now; see the module
    docstring for what it holds and the invariants it keeps (``check_invariants`` asserts
    them)."""

    def __init__(self, limits: WindowLimits, next_load_ms: int) -> None:
        self.limits = limits
        self.wheel = TimingWheel(limits.tick_ms)
        # First bucket not loaded yet (the store's done watermark at start).
        self.next_load_ms = next_load_ms
        self._loading_bucket_ms: int | None = None  # the bucket a load is reading now
        # Part-loaded bucket -> delay-log offset of its first entry not loaded.
        self.resume_at: dict[int, int] = {}
        self.tracked: dict[int, ScheduleEntry] = {}  # delay-log offset -> loaded entry
        self._bucket_counts: dict[int, int] = {}  # bucket -> its loaded entries (never 0)
        # id hash -> the key of the loaded entry with that hash, or a list of keys when several
        # share it. A bare key for the usual single one saves a list (~90 bytes) per entry.
        self._by_id: dict[int, int | list[int]] = {}
        self.in_flight: set[int] = set()  # keys taken by take_due, not confirmed or retried
        self.due: deque[ScheduleEntry] = deque()  # in flight, not taken by a worker yet
        self._held: set[int] = set()  # keys a cancel took out of the wheel meanwhile
        self._retry_ms: dict[int, int] = {}  # key -> its last retry delay

    def __len__(self) -> int:
        """Loaded entries (the window's size, ``qmq_delay_window_messages``)."""
        return len(self.tracked)

    # ------------------------------------------------------------------ buckets

    def bucket_of(self, deliver_at_ms: int) -> int:
        """The start of the bucket ``deliver_at_ms`` falls in."""
        return deliver_at_ms - deliver_at_ms % self.limits.bucket_ms

    def horizon_ms(self, now_ms: int) -> int:
        """The last bucket the window loads at ``now_ms``."""
        limits = self.limits
        return self.bucket_of(now_ms) + limits.preload_buckets * limits.bucket_ms

    def room(self) -> int:
        """Entries that can still be loaded before the window is full (negative: over)."""
        return self.limits.entries_max - len(self.tracked)

    def is_loaded(self, bucket_ms: int) -> bool:
        """Whether ``bucket_ms`` is loaded or being loaded (in part, maybe)."""
        return bucket_ms < self.next_load_ms or bucket_ms == self._loading_bucket_ms

    def refill_due(self) -> bool:
        """A part-loaded bucket waits and the window drained enough to load a good slice of
        it (a quarter of the window), so refills are few and large."""
        return bool(self.resume_at) and (
            self.room() >= max(1, self.limits.entries_max // WINDOW_REFILL_PARTS))

    def load_wanted(self, now_ms: int) -> bool:
        """Whether a load has something to do at ``now_ms``: a bucket within the horizon is not
        loaded yet, or a part-loaded bucket can be continued."""
        return self.horizon_ms(now_ms) >= self.next_load_ms or self.refill_due()

    def take_refill(self) -> tuple[int, int] | None:
        """(bucket, delay-log offset) of the part-loaded bucket to continue now, forgotten as
        part-loaded until the load notes where it stopped (``loaded``); None while the window
        has not drained enough (``refill_due``)."""
        if not self.refill_due():
            return None
        bucket_ms = min(self.resume_at)
        return bucket_ms, self.resume_at.pop(bucket_ms)

    def next_bucket_wanted(self, horizon_ms: int) -> bool:
        """Whether a load should look for the next bucket with pending entries up to
        ``horizon_ms``: one is not loaded yet and there is room. (A load asks ``resume_at``
        first: while a bucket is part-loaded, later buckets wait for it.)"""
        return self.next_load_ms <= horizon_ms and self.room() > 0

    def nothing_pending_until(self, horizon_ms: int) -> None:
        """The store listed no bucket with pending entries from ``next_load_ms`` to
        ``horizon_ms``: all of them count as loaded (a commit into one tracks itself)."""
        assert horizon_ms >= self.next_load_ms, (horizon_ms, self.next_load_ms)
        self.next_load_ms = horizon_ms + self.limits.bucket_ms

    def begin_load(self, bucket_ms: int) -> None:
        """A load of ``bucket_ms``, the first bucket from ``next_load_ms`` the store listed
        with pending entries, starts. The buckets before it had nothing when listed: they count
        as loaded now, so a message committed into one after the listing tracks itself
        (otherwise it stayed on disk, below ``next_load_ms``, and was never dispatched)."""
        assert self._loading_bucket_ms is None, self._loading_bucket_ms
        assert bucket_ms >= self.next_load_ms, (bucket_ms, self.next_load_ms)
        self.next_load_ms = bucket_ms
        self._loading_bucket_ms = bucket_ms

    def end_load(self, bucket_ms: int, *, complete: bool) -> None:
        """The load of ``bucket_ms`` ended: ``complete`` when what fitted of it is loaded (the
        rest, if any, noted by ``loaded``), else it failed and the bucket is loaded again."""
        assert self._loading_bucket_ms == bucket_ms, (self._loading_bucket_ms, bucket_ms)
        self._loading_bucket_ms = None
        if complete:
            self.next_load_ms = bucket_ms + self.limits.bucket_ms

    def slice_entries_max(self) -> int:
        """How many entries a load may read now (at least one, so a load always moves on)."""
        return max(1, self.room())

    def loaded(self, bucket_ms: int, resume_offset: int | None) -> None:
        """A load of ``bucket_ms`` stopped at ``resume_offset`` (None: it read to the end).
        A commit into the bucket meanwhile may have noted an earlier point; the earlier wins,
        and the next load skips what is tracked already."""
        if resume_offset is not None:
            noted = self.resume_at.get(bucket_ms)
            self.resume_at[bucket_ms] = (resume_offset if noted is None
                                         else min(noted, resume_offset))

    def part_loaded(self, bucket_ms: int) -> bool:
        """Whether ``bucket_ms`` has entries left on disk by a part load."""
        return bucket_ms in self.resume_at

    # ------------------------------------------------------------------ loaded entries

    def track(self, entries: Iterable[ScheduleEntry]) -> None:
        """Hold loaded entries until they are due; an entry tracked already is skipped (a load
        re-reads what commits into the bucket tracked meanwhile)."""
        tracked, counts, by_id = self.tracked, self._bucket_counts, self._by_id
        items = []  # for the wheel, in one call
        for entry in entries:
            key = entry.delay_log_offset
            if key in tracked:
                continue
            tracked[key] = entry
            bucket_ms = entry.bucket_ms
            counts[bucket_ms] = counts.get(bucket_ms, 0) + 1
            same_hash = by_id.get(entry.id_hash)
            if same_hash is None:
                by_id[entry.id_hash] = key
            elif type(same_hash) is list:
                same_hash.append(key)
            else:
                by_id[entry.id_hash] = [same_hash, key]
            items.append((entry.deliver_at_ms, key, entry))
        self.wheel.add_items(items)

    def place_committed(self, entries: Sequence[ScheduleEntry]) -> None:
        """Newly committed entries: those of loaded buckets are tracked while there is room.
        When the window is full, such an entry stays on disk, and so does everything committed
        into its bucket after it; the bucket becomes part-loaded from that entry on."""
        resume_at, tracked = self.resume_at, self.tracked
        next_load_ms, loading_ms = self.next_load_ms, self._loading_bucket_ms
        room = self.room()
        to_track = []
        for entry in entries:
            bucket_ms = entry.bucket_ms
            if ((bucket_ms < next_load_ms or bucket_ms == loading_ms)
                    and bucket_ms not in resume_at and entry.delay_log_offset not in tracked):
                if room > 0:
                    to_track.append(entry)
                    room -= 1
                else:
                    resume_at[bucket_ms] = entry.delay_log_offset
        if to_track:
            self.track(to_track)

    def forget(self, entries: Iterable[ScheduleEntry]) -> None:
        """Forget confirmed (recorded) or cancelled entries, wherever they are in the window;
        one no longer tracked is skipped. Lookups are bound once: this runs per dispatched
        batch."""
        tracked_pop, in_flight, by_id = self.tracked.pop, self.in_flight, self._by_id
        retry_ms, held = self._retry_ms, self._held
        per_bucket: dict[int, int] = {}
        for entry in entries:
            key = entry.delay_log_offset
            if tracked_pop(key, None) is None:
                continue  # cancelled meanwhile
            if key in in_flight:  # in flight: take_due already took it out of the wheel
                in_flight.discard(key)
            elif held and key in held:
                held.discard(key)
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
            assert count >= 0, (bucket_ms, count)
            if count:
                bucket_counts[bucket_ms] = count
            else:
                del bucket_counts[bucket_ms]

    def _forget_hash(self, id_hash: int, key: int) -> None:
        keys = self._by_id.get(id_hash)
        if keys == key:
            del self._by_id[id_hash]
        elif type(keys) is list and key in keys:
            keys.remove(key)
            if len(keys) == 1:
                self._by_id[id_hash] = keys[0]

    # ------------------------------------------------------------------ dispatching

    def next_due_ms(self) -> int | None:
        """When the earliest waiting entry is due (rounded up to ``tick_ms``); None if none."""
        return self.wheel.next_due_ms()

    def waiting_between(self, after_ms: int, until_ms: int) -> list[ScheduleEntry]:
        """The entries waiting in the wheel with ``after_ms < deliver_at_ms <= until_ms`` (or
        a retry time in that span), left waiting: the scheduler reads their payloads ahead."""
        return self.wheel.peek_between(after_ms, until_ms)

    def take_due(self, now_ms: int) -> int:
        """Move every waiting entry due at ``now_ms`` into flight and onto the ``due`` queue, in
        due order; returns how many. Never one due after ``now_ms``."""
        due = self.wheel.advance(now_ms)
        if due:
            self.in_flight.update([e.delay_log_offset for e in due])
            self.due.extend(due)
        return len(due)

    def pop_due(self, count: int) -> list[ScheduleEntry]:
        """The first ``count`` entries of the ``due`` queue (fewer if it is shorter), for a
        dispatch worker; they stay in flight."""
        due = self.due
        return [due.popleft() for _ in range(min(count, len(due)))]

    def still_in_flight(self, entries: Iterable[ScheduleEntry]) -> list[ScheduleEntry]:
        """Those of ``entries`` still in flight (not confirmed, retried or cancelled)."""
        in_flight = self.in_flight
        return [e for e in entries if e.delay_log_offset in in_flight]

    def retry(self, entries: Iterable[ScheduleEntry], now_ms: int) -> int:
        """Put in-flight entries whose dispatch failed back into the wheel after their backoff
        (``retry_ms_min`` the first time, doubling up to ``retry_ms_max``); one no longer
        tracked (cancelled meanwhile) is skipped. Returns how many were put back."""
        limits, tracked, retry_ms = self.limits, self.tracked, self._retry_ms
        put_back = 0
        for entry in entries:
            key = entry.delay_log_offset
            if key not in tracked:
                continue
            self.in_flight.discard(key)
            delay_ms = min(limits.retry_ms_max, retry_ms.get(key, limits.retry_ms_min // 2) * 2)
            retry_ms[key] = delay_ms
            self.wheel.add(entry, now_ms + delay_ms, key)
            put_back += 1
        return put_back

    def defer(self, entries: Iterable[ScheduleEntry]) -> int:
        """Put in-flight entries taken ahead of their due time back into the wheel at it (a
        broker did not take the hand-off); one no longer tracked is skipped. Returns how many."""
        tracked, in_flight = self.tracked, self.in_flight
        put_back = 0
        for entry in entries:
            key = entry.delay_log_offset
            if key not in tracked:
                continue
            in_flight.discard(key)
            self.wheel.add(entry, entry.deliver_at_ms, key)
            put_back += 1
        return put_back

    # ------------------------------------------------------------------ cancel

    def hold_for_cancel(self, id_hash: int, bucket_ms: int
                        ) -> tuple[list[ScheduleEntry], list[ScheduleEntry]]:
        """The loaded entries of ``bucket_ms`` whose message id hashes to ``id_hash``, as
        (held, in flight). The waiting ones are taken out of the wheel and held, so nothing
        dispatches them while the cancel reads which is its message; ``release_held`` must
        follow."""
        tracked, in_flight = self.tracked, self.in_flight
        keys = self._by_id.get(id_hash)
        keys = [] if keys is None else keys if type(keys) is list else [keys]
        held: list[ScheduleEntry] = []
        flying: list[ScheduleEntry] = []
        for key in keys:
            entry = tracked[key]
            if entry.bucket_ms != bucket_ms:
                continue
            if key in in_flight:
                flying.append(entry)
            else:
                assert key not in self._held, "one cancel at a time holds entries"
                self.wheel.remove(key)
                self._held.add(key)
                held.append(entry)
        return held, flying

    def release_held(self, held: Sequence[ScheduleEntry], cancelled: set[int],
                     now_ms: int) -> None:
        """End a cancel's hold: forget the held entries whose delay-log offset is in
        ``cancelled``, put the others back into the wheel (at once if they were awaiting a
        retry, else at their due time)."""
        gone = []
        for entry in held:
            key = entry.delay_log_offset
            if key in cancelled:
                gone.append(entry)
                continue
            self._held.discard(key)
            self.wheel.add(entry, entry.deliver_at_ms if key not in self._retry_ms else now_ms,
                           key)
        self.forget(gone)

    # ------------------------------------------------------------------ done watermark

    def done_limit_ms(self, now_ms: int) -> int:
        """The highest bucket start below which nothing is loaded, in flight, held, awaiting a
        retry or left on disk by a part load.

        Never past the bucket of now: messages for the current and later buckets may still
        arrive, and the store files a message for a done bucket into the watermark's bucket;
        a watermark in the future would file a message due now into an unloaded bucket.
        """
        candidate = min(self.next_load_ms, self.bucket_of(now_ms))
        if self.resume_at:  # a part-loaded bucket still has entries on disk only
            candidate = min(candidate, min(self.resume_at))
        if self._bucket_counts:
            candidate = min(candidate, min(self._bucket_counts))
        return candidate

    # ------------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        """Assert that the structures agree (O(n): tests call it, the server does not)."""
        tracked = self.tracked
        waiting = {key for key in tracked if key in self.wheel}
        assert len(self.wheel) == len(waiting), "the wheel holds an entry that is not loaded"
        assert not waiting & self.in_flight and not waiting & self._held, "waiting twice"
        assert not self.in_flight & self._held, "held and in flight"
        assert waiting | self.in_flight | self._held == set(tracked), "an entry is nowhere"
        assert {e.delay_log_offset for e in self.due} <= self.in_flight, "queued, not in flight"
        assert set(self._retry_ms) <= set(tracked), "a retry delay outlives its entry"
        counts: dict[int, int] = {}
        for entry in tracked.values():
            counts[entry.bucket_ms] = counts.get(entry.bucket_ms, 0) + 1
        assert counts == self._bucket_counts, (counts, self._bucket_counts)
        by_id = {h: sorted(k if type(k) is list else [k]) for h, k in self._by_id.items()}
        expected: dict[int, list[int]] = {}
        for key, entry in sorted(tracked.items()):
            expected.setdefault(entry.id_hash, []).append(key)
        assert by_id == expected, "the id index disagrees with what is loaded"


__all__ = ["PreloadWindow", "WindowLimits", "WINDOW_REFILL_PARTS"]
