"""DelayStore as a replica (delayserver.storage.copying): a slave that copies the master's delay
log and done journal holds the same schedule, the same dispatched and cancelled entries, the
same pending counts and the same done watermark, so it can take over dispatching; a copy it
cannot cut back is thrown away and copied again."""

from __future__ import annotations

import pytest

from delayserver.storage import DelayStore, DelayStoreConfig
from delayserver.storage.done_journal import (
    KIND_DISPATCHED,
    decode_journal_record,
    encode_journal_record,
)
from logstore import CopyReset, DiskFull
from logstore.faults import FaultPlan

NOW_MS = 1_700_000_000_000
BUCKET_MS = 1_000
# Segments grow as written (a full disk through writes; allocating ahead: test_logstore_prealloc).
TINY = DelayStoreConfig(bucket_ms=BUCKET_MS, segment_size_bytes_max=4096, preallocate_step_bytes=0)


@pytest.fixture
def pair(tmp_path):
    master = DelayStore(str(tmp_path / "master"), TINY, now_ms=NOW_MS)
    slave = DelayStore(str(tmp_path / "slave"), TINY, now_ms=NOW_MS)
    yield master, slave
    master.close()
    slave.close()


def send(store: DelayStore, count: int, first_ms: int, prefix: str = "m") -> list:
    for i in range(count):
        store.append(f"{prefix}-{i}", f"subject-{i % 3}", first_ms + i * 150, b"payload %d" % i)
    return store.commit()


def copy(master: DelayStore, slave: DelayStore, max_bytes: int = 600) -> None:
    """The delay log first, then the journal (its records refer to delay-log records)."""
    for source, target in ((master.delay_copy, slave.delay_copy),
                           (master.done_copy, slave.done_copy)):
        offset = target.copy_bounds()[1]
        while True:
            data = source.read_copy(offset, max_bytes)
            if not data:
                break
            offset = target.append_copy(offset, data)


def view(store: DelayStore, buckets) -> tuple:
    pending = {bucket: [(e.deliver_at_ms, e.delay_log_offset, store.read(e).message_id)
                        for e in store.load_bucket(bucket)] for bucket in buckets}
    stats = store.pending_stats()
    return pending, stats.total, stats.per_hour, stats.per_subject, store.done_before()


def test_a_copy_holds_the_same_pending_messages_counts_and_watermark(pair):
    master, slave = pair
    first = NOW_MS + 10_000
    entries = send(master, 40, first)
    master.record_dispatched(entries[:12])
    assert master.cancel("m-20", entries[20].deliver_at_ms) == "cancelled"
    buckets = sorted({e.bucket_ms for e in entries})
    master.mark_done_before(entries[12].bucket_ms - entries[12].bucket_ms % BUCKET_MS)
    copy(master, slave)
    assert view(slave, buckets[2:]) == view(master, buckets[2:])
    assert slave.done_before() == master.done_before() > 0


def test_a_copy_taken_in_small_steps_while_the_master_works_ends_the_same(pair, tmp_path):
    master, slave = pair
    first = NOW_MS + 10_000
    buckets = set()
    for step in range(5):
        entries = send(master, 10, first + step * 1_500, prefix=f"s{step}")
        buckets |= {e.bucket_ms for e in entries}
        copy(master, slave, max_bytes=200)
        master.record_dispatched(entries[:3])
        copy(master, slave, max_bytes=200)
    assert view(slave, sorted(buckets)) == view(master, sorted(buckets))
    slave.close()
    reopened = DelayStore(str(tmp_path / "slave"), TINY, now_ms=NOW_MS)
    assert view(reopened, sorted(buckets)) == view(master, sorted(buckets))
    reopened.close()


@pytest.mark.parametrize("spread_ms", [0, 400], ids=["one bucket a commit", "several"])
def test_a_copy_files_whole_commits_as_the_master_filed_them(pair, spread_ms):
    master, slave = pair
    buckets = set()
    for step in range(6):  # whole commits, copied one by one, as a tailing slave gets them
        offset = slave.delay_copy.copy_bounds()[1]
        for i in range(12):
            master.append(f"c{step}-{i}", f"subject-{i % 2}",
                          NOW_MS + 10_000 + step * 1_000 + i * spread_ms // 12, b"body")
        entries = master.commit()
        buckets |= {e.bucket_ms for e in entries}
        end = master.delay_copy.copy_bounds()[1]
        assert slave.delay_copy.append_copy(offset, master.delay_copy.read_copy(
            offset, end - offset)) == end
    assert view(slave, sorted(buckets)) == view(master, sorted(buckets))
    # What only retention and the bucket reads use: each bucket's known count, each chunk's
    # highest bucket.
    assert slave._bucket_pending == master._bucket_pending
    assert slave._chunk_max == master._chunk_max


def test_a_promoted_copy_takes_over_dispatching_what_is_left(pair):
    master, slave = pair
    entries = send(master, 10, NOW_MS + 10_000)
    master.record_dispatched(entries[:4])
    copy(master, slave)
    left = [e for b in sorted({e.bucket_ms for e in entries}) for e in slave.load_bucket(b)]
    assert sorted(slave.read(e).message_id for e in left) == sorted(f"m-{i}" for i in range(4, 10))
    slave.record_dispatched(left)
    assert slave.pending_stats().total == 0


def test_a_copy_cannot_be_cut_back_and_is_copied_again_from_the_master_start(pair):
    master, slave = pair
    entries = send(master, 10, NOW_MS + 10_000)
    master.record_dispatched(entries[:2])
    copy(master, slave)
    send(slave, 3, NOW_MS + 20_000, prefix="own")  # a tail of its own, as an old master has
    assert slave.delay_copy.truncate_copy(slave.delay_copy.copy_bounds()[1]) == 0
    with pytest.raises(CopyReset):
        slave.delay_copy.truncate_copy(0)
    slave.delay_copy.reset_copy(master.delay_copy.copy_bounds()[0])
    copy(master, slave)
    buckets = sorted({e.bucket_ms for e in entries})
    assert view(slave, buckets) == view(master, buckets)


def test_journal_records_round_trip_with_their_subject_counts():
    body = encode_journal_record(KIND_DISPATCHED, 5_000, [10, 99], [7, 8], [0, 3],
                                 {"orders": 1, None: 1})
    record = decode_journal_record(body)
    assert (record.kind, record.bucket_ms, record.offsets, record.id_hashes, record.indexes) == (
        KIND_DISPATCHED, 5_000, (10, 99), (7, 8), (0, 3))
    assert record.per_subject == (("orders", 1), ("", 1))
    with pytest.raises(ValueError, match="after the journal record"):
        decode_journal_record(body + b"x")


def test_a_handed_record_survives_a_reopen_and_reaches_a_copy(pair, tmp_path):
    """The delay server writes it before a hold is sent: a restarted or promoted server knows
    which cancels must ask the broker (docs/REPLICATION.md 16)."""
    master, slave = pair
    send(master, 3, NOW_MS + 10_000)
    assert master.handed_until_ms() == 0
    master.record_handed(NOW_MS + 5_000)
    master.record_handed(NOW_MS + 4_000)  # a lower one changes nothing
    assert master.handed_until_ms() == NOW_MS + 5_000
    copy(master, slave)
    assert slave.handed_until_ms() == NOW_MS + 5_000
    pending = view(slave, [NOW_MS + 10_000 - NOW_MS % BUCKET_MS])
    assert pending == view(master, [NOW_MS + 10_000 - NOW_MS % BUCKET_MS])
    master.close()
    again = DelayStore(str(tmp_path / "master"), TINY, now_ms=NOW_MS)
    try:
        assert again.handed_until_ms() == NOW_MS + 5_000
    finally:
        again.close()


def test_a_handed_message_a_broker_dropped_is_cancelled_on_the_copy_and_after_a_reopen(
        pair, tmp_path):
    """record_dropped (journal kind 5): a later cancel says already_cancelled on a promoted
    copy and after a restart (review s10 N3); the pending counts do not change twice."""
    master, slave = pair
    entries = send(master, 3, NOW_MS + 10_000)
    master.record_dispatched(entries[:2])
    assert master.record_dropped("m-0", entries[0].deliver_at_ms) == "dropped"
    assert master.record_dropped("m-0", entries[0].deliver_at_ms) == "already_cancelled"
    assert master.record_dropped("m-2", entries[2].deliver_at_ms) == "open"
    assert master.record_dropped("m-9", entries[2].deliver_at_ms) == "unknown"
    assert master.cancel("m-0", entries[0].deliver_at_ms) == "already_cancelled"
    assert master.cancel("m-1", entries[1].deliver_at_ms) == "already_dispatched"
    copy(master, slave)
    assert slave.cancel("m-0", entries[0].deliver_at_ms) == "already_cancelled"
    assert slave.cancel("m-1", entries[1].deliver_at_ms) == "already_dispatched"
    assert slave.pending_stats().total == master.pending_stats().total == 1
    master.close()
    again = DelayStore(str(tmp_path / "master"), TINY, now_ms=NOW_MS)
    try:
        assert again.cancel("m-0", entries[0].deliver_at_ms) == "already_cancelled"
        assert again.pending_stats().total == 1
    finally:
        again.close()


def test_a_done_journal_copy_thrown_away_no_longer_counts_its_handed_entries_as_named(pair):
    # Review s12 rvdelay-4: the reset kept the named entries and handed times of the old copy,
    # so cancels of those messages asked the brokers after a promotion.
    master, slave = pair
    entries = send(master, 4, NOW_MS + 10_000)
    master.record_handed_entries([(entries[-1].deliver_at_ms, entries)])
    master.record_handed(entries[-1].deliver_at_ms)
    copy(master, slave)
    assert slave.handed_ids_until_ms() == entries[-1].deliver_at_ms
    assert slave.handed_until_ms() == entries[-1].deliver_at_ms
    assert slave._journal.handed
    slave.done_copy.reset_copy(master.done_copy.copy_bounds()[1])
    assert (slave.handed_ids_until_ms(), slave.handed_until_ms()) == (0, 0)
    assert not slave._journal.handed


@pytest.mark.parametrize("defect", ["entries past the body", "unknown body version"])
def test_a_copied_journal_chunk_with_a_malformed_record_stops_the_copy_exactly_at_it(
        pair, defect):
    # Review s12 rvdelay-5: a CRC-valid kind-6 body whose entry count runs past it raised a
    # bare ValueError after the chunk was appended: its other records never applied, and the
    # next fetch started past them. Review s13 rvmends-3: the error says where and what, and
    # the records before it are kept (a refetch from the chunk's start meets it again).
    from logstore import UndecodableRecord
    from logstore.record import encode_record
    from delayserver.storage.done_journal import HEADER, KIND_HANDED_IDS

    master, slave = pair
    entries = send(master, 2, NOW_MS + 10_000)
    master.record_dispatched(entries[:1])
    copy(master, slave)
    good_end = slave.done_copy.copy_bounds()[1]
    first, end = master.done_copy.copy_bounds()
    assert good_end == end
    master.record_dispatched(entries[1:])
    dispatched = master.done_copy.read_copy(end, 1 << 20)
    body = bytearray(encode_journal_record(KIND_HANDED_IDS, NOW_MS + 10_000, [1], [2], [3], {}))
    if defect == "entries past the body":
        HEADER.pack_into(body, 0, KIND_HANDED_IDS, 1, 0, NOW_MS + 10_000, 5, 0)
    else:
        body[1] = 9
    bad = encode_record(bytes(body))
    stop_at = good_end + len(dispatched)
    with pytest.raises(UndecodableRecord, match="copied journal record") as raised:
        slave.done_copy.append_copy(good_end, dispatched + bad)
    assert (raised.value.offset, raised.value.kind) == (stop_at, KIND_HANDED_IDS)
    assert raised.value.version == (1 if defect == "entries past the body" else 9)
    assert slave.done_copy.copy_bounds()[1] == stop_at, "the records before it are kept"
    assert slave.pending_stats().total == master.pending_stats().total, "and applied"
    with pytest.raises(UndecodableRecord):  # fetched again from the copy's end
        slave.done_copy.append_copy(stop_at, bad)
    assert slave.done_copy.copy_bounds()[1] == stop_at, "nothing of it is written"


def test_a_journal_record_that_cannot_be_decoded_fails_the_open_naming_its_offset(tmp_path):
    # Review s12 rvdelay-5, at open: a bare ValueError ("5 entries run past ...") named no file
    # and no offset.
    from logstore import CorruptRecord
    from delayserver.storage.done_journal import HEADER, KIND_HANDED_IDS

    store = DelayStore(str(tmp_path / "d"), TINY, now_ms=NOW_MS)
    try:
        send(store, 1, NOW_MS + 10_000)
        body = bytearray(encode_journal_record(KIND_HANDED_IDS, NOW_MS, [1], [2], [3], {}))
        HEADER.pack_into(body, 0, KIND_HANDED_IDS, 1, 0, NOW_MS, 5, 0)
        at = store._journal.log.end_offset
        store._journal.log.append_many([bytes(body)])  # CRC-valid, as a master's bug writes it
        store._journal.log.sync()
    finally:
        store.close()
    with pytest.raises(CorruptRecord, match="5 entries run past") as raised:
        DelayStore(str(tmp_path / "d"), TINY, now_ms=NOW_MS)
    assert raised.value.offset == at and "donelog" in raised.value.path


def test_the_store_s_delay_end_is_the_delay_copy_s_end_after_each_commit_and_a_reopen(tmp_path):
    store = DelayStore(str(tmp_path / "delay"), TINY, now_ms=NOW_MS)
    ends = [store.delay_end()]
    for count in (1, 30, 2):  # the 4 KiB segments roll on the way
        send(store, count, NOW_MS + 5_000, prefix=f"c{count}-")
        assert store.delay_end() == store.delay_copy.copy_bounds()[1]
        ends.append(store.delay_end())
    store.append("buffered", "s", NOW_MS + 5_000, b"x")  # not committed: not in the end
    assert store.delay_end() == ends[-1]
    assert ends == sorted(set(ends))
    store.close()
    reopened = DelayStore(str(tmp_path / "delay"), TINY, now_ms=NOW_MS)
    assert reopened.delay_end() == ends[-1] == reopened.delay_copy.copy_bounds()[1]
    reopened.close()


def test_a_delay_slave_whose_disk_fills_during_a_copy_keeps_nothing_of_it_and_copies_it_again(
        tmp_path):
    plan = FaultPlan()
    master = DelayStore(str(tmp_path / "m"), TINY, now_ms=NOW_MS)
    slave = DelayStore(str(tmp_path / "s"), TINY, now_ms=NOW_MS, opener=plan.opener)
    send(master, 30, NOW_MS + 10_000)
    end = master.delay_copy.copy_bounds()[1]
    data = master.delay_copy.read_copy(0, 1 << 20)
    plan.disk_capacity_bytes = plan.bytes_written + len(data) // 2
    with pytest.raises(DiskFull):
        slave.delay_copy.append_copy(0, data)
    assert slave.delay_copy.copy_bounds()[1] == 0
    plan.free_space(1 << 20)
    offset = 0
    while offset < end:  # the follower fetches from the copy's end again
        offset = slave.delay_copy.append_copy(offset, master.delay_copy.read_copy(offset, 1 << 20))
    assert slave.pending_stats().total == master.pending_stats().total == 30
    master.close()
    slave.close()
