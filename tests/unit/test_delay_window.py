"""PreloadWindow alone, told the time: what is loaded, due, in flight, held by a cancel and
awaiting retry, the window cap and the part-loaded bucket's resume offset, and how far the done
watermark may move. The same edge cases the scheduler's race tests (test_delay_scheduler_races)
and docs/OPERATIONS.md describe, here without a store, a thread or an event loop."""

from __future__ import annotations

import random

import pytest

from delayserver.storage import ScheduleEntry
from delayserver.window import PreloadWindow, WindowLimits

BUCKET_MS = 1_000
NOW_MS = 100 * BUCKET_MS  # the fake clock's start: the start of bucket 100


def limits(**overrides: int) -> WindowLimits:
    values = dict(bucket_ms=BUCKET_MS, preload_buckets=2, entries_max=100, tick_ms=1,
                  retry_ms_min=100, retry_ms_max=400)
    values.update(overrides)
    return WindowLimits(**values)


def window(next_load_ms: int = NOW_MS, **overrides: int) -> PreloadWindow:
    return PreloadWindow(limits(**overrides), next_load_ms)


def entry(offset: int, deliver_at_ms: int, *, id_hash: int | None = None,
          bucket_ms: int | None = None) -> ScheduleEntry:
    """A schedule entry whose delay-log offset is ``offset`` (its key in the window)."""
    return ScheduleEntry(
        bucket_ms=deliver_at_ms - deliver_at_ms % BUCKET_MS if bucket_ms is None else bucket_ms,
        index=offset, deliver_at_ms=deliver_at_ms, delay_log_offset=offset, size_bytes=10,
        id_hash=offset if id_hash is None else id_hash)


def load(w: PreloadWindow, bucket_ms: int, entries: list[ScheduleEntry],
         resume_offset: int | None = None) -> None:
    """What the scheduler's loader does with one listed bucket, minus the store."""
    w.begin_load(bucket_ms)
    w.track(entries)
    w.loaded(bucket_ms, resume_offset)
    w.end_load(bucket_ms, complete=True)


def offsets(entries: list[ScheduleEntry]) -> list[int]:
    return [e.delay_log_offset for e in entries]


def take(w: PreloadWindow, now_ms: int) -> list[ScheduleEntry]:
    """Everything due at ``now_ms``, taken off the due queue as a worker would."""
    w.take_due(now_ms)
    taken = w.pop_due(10**9)
    w.check_invariants()
    return taken


# ---------------------------------------------------------------------- due, in flight, retry


def test_a_loaded_entry_is_not_due_one_ms_before_its_time_and_is_in_flight_at_its_time():
    w = window()
    load(w, NOW_MS, [entry(1, NOW_MS + 500)])
    assert take(w, NOW_MS + 499) == []
    assert w.next_due_ms() == NOW_MS + 500
    assert offsets(take(w, NOW_MS + 500)) == [1]
    assert w.in_flight == {1} and len(w) == 1, "in flight until confirmed"
    w.forget([entry(1, NOW_MS + 500)])
    assert len(w) == 0 and w.in_flight == set()
    w.check_invariants()


def test_due_entries_are_queued_in_due_order_and_workers_take_them_from_the_front():
    w = window()
    load(w, NOW_MS, [entry(1, NOW_MS + 30), entry(2, NOW_MS + 10), entry(3, NOW_MS + 20)])
    assert w.take_due(NOW_MS + 30) == 3
    assert offsets(w.pop_due(2)) == [2, 3]
    assert offsets(w.pop_due(2)) == [1]
    assert w.pop_due(2) == []
    assert w.in_flight == {1, 2, 3}


def test_a_failed_dispatch_is_retried_after_a_backoff_that_doubles_up_to_its_cap():
    w = window(retry_ms_min=100, retry_ms_max=400)
    e = entry(1, NOW_MS)
    load(w, NOW_MS, [e])
    now_ms = NOW_MS
    gaps = []
    for _ in range(5):
        assert offsets(take(w, now_ms)) == [1]
        assert w.retry([e], now_ms) == 1
        w.check_invariants()
        due_ms = w.next_due_ms()
        assert due_ms is not None
        assert take(w, due_ms - 1) == [], "never before the backoff is over"
        gaps.append(due_ms - now_ms)
        now_ms = due_ms
    assert gaps == [100, 200, 400, 400, 400]


def test_a_retry_of_an_entry_cancelled_meanwhile_is_dropped():
    w = window()
    e = entry(1, NOW_MS)
    load(w, NOW_MS, [e])
    take(w, NOW_MS)
    w.forget([e])  # cancelled (or confirmed) while its dispatch was failing
    assert w.retry([e], NOW_MS) == 0
    assert len(w) == 0 and w.next_due_ms() is None
    w.check_invariants()


def test_entries_still_in_flight_are_those_neither_confirmed_nor_retried():
    w = window()
    a, b, c = entry(1, NOW_MS), entry(2, NOW_MS), entry(3, NOW_MS)
    load(w, NOW_MS, [a, b, c])
    take(w, NOW_MS)
    w.forget([a])
    w.retry([b], NOW_MS)
    assert offsets(w.still_in_flight([a, b, c])) == [3]


# ---------------------------------------------------------------------- loading and the horizon


def test_a_load_is_wanted_while_a_bucket_within_the_horizon_is_not_loaded():
    w = window(next_load_ms=NOW_MS, preload_buckets=2)
    assert w.horizon_ms(NOW_MS + 999) == NOW_MS + 2 * BUCKET_MS
    assert w.load_wanted(NOW_MS)
    w.nothing_pending_until(w.horizon_ms(NOW_MS))
    assert w.next_load_ms == NOW_MS + 3 * BUCKET_MS
    assert not w.load_wanted(NOW_MS + 999)
    assert w.load_wanted(NOW_MS + BUCKET_MS), "the next bucket enters the window"


def test_a_commit_into_a_loaded_bucket_is_tracked_and_one_beyond_the_window_stays_on_disk():
    w = window(next_load_ms=NOW_MS + 3 * BUCKET_MS)
    near, far = entry(1, NOW_MS + 2 * BUCKET_MS + 5), entry(2, NOW_MS + 3 * BUCKET_MS)
    w.place_committed([near, far])
    assert set(w.tracked) == {1}
    w.check_invariants()


def test_a_message_for_an_empty_bucket_stored_while_a_later_bucket_loads_is_tracked():
    # The loader listed bucket 105 as the first with pending entries; bucket 104 had nothing
    # then. A message committed into 104 after the listing must track itself: the loader will
    # not look at 104 again.
    w = window(next_load_ms=NOW_MS)
    w.begin_load(NOW_MS + 5 * BUCKET_MS)
    assert w.is_loaded(NOW_MS + 4 * BUCKET_MS) and w.is_loaded(NOW_MS + 5 * BUCKET_MS)
    w.place_committed([entry(1, NOW_MS + 4 * BUCKET_MS + 10)])
    w.track([entry(2, NOW_MS + 5 * BUCKET_MS + 10)])
    w.loaded(NOW_MS + 5 * BUCKET_MS, None)
    w.end_load(NOW_MS + 5 * BUCKET_MS, complete=True)
    assert w.next_load_ms == NOW_MS + 6 * BUCKET_MS
    assert offsets(take(w, NOW_MS + 6 * BUCKET_MS)) == [1, 2]


def test_a_failed_load_leaves_its_bucket_to_be_loaded_again():
    w = window(next_load_ms=NOW_MS)
    w.begin_load(NOW_MS + BUCKET_MS)
    w.end_load(NOW_MS + BUCKET_MS, complete=False)
    assert w.next_load_ms == NOW_MS + BUCKET_MS
    assert not w.is_loaded(NOW_MS + BUCKET_MS)
    assert w.next_bucket_wanted(w.horizon_ms(NOW_MS))


def test_a_load_skips_entries_that_commits_tracked_while_it_read_the_bucket():
    w = window()
    e = entry(1, NOW_MS + 10)
    w.begin_load(NOW_MS)
    w.place_committed([e])
    w.track([e, entry(2, NOW_MS + 20)])
    w.loaded(NOW_MS, None)
    w.end_load(NOW_MS, complete=True)
    assert len(w) == 2
    assert offsets(take(w, NOW_MS + 20)) == [1, 2], "each entry once"


# ---------------------------------------------------------------------- the window cap


def test_a_bucket_larger_than_the_window_is_loaded_in_part_and_resumed_from_its_offset():
    w = window(entries_max=8)
    bucket = [entry(offset, NOW_MS + 100) for offset in range(0, 200, 10)]  # 20 entries
    assert w.slice_entries_max() == 8
    load(w, NOW_MS, bucket[:8], resume_offset=bucket[8].delay_log_offset)
    assert w.part_loaded(NOW_MS) and w.resume_at == {NOW_MS: 80}
    assert w.room() == 0 and not w.next_bucket_wanted(w.horizon_ms(NOW_MS))
    assert w.take_refill() is None, "nothing drained yet"
    dispatched = take(w, NOW_MS + 100)
    w.forget(dispatched[:1])
    assert not w.refill_due(), "a refill waits for a quarter of the window"
    w.forget(dispatched[1:2])
    assert w.refill_due() and w.load_wanted(NOW_MS + 100)
    assert w.take_refill() == (NOW_MS, 80)
    assert not w.part_loaded(NOW_MS), "until the refill says where it stopped"
    assert w.slice_entries_max() == 2
    w.track(bucket[8:10])
    w.loaded(NOW_MS, bucket[10].delay_log_offset)
    assert w.resume_at == {NOW_MS: 100}
    w.check_invariants()


def test_a_commit_into_a_full_window_stays_on_disk_and_so_does_everything_after_it():
    w = window(entries_max=2)
    load(w, NOW_MS, [])
    w.place_committed([entry(1, NOW_MS + 10), entry(2, NOW_MS + 20), entry(3, NOW_MS + 5)])
    assert set(w.tracked) == {1, 2}
    assert w.resume_at == {NOW_MS: 3}, "resumes at the first entry left on disk"
    w.forget([w.tracked[1], w.tracked[2]])
    w.place_committed([entry(4, NOW_MS + 30)])
    assert set(w.tracked) == set(), "the bucket is part-loaded: later commits wait on disk"
    assert w.take_refill() == (NOW_MS, 3)


def test_a_load_that_stopped_later_than_a_commit_noted_resumes_from_the_commit():
    w = window(entries_max=1)
    w.track([entry(1, NOW_MS + BUCKET_MS)])  # the window is full
    w.begin_load(NOW_MS)
    w.place_committed([entry(50, NOW_MS + 5)])  # noted: resume at 50
    w.loaded(NOW_MS, 70)  # the load read up to 70 before it ran out of room
    w.end_load(NOW_MS, complete=True)
    assert w.resume_at == {NOW_MS: 50}, "the earlier of the two wins"


def test_later_buckets_wait_for_a_part_loaded_bucket():
    w = window(entries_max=4)
    load(w, NOW_MS, [entry(1, NOW_MS + 1)], resume_offset=2)
    w.forget(take(w, NOW_MS + 1))
    assert w.room() == 4 and w.resume_at
    # The loader continues the part-loaded bucket before it looks at later ones.
    assert w.take_refill() == (NOW_MS, 2)


def test_a_load_always_reads_at_least_one_entry_so_it_moves_on():
    w = window(entries_max=1)
    w.track([entry(1, NOW_MS + 1), entry(2, NOW_MS + 2)])
    assert w.room() == -1 and w.slice_entries_max() == 1


# ---------------------------------------------------------------------- cancel


def test_a_cancel_holds_the_candidates_so_they_are_not_due_while_it_reads_them():
    w = window()
    mine, other = entry(1, NOW_MS + 10, id_hash=7), entry(2, NOW_MS + 10, id_hash=7)
    load(w, NOW_MS, [mine, other])
    held, flying = w.hold_for_cancel(7, NOW_MS)
    assert offsets(held) == [1, 2] and flying == []
    assert take(w, NOW_MS + 10) == [], "held: not due while the cancel reads"
    w.release_held(held, {1}, NOW_MS + 10)
    assert set(w.tracked) == {2}
    assert offsets(take(w, NOW_MS + 10)) == [2], "another message with the same hash stays"


def test_a_cancel_that_cancelled_nothing_puts_every_held_entry_back_at_its_due_time():
    w = window()
    e = entry(1, NOW_MS + 500, id_hash=7)
    load(w, NOW_MS, [e])
    held, _ = w.hold_for_cancel(7, NOW_MS)
    w.release_held(held, set(), NOW_MS)
    assert w.next_due_ms() == NOW_MS + 500
    w.check_invariants()


def test_a_held_entry_that_was_awaiting_a_retry_goes_back_due_at_once():
    w = window()
    e = entry(1, NOW_MS, id_hash=7)
    load(w, NOW_MS, [e])
    take(w, NOW_MS)
    w.retry([e], NOW_MS)
    held, _ = w.hold_for_cancel(7, NOW_MS)
    w.release_held(held, set(), NOW_MS + 1)
    assert w.next_due_ms() == NOW_MS + 1


def test_a_cancel_finds_in_flight_entries_without_holding_them():
    w = window()
    e = entry(1, NOW_MS, id_hash=7)
    load(w, NOW_MS, [e])
    take(w, NOW_MS)
    held, flying = w.hold_for_cancel(7, NOW_MS)
    assert held == [] and offsets(flying) == [1]
    w.release_held(held, set(), NOW_MS)
    assert w.in_flight == {1}


def test_a_cancel_looks_only_at_the_bucket_it_names():
    w = window()
    load(w, NOW_MS, [entry(1, NOW_MS + 10, id_hash=7)])
    load(w, NOW_MS + BUCKET_MS, [entry(2, NOW_MS + BUCKET_MS + 10, id_hash=7)])
    held, flying = w.hold_for_cancel(7, NOW_MS + BUCKET_MS)
    assert offsets(held) == [2] and flying == []
    w.release_held(held, set(), NOW_MS)
    w.check_invariants()


# ---------------------------------------------------------------------- the done limit


def test_the_done_limit_never_passes_the_bucket_of_now_or_the_first_bucket_not_loaded():
    w = window(next_load_ms=NOW_MS + 3 * BUCKET_MS)
    assert w.done_limit_ms(NOW_MS + 10) == NOW_MS
    assert w.done_limit_ms(NOW_MS + 10 * BUCKET_MS) == NOW_MS + 3 * BUCKET_MS


@pytest.mark.parametrize("state", ["loaded", "in_flight", "held", "awaiting_retry",
                                   "confirmed_not_recorded"])
def test_the_done_limit_stays_at_a_bucket_with_an_entry_that_is_not_forgotten(state):
    w = window(next_load_ms=NOW_MS + 5 * BUCKET_MS)
    e = entry(1, NOW_MS + BUCKET_MS + 10, id_hash=7)
    w.track([e])
    later_ms = NOW_MS + 4 * BUCKET_MS
    if state in ("in_flight", "awaiting_retry", "confirmed_not_recorded"):
        take(w, e.deliver_at_ms)
    if state == "awaiting_retry":
        w.retry([e], e.deliver_at_ms)
    if state == "held":
        w.hold_for_cancel(7, e.bucket_ms)
    assert w.done_limit_ms(later_ms) == e.bucket_ms
    w.forget([e])  # recorded, or cancelled
    assert w.done_limit_ms(later_ms) == later_ms


def test_the_done_limit_stays_at_a_part_loaded_bucket_with_nothing_loaded():
    w = window(next_load_ms=NOW_MS + 5 * BUCKET_MS)
    w.resume_at[NOW_MS + BUCKET_MS] = 40
    assert w.done_limit_ms(NOW_MS + 4 * BUCKET_MS) == NOW_MS + BUCKET_MS


# ---------------------------------------------------------------------- every operation


def test_a_random_walk_of_loads_commits_dispatches_retries_and_cancels_keeps_the_invariants():
    rng = random.Random(12)
    w = window(next_load_ms=NOW_MS, entries_max=30)
    now_ms = NOW_MS
    next_offset = 0
    dispatched: set[int] = set()
    for _ in range(2_000):
        step = rng.randrange(7)
        if step == 0:  # commits, some into loaded buckets, some beyond the window
            fresh = [entry(next_offset + i, now_ms + rng.randrange(4 * BUCKET_MS),
                           id_hash=rng.randrange(8)) for i in range(rng.randrange(1, 6))]
            next_offset += len(fresh)
            w.place_committed(fresh)
        elif step == 1:
            w.take_due(now_ms)
        elif step == 2 and w.due:  # a worker's batch: some confirmed, some retried
            batch = w.pop_due(rng.randrange(1, 5))
            confirmed = [e for e in batch if rng.random() < 0.7]
            w.retry([e for e in batch if e not in confirmed], now_ms)
            w.forget(confirmed)
            dispatched.update(e.delay_log_offset for e in confirmed)
        elif step == 3:  # a cancel of one of the hashes
            id_hash = rng.randrange(8)
            held, _ = w.hold_for_cancel(id_hash, w.bucket_of(now_ms))
            w.release_held(held, {e.delay_log_offset for e in held[:1]}, now_ms)
        elif step == 4 and w.next_bucket_wanted(w.horizon_ms(now_ms)) and not w.resume_at:
            w.nothing_pending_until(w.horizon_ms(now_ms))
        else:
            now_ms += rng.randrange(50)
        w.check_invariants()
        assert all(e.deliver_at_ms <= now_ms for e in w.due), "never early"
        assert not dispatched & set(w.tracked), "a confirmed entry is never loaded again"
        assert w.done_limit_ms(now_ms) <= min(
            [w.bucket_of(now_ms)] + [e.bucket_ms for e in w.tracked.values()])
