"""PullLogStore recovery: clean reopen, checkpoints, torn tails, crashes and pull-seq epochs."""

from __future__ import annotations

import os
import shutil
from collections import Counter

import pytest

from logstore import LogConfig, SegmentedLog
from logstore.faults import flip_bit
from pulllog import ActionLogGap, CorruptAction, PullLogConfig, PullLogStore
from pulllog.store import ACTIONS_DIRECTORY

S, G = "orders", "billing"
TINY = PullLogConfig(segment_size_bytes_max=4096, checkpoint_every_actions=10)
NO_CHECKPOINTS = PullLogConfig(segment_size_bytes_max=4096, checkpoint_every_actions=1 << 30)


def owners(store, subject=S, group=G) -> Counter:
    """How many times each consumer-log seq is held or queued."""
    count: Counter = Counter()
    for consumer in store.consumers(subject, group):
        count.update(e.consumer_log_seq for e in store.unacked(subject, group, consumer.consumer))
    count.update(store.take_redeliveries(subject, group, 1 << 30))
    return count


def assert_nothing_lost_or_double_held(store, done: set[int], start: int = 0) -> None:
    """Each seq in [start, cursor) is held or queued exactly once, or was acked/passed over."""
    count = owners(store)
    assert all(n == 1 for n in count.values()), count
    assert not (set(count) & done)
    assert set(count) | done >= set(range(start, store.cursor(S, G)))
    assert set(count) <= set(range(start, store.cursor(S, G)))


def action_segments(directory) -> list[str]:
    path = os.path.join(directory, ACTIONS_DIRECTORY)
    return sorted(os.listdir(path))


def busy_history(store, rounds: int) -> set[int]:
    """Pulls, acks, timeouts and departures over three consumers; returns the acked seqs."""
    done: set[int] = set()
    now = 0
    for i in range(rounds):
        now += 10
        consumer = f"c{i % 3}"
        queued = store.take_redeliveries(S, G, 2)
        cursor = store.cursor(S, G)
        got = store.record_pull(S, G, consumer, queued + [cursor, cursor + 2], cursor + 3, now)
        done.add(cursor + 1)  # passed over by a filter
        ack = got[0].pull_seq
        if store.record_ack(S, G, consumer, [(ack, ack)], now):
            done.add(got[0].consumer_log_seq)
        if i % 4 == 3:
            store.release_expired(S, G, 25, now)
        if i % 7 == 6:
            store.remove_consumer(S, G, "c1", now)
    return done


def test_a_clean_close_and_reopen_restores_the_same_state_and_epoch(tmp_path):
    store = PullLogStore(str(tmp_path), NO_CHECKPOINTS)
    store.ensure_group(S, G, 0, 0)
    busy_history(store, 20)
    before = store.export_state()
    store.close()
    reopened = PullLogStore(str(tmp_path), NO_CHECKPOINTS)
    assert reopened.export_state() == before
    assert reopened.recovery.clean_shutdown and reopened.epoch == 0
    assert reopened.recovery.actions_replayed > 20
    reopened.close()


def test_checkpoints_bound_replay_and_delete_action_segments_no_checkpoint_needs(tmp_path):
    store = PullLogStore(str(tmp_path), TINY)
    store.ensure_group(S, G, 0, 0)
    done = busy_history(store, 200)
    assert action_segments(tmp_path)[0] != f"{0:020d}.log"
    first = store._log.first_offset
    assert first <= store._kept_offsets[0]
    before = store.export_state()
    store.close()
    reopened = PullLogStore(str(tmp_path), TINY)
    assert reopened.export_state() == before
    assert reopened.recovery.checkpoint_sequence is not None
    assert reopened.recovery.actions_replayed <= TINY.checkpoint_every_actions + 1
    assert_nothing_lost_or_double_held(reopened, done)
    reopened.close()


def test_a_damaged_newest_checkpoint_falls_back_to_an_older_one_and_replays_to_the_same_state(tmp_path):
    store = PullLogStore(str(tmp_path), NO_CHECKPOINTS)
    store.ensure_group(S, G, 0, 0)
    busy_history(store, 10)
    store.checkpoint()
    older_offset = store._log.end_offset
    busy_history(store, 150)  # rolls several segments past the older checkpoint
    store.checkpoint()
    assert store._log.end_offset - older_offset > 2 * NO_CHECKPOINTS.segment_size_bytes_max
    assert store._log.first_offset <= older_offset  # kept for the fallback
    before = store.export_state()
    store.close()
    newest = sorted(n for n in os.listdir(tmp_path) if n.endswith(".ckpt"))[-1]
    flip_bit(str(tmp_path / newest), 30)
    reopened = PullLogStore(str(tmp_path), NO_CHECKPOINTS)
    assert reopened.recovery.checkpoint_sequence == int(newest.split(".")[1]) - 1
    assert reopened.recovery.replay_from_offset == older_offset
    assert reopened.export_state() == before
    reopened.close()


def test_a_crash_without_close_starts_a_new_epoch_and_keeps_what_was_flushed(tmp_path):
    store = PullLogStore(str(tmp_path), NO_CHECKPOINTS)
    store.ensure_group(S, G, 0, 0)
    store.record_pull(S, G, "c1", [0, 1], 2, 10)
    store.flush()  # then the process dies
    reopened = PullLogStore(str(tmp_path), NO_CHECKPOINTS)
    assert not reopened.recovery.clean_shutdown
    assert reopened.epoch == 1
    assert [e.consumer_log_seq for e in reopened.unacked(S, G, "c1")] == [0, 1]
    got = reopened.record_pull(S, G, "c1", [2], 3, 20)
    assert got[0].pull_seq == 1 << 32
    assert reopened.record_pull(S, G, "c2", [3], 4, 20)[0].pull_seq == 1 << 32
    reopened.record_ack(S, G, "c1", [(0, 1)], 21)
    assert reopened.consumers(S, G)[0].ack_sequence == (1 << 32) - 1
    reopened.close()
    again = PullLogStore(str(tmp_path), NO_CHECKPOINTS)
    assert again.recovery.clean_shutdown and again.epoch == 1
    again.close()


def test_an_ack_for_a_pull_lost_in_a_crash_cannot_ack_the_entry_that_reuses_its_pull_seq(tmp_path):
    store = PullLogStore(str(tmp_path), NO_CHECKPOINTS)
    store.ensure_group(S, G, 0, 0)
    store.sync()
    lost = store.record_pull(S, G, "c1", [0], 1, 10)  # handed to c1, never written: crash
    reopened = PullLogStore(str(tmp_path), NO_CHECKPOINTS)
    assert reopened.cursor(S, G) == 0
    again = reopened.record_pull(S, G, "c1", [0, 1], 2, 20)
    assert reopened.record_ack(S, G, "c1", [(lost[0].pull_seq, lost[0].pull_seq)], 21) == 0
    assert [e.pull_seq for e in reopened.unacked(S, G, "c1")] == [e.pull_seq for e in again]
    reopened.close()


def _build_crashed_history(directory) -> tuple[set[int], int, int, int]:
    """A history whose last actions are an ACK then a PULL; returns (done, cursor before the
    last pull, bytes of the last two records, bytes of the last record)."""
    store = PullLogStore(directory, NO_CHECKPOINTS)
    store.ensure_group(S, G, 0, 0)
    done = busy_history(store, 12)
    cursor = store.cursor(S, G)
    pulled = store.record_pull(S, G, "c2", [cursor], cursor + 1, 1000)
    store.flush()
    before_ack = store._log.end_offset
    assert store.record_ack(S, G, "c2", [(pulled[0].pull_seq, pulled[0].pull_seq)], 1001) == 1
    done.add(cursor)
    store.flush()
    before_pull = store._log.end_offset
    queued = store.take_redeliveries(S, G, 2)
    assert queued, "the history must leave entries to redeliver"
    store.record_pull(S, G, "c0", queued + [cursor + 1], cursor + 2, 1002)
    store.flush()  # and the process dies mid-write of what follows
    return done, cursor + 1, store._log.end_offset - before_ack, store._log.end_offset - before_pull


def test_a_torn_tail_loses_at_most_the_torn_actions_and_nothing_becomes_double_held_or_lost(tmp_path):
    base = tmp_path / "base"
    done, cursor_before_pull, last_two_bytes, last_bytes = _build_crashed_history(str(base))
    segment = os.path.join(base, ACTIONS_DIRECTORY, action_segments(base)[-1])
    size = os.path.getsize(segment)
    assert size > last_two_bytes, "the last two actions must sit in the last segment"
    for cut in sorted({1, 2, 11, 12, 13, last_bytes - 1, last_bytes, last_bytes + 1,
                       last_two_bytes - 1, last_two_bytes}):
        trial = tmp_path / f"cut{cut}"
        shutil.copytree(base, trial)
        os.truncate(os.path.join(trial, ACTIONS_DIRECTORY, os.path.basename(segment)), size - cut)
        store = PullLogStore(str(trial), NO_CHECKPOINTS)
        recovery = store.recovery
        assert not recovery.clean_shutdown
        if cut < last_bytes:
            assert recovery.truncation is not None and recovery.truncation.bytes_cut == last_bytes - cut
        # The torn PULL is gone: its entries are back in the queue or beyond the cursor.
        assert store.cursor(S, G) == cursor_before_pull
        # A torn ACK leaves its entry held (it will be redelivered), never lost.
        lost_ack = cut > last_bytes
        assert_nothing_lost_or_double_held(store, done - {cursor_before_pull - 1} if lost_ack else done)
        assert (cursor_before_pull - 1 in owners(store)) == lost_ack
        # The entries of the lost PULL are simply handed out again.
        queued = store.take_redeliveries(S, G, 5)
        got = store.record_pull(S, G, "c9", queued + [cursor_before_pull],
                                cursor_before_pull + 1, 2000)
        assert [e.consumer_log_seq for e in got] == queued + [cursor_before_pull]
        store.close()


def test_an_action_that_passes_its_crc_but_does_not_decode_is_reported_with_its_offset(tmp_path):
    store = PullLogStore(str(tmp_path), NO_CHECKPOINTS)
    store.ensure_group(S, G, 0, 0)
    store.close()
    log = SegmentedLog(os.path.join(tmp_path, ACTIONS_DIRECTORY), LogConfig())
    offset = log.append(b"\x63\x01garbage")
    log.close()
    with pytest.raises(CorruptAction) as info:
        PullLogStore(str(tmp_path), NO_CHECKPOINTS)
    assert info.value.offset == offset and "unknown action type 99" in str(info.value)


def test_losing_every_checkpoint_after_segments_were_deleted_is_a_gap_not_a_silent_loss(tmp_path):
    store = PullLogStore(str(tmp_path), TINY)
    store.ensure_group(S, G, 0, 0)
    busy_history(store, 200)
    first = store._log.first_offset
    assert first > 0
    store.close()
    for name in os.listdir(tmp_path):
        if name.endswith(".ckpt"):
            flip_bit(str(tmp_path / name), 30)
    with pytest.raises(ActionLogGap) as info:
        PullLogStore(str(tmp_path), TINY)
    assert (info.value.checkpoint_offset, info.value.first_offset) == (0, first)


def test_a_log_cut_below_the_checkpoint_keeps_the_checkpoint_state_and_restarts_from_it(tmp_path):
    store = PullLogStore(str(tmp_path), NO_CHECKPOINTS)
    store.ensure_group(S, G, 0, 0)
    done = busy_history(store, 10)
    store.flush()
    keep_bytes = store._log.end_offset - store._log.segments()[-1].base_offset
    store.checkpoint()
    before = store.export_state()
    store.close()
    segment = os.path.join(tmp_path, ACTIONS_DIRECTORY, action_segments(tmp_path)[-1])
    os.truncate(segment, keep_bytes - 5)  # bit rot / a lost tail below the checkpoint's offset
    reopened = PullLogStore(str(tmp_path), NO_CHECKPOINTS)
    assert not reopened.recovery.clean_shutdown
    assert reopened.cursor(S, G) == before[1][0][4]
    assert_nothing_lost_or_double_held(reopened, done)
    cursor = reopened.cursor(S, G)
    reopened.record_pull(S, G, "c5", [cursor], cursor + 1, 5000)
    after = reopened.export_state()
    reopened.close()
    again = PullLogStore(str(tmp_path), NO_CHECKPOINTS)
    assert again.export_state() == after
    again.close()


def test_a_session_whose_every_action_was_lost_still_starts_a_new_epoch(tmp_path):
    store = PullLogStore(str(tmp_path), NO_CHECKPOINTS)
    store.ensure_group(S, G, 0, 0)
    store.close()
    session = PullLogStore(str(tmp_path), NO_CHECKPOINTS)
    assert session.recovery.clean_shutdown
    lost = session.record_pull(S, G, "c1", [0], 1, 10)  # buffered only; then the process dies
    reopened = PullLogStore(str(tmp_path), NO_CHECKPOINTS)
    assert not reopened.recovery.clean_shutdown and reopened.epoch == 1
    again = reopened.record_pull(S, G, "c1", [0], 1, 20)
    assert again[0].pull_seq != lost[0].pull_seq
    assert reopened.record_ack(S, G, "c1", [(lost[0].pull_seq, lost[0].pull_seq)], 21) == 0
    reopened.close()
