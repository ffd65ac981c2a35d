"""Retention: time based, held back by online groups, overridden by the hard caps."""

from __future__ import annotations

import dataclasses
import glob
import os
import shutil

import pytest

from realtime.storage import MessageStore, SequenceOutOfRange, StoreConfig
from realtime.storage.subject_names import encode_subject

HOUR_MS = 3600_000
TINY = StoreConfig(
    segment_size_bytes_max=4096,
    record_size_bytes_max=2048,
    consumer_log_entries_per_file=4,
    write_buffer_bytes_max=1024,
    checkpoint_interval_bytes=2048,
    retention_ms=1 * HOUR_MS,
    retention_hard_cap_ms=10 * HOUR_MS,
    retention_hard_cap_bytes=1 << 30,
)
T0 = 1_700_000_000_000
PAYLOAD_BYTES = 1200  # three records per 4 KiB segment, so retention cuts inside consumer-log files


@pytest.fixture
def data_dir(tmp_path) -> str:
    return str(tmp_path / "data")


def fill(data_dir, config=TINY, count=20) -> MessageStore:
    """``count`` messages on subject "a", one a minute, plus one on "b" at the start."""
    store = MessageStore(data_dir, config, now_ms=T0)
    store.append("b", "b0", [], T0, b"b")
    store.commit()
    for i in range(count):
        store.append("a", f"a{i}", [], T0 + i * 60_000, bytes([i]) * PAYLOAD_BYTES)
        store.commit()
    return store


def segment_count(data_dir) -> int:
    return len(glob.glob(os.path.join(data_dir, "messagelog", "*.log")))


def test_nothing_is_deleted_before_retention_ms(data_dir):
    store = fill(data_dir)
    report = store.apply_retention(T0 + 19 * 60_000 + HOUR_MS // 2, {"a": 20, "b": 1})
    assert report.deleted_segments == [] and report.bytes_deleted == 0
    assert not report
    assert store.first_sequence("a") == 0
    store.close()


def test_old_segments_are_kept_while_an_online_group_still_needs_them(data_dir):
    store = fill(data_dir)
    segments = segment_count(data_dir)
    report = store.apply_retention(T0 + 5 * HOUR_MS, {"a": 0})
    assert report.deleted_segments == [] and report.kept_for == "a"
    assert segment_count(data_dir) == segments
    assert store.read("a", 0).payload == bytes([0]) * PAYLOAD_BYTES
    store.close()


def test_segments_every_group_has_consumed_are_deleted_and_first_sequence_moves(data_dir):
    store = fill(data_dir)
    segments = segment_count(data_dir)
    report = store.apply_retention(T0 + 5 * HOUR_MS, {"a": 9})
    assert report.deleted_segments, "the group at 9 has consumed the oldest segments"
    assert report
    assert {d.reason for d in report.deleted_segments} == {"retention"}
    assert segment_count(data_dir) == segments - len(report.deleted_segments)
    first = store.first_sequence("a")
    assert 0 < first <= 9
    assert report.first_sequences["a"] == first
    assert report.first_sequences["b"] == store.first_sequence("b") == store.end_sequence("b") == 1
    assert report.bytes_deleted >= sum(d.size_bytes for d in report.deleted_segments)
    with pytest.raises(SequenceOutOfRange, match="deleted by retention") as info:
        store.read("a", first - 1)
    assert info.value.first_sequence == first
    with pytest.raises(SequenceOutOfRange):
        store.scan("a", first - 1, 10)
    for sequence in range(first, 20):
        assert store.read("a", sequence).payload == bytes([sequence]) * PAYLOAD_BYTES
    assert [m.sequence for m in store.scan("a", first, 100)[0]] == list(range(first, 20))
    store.close()


def test_consumer_log_files_entirely_below_the_retained_log_are_deleted(data_dir):
    store = fill(data_dir)
    report = store.apply_retention(T0 + 5 * HOUR_MS, {})
    first = store.first_sequence("a")
    assert first > 4
    deleted = report.consumer_log_files_deleted["a"]
    assert [d.base_sequence for d in deleted] == list(range(0, first - first % 4, 4))
    remaining = sorted(os.listdir(os.path.join(data_dir, "consumerlog", "a")))
    assert remaining[0] == f"{first - first % 4:020d}.clog"
    # "b" keeps its last file so its end sequence survives.
    assert os.listdir(os.path.join(data_dir, "consumerlog", "b")) == [f"{0:020d}.clog"]
    store.close()


def test_the_active_segment_is_never_deleted(data_dir):
    store = fill(data_dir)
    store.apply_retention(T0 + 100 * HOUR_MS, {})
    assert segment_count(data_dir) == 1
    assert store.read("a", 19).payload == bytes([19]) * PAYLOAD_BYTES
    store.close()


def test_the_age_hard_cap_deletes_even_what_a_group_still_needs(data_dir):
    store = fill(data_dir)
    report = store.apply_retention(T0 + 11 * HOUR_MS, {"a": 0})
    assert report.deleted_segments
    assert {d.reason for d in report.deleted_segments} == {"hard_cap_age"}
    assert store.first_sequence("a") > 0
    store.close()


def test_the_bytes_hard_cap_deletes_the_oldest_young_segments(data_dir):
    config = dataclasses.replace(TINY, retention_hard_cap_bytes=8192)
    store = fill(data_dir, config)
    report = store.apply_retention(T0 + 20 * 60_000, {"a": 0})
    assert {d.reason for d in report.deleted_segments} == {"hard_cap_bytes"}
    sizes = [os.path.getsize(p) for p in glob.glob(os.path.join(data_dir, "messagelog", "*.log"))]
    assert sum(sizes) <= 8192
    assert sum(sizes) + report.deleted_segments[-1].size_bytes > 8192
    store.close()


def test_retention_survives_a_reopen_and_a_full_rebuild_leaves_holes_below_first(data_dir):
    store = fill(data_dir)
    store.apply_retention(T0 + 5 * HOUR_MS, {"a": 9})
    first = store.first_sequence("a")
    store.close()
    again = MessageStore(data_dir, TINY, now_ms=T0 + 5 * HOUR_MS)
    assert again.first_sequence("a") == first and again.end_sequence("a") == 20
    again.close()
    shutil.rmtree(os.path.join(data_dir, "consumerlog"))
    shutil.rmtree(os.path.join(data_dir, "checkpoint"))
    rebuilt = MessageStore(data_dir, TINY, now_ms=T0 + 5 * HOUR_MS)
    assert rebuilt.recovery.full_rebuild
    assert rebuilt.first_sequence("a") == first and rebuilt.end_sequence("a") == 20
    # Holes stand for the deleted sequences of the first retained file only.
    assert rebuilt.recovery.subjects["a"].holes == first % 4
    with pytest.raises(SequenceOutOfRange):
        rebuilt.read("a", first - 1)
    assert rebuilt.read("a", first).payload == bytes([first]) * PAYLOAD_BYTES
    rebuilt.append("a", "next", [], T0 + 5 * HOUR_MS, b"n")
    assert rebuilt.commit()[0].sequence == 20
    rebuilt.close()


def test_a_subject_whose_records_are_all_deleted_keeps_its_end_sequence_over_a_rebuild(data_dir):
    store = fill(data_dir)
    store.apply_retention(T0 + 5 * HOUR_MS, {})
    store.close()
    shutil.rmtree(os.path.join(data_dir, "consumerlog", encode_subject("b")))
    again = MessageStore(data_dir, TINY, now_ms=T0 + 5 * HOUR_MS)
    assert again.end_sequence("b") == 1 and again.first_sequence("b") == 1
    assert again.append("b", "b1", [], T0 + 5 * HOUR_MS, b"").sequence == 1
    again.close()


def test_the_hard_cap_counts_and_names_what_a_group_had_not_consumed_and_only_that(data_dir):
    config = dataclasses.replace(TINY, retention_hard_cap_bytes=8192)
    store = fill(data_dir, config)
    report = store.apply_retention(T0 + 20 * 60_000, {"a": 2, "b": 1},
                                   lambda payload: f"payload of {payload[0]}")
    first = store.first_sequence("a")
    # "a" 0 and 1 (consumed) and "b" 0 (consumed) went unnoticed; 2 .. first-1 are given up.
    assert first > 2
    assert report.unconsumed_deleted == first - 2
    assert report.unconsumed_names == [f"payload of {i}" for i in range(2, first)]
    store.close()


def test_the_hard_cap_passes_over_a_damaged_record_and_names_the_records_after_it(data_dir):
    config = dataclasses.replace(TINY, retention_hard_cap_bytes=8192)
    store = fill(data_dir, config)
    store.close()
    # Damage the body of "a" 4, the middle record of its segment ("a" 3, 4, 5).
    (segment,) = [p for p in glob.glob(os.path.join(data_dir, "messagelog", "*.log"))
                  if bytes([4]) * PAYLOAD_BYTES in open(p, "rb").read()]
    with open(segment, "r+b") as file:
        offset = file.read().find(bytes([4]) * PAYLOAD_BYTES) + PAYLOAD_BYTES // 2
        file.seek(offset)
        file.write(bytes([4 ^ 0x10]))
    store = MessageStore(data_dir, config, now_ms=T0 + 20 * 60_000)
    report = store.apply_retention(T0 + 20 * 60_000, {"a": 2, "b": 1},
                                   lambda payload: f"payload of {payload[0]}")
    first = store.first_sequence("a")
    assert first > 6  # "a" 5, after the damaged record, was deleted too
    assert report.unconsumed_deleted == first - 2
    assert report.unconsumed_names == [f"payload of {i}" for i in range(2, first) if i != 4]
    assert report.unconsumed_unnamed == [("a", 4)]
    store.close()


def test_time_retention_and_a_hard_cap_without_groups_give_nothing_up(data_dir):
    store = fill(data_dir)
    report = store.apply_retention(T0 + 5 * HOUR_MS, {"a": 9}, lambda payload: "named")
    assert {d.reason for d in report.deleted_segments} == {"retention"}
    assert report.unconsumed_deleted == 0 and report.unconsumed_names == []
    store.close()
    config = dataclasses.replace(TINY, retention_hard_cap_bytes=8192)
    capped = MessageStore(data_dir + "-capped", config, now_ms=T0)
    capped.append("a", "x", [], T0, b"x" * PAYLOAD_BYTES)
    capped.commit()
    for i in range(9):
        capped.append("a", f"a{i}", [], T0, b"a" * PAYLOAD_BYTES)
        capped.commit()
    report = capped.apply_retention(T0, {}, lambda payload: "named")
    assert report.deleted_segments and report.unconsumed_deleted == 0
    capped.close()
