"""Recovery on open: consumer logs and the dedup index are rebuilt from the message log."""

from __future__ import annotations

import glob
import os
import shutil

import pytest

from logstore import DiskFull, LogConfig, SegmentedLog
from logstore.faults import FaultPlan, flip_bit
from realtime.storage import MessageStore, StoreConfig
from realtime.storage.consumer_log import ENTRY_SIZE_BYTES
from realtime.storage.message_record import encode_message_record, tag_bloom
from realtime.storage.subject_names import encode_subject

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
SUBJECTS = ["a", "%retry%a%g"]


@pytest.fixture
def data_dir(tmp_path) -> str:
    return str(tmp_path / "data")


def open_store(data_dir, now_ms=T0 + 1, config=TINY, **kwargs) -> MessageStore:
    return MessageStore(data_dir, config, now_ms=now_ms, **kwargs)


def payload(subject: str, sequence: int) -> bytes:
    return f"{subject}/{sequence}/".encode() + b"\xfe" * (sequence * 13 % 150)


def fill(data_dir, batches=5, per_batch=9, close=True) -> MessageStore:
    """Commit messages to both subjects; returns the (open or closed) store."""
    store = open_store(data_dir, now_ms=T0)
    for _ in range(batches):
        buffered = dict.fromkeys(SUBJECTS, 0)  # appended since the last commit, per subject
        for i in range(per_batch):
            subject = SUBJECTS[i % 2]
            sequence = store.end_sequence(subject) + buffered[subject]
            buffered[subject] += 1
            store.append(subject, f"{subject}:{sequence}", [sequence % 3], T0, payload(subject, sequence))
        store.commit()
    if close:
        store.close()
    return store


def assert_all_readable(store: MessageStore, ends: dict[str, int]) -> None:
    assert store.end_sequences() == ends
    for subject, end in ends.items():
        for sequence in range(end):
            message = store.read(subject, sequence)
            assert message.payload == payload(subject, sequence)
            assert message.message_id == f"{subject}:{sequence}"
            assert message.tag_bloom == tag_bloom([sequence % 3])


def consumer_log_dir(data_dir, subject) -> str:
    return os.path.join(data_dir, "consumerlog", encode_subject(subject))


def consumer_log_files(data_dir, subject) -> list[str]:
    return sorted(glob.glob(os.path.join(consumer_log_dir(data_dir, subject), "*.clog")))


def test_a_clean_reopen_replays_from_the_checkpoint_and_changes_nothing(data_dir):
    fill(data_dir)
    store = open_store(data_dir)
    report = store.recovery
    assert report.checkpoint_offset == store._message_log.end_offset
    assert not report.full_rebuild and report.subjects == {}
    assert_all_readable(store, {"a": 25, "%retry%a%g": 20})
    store.close()


def test_appends_not_committed_before_close_are_gone_after_reopen(data_dir):
    store = fill(data_dir, close=False)
    store.append("a", "uncommitted", [], T0, b"never")
    store.close()
    store = open_store(data_dir)
    assert store.end_sequence("a") == 25
    assert not store.append("a", "uncommitted", [], T0 + 1, b"now").duplicate
    store.close()


def test_a_deleted_consumer_log_is_rebuilt_from_the_message_log(data_dir):
    fill(data_dir)
    shutil.rmtree(consumer_log_dir(data_dir, "%retry%a%g"))
    store = open_store(data_dir)
    report = store.recovery
    assert report.full_rebuild and "%retry%a%g" in report.full_rebuild_reason
    assert report.subjects["%retry%a%g"].entries_rebuilt == 20
    assert "a" not in report.subjects
    assert_all_readable(store, {"a": 25, "%retry%a%g": 20})
    store.close()


def test_deleted_consumer_log_files_are_rebuilt_even_without_a_checkpoint(data_dir):
    fill(data_dir)
    files = consumer_log_files(data_dir, "a")
    for path in files[2:]:
        os.unlink(path)
    for path in glob.glob(os.path.join(data_dir, "checkpoint", "*")):
        os.unlink(path)
    store = open_store(data_dir)
    assert store.recovery.full_rebuild_reason == "no checkpoint file verifies"
    assert store.recovery.subjects["a"].entries_rebuilt == 25 - 8
    assert_all_readable(store, {"a": 25, "%retry%a%g": 20})
    store.close()


def test_records_appended_to_the_message_log_behind_the_store_are_indexed_on_reopen(data_dir):
    fill(data_dir)
    log = SegmentedLog(os.path.join(data_dir, "messagelog"),
                       LogConfig(segment_size_bytes_max=4096, record_size_bytes_max=2048))
    for sequence in range(25, 32):
        log.append(encode_message_record(T0, sequence, tag_bloom([sequence % 3]), "a",
                                         f"a:{sequence}", payload("a", sequence)))
    log.append(encode_message_record(T0, 0, tag_bloom([0]), "new", "new:0", payload("new", 0)))
    log.close()
    store = open_store(data_dir)
    assert not store.recovery.full_rebuild
    assert store.recovery.subjects["a"].entries_rebuilt == 7
    assert_all_readable(store, {"a": 32, "%retry%a%g": 20, "new": 1})
    assert store.append("a", "a:31", [], T0 + 1, b"").duplicate
    store.close()


def test_a_torn_consumer_log_entry_is_cut_and_rebuilt(data_dir):
    fill(data_dir)
    last = consumer_log_files(data_dir, "a")[-1]
    os.truncate(last, os.path.getsize(last) - 10)
    store = open_store(data_dir)
    subject_report = store.recovery.subjects["a"]
    assert any("torn entry" in reason for reason in subject_report.reasons)
    assert subject_report.entries_rebuilt >= 1
    assert_all_readable(store, {"a": 25, "%retry%a%g": 20})
    store.close()


def test_a_consumer_log_entry_with_a_bad_crc_is_cut_and_rebuilt(data_dir):
    store = fill(data_dir, close=False)
    # A crash after the last commit: the checkpoint is older than the last entries.
    store._checkpoint_offset = -1
    last = consumer_log_files(data_dir, "a")[-1]
    flip_bit(last, os.path.getsize(last) - ENTRY_SIZE_BYTES + 3)
    for path in sorted(glob.glob(os.path.join(data_dir, "checkpoint", "*.ckpt")))[-1:]:
        os.unlink(path)
    store = open_store(data_dir)
    subject_report = store.recovery.subjects["a"]
    assert any("corrupt sequence 24" in reason for reason in subject_report.reasons)
    assert_all_readable(store, {"a": 25, "%retry%a%g": 20})
    store.close()


def test_a_cut_message_log_tail_removes_the_consumer_log_entries_past_it(data_dir):
    fill(data_dir)
    segments = sorted(glob.glob(os.path.join(data_dir, "messagelog", "*.log")))
    os.truncate(segments[-1], os.path.getsize(segments[-1]) - 5)
    store = open_store(data_dir)
    report = store.recovery
    assert report.message_log.truncation is not None
    assert report.full_rebuild  # the checkpoint pointed past the new end
    lost = [s for s in SUBJECTS if s in report.subjects]
    assert len(lost) == 1 and report.subjects[lost[0]].entries_truncated == 1
    ends = {"a": 25, "%retry%a%g": 20}
    ends[lost[0]] -= 1
    assert_all_readable(store, ends)
    # The lost sequence is assigned again.
    assert store.append(lost[0], "again", [], T0 + 1, b"x").sequence == ends[lost[0]]
    store.close()


@pytest.mark.parametrize("damage", ["delete", "flip"])
def test_a_missing_or_corrupt_checkpoint_means_a_full_rebuild(data_dir, damage):
    fill(data_dir)
    for path in glob.glob(os.path.join(data_dir, "checkpoint", "*.ckpt")):
        if damage == "delete":
            os.unlink(path)
        else:
            flip_bit(path, os.path.getsize(path) - 2)
    shutil.rmtree(consumer_log_dir(data_dir, "a"))
    store = open_store(data_dir)
    assert store.recovery.full_rebuild
    assert store.recovery.replay_from_offset == 0
    assert store.recovery.subjects["a"].entries_rebuilt == 25
    assert_all_readable(store, {"a": 25, "%retry%a%g": 20})
    store.close()


def test_a_batch_dropped_for_a_full_disk_leaves_no_record_for_recovery_to_replay(data_dir):
    plan = FaultPlan()
    store = open_store(data_dir, opener=plan.opener)
    for i in range(3):
        store.append("a", f"a:{i}", [i % 3], T0, payload("a", i))
    store.commit()
    plan.disk_capacity_bytes = plan.bytes_written + 1500
    for i in range(12):
        store.append("a", f"dropped{i}", [], T0, b"d" * 200)
    with pytest.raises(DiskFull):
        store.commit()
    plan.free_space(1 << 20)
    for i in range(3, 6):
        store.append("a", f"a:{i}", [i % 3], T0, payload("a", i))
    store.commit()
    store.close()
    for path in glob.glob(os.path.join(data_dir, "checkpoint", "*.ckpt")):
        os.unlink(path)
    store = open_store(data_dir)
    assert store.recovery.records_replayed == 6  # the dropped batch left none (rvb-2, s14)
    assert_all_readable(store, {"a": 6})
    assert not store.append("a", "dropped0", [], T0 + 1, b"").duplicate
    store.close()


def test_a_crash_without_close_loses_no_committed_message(data_dir):
    store = fill(data_dir, close=False)
    # No close(): the second store opens the files as they are after a kill -9.
    shutil.rmtree(consumer_log_dir(data_dir, "a"))
    again = open_store(data_dir)
    assert_all_readable(again, {"a": 25, "%retry%a%g": 20})
    again.close()
    store._closed = True  # its files are the first store's; do not write through them again


def test_a_missing_middle_consumer_log_file_cuts_the_files_after_it_and_rebuilds(data_dir):
    fill(data_dir)
    files = consumer_log_files(data_dir, "a")
    os.unlink(files[1])
    store = open_store(data_dir)
    assert any("gap before file" in r for r in store.recovery.subjects["a"].reasons)
    assert_all_readable(store, {"a": 25, "%retry%a%g": 20})
    store.close()


def test_consumer_logs_written_with_another_entries_per_file_are_dropped_and_rebuilt(data_dir):
    fill(data_dir)
    import dataclasses

    store = open_store(data_dir, config=dataclasses.replace(TINY, consumer_log_entries_per_file=3))
    assert any("not multiples" in r for r in store.recovery.subjects["a"].reasons)
    assert store.recovery.full_rebuild
    assert_all_readable(store, {"a": 25, "%retry%a%g": 20})
    store.close()


def test_a_flipped_bit_in_a_stored_entry_or_record_is_an_error_on_read_not_data(data_dir):
    from realtime.storage import CorruptEntry

    fill(data_dir)
    flip_bit(consumer_log_files(data_dir, "a")[0], 2 * ENTRY_SIZE_BYTES + 9)  # sequence 2
    # Past the dedup window the replay starts at the checkpoint and never looks at sequence 2
    # (nor do the binary searches for the first sequence and the message-log end).
    store = open_store(data_dir, now_ms=T0 + 10 * TINY.dedup_window_ms)
    with pytest.raises(CorruptEntry, match="sequence 2 of subject 'a'"):
        store.read("a", 2)
    with pytest.raises(CorruptEntry):
        store.scan("a", 0, 10)
    store.close()
    # Within the window the replay for the dedup index verifies it and rewrites it.
    store = open_store(data_dir)
    assert store.recovery.subjects["a"].entries_truncated > 0
    assert_all_readable(store, {"a": 25, "%retry%a%g": 20})
    offset = store._consumer_logs["a"].entry(2).message_log_offset
    store.close()
    segment = sorted(glob.glob(os.path.join(data_dir, "messagelog", "*.log")))[0]
    flip_bit(segment, offset + 40)
    # A bad record below the checkpoint: the dedup rebuild falls back to the checkpoint range.
    store = open_store(data_dir)
    with pytest.raises(CorruptEntry, match="crc mismatch"):
        store.read("a", 2)
    assert store.read("a", 3).payload == payload("a", 3)
    store.close()


def test_a_corrupt_entry_met_while_finding_the_first_sequence_is_rebuilt(data_dir):
    fill(data_dir)
    # The binary search for the first sequence of 25 entries looks at 12, 6, 3, 1 and 0.
    flip_bit(consumer_log_files(data_dir, "a")[0], 1 * ENTRY_SIZE_BYTES + 9)
    store = open_store(data_dir, now_ms=T0 + 10 * TINY.dedup_window_ms)
    assert store.recovery.full_rebuild
    assert any("corrupt sequence 1" in r for r in store.recovery.subjects["a"].reasons)
    assert_all_readable(store, {"a": 25, "%retry%a%g": 20})
    store.close()


def test_records_of_a_batch_dropped_for_a_full_disk_never_reappear_after_a_crash(data_dir):
    # Until session 14 they could, like a send whose acknowledgement was lost: the part of the
    # batch written before the disk filled stayed in the message log (review s14 rvb-2).
    plan = FaultPlan()
    store = open_store(data_dir, opener=plan.opener)
    store.append("a", "a:0", [0], T0, payload("a", 0))
    store.commit()
    plan.disk_capacity_bytes = plan.bytes_written + 1500
    for i in range(8):
        store.append("a", f"dropped{i}", [], T0, b"d" * 300)
    with pytest.raises(DiskFull):
        store.commit()
    assert store.end_sequence("a") == 1
    plan.disk_capacity_bytes = None
    again = open_store(data_dir)  # no close(): a crash
    assert again.end_sequence("a") == 1
    assert not again.append("a", "dropped0", [], T0 + 1, b"").duplicate
    again.close()
    store._closed = True


def test_a_scan_told_to_pass_over_a_damaged_record_names_it_by_its_unverified_id(data_dir):
    from logstore.record import HEADER_SIZE_BYTES
    from realtime.storage import CorruptEntry

    fill(data_dir)
    store = open_store(data_dir)
    entry = store._consumer_logs["a"].entry(2)
    store.close()
    segment = sorted(glob.glob(os.path.join(data_dir, "messagelog", "*.log")))[0]
    # The last payload byte: the header still names "a" sequence 2 and its id.
    flip_bit(segment, entry.message_log_offset + HEADER_SIZE_BYTES + entry.size_bytes - 1)
    store = open_store(data_dir, now_ms=T0 + 10 * TINY.dedup_window_ms)
    with pytest.raises(CorruptEntry):
        store.scan("a", 0, 10)
    unreadable: list = []
    found, next_sequence = store.scan("a", 0, 10, unreadable=unreadable)
    assert [m.sequence for m in found] == [0, 1, *range(3, 11)] and next_sequence == 11
    assert unreadable == [(2, "a:2")]
    assert store.unverified_id("a", 3) == "a:3"
    assert store.unverified_id("a", 99) is None
    store.close()
