"""PullLogStore as a replica (pulllog.copying): a follower copies the master's actions byte for
byte and holds the same state, writes nothing of its own, cuts its copy back, installs the
master's checkpoint, and starts a new pull-seq epoch when it is promoted."""

from __future__ import annotations

import os

import pytest

from logstore import DiskFull
from logstore.faults import FaultPlan
from pulllog import PullLogConfig, PullLogStore
from pulllog.copying import NeedsSnapshot
from pulllog.state import PULL_SEQ_EPOCH_SHIFT

S, G = "orders", "billing"
TINY = PullLogConfig(segment_size_bytes_max=4096, checkpoint_every_actions=10)


def work(store: PullLogStore, rounds: int, start_ms: int = 0) -> None:
    """Pulls, acks and a release, as a master's consumers make them."""
    if not store.has_group(S, G):
        store.ensure_group(S, G, 0, now_ms=start_ms)
    for i in range(rounds):
        now_ms = start_ms + i
        cursor = store.cursor(S, G)
        batch = store.record_pull(S, G, f"c{i % 2}", range(cursor, cursor + 3), cursor + 3, now_ms)
        store.record_ack(S, G, f"c{i % 2}", [(batch[0].pull_seq, batch[1].pull_seq)], now_ms)
        if i % 5 == 4:
            store.release_expired(S, G, 0, now_ms + 1)


def copy(master: PullLogStore, follower: PullLogStore, max_bytes: int = 500) -> None:
    master.flush()
    offset = follower.copy_bounds()[1]
    while True:
        data = master.read_copy(offset, max_bytes)
        if not data:
            return
        offset = follower.append_copy(offset, data)


@pytest.fixture
def pair(tmp_path):
    master = PullLogStore(str(tmp_path / "master"), TINY)
    follower = PullLogStore(str(tmp_path / "follower"), TINY, follower=True)
    yield master, follower
    master.close()
    follower.close()


def test_a_follower_holds_the_master_state_and_writes_nothing_of_its_own(pair, tmp_path):
    master, follower = pair
    assert follower.copy_bounds() == (0, 0)  # opening a follower wrote no OPENED
    work(master, 30)
    copy(master, follower)
    assert follower.copy_bounds() == master.copy_bounds()
    assert follower.export_state() == master.export_state()
    follower.close()
    reopened = PullLogStore(str(tmp_path / "follower"), TINY, follower=True)
    assert reopened.copy_bounds()[1] == master.copy_bounds()[1]
    assert reopened.export_state() == master.export_state()
    reopened.close()


def test_a_follower_refuses_to_record_anything_itself(pair):
    _master, follower = pair
    with pytest.raises(AssertionError):
        follower.ensure_group(S, G, 0, now_ms=1)


def test_a_promoted_follower_starts_a_new_pull_seq_epoch(pair):
    master, follower = pair
    work(master, 4)
    copy(master, follower)
    epoch = follower.epoch
    follower.promote()
    assert follower.epoch == epoch + 1
    batch = follower.record_pull(S, G, "c9", [follower.cursor(S, G)], follower.cursor(S, G) + 1, 9)
    assert batch[0].pull_seq >> PULL_SEQ_EPOCH_SHIFT == epoch + 1


def test_a_follower_whose_copy_ends_with_a_clean_close_keeps_the_epoch(tmp_path):
    master = PullLogStore(str(tmp_path / "master"), TINY)
    work(master, 3)
    master.close()
    reopened_master = PullLogStore(str(tmp_path / "master"), TINY, follower=True)
    follower = PullLogStore(str(tmp_path / "follower"), TINY, follower=True)
    copy(reopened_master, follower)
    epoch = follower.epoch
    follower.promote()
    assert follower.epoch == epoch
    follower.close()
    reopened_master.close()


def test_a_demoted_master_cuts_its_own_tail_and_copies_the_new_master(pair):
    master, old = pair
    old.promote()  # old was master first; master copies it, then takes over
    master.close()
    work(old, 12)
    new = PullLogStore(master.directory + "-new", TINY, follower=True)
    copy(old, new)
    fork = new.copy_bounds()[1]
    work(old, 6, start_ms=100)  # recorded by the old master, never shipped
    new.promote()
    work(new, 5, start_ms=200)
    old.demote()
    old.truncate_copy(fork)
    copy(new, old)
    assert old.export_state() == new.export_state()
    new.close()


def test_a_cut_below_every_checkpoint_kept_needs_the_master_snapshot(tmp_path):
    config = PullLogConfig(segment_size_bytes_max=1024, checkpoint_every_actions=5,
                           checkpoints_kept=1)
    master = PullLogStore(str(tmp_path / "master"), config)
    follower = PullLogStore(str(tmp_path / "follower"), config, follower=True)
    for step in range(60):
        work(master, 1, start_ms=step * 10)
        copy(master, follower)
    assert master.copy_bounds()[0] > 0  # a new follower could not start at 0
    assert follower.copy_bounds()[0] > 0  # its own checkpoints let it drop old segments
    with pytest.raises(NeedsSnapshot):
        follower.truncate_copy(follower.copy_bounds()[0])
    checkpoint, covers = master.newest_checkpoint()
    fresh = PullLogStore(str(tmp_path / "fresh"), config, follower=True)
    fresh.install_snapshot(checkpoint.payload, covers)
    assert fresh.copy_bounds() == (covers, covers)
    copy(master, fresh)
    assert fresh.export_state() == master.export_state()
    for store in (master, follower, fresh):
        store.close()
    assert os.listdir(str(tmp_path / "fresh"))


def test_a_follower_whose_disk_fills_during_a_copy_keeps_nothing_of_it_and_copies_it_again(
        tmp_path):
    # The copy's records are made durable before the state takes them: a full disk leaves the
    # action log cut back where the copy began and the state as it was, so the next fetch, from
    # the copy's end, copies the same actions again and the follower ends as the master.
    plan = FaultPlan()
    master = PullLogStore(str(tmp_path / "master"), TINY)
    follower = PullLogStore(str(tmp_path / "follower"), TINY, opener=plan.opener,
                            follower=True)
    work(master, 3)
    copy(master, follower)
    before = follower.export_state()
    offset = follower.copy_bounds()[1]
    work(master, 3, start_ms=100)
    master.flush()
    data = master.read_copy(offset, 1 << 20)
    plan.disk_capacity_bytes = plan.bytes_written + len(data) // 2
    with pytest.raises(DiskFull):
        follower.append_copy(offset, data)
    assert follower.copy_bounds()[1] == offset
    assert follower.export_state() == before
    plan.free_space(1 << 20)
    copy(master, follower)
    assert follower.copy_bounds() == master.copy_bounds()
    assert follower.export_state() == master.export_state()
    master.close()
    follower.close()
