"""DelayStore's API: append/commit/load_bucket/read, dispatch and cancel, buckets on disk, pending
stats, the done watermark and retention. Tiny limits (1 s buckets, 4 KiB segments), fake times."""

from __future__ import annotations

import os

import pytest

from delayserver.storage import (
    CorruptScheduleEntry,
    DelayStore,
    DelayStoreConfig,
    ScheduleEntry,
    StoreClosed,
)
from delayserver.storage.layout import DAY_MS, HOUR_MS
from logstore import CorruptRecord, RecordTooLarge

NOW_MS = 1_700_000_000_000  # a fixed "now", never the clock
BUCKET_MS = 1_000
TINY = DelayStoreConfig(bucket_ms=BUCKET_MS, segment_size_bytes_max=4096)


@pytest.fixture
def data_dir(tmp_path) -> str:
    return str(tmp_path / "delay")


@pytest.fixture
def store(data_dir):
    opened = DelayStore(data_dir, TINY, now_ms=NOW_MS)
    yield opened
    opened.close()


def send(store: DelayStore, messages) -> list[ScheduleEntry]:
    """Append (id, subject, deliver_at) triples with a payload derived from the id; commit."""
    for message_id, subject, deliver_at in messages:
        store.append(message_id, subject, deliver_at, payload_of(message_id))
    return store.commit()


def payload_of(message_id: str) -> bytes:
    return f"payload of {message_id}".encode() * 3


def pending_ids(store: DelayStore, bucket_ms: int) -> list[str]:
    return [store.read(entry).message_id for entry in store.load_bucket(bucket_ms)]


# ---------------------------------------------------------------------- append, commit, load, read


def test_committed_messages_come_back_from_their_bucket_sorted_by_due_time_with_verbatim_payloads(
    store,
):
    base = NOW_MS + 10_000
    entries = send(store, [("late", "s", base + 900), ("early", "s", base + 100),
                           ("next-bucket", "t", base + 1_000), ("mid", "s", base + 500)])
    assert [e.bucket_ms for e in entries] == [base, base, base + 1_000, base]
    assert [e.index for e in entries] == [0, 1, 0, 2]
    loaded = store.load_bucket(base)
    assert [store.read(e).message_id for e in loaded] == ["early", "mid", "late"]
    record = store.read(loaded[0])
    assert (record.subject, record.deliver_at_ms, record.payload) == (
        "s", base + 100, payload_of("early"))
    assert store.load_bucket(base + 1_000) == [entries[2]]
    assert store.load_bucket(base + 2_000) == []


def test_entries_returned_by_commit_equal_those_loaded_from_the_bucket(store):
    base = NOW_MS + 5_000
    entries = send(store, [(f"m{i}", "s", base + i) for i in range(30)])
    assert store.load_bucket(base) == entries


def test_appended_messages_are_invisible_until_commit_and_an_empty_commit_returns_nothing(store):
    base = NOW_MS + 5_000
    store.append("m1", "s", base, b"x")
    assert store.load_bucket(base) == []
    assert store.cancel("m1", base) == "unknown"
    assert len(store.commit()) == 1
    assert store.commit() == []
    assert len(store.load_bucket(base)) == 1


def test_messages_spread_over_many_buckets_and_segments_all_read_back(store):
    base = NOW_MS
    entries = send(store, [(f"id-{i}", f"subj{i % 4}", base + i * 137) for i in range(400)])
    assert len(os.listdir(os.path.join(store.layout.delaylog_dir))) > 3  # rolled segments
    seen = set()
    for bucket in store.buckets_with_pending(base, base + 400 * 137):
        for entry in store.load_bucket(bucket):
            record = store.read(entry)
            assert record.payload == payload_of(record.message_id)
            assert store.bucket_of(record.deliver_at_ms) == bucket
            seen.add(record.message_id)
    assert seen == {f"id-{i}" for i in range(400)}
    assert len(entries) == 400


def test_bucket_of_is_the_deliver_time_rounded_down_to_the_bucket(store):
    assert store.bucket_of(NOW_MS + 1_999) == NOW_MS + 1_000
    assert store.bucket_of(NOW_MS + 2_000) == NOW_MS + 2_000


@pytest.mark.parametrize("deliver_at", [-1, 1 << 64, 1.5])
def test_a_deliver_time_outside_u64_is_refused(store, deliver_at):
    with pytest.raises(ValueError, match="deliver_at_ms"):
        store.append("m", "s", deliver_at, b"")


def test_an_empty_message_id_or_subject_is_refused(store):
    with pytest.raises(ValueError, match="message id"):
        store.append("", "s", NOW_MS, b"")
    with pytest.raises(ValueError, match="subject"):
        store.append("m", "", NOW_MS, b"")


def test_a_record_at_the_size_limit_is_stored_and_one_byte_more_is_refused(data_dir):
    config = DelayStoreConfig(bucket_ms=BUCKET_MS, segment_size_bytes_max=4096,
                              record_size_bytes_max=1000)
    store = DelayStore(data_dir, config, now_ms=NOW_MS)
    overhead = 20 + len("m") + len("s")
    store.append("m", "s", NOW_MS, b"x" * (1000 - overhead - 1))
    store.append("m", "s", NOW_MS, b"x" * (1000 - overhead))
    with pytest.raises(RecordTooLarge) as caught:
        store.append("m", "s", NOW_MS, b"x" * (1000 - overhead + 1))
    assert caught.value.size_bytes == 1001 and caught.value.limit_bytes == 1000
    assert len(store.commit()) == 2
    store.close()


@pytest.mark.parametrize("key,value", [
    ("bucket_ms", 0), ("bucket_ms", 7_000), ("flush_mode", "never"), ("segment_size_bytes_max", 0),
    ("checkpoint_every_bytes", -1), ("flush_interval_ms", 0),
])
def test_a_bad_config_value_fails_naming_the_key(key, value):
    with pytest.raises(ValueError, match=key):
        DelayStoreConfig(**{key: value})


def test_a_closed_store_refuses_every_call(data_dir):
    store = DelayStore(data_dir, TINY, now_ms=NOW_MS)
    store.close()
    store.close()  # idempotent
    for call in (lambda: store.append("m", "s", NOW_MS, b""), store.commit,
                 lambda: store.load_bucket(NOW_MS), store.pending_stats,
                 lambda: store.cancel("m", NOW_MS), lambda: store.tick(NOW_MS)):
        with pytest.raises(StoreClosed):
            call()


# ---------------------------------------------------------------------- directories


def test_a_40_day_and_a_2_year_deliver_time_land_in_their_day_directories(store):
    forty_days = NOW_MS + 40 * DAY_MS + 12_345
    two_years = NOW_MS + 730 * DAY_MS + 999
    entries = send(store, [("forty", "s", forty_days), ("two-years", "s", two_years)])
    store.sync()
    for entry, deliver_at in zip(entries, (forty_days, two_years)):
        bucket = deliver_at - deliver_at % BUCKET_MS
        assert entry.bucket_ms == bucket
        day_dir = os.path.join(store.layout.schedule_dir, f"{deliver_at // DAY_MS:08d}")
        assert os.listdir(day_dir) == [f"{bucket:020d}.sched"]
        assert os.path.getsize(os.path.join(day_dir, f"{bucket:020d}.sched")) == 32
    assert store.buckets_with_pending(NOW_MS, two_years) == [e.bucket_ms for e in entries]
    assert [store.read(e).message_id for e in store.load_bucket(entries[1].bucket_ms)] == [
        "two-years"]


def test_buckets_with_pending_lists_both_ends_and_skips_buckets_with_nothing_pending(store):
    base = NOW_MS - NOW_MS % HOUR_MS + HOUR_MS  # an hour start
    entries = send(store, [("a", "s", base), ("b", "s", base + 5_000), ("c", "s", base + 9_000),
                           ("d", "s", base + 2 * HOUR_MS)])
    assert store.buckets_with_pending(base, base + 9_000) == [base, base + 5_000, base + 9_000]
    assert store.buckets_with_pending(base + 1, base + 8_999) == [base + 5_000]
    assert store.buckets_with_pending(base + 9_000, base) == []
    store.record_dispatched([entries[3]])  # its hour has nothing pending any more
    assert store.buckets_with_pending(base, base + 3 * HOUR_MS) == [base, base + 5_000,
                                                                     base + 9_000]
    store.record_dispatched([entries[1]])  # same hour as others: known empty once loaded
    assert store.load_bucket(base + 5_000) == []
    assert store.buckets_with_pending(base, base + 3 * HOUR_MS) == [base, base + 9_000]
    send(store, [("e", "s", base + 5_500)])
    assert store.buckets_with_pending(base, base + 3 * HOUR_MS) == [base, base + 5_000,
                                                                     base + 9_000]


# ---------------------------------------------------------------------- dispatch and cancel


def test_dispatched_entries_are_never_loaded_again_even_after_reopen(data_dir):
    store = DelayStore(data_dir, TINY, now_ms=NOW_MS)
    base = NOW_MS + 3_000
    entries = send(store, [(f"m{i}", "s", base + i * 10) for i in range(6)])
    store.record_dispatched(entries[:2] + entries[4:5])
    assert pending_ids(store, base) == ["m2", "m3", "m5"]
    store.close()
    reopened = DelayStore(data_dir, TINY, now_ms=NOW_MS)
    assert pending_ids(reopened, base) == ["m2", "m3", "m5"]
    reopened.record_dispatched(reopened.load_bucket(base))
    assert reopened.load_bucket(base) == []
    reopened.close()


def test_dispatching_an_entry_twice_counts_it_once(store):
    entries = send(store, [("m1", "s", NOW_MS), ("m2", "s", NOW_MS)])
    store.record_dispatched([entries[0], entries[0]])
    store.record_dispatched([entries[0]])
    assert store.pending_stats().total == 1
    dispatched = os.path.join(store.layout.day_dir(NOW_MS // DAY_MS),
                              f"{store.bucket_of(NOW_MS):020d}.dispatched")
    assert os.path.getsize(dispatched) == 28


def test_dispatching_an_entry_the_store_never_indexed_is_refused(store):
    entries = send(store, [("m1", "s", NOW_MS)])
    bogus = ScheduleEntry(entries[0].bucket_ms, 5, NOW_MS, 0, 10, 1)
    with pytest.raises(ValueError, match="not in the schedule"):
        store.record_dispatched([bogus])


def test_a_cancel_before_dispatch_stops_delivery_and_after_dispatch_says_already_dispatched(
    data_dir,
):
    store = DelayStore(data_dir, TINY, now_ms=NOW_MS)
    base = NOW_MS + 7_000
    entries = send(store, [("keep", "s", base + 1), ("drop", "s", base + 2),
                           ("sent", "s", base + 3)])
    store.record_dispatched([entries[2]])
    assert store.cancel("drop", base + 2) == "cancelled"
    assert store.cancel("drop", base + 2) == "already_cancelled"
    assert store.cancel("sent", base + 3) == "already_dispatched"
    assert store.cancel("nobody", base + 2) == "unknown"
    assert store.cancel("keep", base + 500) == "unknown"  # right bucket, wrong due time
    assert pending_ids(store, base) == ["keep"]
    store.close()
    reopened = DelayStore(data_dir, TINY, now_ms=NOW_MS)
    assert pending_ids(reopened, base) == ["keep"]
    assert reopened.cancel("drop", base + 2) == "already_cancelled"
    reopened.close()


def test_a_cancel_confirms_the_id_by_reading_the_record_when_id_hashes_collide(store):
    # "plumless" and "buckeroo" share a CRC-32.
    import zlib
    assert zlib.crc32(b"plumless") == zlib.crc32(b"buckeroo")
    send(store, [("plumless", "s", NOW_MS + 10), ("buckeroo", "s", NOW_MS + 10)])
    assert store.cancel("buckeroo", NOW_MS + 10) == "cancelled"
    assert pending_ids(store, store.bucket_of(NOW_MS)) == ["plumless"]


def test_a_dispatch_of_an_entry_cancelled_meanwhile_does_not_count_twice(store):
    entries = send(store, [("m", "s", NOW_MS), ("n", "s", NOW_MS)])
    assert store.cancel("m", NOW_MS) == "cancelled"
    store.record_dispatched(entries)
    assert store.pending_stats().total == 0
    assert store.cancel("m", NOW_MS) == "already_cancelled"


# ---------------------------------------------------------------------- pending stats


def test_pending_stats_follow_appends_dispatches_and_cancels_and_survive_reopen(data_dir):
    store = DelayStore(data_dir, TINY, now_ms=NOW_MS)
    hour = NOW_MS - NOW_MS % HOUR_MS
    entries = send(store, [("a", "orders", hour + 1_000), ("b", "orders", hour + 2_000),
                           ("c", "refunds", hour + HOUR_MS + 5), ("d", "orders", hour + HOUR_MS)])
    stats = store.pending_stats()
    assert stats.total == 4
    assert stats.per_hour == {hour: 2, hour + HOUR_MS: 2}
    assert stats.per_subject == {"orders": 3, "refunds": 1}
    store.record_dispatched([entries[0]])
    assert store.cancel("c", hour + HOUR_MS + 5) == "cancelled"
    expected = ({hour: 1, hour + HOUR_MS: 1}, {"orders": 2})
    stats = store.pending_stats()
    assert (stats.per_hour, stats.per_subject, stats.total) == (*expected, 2)
    store.close()
    reopened = DelayStore(data_dir, TINY, now_ms=NOW_MS)
    stats = reopened.pending_stats()
    assert (stats.per_hour, stats.per_subject, stats.total) == (*expected, 2)
    reopened.close()


def test_the_subject_count_drops_on_dispatch_even_when_the_record_was_not_read_first(store):
    entries = send(store, [("a", "orders", NOW_MS), ("b", "refunds", NOW_MS)])
    store.record_dispatched([entries[1]])  # never read(): the store reads the subject itself
    assert store.pending_stats().per_subject == {"orders": 1}


# ---------------------------------------------------------------------- watermark and retention


def test_the_done_watermark_is_persisted_and_late_messages_are_filed_at_it(data_dir):
    store = DelayStore(data_dir, TINY, now_ms=NOW_MS)
    assert store.done_before() == 0
    base = NOW_MS - NOW_MS % BUCKET_MS
    entries = send(store, [("old", "s", base), ("new", "s", base + 5_000)])
    store.record_dispatched(entries[:1])
    store.mark_done_before(base + 3_000)
    store.mark_done_before(base + 2_000)  # never goes back
    assert store.done_before() == base + 3_000
    late = send(store, [("late", "s", base + 1_500)])
    assert late[0].bucket_ms == base + 3_000  # not the retired bucket of its due time
    assert store.cancel("late", base + 1_500) == "cancelled"
    store.close()
    reopened = DelayStore(data_dir, TINY, now_ms=NOW_MS)
    assert reopened.done_before() == base + 3_000
    # The late message's bucket may be listed (a superset), but it holds nothing pending.
    assert reopened.buckets_with_pending(0, base + 10_000)[-1] == base + 5_000
    assert reopened.load_bucket(base + 3_000) == []
    assert [reopened.read(e).message_id for e in reopened.load_bucket(base + 5_000)] == ["new"]
    reopened.close()


def test_marking_done_over_a_pending_message_is_refused_and_changes_nothing(store):
    base = NOW_MS - NOW_MS % HOUR_MS
    send(store, [("a", "s", base + 1_000)])
    with pytest.raises(ValueError, match="still has"):
        store.mark_done_before(base + 2_000)
    with pytest.raises(ValueError, match="still has"):
        store.mark_done_before(base + HOUR_MS)
    with pytest.raises(ValueError, match="bucket start"):
        store.mark_done_before(base + 1)
    assert store.done_before() == 0
    assert len(store.load_bucket(base + 1_000)) == 1


def test_retention_deletes_done_bucket_files_and_only_segments_whose_records_are_all_done(
    data_dir,
):
    store = DelayStore(data_dir, TINY, now_ms=NOW_MS)
    base = NOW_MS - NOW_MS % BUCKET_MS
    early = send(store, [(f"e{i}", "s", base + (i % 3) * BUCKET_MS) for i in range(60)])
    later = send(store, [(f"l{i}", "s", base + 10_000 + i) for i in range(60)])
    segments_before = sorted(os.listdir(store.layout.delaylog_dir))
    assert len(segments_before) >= 3
    store.record_dispatched(early)
    store.mark_done_before(base + 3 * BUCKET_MS)
    day_dir = store.layout.day_dir(base // DAY_MS)
    assert not [n for n in os.listdir(day_dir) if int(n.split(".")[0]) < base + 3 * BUCKET_MS]
    segments_after = sorted(os.listdir(store.layout.delaylog_dir))
    assert segments_before[0] not in segments_after  # held only done records
    assert segments_after[-1] == segments_before[-1]
    # Every record still pending is still readable.
    assert sorted(store.read(e).message_id for e in store.load_bucket(base + 10_000)) == sorted(
        f"l{i}" for i in range(60))
    assert store.cancel("e1", base + BUCKET_MS) == "already_past"  # its bucket is retired
    store.close()
    reopened = DelayStore(data_dir, TINY, now_ms=NOW_MS)
    assert len(reopened.load_bucket(base + 10_000)) == len(later)
    assert reopened.pending_stats().total == 60
    reopened.close()


def test_moving_the_watermark_past_a_loaded_and_fully_dispatched_bucket_reads_nothing(
    store, monkeypatch,
):
    """The watermark used to re-read and verify the whole finished bucket on the server's only
    I/O thread, stalling every dispatch behind it at each minute."""
    base = NOW_MS - NOW_MS % HOUR_MS
    send(store, [("later", "s", base + 30_000)])  # keeps the hour pending
    send(store, [(f"m{i}", "s", base + 1_000 + i) for i in range(50)])
    loaded = store.load_bucket(base + 1_000)
    send(store, [("arrived-after-load", "s", base + 1_500)])
    store.record_dispatched(loaded)
    with pytest.raises(ValueError, match="bucket .* still has 1 pending"):
        store.mark_done_before(base + 2_000)
    store.record_dispatched(store.load_bucket(base + 1_000))

    def no_reading(bucket_ms):
        raise AssertionError(f"bucket {bucket_ms} read again")

    monkeypatch.setattr(store, "_bucket_entries", no_reading)
    store.mark_done_before(base + 2_000)
    assert store.done_before() == base + 2_000


def test_a_bucket_not_loaded_since_open_is_checked_by_reading_it_before_the_watermark_passes(
    data_dir,
):
    base = NOW_MS - NOW_MS % HOUR_MS
    store = DelayStore(data_dir, TINY, now_ms=NOW_MS)
    send(store, [("later", "s", base + 30_000)])
    store.record_dispatched(send(store, [("done", "s", base + 1_000)]))
    send(store, [("pending", "s", base + 2_000)])
    store.close()
    reopened = DelayStore(data_dir, TINY, now_ms=NOW_MS)
    assert reopened.bucket_pending(base + 2_000) is None
    with pytest.raises(ValueError, match="bucket .* still has 1 pending"):
        reopened.mark_done_before(base + 3_000)
    reopened.mark_done_before(base + 2_000)
    assert reopened.done_before() == base + 2_000
    reopened.close()


def test_a_cancel_counts_towards_a_loaded_bucket_being_finished(store):
    base = NOW_MS - NOW_MS % HOUR_MS
    send(store, [("later", "s", base + 30_000)])
    entries = send(store, [("a", "s", base + 1_000), ("b", "s", base + 1_001)])
    store.load_bucket(base + 1_000)
    store.record_dispatched(entries[:1])
    assert store.bucket_pending(base + 1_000) == 1
    assert store.cancel("b", base + 1_001) == "cancelled"
    assert store.bucket_pending(base + 1_000) == 0
    store.mark_done_before(base + 2_000)
    assert store.done_before() == base + 2_000


def test_a_hot_slots_payloads_are_read_in_shared_reads_and_equal_single_reads(
    data_dir, monkeypatch,
):
    store = DelayStore(data_dir, DelayStoreConfig(bucket_ms=BUCKET_MS), now_ms=NOW_MS)
    base = NOW_MS - NOW_MS % BUCKET_MS
    entries = send(store, [(f"h{i}", f"s{i % 3}", base + i % 7) for i in range(100)])
    expected = [store.read(e) for e in entries]
    wanted = list(reversed(entries[::2]))  # every other record, out of log order
    preads: list[int] = []
    segment = store._log._segments[-1]
    pread = segment.handle.pread
    monkeypatch.setattr(segment.handle, "pread",
                        lambda at, size: (preads.append(size), pread(at, size))[1])

    def no_single_read(offset):
        raise AssertionError(f"record at {offset} read on its own")

    monkeypatch.setattr(store._log, "read", no_single_read)
    subjects, payloads = store.read_payloads(wanted)
    assert subjects == [r.subject for r in reversed(expected[::2])]
    assert payloads == [r.payload for r in reversed(expected[::2])]
    assert len(preads) == 1  # close together: one read for all fifty
    monkeypatch.undo()
    store.close()


def test_read_payloads_of_sparse_entries_equals_single_reads_and_a_bad_entry_fails_alike(store):
    base = NOW_MS - NOW_MS % BUCKET_MS
    entries = send(store, [(f"s{i}", "s", base + i) for i in range(40)])
    assert store.read_payloads(entries[::10]) == (
        [store.read(e).subject for e in entries[::10]],
        [store.read(e).payload for e in entries[::10]])
    moved = entries[5]
    for bad in (
        ScheduleEntry(moved.bucket_ms, moved.index, moved.deliver_at_ms + 1,
                      moved.delay_log_offset, moved.size_bytes, moved.id_hash),
        ScheduleEntry(moved.bucket_ms, moved.index, moved.deliver_at_ms,
                      moved.delay_log_offset, moved.size_bytes, moved.id_hash ^ 1),
        ScheduleEntry(moved.bucket_ms, moved.index, moved.deliver_at_ms,
                      moved.delay_log_offset + 1, moved.size_bytes, moved.id_hash),
    ):
        with pytest.raises(Exception) as alone:
            store.read(bad)
        assert isinstance(alone.value, (CorruptScheduleEntry, CorruptRecord))
        with pytest.raises(type(alone.value)):
            store.read_payloads(entries[:5] + [bad] + entries[6:])


def test_a_bucket_loaded_slice_by_slice_gives_each_pending_entry_once_in_disk_order(store):
    base = NOW_MS - NOW_MS % BUCKET_MS
    entries = send(store, [(f"m{i}", "s", base + 999 - i % 5) for i in range(23)])
    store.record_dispatched([entries[1], entries[8]])
    assert store.cancel("m9", entries[9].deliver_at_ms) == "cancelled"
    pending = [e for e in entries if e.index not in (1, 8, 9)]
    loaded: list[ScheduleEntry] = []
    resume_at, slices = 0, 0
    while resume_at is not None:
        part, resume_at = store.load_bucket_slice(base, resume_at, limit=6)
        assert len(part) <= 6
        assert part == sorted(part, key=lambda e: (e.deliver_at_ms, e.index))
        loaded += part
        slices += 1
    assert slices == 4  # 20 pending entries, 6 at a time
    assert sorted(loaded, key=lambda e: e.index) == pending
    assert store.bucket_pending(base) == 20  # the first slice counted the whole bucket
    more = send(store, [("late", "s", base + 1)])
    assert store.load_bucket_slice(base, more[0].delay_log_offset, limit=6) == (more, None)


# ---------------------------------------------------------------------- tick


@pytest.mark.parametrize("flush_mode", ["sync", "async"])
def test_a_tick_is_idle_until_a_commit_and_again_once_a_tick_wrote_everything_out(
        data_dir, flush_mode):
    config = DelayStoreConfig(bucket_ms=BUCKET_MS, segment_size_bytes_max=4096,
                              flush_mode=flush_mode, flush_interval_ms=100)
    store = DelayStore(data_dir, config, now_ms=NOW_MS)
    try:
        store.tick(NOW_MS)
        assert store.tick_is_idle(), "a fresh store: nothing to fsync or write"
        send(store, [("m-1", "orders", NOW_MS + 5_000)])
        assert not store.tick_is_idle(), "its schedule entry is buffered (and, async, unsynced)"
        store.tick(NOW_MS + 2_000)  # past the fsync and schedule flush intervals
        assert store.tick_is_idle()
    finally:
        store.close()


def test_a_store_never_ticked_is_not_idle_so_its_first_tick_starts_the_flush_interval(data_dir):
    config = DelayStoreConfig(bucket_ms=BUCKET_MS, segment_size_bytes_max=4096,
                              flush_mode="async", flush_interval_ms=100)
    store = DelayStore(data_dir, config, now_ms=NOW_MS)
    try:
        assert not store.tick_is_idle(), "the flush interval has not started"
        store.tick(NOW_MS)
        assert store.tick_is_idle()
        send(store, [("m-1", "orders", NOW_MS + 5_000)])
        store.tick(NOW_MS + 100)  # one interval after the first tick: the commit is fsynced
        assert store._log.durable_offset == store._log.end_offset
    finally:
        store.close()


def test_a_failed_or_closed_store_is_never_idle_so_its_tick_raises(data_dir):
    store = DelayStore(data_dir, TINY, now_ms=NOW_MS)
    store.close()
    assert not store.tick_is_idle()
    with pytest.raises(StoreClosed):
        store.tick(NOW_MS)
