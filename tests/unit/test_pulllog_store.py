"""PullLogStore behaviour: hand-outs, acks, ack timeouts, offline consumers, durability modes."""

from __future__ import annotations

import pytest

from logstore import DiskFull, LogWriteFailed
from logstore.faults import FaultPlan
from pulllog import PullLogConfig, PullLogStore, UnknownGroup
from pulllog.config import SEGMENT_SIZE_BYTES_MIN

S, G = "orders", "billing"
TINY = PullLogConfig(segment_size_bytes_max=4096, checkpoint_every_actions=10)


@pytest.fixture
def store(tmp_path):
    s = PullLogStore(str(tmp_path / "pull"), TINY)
    s.ensure_group(S, G, 0, now_ms=0)
    yield s
    s.close()


def clseqs(entries):
    return [e.consumer_log_seq for e in entries]


def pull_new(store, consumer, count, now_ms):
    cursor = store.cursor(S, G)
    return store.record_pull(S, G, consumer, range(cursor, cursor + count), cursor + count, now_ms)


def test_a_consumer_gets_dense_pull_seqs_mapped_to_consumer_log_seqs(store):
    first = pull_new(store, "c1", 3, 10)
    second = pull_new(store, "c1", 2, 11)
    assert [(e.pull_seq, e.consumer_log_seq, e.redelivered, e.pulled_at_ms) for e in first + second] == [
        (0, 0, 0, 10), (1, 1, 0, 10), (2, 2, 0, 10), (3, 3, 0, 11), (4, 4, 0, 11)]
    assert store.cursor(S, G) == 5


def test_out_of_order_acks_advance_the_ack_sequence_only_when_contiguous(store):
    pull_new(store, "c1", 5, 10)
    assert store.record_ack(S, G, "c1", [(1, 2)], 11) == 2
    assert store.consumers(S, G)[0].ack_sequence == -1
    assert store.record_ack(S, G, "c1", [(4, 4)], 12) == 1
    assert store.consumers(S, G)[0].ack_sequence == -1
    assert store.record_ack(S, G, "c1", [(0, 0)], 13) == 1
    state = store.consumers(S, G)[0]
    assert (state.ack_sequence, state.unacked_count) == (2, 1)
    assert store.record_ack(S, G, "c1", [(3, 3)], 14) == 1
    assert store.consumers(S, G)[0].ack_sequence == 4
    assert store.held_count(S, G) == 0


def test_duplicate_and_unknown_acks_count_zero_and_write_nothing(store):
    pull_new(store, "c1", 3, 10)
    assert store.record_ack(S, G, "c1", [(0, 1)], 11) == 2
    end = store._log.end_offset
    assert store.record_ack(S, G, "c1", [(0, 1)], 12) == 0
    assert store.record_ack(S, G, "c1", [(50, 1 << 40)], 12) == 0
    assert store.record_ack(S, G, "nobody", [(0, 9)], 12) == 0
    assert store._log.end_offset == end
    assert clseqs(store.unacked(S, G, "c1")) == [2]


def test_an_ack_range_with_its_start_above_its_end_is_refused(store):
    pull_new(store, "c1", 3, 10)
    with pytest.raises(ValueError, match=r"ack range \(2, 1\)"):
        store.record_ack(S, G, "c1", [(2, 1)], 11)
    assert store.held_count(S, G) == 3


def test_a_huge_ack_range_acks_only_what_is_held(store):
    pull_new(store, "c1", 3, 10)
    assert store.record_ack(S, G, "c1", [(0, (1 << 64) - 1)], 11) == 3


def test_entries_past_their_ack_timeout_go_to_the_queue_and_the_next_puller_gets_them_first(store):
    pull_new(store, "c1", 3, 1000)
    store.record_ack(S, G, "c1", [(1, 1)], 1001)
    assert store.release_expired(S, G, ack_timeout_ms=500, now_ms=1499) == []
    assert store.release_expired(S, G, ack_timeout_ms=500, now_ms=1500) == [0, 2]
    assert store.take_redeliveries(S, G, 10) == [0, 2]
    assert store.unacked(S, G, "c1") == []
    queued = store.take_redeliveries(S, G, 10)
    cursor = store.cursor(S, G)
    got = store.record_pull(S, G, "c2", queued + [cursor], cursor + 1, 1600)
    assert [(e.consumer_log_seq, e.redelivered) for e in got] == [(0, 1), (2, 1), (3, 0)]
    assert store.redelivery_count(S, G) == 0


def test_an_ack_from_the_first_consumer_after_release_counts_zero(store):
    pull_new(store, "c1", 1, 0)
    store.release_expired(S, G, 10, 10)
    assert store.record_ack(S, G, "c1", [(0, 0)], 11) == 0
    assert store.take_redeliveries(S, G, 5) == [0]


def test_the_redelivery_count_grows_with_each_release(store):
    pull_new(store, "c1", 1, 0)
    for round_, consumer in enumerate(["c2", "c3", "c1"], start=1):
        store.release_expired(S, G, 10, 100 * round_)
        got = store.record_pull(S, G, consumer, store.take_redeliveries(S, G, 1), 1, 100 * round_)
        assert [(e.consumer_log_seq, e.redelivered) for e in got] == [(0, round_)]


def test_unacked_messages_of_an_expired_consumer_go_to_the_others(store):
    pull_new(store, "c1", 2, 0)
    pull_new(store, "c2", 2, 0)
    store.record_ack(S, G, "c1", [(0, 0)], 1)
    assert store.remove_consumer(S, G, "c1", now_ms=30_000) == [1]
    assert [c.consumer for c in store.consumers(S, G)] == ["c2"]
    got = store.record_pull(S, G, "c2", store.take_redeliveries(S, G, 5), store.cursor(S, G), 30_001)
    assert [(e.consumer_log_seq, e.redelivered, e.pull_seq) for e in got] == [(1, 1, 2)]
    assert store.remove_consumer(S, G, "c1", 30_002) == []


@pytest.mark.parametrize("bad", [-1, 2**64, True, 1.5, "3"])
def test_record_pull_refuses_a_consumer_log_seq_that_is_no_u64(store, bad):
    with pytest.raises(ValueError, match="consumer-log seq"):
        store.record_pull(S, G, "c1", [0, bad], 10, 10)
    assert store.cursor(S, G) == 0


def test_a_pull_after_a_release_reports_which_entries_are_redeliveries(store):
    pull_new(store, "c1", 3, 10)
    assert store.release_expired(S, G, 5, 20) == [0, 1, 2]
    batch = store.record_pull(S, G, "c2", [1, 3], 4, 30)
    assert [(e.consumer_log_seq, e.redelivered) for e in batch] == [(1, 1), (3, 0)]
    assert batch.redelivered == [1, 0] and batch.first_pull_seq == 0


def test_record_pull_refuses_a_double_hand_out(store):
    pull_new(store, "c1", 3, 0)
    before = store.export_state()
    with pytest.raises(ValueError, match="double hand-out"):
        store.record_pull(S, G, "c2", [1], 3, 1)  # held by c1
    store.record_ack(S, G, "c1", [(0, 0)], 2)
    before = store.export_state()
    with pytest.raises(ValueError, match="double hand-out"):
        store.record_pull(S, G, "c2", [0], 3, 3)  # already acked
    with pytest.raises(ValueError, match="appears twice"):
        store.record_pull(S, G, "c2", [3, 3], 4, 3)
    with pytest.raises(ValueError, match="at or above new_cursor"):
        store.record_pull(S, G, "c2", [3], 3, 3)
    with pytest.raises(ValueError, match="below the cursor"):
        store.record_pull(S, G, "c2", [], 2, 3)
    assert store.export_state() == before


def test_a_queued_entry_cannot_be_handed_out_twice(store):
    pull_new(store, "c1", 1, 0)
    store.remove_consumer(S, G, "c1", 5)
    store.record_pull(S, G, "c2", [0], 1, 6)
    with pytest.raises(ValueError, match="double hand-out"):
        store.record_pull(S, G, "c3", [0], 1, 7)


def test_entries_passed_over_by_a_filter_are_not_held_or_queued(store):
    got = store.record_pull(S, G, "c1", [1, 3], 5, 10)
    assert clseqs(got) == [1, 3]
    assert store.cursor(S, G) == 5
    store.remove_consumer(S, G, "c1", 20)
    assert store.take_redeliveries(S, G, 10) == [1, 3]
    assert store.lowest_needed_sequence(S, G) == 1


def test_an_empty_pull_that_does_not_move_the_cursor_records_nothing(store):
    end = store._log.end_offset
    assert store.record_pull(S, G, "c1", [], 0, 10) == []
    assert store._log.end_offset == end
    assert store.consumers(S, G) == []


def test_ensure_group_returns_an_existing_group_unchanged(store):
    pull_new(store, "c1", 4, 10)
    state = store.ensure_group(S, G, 100, now_ms=50)
    assert (state.cursor, state.start_sequence, state.created_ms) == (4, 0, 0)
    fresh = store.ensure_group(S, "other", 100, now_ms=50)
    assert (fresh.cursor, fresh.start_sequence) == (100, 100)
    assert store.groups() == [(S, G), (S, "other")]
    assert store.has_group(S, "other") and not store.has_group("x", G)


def test_an_unknown_group_is_an_error_naming_it(store):
    with pytest.raises(UnknownGroup, match="'nope'"):
        store.record_pull(S, "nope", "c1", [0], 1, 0)
    with pytest.raises(UnknownGroup):
        store.cursor("x", G)


def test_lowest_needed_sequence_is_the_minimum_of_held_queued_and_cursor(store):
    assert store.lowest_needed_sequence(S, G) == 0
    pull_new(store, "c1", 3, 0)
    pull_new(store, "c2", 3, 5)
    store.record_ack(S, G, "c1", [(0, 0)], 6)
    assert store.lowest_needed_sequence(S, G) == 1
    store.record_ack(S, G, "c1", [(1, 2)], 6)
    assert store.lowest_needed_sequence(S, G) == 3
    store.release_expired(S, G, 1, 6)
    assert store.take_redeliveries(S, G, 9) == [3, 4, 5]
    store.record_pull(S, G, "c1", [4], 6, 7)
    assert store.lowest_needed_sequence(S, G) == 3
    store.record_ack(S, G, "c2", [(0, 9)], 8)
    store.record_pull(S, G, "c1", [3, 5], 6, 9)
    store.record_ack(S, G, "c1", [(0, 99)], 10)
    assert store.lowest_needed_sequence(S, G) == 6


def test_pulled_before_lists_old_unacked_entries_with_their_consumer(store):
    pull_new(store, "c1", 2, 100)
    pull_new(store, "c2", 1, 200)
    store.record_ack(S, G, "c1", [(1, 1)], 201)
    assert [(c, e.consumer_log_seq) for c, e in store.pulled_before(S, G, 100)] == [("c1", 0)]
    assert [(c, e.consumer_log_seq) for c, e in store.pulled_before(S, G, 200)] == [
        ("c1", 0), ("c2", 2)]


def test_consumers_report_last_pull_time_and_unacked_count(store):
    pull_new(store, "c1", 2, 100)
    pull_new(store, "c1", 1, 150)
    [state] = store.consumers(S, G)
    assert (state.consumer, state.next_pull_seq, state.unacked_count, state.last_pull_ms) == (
        "c1", 3, 3, 150)


@pytest.mark.parametrize("size, ok", [(SEGMENT_SIZE_BYTES_MIN - 1, False),
                                      (SEGMENT_SIZE_BYTES_MIN, True),
                                      (SEGMENT_SIZE_BYTES_MIN + 1, True)])
def test_segment_size_below_the_minimum_is_refused_naming_the_value(size, ok):
    if ok:
        assert PullLogConfig(segment_size_bytes_max=size).segment_size_bytes_max == size
    else:
        with pytest.raises(ValueError, match=f"segment_size_bytes_max {size}"):
            PullLogConfig(segment_size_bytes_max=size)


@pytest.mark.parametrize("key", ["checkpoint_every_actions", "flush_interval_ms",
                                 "checkpoints_kept", "action_size_bytes_max"])
def test_counts_below_one_are_refused_naming_the_key(key):
    assert getattr(PullLogConfig(**{key: 1}), key) == 1
    with pytest.raises(ValueError, match=f"{key} 0"):
        PullLogConfig(**{key: 0})


def test_an_unknown_flush_mode_is_refused():
    with pytest.raises(ValueError, match="'sometimes'"):
        PullLogConfig(flush_mode="sometimes")


def test_sync_mode_fsyncs_before_every_change_returns(tmp_path):
    plan = FaultPlan()
    store = PullLogStore(str(tmp_path), PullLogConfig(flush_mode="sync"), opener=plan.opener)
    store.ensure_group(S, G, 0, 0)
    syncs = plan.syncs
    pull_new(store, "c1", 2, 1)
    assert plan.syncs == syncs + 1
    store.record_ack(S, G, "c1", [(0, 0)], 2)
    assert plan.syncs == syncs + 2
    store.close()


def test_async_mode_fsyncs_only_when_tick_passes_the_flush_interval(tmp_path):
    plan = FaultPlan()
    store = PullLogStore(str(tmp_path), PullLogConfig(flush_interval_ms=100), opener=plan.opener)
    opened_syncs = plan.syncs  # opening fsyncs its OPENED marker
    store.ensure_group(S, G, 0, 0)
    assert store.tick(1000) is False  # the first tick starts the interval
    pull_new(store, "c1", 2, 1000)
    assert plan.syncs == opened_syncs
    assert store.tick(1099) is False
    assert store.tick(1100) is True
    assert plan.syncs == opened_syncs + 1
    store.close()


def test_a_failed_write_is_sticky_until_the_store_is_reopened(tmp_path):
    plan = FaultPlan()
    config = PullLogConfig(flush_mode="sync")
    store = PullLogStore(str(tmp_path), config, opener=plan.opener)
    store.ensure_group(S, G, 0, 0)
    pull_new(store, "c1", 2, 1)
    plan.fail_write_at = plan.writes + 1
    with pytest.raises(LogWriteFailed):
        pull_new(store, "c1", 2, 2)
    with pytest.raises(LogWriteFailed):
        store.record_ack(S, G, "c1", [(0, 0)], 3)
    store.close()
    reopened = PullLogStore(str(tmp_path), config)
    assert clseqs(reopened.unacked(S, G, "c1")) == [0, 1]
    assert reopened.cursor(S, G) == 2
    reopened.close()


@pytest.mark.parametrize("value, ok", [((1 << 64) - 2, True), ((1 << 64) - 1, True),
                                       (1 << 64, False), (-1, False)])
def test_sequences_and_times_must_fit_in_a_u64(tmp_path, value, ok):
    store = PullLogStore(str(tmp_path), TINY)
    try:
        if ok:
            assert store.ensure_group(S, G, value, now_ms=value).cursor == value
            store.close()
            store = PullLogStore(str(tmp_path), TINY)
            assert store.cursor(S, G) == value
        else:
            with pytest.raises(ValueError, match=f"start_sequence {value}"):
                store.ensure_group(S, G, value, now_ms=0)
            assert not store.has_group(S, G)
    finally:
        store.close()


def test_names_must_be_non_empty_strings(store):
    with pytest.raises(ValueError, match="consumer '' must be a non-empty string"):
        store.record_pull(S, G, "", [0], 1, 0)
    with pytest.raises(ValueError, match="group 7"):
        store.ensure_group(S, 7, 0, 0)


def _fill_disk(store, plan, monkeypatch):
    """From now on every append and every checkpoint meets ENOSPC."""
    plan.disk_capacity_bytes = plan.bytes_written

    def no_space(payload):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store._checkpoints, "write", no_space)


def test_a_full_disk_keeps_pulls_and_acks_working_in_memory_and_a_checkpoint_ends_it(
        tmp_path, monkeypatch):
    plan = FaultPlan()
    config = PullLogConfig(segment_size_bytes_max=4096)
    store = PullLogStore(str(tmp_path / "pull"), config, opener=plan.opener)
    store.ensure_group(S, G, 0, now_ms=0)
    pull_new(store, "c1", 3, 10)
    store.tick(1_000)
    _fill_disk(store, plan, monkeypatch)
    pull_new(store, "c1", 3, 1_010)
    assert store.tick(1_200) is False
    assert store.unlogged
    # Still serving: a pull and an ack go through, in memory.
    assert clseqs(pull_new(store, "c1", 2, 1_300)) == [6, 7]
    assert store.record_ack(S, G, "c1", [(0, 4)], 1_400) == 5
    assert store.tick(2_000) is False and store.unlogged  # still full
    plan.free_space(1 << 20)
    monkeypatch.undo()
    assert store.tick(2_500) is False, "retries wait DISK_FULL_RETRY_MS after the last try"
    assert store.tick(3_000) is True
    assert not store.unlogged
    store.record_ack(S, G, "c1", [(5, 5)], 3_100)
    expected = store.export_state()
    store.close()
    reopened = PullLogStore(str(tmp_path / "pull"), config)
    assert reopened.recovery.clean_shutdown
    assert reopened.export_state() == expected
    assert reopened.cursor(S, G) == 8
    reopened.close()


def test_a_crash_while_the_disk_is_full_redelivers_what_was_only_in_memory(tmp_path, monkeypatch):
    plan = FaultPlan()
    config = PullLogConfig(segment_size_bytes_max=4096)
    store = PullLogStore(str(tmp_path / "pull"), config, opener=plan.opener)
    store.ensure_group(S, G, 0, now_ms=0)
    pull_new(store, "c1", 3, 10)
    store.tick(1_000)
    _fill_disk(store, plan, monkeypatch)
    pull_new(store, "c1", 3, 1_010)
    store.record_ack(S, G, "c1", [(0, 5)], 1_020)
    store.tick(1_200)
    assert store.unlogged
    store._log.close()  # the process dies: no checkpoint, no CLOSED record
    reopened = PullLogStore(str(tmp_path / "pull"), config)
    assert not reopened.recovery.clean_shutdown
    assert reopened.cursor(S, G) == 3, "pulls that were only in memory are handed out again"
    assert reopened.held_count(S, G) == 3, "acks that were only in memory are redone"
    reopened.close()


def test_a_full_disk_in_sync_mode_is_sticky_because_callers_were_promised_durability(tmp_path):
    plan = FaultPlan()
    config = PullLogConfig(segment_size_bytes_max=4096, flush_mode="sync")
    store = PullLogStore(str(tmp_path / "pull"), config, opener=plan.opener)
    store.ensure_group(S, G, 0, now_ms=0)
    plan.disk_capacity_bytes = plan.bytes_written
    with pytest.raises(DiskFull):
        pull_new(store, "c1", 1, 10)
    plan.free_space(1 << 20)
    with pytest.raises(DiskFull):
        pull_new(store, "c1", 1, 20)
    assert not store.unlogged
    store.close()
