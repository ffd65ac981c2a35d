"""PullLogStore.record_tail_pull (issue 18: a pull from the tail recorded on the event loop
without a Pull action built and checked layer by layer): the same records on disk, state,
answers and errors as the cursor check followed by record_pull, and the same recovery."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from logstore import DiskFull, LogWriteFailed
from logstore.faults import FaultPlan
from pulllog import PullLogConfig, PullLogStore, UnknownGroup
from pulllog.store import ACTIONS_DIRECTORY

S, G = "orders", "billing"
NO_CHECKPOINTS = PullLogConfig(segment_size_bytes_max=1 << 20, checkpoint_every_actions=1 << 30)


def actions_bytes(directory: str) -> list[bytes]:
    """The action segments' bytes, in name order."""
    path = os.path.join(directory, ACTIONS_DIRECTORY)
    out = []
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            out.append(f.read())
    return out


def reference(store, consumer, seqs, new_cursor, now_ms, expected_cursor):
    """What Pulls recorded before record_tail_pull: the checks, then record_pull."""
    if store.cursor(S, G) != expected_cursor or store.redelivery_count(S, G):
        return None
    return store.record_pull(S, G, consumer, seqs, new_cursor, now_ms)


def outcome(call):
    try:
        batch = call()
    except (ValueError, UnknownGroup) as exc:
        return ("raised", type(exc), str(exc))
    if batch is None:
        return None
    return (batch.first_pull_seq, tuple(batch.consumer_log_seqs), batch.redelivered,
            batch.pulled_at_ms)


def history(store, released: bool) -> None:
    """c1 pulls 0..2 and 3..4, acks one; optionally its entries time out into the queue."""
    store.ensure_group(S, G, 0, now_ms=0)
    store.record_pull(S, G, "c1", [0, 1, 2], 3, 10)
    store.record_pull(S, G, "c1", [3, 4], 5, 11)
    store.record_ack(S, G, "c1", [(0, 0)], 12)
    if released:
        store.release_expired(S, G, 5, 30)


SEQ = st.one_of(st.integers(min_value=-2, max_value=12), st.sampled_from([True, False, 2**64, 1.5]))


@settings(max_examples=300, deadline=None)
@given(consumer=st.sampled_from(["c1", "c2", "c2", "", 7]),
       seqs=st.one_of(
           st.builds(lambda a, n: list(range(a, a + n)), st.sampled_from([0, 3, 4, 5, 6]),
                     st.integers(0, 4)),
           st.lists(SEQ, max_size=5)),
       cursor_past_seqs=st.one_of(st.integers(min_value=-1, max_value=2), st.just(2**64)),
       now_ms=st.sampled_from([40, -1, 2**64, 40.0]),
       expected_cursor=st.sampled_from([5, 4, 0]),
       released=st.booleans(), group=st.sampled_from([G, G, G, "nobody"]))
def test_a_tail_pull_records_the_same_bytes_state_and_answer_as_the_checks_and_record_pull(
        consumer, seqs, cursor_past_seqs, now_ms, expected_cursor, released, group):
    # new_cursor around the seqs' end (one past the last is the common case), or no u64.
    ints = [s for s in seqs if type(s) is int]
    new_cursor = (cursor_past_seqs if cursor_past_seqs == 2**64
                  else max(ints + [expected_cursor - 1]) + cursor_past_seqs)
    with tempfile.TemporaryDirectory() as tmp:
        fast = PullLogStore(os.path.join(tmp, "fast"), NO_CHECKPOINTS)
        slow = PullLogStore(os.path.join(tmp, "slow"), NO_CHECKPOINTS)
        try:
            history(fast, released)
            history(slow, released)
            got = outcome(lambda: fast.record_tail_pull(S, group, consumer, seqs, new_cursor,
                                                         now_ms, expected_cursor))
            if group == G:
                want = outcome(lambda: reference(slow, consumer, seqs, new_cursor, now_ms,
                                                 expected_cursor))
            else:
                want = outcome(lambda: slow.cursor(S, group))
            assert got == want
            assert fast.export_state() == slow.export_state()
            fast.flush()
            slow.flush()
            assert actions_bytes(os.path.join(tmp, "fast")) == actions_bytes(
                os.path.join(tmp, "slow"))
        finally:
            fast.close()
            slow.close()


def test_a_tail_pull_refuses_a_run_that_starts_below_the_cursor_as_a_double_hand_out(tmp_path):
    store = PullLogStore(str(tmp_path), NO_CHECKPOINTS)
    store.ensure_group(S, G, 0, now_ms=0)
    store.record_tail_pull(S, G, "c1", [0, 1, 2], 3, 10, 0)
    before = store.export_state()
    with pytest.raises(ValueError, match="double hand-out"):
        store.record_tail_pull(S, G, "c2", [2, 3], 4, 11, 3)
    with pytest.raises(ValueError, match="at or above new_cursor"):
        store.record_tail_pull(S, G, "c2", [3, 4], 4, 11, 3)
    assert store.export_state() == before
    store.close()


def test_a_tail_pull_refuses_a_bool_standing_for_a_sequence_as_record_pull_does(tmp_path):
    store = PullLogStore(str(tmp_path), NO_CHECKPOINTS)
    store.ensure_group(S, G, 0, now_ms=0)
    with pytest.raises(ValueError, match="consumer-log seq"):
        store.record_tail_pull(S, G, "c1", [0, True], 2, 10, 0)
    assert store.cursor(S, G) == 0
    store.close()


def test_a_torn_tail_pull_is_lost_whole_and_its_entries_are_handed_out_again(tmp_path):
    base = tmp_path / "base"
    store = PullLogStore(str(base), NO_CHECKPOINTS)
    store.ensure_group(S, G, 0, now_ms=0)
    assert store.record_tail_pull(S, G, "c1", [0, 1], 2, 10, 0).first_pull_seq == 0
    store.flush()
    segment = os.path.join(base, ACTIONS_DIRECTORY, sorted(os.listdir(
        os.path.join(base, ACTIONS_DIRECTORY)))[-1])
    size_before = os.path.getsize(segment)
    batch = store.record_tail_pull(S, G, "c1", [2, 3, 4], 5, 20, 2)
    assert (batch.first_pull_seq, batch.consumer_log_seqs) == (2, (2, 3, 4))
    store.flush()  # then the process dies with the last record torn
    last_bytes = os.path.getsize(segment) - size_before
    for cut in (1, last_bytes // 2, last_bytes - 1):
        trial = tmp_path / f"cut{cut}"
        shutil.copytree(base, trial)
        os.truncate(os.path.join(trial, ACTIONS_DIRECTORY, os.path.basename(segment)),
                    size_before + last_bytes - cut)
        reopened = PullLogStore(str(trial), NO_CHECKPOINTS)
        assert reopened.recovery.truncation is not None
        assert reopened.cursor(S, G) == 2
        assert [e.consumer_log_seq for e in reopened.unacked(S, G, "c1")] == [0, 1]
        again = reopened.record_tail_pull(S, G, "c2", [2, 3, 4], 5, 30, 2)
        assert again.consumer_log_seqs == (2, 3, 4)
        reopened.close()
    store.close()


def tail_pull_new(store, consumer, count, now_ms):
    """``record_tail_pull`` of the next ``count`` entries from the group's cursor."""
    cursor = store.cursor(S, G)
    return store.record_tail_pull(S, G, consumer, list(range(cursor, cursor + count)),
                                  cursor + count, now_ms, cursor)


def test_a_tail_pull_on_a_full_disk_is_kept_in_memory_as_record_pull_is(tmp_path, monkeypatch):
    plan = FaultPlan()
    store = PullLogStore(str(tmp_path), PullLogConfig(segment_size_bytes_max=4096),
                         opener=plan.opener)
    store.ensure_group(S, G, 0, now_ms=0)
    tail_pull_new(store, "c1", 3, 10)
    monkeypatch.setattr(store._log, "append", _no_space)  # the write to the OS meets ENOSPC
    batch = tail_pull_new(store, "c1", 2, 20)
    assert store.unlogged, "a full disk in async mode keeps serving, in memory"
    assert tuple(batch.consumer_log_seqs) == (3, 4) and store.cursor(S, G) == 5
    store._log.close()  # the process dies: what was only in memory is handed out again
    monkeypatch.undo()
    reopened = PullLogStore(str(tmp_path), PullLogConfig(segment_size_bytes_max=4096))
    assert reopened.cursor(S, G) == 3
    reopened.close()


def _no_space(body):
    raise DiskFull("actions", 1)  # as the segment log raises ENOSPC


def test_a_tail_pull_whose_write_fails_leaves_the_store_failed_as_record_pull_does(tmp_path):
    plan = FaultPlan()
    store = PullLogStore(str(tmp_path), PullLogConfig(flush_mode="sync"), opener=plan.opener)
    store.ensure_group(S, G, 0, now_ms=0)
    tail_pull_new(store, "c1", 2, 10)
    plan.fail_write_at = plan.writes + 1
    with pytest.raises(LogWriteFailed):
        tail_pull_new(store, "c1", 2, 20)
    with pytest.raises(LogWriteFailed):  # sticky: the next one is refused too
        store.record_ack(S, G, "c1", [(0, 0)], 30)
    store.close()
    reopened = PullLogStore(str(tmp_path), PullLogConfig(flush_mode="sync"))
    assert reopened.cursor(S, G) == 2
    reopened.close()


@pytest.mark.parametrize("flush_mode", ["sync", "async"])
def test_a_tail_pull_fsyncs_and_checkpoints_when_record_pull_would(tmp_path, flush_mode):
    config = PullLogConfig(flush_mode=flush_mode, checkpoint_every_actions=3)
    seen = []
    for name, pull in (("tail", tail_pull_new), ("reference", pull_new)):
        plan = FaultPlan()
        store = PullLogStore(str(tmp_path / name), config, opener=plan.opener)
        store.ensure_group(S, G, 0, now_ms=0)
        steps = []
        for now_ms in range(10, 80, 10):  # past two checkpoints
            pull(store, "c1", 1, now_ms)
            steps.append((plan.syncs, store._actions_since_checkpoint))
        seen.append(steps)
        store.close()
    assert seen[0] == seen[1]
    assert any(count == 0 for _, count in seen[0]), "a checkpoint was written"


def pull_new(store, consumer, count, now_ms):
    """``record_pull`` of the next ``count`` entries from the group's cursor."""
    cursor = store.cursor(S, G)
    return store.record_pull(S, G, consumer, range(cursor, cursor + count), cursor + count,
                             now_ms)
