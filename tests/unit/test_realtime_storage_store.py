"""MessageStore behaviour: batches, reads, scans with tag filters, dedup, disk faults."""

from __future__ import annotations

import dataclasses
import errno
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from logstore import DiskFull, LogWriteFailed, OutOfDescriptors
from logstore.faults import FaultPlan
from realtime.storage import MessageStore, SequenceOutOfRange, StoreClosed, StoreConfig

# 4 KiB segments and 4 entries per consumer-log file: every test rolls both.
TINY = StoreConfig(
    segment_size_bytes_max=4096,
    record_size_bytes_max=2048,
    consumer_log_entries_per_file=4,
    write_buffer_bytes_max=1024,
    checkpoint_interval_bytes=2048,
    dedup_window_ms=60_000,
    # Segments grow as they are written: these tests fill the disk through writes and tear
    # files by their size (allocating ahead: test_logstore_prealloc.py).
    preallocate_step_bytes=0,
)
T0 = 1_700_000_000_000


def payload_of(subject: str, index: int) -> bytes:
    # Not valid UTF-8 and with every byte value, so any re-encoding would show.
    return bytes([index % 256, 0xFF, 0x00]) + f"{subject}#{index}".encode() + bytes(range(256))[: index % 97]


@pytest.fixture
def data_dir(tmp_path) -> str:
    return str(tmp_path / "data")


def open_store(data_dir, config=TINY, now_ms=T0, **kwargs) -> MessageStore:
    return MessageStore(data_dir, config, now_ms=now_ms, **kwargs)


def test_sequences_are_dense_per_subject_and_reads_return_the_payload_bytes(data_dir):
    store = open_store(data_dir)
    subjects = ["order.created", "%retry%order.created%billing", "pay"]
    expected = {s: [] for s in subjects}
    for batch in range(6):
        for i in range(7):
            subject = subjects[(batch + i) % 3]
            index = len(expected[subject])
            appended = store.append(subject, f"{subject}-{index}", [index], T0 + batch, payload_of(subject, index))
            assert appended.sequence == index and not appended.duplicate
            expected[subject].append(payload_of(subject, index))
        results = store.commit()
        assert [r.sequence for r in results if r.subject == subjects[0]] == sorted(
            r.sequence for r in results if r.subject == subjects[0])
    assert store.subjects() == sorted(subjects)
    assert store.end_sequences() == {s: len(p) for s, p in expected.items()}
    for subject, payloads in expected.items():
        assert store.first_sequence(subject) == 0
        for sequence, payload in enumerate(payloads):
            message = store.read(subject, sequence)
            assert (message.subject, message.sequence, message.message_id) == (
                subject, sequence, f"{subject}-{sequence}")
            assert message.payload == payload
            assert message.tag_bloom == 1 << (sequence % 64)
    store.close()


def test_appends_are_invisible_until_commit(data_dir):
    store = open_store(data_dir)
    appended = store.append("s", "a", [], T0, b"x")
    assert appended.sequence == 0
    assert store.end_sequence("s") == 0 and store.subjects() == []
    with pytest.raises(SequenceOutOfRange, match=r"sequence 0 of subject 's'.*\[0, 0\)"):
        store.read("s", 0)
    assert store.scan("s", 0, 10) == ([], 0)
    assert store.commit() == [appended]
    assert store.read("s", 0).payload == b"x"
    assert store.commit() == []
    store.close()


def test_an_unknown_subject_has_no_sequences(data_dir):
    store = open_store(data_dir)
    assert (store.first_sequence("nope"), store.end_sequence("nope")) == (0, 0)
    with pytest.raises(SequenceOutOfRange):
        store.scan("nope", 1, 10)
    store.close()


def test_a_read_past_the_end_says_it_has_not_been_written(data_dir):
    store = open_store(data_dir)
    store.append("s", "a", [], T0, b"x")
    store.commit()
    with pytest.raises(SequenceOutOfRange, match="not been written yet") as info:
        store.read("s", 1)
    assert (info.value.first_sequence, info.value.end_sequence) == (0, 1)
    store.close()


def fill_tagged(store):
    # sequence i carries tag hash i % 3 (0, 1, 2); every 5th also 64 + 7 (bit 7).
    for i in range(30):
        hashes = [i % 3] + ([64 + 7] if i % 5 == 0 else [])
        store.append("s", f"m{i}", hashes, T0, f"{i}".encode())
    store.commit()


def test_scan_with_tags_returns_only_messages_whose_bloom_matches_any_tag(data_dir):
    store = open_store(data_dir)
    fill_tagged(store)
    messages, next_sequence = store.scan("s", 0, 100, [1])
    assert [m.sequence for m in messages] == [i for i in range(30) if i % 3 == 1]
    assert next_sequence == 30
    messages, _ = store.scan("s", 0, 100, [1, 2])
    assert [m.sequence for m in messages] == [i for i in range(30) if i % 3 != 0]
    assert [m.sequence for m in store.scan("s", 0, 100, [99])[0]] == []
    assert [m.sequence for m in store.scan("s", 0, 100, None)[0]] == list(range(30))
    assert [m.sequence for m in store.scan("s", 0, 100, [])[0]] == list(range(30))
    store.close()


def test_scan_is_a_bloom_prefilter_so_a_colliding_tag_hash_also_matches(data_dir):
    # Decided contract: the caller checks exact tags; hash 7 shares bit 7 with hash 71.
    store = open_store(data_dir)
    fill_tagged(store)
    messages, _ = store.scan("s", 0, 100, [7])
    assert [m.sequence for m in messages] == [0, 5, 10, 15, 20, 25]
    store.close()


def test_scan_stops_at_max_count_and_max_entries_and_says_where_to_continue(data_dir):
    store = open_store(data_dir)
    fill_tagged(store)
    messages, next_sequence = store.scan("s", 2, 3, [1])
    assert [m.sequence for m in messages] == [4, 7, 10]
    assert next_sequence == 11
    messages, next_sequence = store.scan("s", 11, 100, [1], max_entries=5)
    assert [m.sequence for m in messages] == [13]
    assert next_sequence == 16
    assert store.scan("s", 30, 10) == ([], 30)
    assert store.scan("s", 0, 0) == ([], 0)
    store.close()


def test_a_message_without_tags_never_matches_a_tag_filter(data_dir):
    store = open_store(data_dir)
    store.append("s", "untagged", [], T0, b"u")
    store.commit()
    assert store.read("s", 0).tag_bloom == 0
    assert store.scan("s", 0, 10, [0])[0] == []
    assert len(store.scan("s", 0, 10)[0]) == 1
    store.close()


def test_the_same_id_within_the_window_is_a_duplicate_of_the_original(data_dir):
    store = open_store(data_dir)
    store.append("s", "other", [], T0, b"0")
    store.append("s", "dup", [], T0, b"1")
    store.commit()
    again = store.append("s", "dup", [], T0 + TINY.dedup_window_ms - 1, b"resend")
    assert again.duplicate and again.sequence == 1
    assert store.commit() == [again]
    assert store.end_sequence("s") == 2
    assert store.read("s", 1).payload == b"1"
    # The same id on another subject is a different message.
    assert not store.append("t", "dup", [], T0, b"t").duplicate
    store.close()


def test_the_same_id_after_the_window_is_stored_again(data_dir):
    store = open_store(data_dir)
    store.append("s", "dup", [], T0, b"1")
    store.commit()
    later = store.append("s", "dup", [], T0 + TINY.dedup_window_ms, b"2")
    assert not later.duplicate and later.sequence == 1
    store.commit()
    assert store.read("s", 1).payload == b"2"
    assert store.append("s", "dup", [], T0 + TINY.dedup_window_ms + 1, b"3").sequence == 1
    store.close()


def test_the_same_id_twice_in_one_batch_is_stored_once(data_dir):
    store = open_store(data_dir)
    first = store.append("s", "dup", [], T0, b"1")
    second = store.append("s", "dup", [], T0, b"2")
    assert (first.sequence, first.duplicate) == (0, False)
    assert (second.sequence, second.duplicate) == (None, True)
    assert store.commit() == [first, second]
    assert store.end_sequence("s") == 1
    assert store.read("s", 0).payload == b"1"
    store.close()


def test_dedup_survives_a_reopen_within_the_window(data_dir):
    store = open_store(data_dir)
    for i in range(20):
        store.append("s", f"id{i}", [], T0 + i, b"x" * 300)
    store.commit()
    store.close()
    store = open_store(data_dir, now_ms=T0 + 1000)
    assert store.recovery.dedup_ids_rebuilt == 20
    resend = store.append("s", "id3", [], T0 + 1000, b"again")
    assert resend.duplicate and resend.sequence == 3
    store.close()
    # Past the window, a reopen rebuilds nothing and the id is new again.
    store = open_store(data_dir, now_ms=T0 + 19 + TINY.dedup_window_ms)
    assert not store.append("s", "id3", [], T0 + 19 + TINY.dedup_window_ms, b"new").duplicate
    store.close()


def test_tick_prunes_ids_older_than_the_window(data_dir):
    store = open_store(data_dir)
    store.append("s", "a", [], T0, b"x")
    store.commit()
    store.tick(T0 + TINY.dedup_window_ms - 1)
    assert len(store._dedup) == 1
    store.tick(T0 + TINY.dedup_window_ms)
    assert len(store._dedup) == 0
    store.close()


def test_dedup_ids_max_forgets_the_oldest_ids_first(data_dir):
    store = open_store(data_dir, StoreConfig(consumer_log_entries_per_file=4, dedup_ids_max=2))
    for name in ("a", "b", "c"):
        store.append("s", name, [], T0, b"x")
    store.commit()
    assert not store.append("s", "a", [], T0, b"x").duplicate
    assert store.append("s", "c", [], T0, b"x").duplicate
    store.close()


def test_sync_mode_commits_a_batch_with_one_message_log_fsync(data_dir):
    plan = FaultPlan()
    store = open_store(data_dir, StoreConfig(consumer_log_entries_per_file=4),
                       opener=plan.opener)
    syncs = plan.syncs
    for i in range(50):
        store.append(f"s{i % 5}", f"id{i}", [], T0, b"x" * 100)
    store.commit()
    assert plan.syncs - syncs == 1
    store.close()


def test_async_mode_commits_without_fsync_and_tick_fsyncs_on_the_interval(data_dir):
    plan = FaultPlan()
    config = StoreConfig(flush_mode="async", flush_interval_ms=100,
                         consumer_log_entries_per_file=4)
    store = open_store(data_dir, config, opener=plan.opener)
    store.tick(T0)
    syncs = plan.syncs
    store.append("s", "a", [], T0, b"x")
    store.commit()
    assert store.read("s", 0).payload == b"x"
    assert plan.syncs == syncs
    store.tick(T0 + 99)
    assert plan.syncs == syncs
    store.tick(T0 + 100)
    assert plan.syncs > syncs
    store.close()


def test_a_commit_that_hits_a_full_disk_drops_the_batch_and_a_later_one_works(data_dir):
    plan = FaultPlan()
    store = open_store(data_dir, opener=plan.opener)
    for i in range(6):
        store.append("s", f"old{i}", [1], T0, payload_of("s", i))
    store.commit()
    # Room for part of the next batch: some of it reaches the file before the disk fills.
    plan.disk_capacity_bytes = plan.bytes_written + 1500
    for i in range(12):
        store.append("s", f"new{i}", [1], T0, b"n" * 200)
    with pytest.raises(DiskFull):
        store.commit()
    assert store.end_sequence("s") == 6
    with pytest.raises(SequenceOutOfRange):
        store.read("s", 6)
    assert [m.message_id for m in store.scan("s", 0, 100)[0]] == [f"old{i}" for i in range(6)]
    # The dropped ids were never stored, so they are not duplicates.
    plan.free_space(1 << 20)
    again = store.append("s", "new0", [1], T0, b"retry")
    assert (again.sequence, again.duplicate) == (6, False)
    store.commit()
    assert store.read("s", 6).payload == b"retry"
    for i in range(6):
        assert store.read("s", i).payload == payload_of("s", i)
    store.close()
    # Records of the dropped batch left in the message log never come back over a reuse.
    store = open_store(data_dir, now_ms=T0 + 1)
    assert store.end_sequence("s") == 7
    assert store.read("s", 6).payload == b"retry"
    assert [m.message_id for m in store.scan("s", 0, 100)[0]] == (
        [f"old{i}" for i in range(6)] + ["new0"])
    store.close()


def test_a_slave_copies_past_a_commit_that_hit_a_full_disk_part_way(tmp_path):
    # review s14 rvb-2: the part of the batch written before the disk filled stayed in the
    # master's message log, and a slave copying it indexed it, then refused the master's
    # real record of the same sequence (CorruptRecord) and stopped copying.
    plan = FaultPlan()
    master = MessageStore(str(tmp_path / "m"), TINY, opener=plan.opener, now_ms=T0)
    slave = MessageStore(str(tmp_path / "s"), TINY, now_ms=T0)
    for i in range(6):
        master.append("s", f"old{i}", [1], T0, payload_of("s", i))
    master.commit()
    start = master.copy_bounds()[1]
    plan.disk_capacity_bytes = plan.bytes_written + 1500  # part of the next batch fits
    for i in range(12):
        master.append("s", f"new{i}", [1], T0, b"n" * 200)
    with pytest.raises(DiskFull):
        master.commit()
    assert master.copy_bounds()[1] == start, "the dropped batch's first records stay"
    plan.free_space(1 << 20)
    master.append("s", "new0", [1], T0, b"retry")  # the producer's resend: sequence 6
    master.commit()
    offset, end = slave.copy_bounds()[1], master.copy_bounds()[1]
    while offset < end:  # as a slave's fetches copy it
        offset = slave.append_copy(offset, master.read_copy(offset, 1 << 20))
    assert slave.read("s", 6).payload == b"retry"
    assert slave.end_sequence("s") == master.end_sequence("s") == 7
    master.close()
    slave.close()


def test_a_hold_that_hits_a_full_disk_part_way_leaves_no_record_of_it_in_the_log(tmp_path):
    # review s14 rvb-2, the held records' write: what reached the file before the disk filled
    # would be copied by a slave as held messages the master never held.
    plan = FaultPlan()
    store = MessageStore(str(tmp_path / "m"), TINY, opener=plan.opener, now_ms=T0)
    store.append("s", "m0", [1], T0, payload_of("s", 0))
    store.commit()
    start = store.copy_bounds()[1]
    plan.disk_capacity_bytes = plan.bytes_written + 1500
    ids = [f"h{i}" for i in range(12)]
    with pytest.raises(DiskFull):
        store.hold_many(["s"] * 12, ids, [()] * 12, T0, [b"h" * 200] * 12, [T0 + 1_000] * 12)
    assert store.copy_bounds()[1] == start
    plan.free_space(1 << 20)
    assert None not in store.hold_many(["s"] * 12, ids, [()] * 12, T0, [b"h" * 200] * 12,
                                       [T0 + 1_000] * 12), "held again, none a duplicate"
    assert len(store.held()) == 12
    store.close()


def test_a_slave_whose_disk_fills_part_way_through_a_copy_serves_every_copied_message(tmp_path):
    # review s14 rvb-6: the records of the copy written before the disk filled stayed in the
    # slave's log unindexed, the next fetch started past them, and their sequences read as
    # missing on the slave (lost there after a failover).
    plan = FaultPlan()
    master = MessageStore(str(tmp_path / "m"), TINY, now_ms=T0)
    slave = MessageStore(str(tmp_path / "s"), TINY, opener=plan.opener, now_ms=T0)
    for i in range(3):
        master.append("s", f"a{i}", [1], T0, b"a" * 200)
    master.commit()
    first_end = master.copy_bounds()[1]
    for i in range(12):
        master.append("s", f"b{i}", [1], T0, b"b" * 200)
    master.commit()
    end = master.copy_bounds()[1]
    offset = slave.append_copy(0, master.read_copy(0, first_end))
    plan.disk_capacity_bytes = plan.bytes_written + 1500  # part of the next copy fits
    with pytest.raises(DiskFull):
        slave.append_copy(offset, master.read_copy(offset, 1 << 20))
    assert slave.copy_bounds()[1] == offset, "the failed copy's first records stay"
    plan.free_space(1 << 20)
    while offset < end:  # the follower fetches from the slave's end again
        offset = slave.append_copy(offset, master.read_copy(offset, 1 << 20))
    assert slave.end_sequence("s") == master.end_sequence("s") == 15
    assert [slave.read("s", n).message_id for n in range(15)] == (
        [f"a{i}" for i in range(3)] + [f"b{i}" for i in range(12)])
    master.close()
    slave.close()


def test_a_failed_fsync_drops_the_batch_and_the_store_refuses_writes_until_reopened(data_dir):
    plan = FaultPlan()
    store = open_store(data_dir, opener=plan.opener)
    store.append("s", "kept", [], T0, b"k")
    store.commit()
    plan.fail_sync_at = plan.syncs + 1
    store.append("s", "lost", [], T0, b"l")
    with pytest.raises(LogWriteFailed):
        store.commit()
    assert store.end_sequence("s") == 1
    assert store.read("s", 0).payload == b"k"
    with pytest.raises(LogWriteFailed):
        store.append("s", "next", [], T0, b"n")
    with pytest.raises(LogWriteFailed):
        store.commit()
    store.close()
    store = open_store(data_dir, now_ms=T0 + 1)
    assert store.read("s", 0).payload == b"k"
    assert store.end_sequence("s") in (1, 2)  # the failed fsync's record may have reached disk
    store.append("s", "after", [], T0 + 1, b"a")
    store.commit()
    assert store.read("s", store.end_sequence("s") - 1).payload == b"a"
    store.close()


def test_a_closed_store_refuses_every_call(data_dir):
    store = open_store(data_dir)
    store.close()
    store.close()
    with pytest.raises(StoreClosed):
        store.append("s", "a", [], T0, b"x")
    with pytest.raises(StoreClosed):
        store.read("s", 0)


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_store_of_many_subjects_keeps_at_most_its_budget_of_consumer_log_files_open(data_dir):
    config = dataclasses.replace(TINY, consumer_log_files_open_max=5)
    store = open_store(data_dir, config)
    before = open_descriptors()
    for i in range(60):  # 12 subjects of 5 messages: 2 files each (4 entries per file)
        store.append(f"s{i % 12}", f"id{i}", [], T0, payload_of("s", i))
        if i % 7 == 6:
            store.commit()
    store.commit()
    for i in range(60):
        assert store.read(f"s{i % 12}", i // 12).payload == payload_of("s", i)
    assert [m.payload for m in store.scan("s3", 0, 100)[0]] == [
        payload_of("s", i) for i in range(3, 60, 12)]
    assert store._files.open_count <= 5
    assert open_descriptors() - before <= 5 + 1  # a new message-log segment at most
    store.close()
    reopened = open_store(data_dir, config)  # recovery goes through the cache too
    assert reopened.end_sequences() == {f"s{k}": 5 for k in range(12)}
    assert reopened._files.open_count <= 5
    reopened.close()


def _emfile_beyond(limit: int, limits: list[int] | None = None):
    """An opener that, like a process at its open-files limit, refuses a file while
    ``limit`` of its files are open (``limits[0]`` instead, when given, so a test can move it)."""
    from logstore import OsFile

    open_files: set = set()
    limits = limits if limits is not None else [limit]

    class Limited(OsFile):
        def __init__(self, path: str) -> None:
            if len(open_files) >= limits[0]:
                raise OSError(errno.EMFILE, "Too many open files (injected)", path)
            super().__init__(path)
            open_files.add(self)

        def close(self) -> None:
            open_files.discard(self)
            super().close()

    return Limited, open_files


def test_running_out_of_descriptors_fails_no_commit_of_any_subject(data_dir):
    opener, open_files = _emfile_beyond(4)  # one message-log segment + 3 consumer-log files
    config = dataclasses.replace(TINY, consumer_log_files_open_max=50,
                                 segment_size_bytes_max=1 << 20)
    store = open_store(data_dir, config, opener=opener)
    for round_ in range(3):
        for k in range(20):
            store.append(f"s{k}", f"id{round_}-{k}", [], T0, payload_of(f"s{k}", round_))
        store.commit()  # 20 subjects to index; only 3 files may be open at a time
    assert store.end_sequences() == {f"s{k}": 3 for k in range(20)}
    for k in range(20):
        assert [m.payload for m in store.scan(f"s{k}", 0, 10)[0]] == [
            payload_of(f"s{k}", r) for r in range(3)]
    assert store._files.relieved > 0 and len(open_files) <= 4
    store.close()


def test_commits_write_a_checkpoint_every_interval_so_a_crash_replays_little(data_dir):
    store = open_store(data_dir)
    for i in range(40):
        store.append("s", f"id{i}", [], T0, b"x" * 200)
        store.commit()
    end = store._message_log.end_offset
    # No close(): reopen as after a crash, long after the dedup window.
    again = open_store(data_dir, now_ms=T0 + 10 * TINY.dedup_window_ms)
    report = again.recovery
    assert 0 < end - report.replay_from_offset <= TINY.checkpoint_interval_bytes
    assert report.records_replayed <= TINY.checkpoint_interval_bytes // 200
    assert again.end_sequence("s") == 40
    again.close()
    store._closed = True


def test_a_failed_consumer_log_fsync_at_a_checkpoint_keeps_the_batch_and_stops_writes(data_dir):
    from realtime.storage import StoreFailed

    plan = FaultPlan()
    store = open_store(data_dir, opener=plan.opener)
    plan.fail_sync_at = plan.syncs + 2  # the message log's fsync passes; a consumer log's fails
    for i in range(12):
        store.append("s", f"id{i}", [], T0, b"x" * 200)  # past checkpoint_interval_bytes
    assert len(store.commit()) == 12
    assert store.read("s", 11).payload == b"x" * 200
    with pytest.raises(StoreFailed, match="must be reopened"):
        store.append("s", "more", [], T0, b"")
    store.close()
    store = open_store(data_dir)
    assert store.end_sequence("s") == 12
    store.close()


appends = st.lists(st.tuples(st.sampled_from(["a", "b", "%retry%a%g"]),
                             st.sampled_from([f"id{i}" for i in range(6)]),
                             st.lists(st.integers(0, (1 << 32) - 1), max_size=2),
                             st.binary(max_size=20)), max_size=12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(appends, st.integers(0, 3)), max_size=4))
def test_append_many_gives_what_the_same_appends_one_at_a_time_give(tmp_path_factory, commits):
    """Commits of a few batches (with ids repeated inside a batch and across commits) in two
    stores, one message at a time and column by column: the same outcomes, the same data."""
    one_dir, many_dir = tmp_path_factory.mktemp("one"), tmp_path_factory.mktemp("many")
    one, many = open_store(str(one_dir)), open_store(str(many_dir))
    for batch, chunks in commits:
        for subject, message_id, hashes, payload in batch:
            one.append(subject, message_id, hashes, T0, payload)
        size = max(1, len(batch) // (chunks + 1))
        for start in range(0, len(batch), size):
            chunk = batch[start:start + size]
            many.append_many([m[0] for m in chunk], [m[1] for m in chunk],
                             [tuple(m[2]) for m in chunk], T0, [m[3] for m in chunk])
        expected = one.commit()
        assert many.commit_sequences() == [None if a.duplicate else a.sequence for a in expected]
    assert many.end_sequences() == one.end_sequences()
    for subject, end in one.end_sequences().items():
        for sequence in range(end):
            assert many.read(subject, sequence) == one.read(subject, sequence)
    one.close()
    many.close()


@pytest.mark.parametrize("hashes", [((1 << 32),), (-1,), ([1],), ("1",)])
def test_a_bad_tag_hash_in_append_many_is_a_value_error(data_dir, hashes):
    store = open_store(data_dir)
    with pytest.raises(ValueError, match="tag hash"):
        store.append_many(["s", "s"], ["a", "b"], [(1, 2), hashes], T0, [b"1", b"2"])
    assert store.commit_sequences() == []


def test_a_bad_message_in_append_many_buffers_none_of_the_batch(data_dir):
    store = open_store(data_dir)
    with pytest.raises(ValueError, match="message_id of 0 bytes"):
        store.append_many(["s", "t", "t"], ["ok1", "ok2", ""], [[], [], []], T0,
                          [b"1", b"2", b"3"])
    assert store.commit_sequences() == []
    store.append_many(["s"], ["ok1"], [[]], T0, [b"1"])
    assert store.commit_sequences() == [0]


def test_discard_drops_the_appends_since_the_last_commit(data_dir):
    store = open_store(data_dir)
    store.append_many(["s", "s"], ["a", "b"], [(), ()], T0, [b"1", b"2"])
    store.discard()
    store.append_many(["s"], ["a"], [()], T0, [b"3"])
    assert store.commit_sequences() == [0]
    assert store.read("s", 0).payload == b"3"


def test_an_open_that_finds_no_descriptor_even_after_relief_refuses_the_batch_without_failing_the_store(
        data_dir):
    limits = [1 << 20]
    opener, open_files = _emfile_beyond(0, limits)
    config = dataclasses.replace(TINY, segment_size_bytes_max=1 << 20)
    store = open_store(data_dir, config, opener=opener)
    store.append("a", "a0", [], T0, payload_of("a", 0))
    store.commit()
    # Only the files outside the cache (the message-log segment): closing the cache's own
    # does not make room.
    limits[0] = len(open_files) - store._files.open_count
    store.append("a", "a1", [], T0, payload_of("a", 1))
    store.append("b", "b0", [], T0, payload_of("b", 0))
    with pytest.raises(OutOfDescriptors) as raised:
        store.commit()
    assert raised.value.retriable
    # Cut back: nothing of the batch indexed, and the store not failed.
    assert store.end_sequence("a") == 1 and store.end_sequences().get("b", 0) == 0
    limits[0] = 1 << 20  # a descriptor comes back: the store takes sends again
    store.append("b", "b1", [], T0, payload_of("b", 1))
    store.commit()
    assert store.read("b", store.end_sequence("b") - 1).payload == payload_of("b", 1)
    assert store.read("a", 0).payload == payload_of("a", 0)
    store.close()
