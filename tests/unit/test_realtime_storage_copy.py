"""MessageStore as a slave's copy: records copied from a master's message log are indexed as
the master indexed them (same sequences at the same offsets, dedup included), and a copy is cut
back or thrown away whole (docs/REPLICATION.md 8.4, 8.6)."""

from __future__ import annotations

import os

import pytest

from logstore import CorruptRecord
from logstore.faults import flip_bit
from realtime.storage import MessageStore, SequenceOutOfRange, StoreClosed, StoreConfig

TINY = StoreConfig(segment_size_bytes_max=4096, record_size_bytes_max=2048,
                   consumer_log_entries_per_file=4, write_buffer_bytes_max=1024,
                   checkpoint_interval_bytes=2048, dedup_window_ms=60_000)
T0 = 1_700_000_000_000
SUBJECTS = ("orders", "pay", "%retry%orders%billing")


def commit_batches(store: MessageStore, batches: int, start: int = 0) -> None:
    for batch in range(start, start + batches):
        for i in range(5):
            subject = SUBJECTS[(batch + i) % 3]
            store.append(subject, f"id-{batch}-{i}", [i], T0 + batch, b"p%d.%d" % (batch, i))
        store.commit()


def copy(master: MessageStore, slave: MessageStore, max_bytes: int = 700) -> None:
    offset = slave.copy_bounds()[1]
    while True:
        data = master.read_copy(offset, max_bytes)
        if not data:
            return
        offset = slave.append_copy(offset, data)


def contents(store: MessageStore) -> dict[str, list[tuple[int, str, bytes]]]:
    out = {}
    for subject in store.subjects():
        first, end = store.first_sequence(subject), store.end_sequence(subject)
        out[subject] = [(m.sequence, m.message_id, m.payload)
                        for m in (store.read(subject, s) for s in range(first, end))]
    return out


@pytest.fixture
def stores(tmp_path):
    master = MessageStore(str(tmp_path / "master"), TINY, now_ms=T0)
    slave = MessageStore(str(tmp_path / "slave"), TINY, now_ms=T0)
    yield master, slave
    master.close()
    slave.close()


def test_a_copied_store_holds_the_same_messages_under_the_same_sequences(stores, tmp_path):
    master, slave = stores
    commit_batches(master, 20)
    copy(master, slave)
    assert slave.copy_bounds() == master.copy_bounds()
    assert slave.end_sequences() == master.end_sequences()
    assert contents(slave) == contents(master)
    slave.close()
    reopened = MessageStore(str(tmp_path / "slave"), TINY, now_ms=T0)
    assert contents(reopened) == contents(master)
    reopened.close()


def test_a_promoted_copy_refuses_a_resend_as_a_duplicate(stores):
    master, slave = stores
    commit_batches(master, 3)
    copy(master, slave)
    assert slave.append("pay", "id-1-0", [], T0 + 5, b"again").duplicate or slave.append(
        "orders", "id-1-0", [], T0 + 5, b"again").duplicate
    slave.discard()


def test_a_copy_cut_back_continues_from_the_cut_and_ends_like_the_master(stores):
    master, slave = stores
    commit_batches(master, 10)
    copy(master, slave)
    middle = master.copy_bounds()[1]
    commit_batches(master, 10, start=10)
    copy(master, slave)
    slave.truncate_copy(middle)
    assert slave.copy_bounds()[1] == middle
    assert all(slave.end_sequence(s) < master.end_sequence(s) for s in SUBJECTS)
    copy(master, slave)
    assert contents(slave) == contents(master)


def test_a_cut_tail_of_the_slave_own_is_replaced_by_the_master_records(stores, tmp_path):
    # An old master wrote messages its successor never had: cut them, copy the new ones.
    master, old = stores
    commit_batches(master, 4)
    copy(master, old)
    fork = old.copy_bounds()[1]
    commit_batches(old, 3, start=100)  # the old master's own unreplicated tail
    commit_batches(master, 5, start=4)
    old.truncate_copy(fork)
    copy(master, old)
    assert contents(old) == contents(master)


def test_a_copy_reset_to_the_master_retention_point_starts_there_with_holes(stores):
    master, slave = stores
    commit_batches(master, 10)
    start = master.copy_bounds()[1]
    commit_batches(master, 5, start=10)
    commit_batches(slave, 2, start=500)  # whatever the slave had is thrown away
    slave.reset_copy(start)
    copy(master, slave)
    copied = 0
    for subject in SUBJECTS:
        assert slave.end_sequence(subject) == master.end_sequence(subject)
        for sequence in range(slave.first_sequence(subject), slave.end_sequence(subject)):
            try:
                message = slave.read(subject, sequence)
            except SequenceOutOfRange:
                continue  # a hole: the record lies before the reset point
            assert message == master.read(subject, sequence)
            copied += 1
    assert copied == 25


def test_a_rotten_record_in_a_copy_is_found_by_the_scrub_and_cut_for_a_fetch_again(stores):
    master, slave = stores
    commit_batches(master, 20)
    copy(master, slave)
    segment = sorted(os.listdir(os.path.join(slave.data_dir, "messagelog")))[1]
    flip_bit(os.path.join(slave.data_dir, "messagelog", segment), 100)
    offset, bad = 0, None
    while bad is None:
        offset, bad = slave.verify_copy(offset, 1000)
    with pytest.raises(CorruptRecord):
        slave.read_copy(bad, 1 << 20)
    slave.truncate_copy(bad)
    copy(master, slave)
    assert contents(slave) == contents(master)


def test_an_inconsistent_copy_is_refused_and_not_indexed(stores):
    master, slave = stores
    commit_batches(master, 2)
    copy(master, slave)
    data = master.read_copy(0, 1 << 20)
    with pytest.raises(ValueError, match="start at offset 0"):
        slave.append_copy(0, data)
    broken = bytearray(master.read_copy(0, 1 << 20))
    broken[-1] ^= 1
    other = MessageStore(os.path.join(slave.data_dir, "..", "other"), TINY, now_ms=T0)
    with pytest.raises(CorruptRecord):
        other.append_copy(0, bytes(broken))
    assert other.copy_bounds() == (0, 0)
    other.close()


def test_a_copy_begun_past_retention_numbers_a_subject_it_never_saw_where_the_master_does(
        tmp_path):
    # "only" has records in the first segments alone; retention deletes them, so a slave
    # copying from the master's log start never sees one. The sequence starts tell it.
    master = MessageStore(str(tmp_path / "master"), TINY, now_ms=T0)
    slave = MessageStore(str(tmp_path / "slave"), TINY, now_ms=T0)
    try:
        for i in range(30):
            master.append("only", f"only-{i}", [], T0, b"x" * 100)
            master.commit()
        commit_batches(master, 30, start=100)
        report = master.apply_retention(T0 + 10 ** 12, {})
        assert report.deleted_segments and master.copy_bounds()[0] > 0
        assert master.first_sequence("only") == master.end_sequence("only") == 30
        found = master.newest_checkpoint(0)
        assert found is not None
        snapshot, covers = found
        assert snapshot.sequence == covers == master.copy_bounds()[0]
        assert master.newest_checkpoint(covers + 1) is None  # a start retention moved past
        slave.install_snapshot(snapshot.payload, covers)
        copy(master, slave)
        for subject in ("only", *SUBJECTS):
            assert slave.end_sequence(subject) == master.end_sequence(subject), subject
        assert slave.end_sequence("only") == 30
        slave.close()  # the starts outlive a restart (its checkpoint holds them)
        slave = MessageStore(str(tmp_path / "slave"), TINY, now_ms=T0)
        assert slave.end_sequence("only") == 30
        slave.append("only", "only-30", [], T0, b"y")
        assert [a.sequence for a in slave.commit()] == [30]
    finally:
        master.close()
        slave.close()


def test_sequence_starts_that_do_not_check_out_are_refused(stores):
    master, slave = stores
    commit_batches(master, 3)
    snapshot, covers = master.newest_checkpoint(0)
    rotten = bytearray(snapshot.payload)
    rotten[len(rotten) // 2] ^= 0x01
    with pytest.raises(CorruptRecord):
        slave.install_snapshot(bytes(rotten), covers)
    with pytest.raises(CorruptRecord):
        slave.install_snapshot(snapshot.payload, covers + 1)


def test_copy_end_is_the_end_copy_bounds_gives_and_refuses_a_closed_store(tmp_path):
    store = MessageStore(str(tmp_path / "m"), TINY, now_ms=T0)
    assert store.copy_end() == store.copy_bounds()[1] == 0
    commit_batches(store, 5)  # across segment rolls (TINY's 4 KiB segments)
    assert store.copy_end() == store.copy_bounds()[1] > 0
    store.close()
    with pytest.raises(StoreClosed):
        store.copy_end()
