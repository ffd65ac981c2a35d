"""DelayStore.append_many (the delay server's group commit appends columns) against append one
row at a time: the same records, schedule files, entries, stats and errors. Tiny limits (1 s
buckets, 4 KiB segments), fake times."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from delayserver.storage import DelayStore, DelayStoreConfig
from delayserver.storage.delay_record import (
    encode_delay_record,
    encode_delay_records,
    subject_tail,
)
from delayserver.storage.layout import Layout
from delayserver.storage.schedule import ScheduleFiles
from delayserver.storage.schedule_entry import encode_schedule_entries, encode_schedule_entry
from logstore import OsFile, RecordTooLarge
from logstore.record import frame_records_python

NOW_MS = 1_700_000_000_000  # a fixed "now", never the clock
BUCKET_MS = 1_000
TINY = DelayStoreConfig(bucket_ms=BUCKET_MS, segment_size_bytes_max=4096,
                        record_size_bytes_max=1_000)
BASE_MS = NOW_MS - NOW_MS % BUCKET_MS


def rows(count: int, first: int = 0) -> list[tuple[str, str, int, bytes]]:
    """Rows spread over 7 buckets and 3 subjects, due times out of order."""
    return [(f"id-{k}", f"subject-{k % 3}", BASE_MS + 5_000 + (k * 379) % 7_000,
             b"payload %d " % k * (1 + k % 5)) for k in range(first, first + count)]


def columns(batch):
    return [list(column) for column in zip(*batch)]


def files_of(data_dir: str) -> dict[str, bytes]:
    """Every file under ``data_dir`` but the checkpoints, by relative path."""
    found = {}
    for root, _, names in os.walk(data_dir):
        for name in names:
            path = os.path.join(root, name)
            if "checkpoint" not in path:
                with open(path, "rb") as f:
                    found[os.path.relpath(path, data_dir)] = f.read()
    return found


def test_append_many_stores_what_append_row_by_row_stores_byte_for_byte(tmp_path):
    one_by_one = DelayStore(str(tmp_path / "rows"), TINY, now_ms=NOW_MS)
    in_columns = DelayStore(str(tmp_path / "columns"), TINY, now_ms=NOW_MS)
    for store in (one_by_one, in_columns):  # a watermark, so that some messages are late
        store.mark_done_before(BASE_MS + 8_000)
    committed = []
    for first, count in ((0, 1), (1, 40), (41, 3), (44, 25)):  # segments roll on the way
        batch = rows(count, first)
        for row in batch:
            one_by_one.append(*row)
        in_columns.append_many(*columns(batch))
        committed.append((one_by_one.commit(), in_columns.commit()))
    for expected, got in committed:
        assert got == expected
    late = [e for expected, _ in committed for e in expected if e.deliver_at_ms < BASE_MS + 8_000]
    assert late and {e.bucket_ms for e in late} == {BASE_MS + 8_000}
    assert in_columns.pending_stats() == one_by_one.pending_stats()
    in_columns.checkpoint()
    one_by_one.checkpoint()
    assert files_of(in_columns.data_dir) == files_of(one_by_one.data_dir)
    entries = committed[1][1]
    assert [in_columns.read(e).message_id for e in entries] == [row[0] for row in rows(40, 1)]
    one_by_one.close()
    in_columns.close()


@pytest.mark.parametrize("bad_row,error,match", [
    (("bad", "s", -1, b""), ValueError, "deliver_at_ms"),
    (("bad", "s", 1 << 64, b""), ValueError, "deliver_at_ms"),
    (("bad", "s", 1.5, b""), ValueError, "deliver_at_ms"),
    (("bad", "s", None, b""), ValueError, "deliver_at_ms"),
    (("", "s", NOW_MS, b""), ValueError, "message id"),
    (("x" * 0x10000, "s", NOW_MS, b""), ValueError, "message id"),  # past the u16 length
    (("bad", "s", NOW_MS, "not bytes"), TypeError, None),
    (("bad", "", NOW_MS, b""), ValueError, "subject"),
    (("bad", "s", NOW_MS, b"x" * 1_000), RecordTooLarge, "1000"),
])
def test_a_bad_row_raises_as_append_does_and_the_rows_before_it_stay_buffered(
        tmp_path, bad_row, error, match):
    store = DelayStore(str(tmp_path / "delay"), TINY, now_ms=NOW_MS)
    store.append_many(*columns(rows(3)))  # the subjects are known: the column path
    store.commit()
    batch = rows(4, 3) + [bad_row] + rows(2, 7)
    with pytest.raises(error, match=match):
        store.append_many(*columns(batch))
    assert [store.read(e).message_id for e in store.commit()] == ["id-3", "id-4", "id-5", "id-6"]
    store.close()


def test_the_column_encoders_give_the_bytes_of_the_one_row_encoders():
    dues, buckets = [5, 1 << 40, 0], [0, 1 << 40, 7]
    ids, subjects, payloads = [b"a", b"id" * 50, b"\xc3\xa9"], [b"s", b"t" * 300, b"s"], \
        [b"", b"x" * 70, b"\x00"]
    assert encode_delay_records(dues, buckets, ids, list(map(subject_tail, subjects)),
                                payloads) == list(map(encode_delay_record, dues, buckets, ids,
                                                      subjects, payloads))
    offsets, sizes, hashes = [0, 1 << 50, 12], [1, 2, (1 << 32) - 1], [0, 99, (1 << 32) - 1]
    assert encode_schedule_entries(dues, offsets, sizes, hashes) == list(
        map(encode_schedule_entry, dues, offsets, sizes, hashes))
    with pytest.raises(ValueError, match="subject"):
        subject_tail(b"")


@pytest.mark.parametrize("hours, subjects", [
    ([0, 0, 0], ["a", "a", "a"]),  # one hour, one subject: counted without a Counter
    ([0, 1, 0], ["a", "a", "a"]),
    ([2, 2], ["a", "b"]),
    ([0, 1, 2, 1], ["c", "a", "c", "b"]),
    ([], []),
])
def test_pending_counts_of_a_commit_are_those_of_its_rows_added_one_by_one(hours, subjects):
    from delayserver.storage.layout import HOUR_MS
    from delayserver.storage.stats import PendingCounts

    buckets = [BASE_MS + hour * HOUR_MS + 7 * BUCKET_MS for hour in hours]
    in_one, one_by_one = PendingCounts({BASE_MS - BASE_MS % HOUR_MS: 2}, {"a": 1}), \
        PendingCounts({BASE_MS - BASE_MS % HOUR_MS: 2}, {"a": 1})
    in_one.add_many(buckets, subjects)
    for bucket, subject in zip(buckets, subjects):
        one_by_one.add(bucket, subject)
    assert (in_one.per_hour, in_one.per_subject, in_one.total) == (
        one_by_one.per_hour, one_by_one.per_subject, one_by_one.total)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0, BUCKET_MS, 5 * BUCKET_MS]),
                          st.integers(1, 40)), max_size=12))
def test_a_run_of_entries_for_one_bucket_buffers_what_appending_them_one_by_one_does(runs):
    one_by_one = ScheduleFiles(Layout("/nonexistent-one"), OsFile)
    as_runs = ScheduleFiles(Layout("/nonexistent-runs"), OsFile)
    entry = 0
    for bucket, count in runs:
        entries = [encode_schedule_entry(BASE_MS + bucket, entry + k, 100, k) for k in range(count)]
        entry += count
        indexes = [one_by_one.append(BASE_MS + bucket, e) for e in entries]
        first = as_runs.append_run(BASE_MS + bucket, b"".join(entries))
        assert list(range(first, first + count)) == indexes
    for bucket in (0, BUCKET_MS, 5 * BUCKET_MS):
        assert as_runs.buffered(BASE_MS + bucket) == one_by_one.buffered(BASE_MS + bucket)
        assert as_runs.count(BASE_MS + bucket) == one_by_one.count(BASE_MS + bucket)
    assert as_runs.buffered_bytes == one_by_one.buffered_bytes


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([0, BUCKET_MS, 5 * BUCKET_MS]), max_size=40),
       st.integers(0, 40))
def test_entries_of_many_buckets_appended_in_one_call_buffer_what_appending_each_does(
        buckets, split):
    one_by_one = ScheduleFiles(Layout("/nonexistent-one"), OsFile)
    in_calls = ScheduleFiles(Layout("/nonexistent-calls"), OsFile)
    entries = [encode_schedule_entry(BASE_MS + bucket, k, 100, k)
               for k, bucket in enumerate(buckets)]
    dues = [BASE_MS + bucket for bucket in buckets]
    indexes = [one_by_one.append(due, entry) for due, entry in zip(dues, entries)]
    # Two calls, so the second finds buckets the first buffered.
    assert (in_calls.append_each(dues[:split], entries[:split])
            + in_calls.append_each(dues[split:], entries[split:])) == indexes
    for bucket in (0, BUCKET_MS, 5 * BUCKET_MS):
        assert in_calls.buffered(BASE_MS + bucket) == one_by_one.buffered(BASE_MS + bucket)
        assert in_calls.count(BASE_MS + bucket) == one_by_one.count(BASE_MS + bucket)
    assert in_calls.buffered_bytes == one_by_one.buffered_bytes == 32 * len(buckets)


def test_commits_within_one_bucket_index_what_commits_over_many_buckets_index(tmp_path):
    """A commit whose rows share a bucket takes the one-run path; the same rows committed with
    a row of another bucket among them take the per-entry path: the same entries (but for the
    delay-log offsets, which the extra rows move), read back the same, before and after a
    checkpoint writes the schedule files."""
    one_run = DelayStore(str(tmp_path / "one"), TINY, now_ms=NOW_MS)
    per_entry = DelayStore(str(tmp_path / "many"), TINY, now_ms=NOW_MS)
    other = ("other", "subject-9", BASE_MS + 50_500, b"elsewhere")  # a bucket of its own
    bucket = BASE_MS + 20_000
    got, expected = [], []
    for first, count in ((0, 9), (9, 10), (19, 1)):
        batch = [(f"id-{k}", f"subject-{k % 3}", bucket + k, b"p%d" % k)
                 for k in range(first, first + count)]
        one_run.append_many(*columns(batch))
        got += one_run.commit()
        per_entry.append_many(*columns(batch + [other] if first else [other] + batch))
        expected += [e for e in per_entry.commit() if e.bucket_ms == bucket]

    def without_offsets(entries):
        return [(e.bucket_ms, e.index, e.deliver_at_ms, e.size_bytes, e.id_hash)
                for e in entries]

    assert without_offsets(got) == without_offsets(expected)
    assert [e.index for e in got] == list(range(20))
    for store in (one_run, per_entry):
        assert without_offsets(store.load_bucket(bucket)) == without_offsets(got)
        store.checkpoint()  # the buffered runs reach the bucket's file
        assert without_offsets(store.load_bucket(bucket)) == without_offsets(got)
        assert [store.read(e).message_id for e in store.load_bucket(bucket)] == [
            f"id-{k}" for k in range(20)]
        store.close()


def test_a_commit_in_the_active_segment_writes_its_framed_records_as_the_log_frames_them(
        tmp_path, monkeypatch):
    """The usual commit hands the delay log the records framed by ``append_many`` (one write, no
    record by record append); the log holds what its own framing of the bodies would be, and
    every record reads back. (The first commit after the open fsyncs the new segment's
    directory too: it goes record by record.)"""
    store = DelayStore(str(tmp_path / "d"), DelayStoreConfig(bucket_ms=BUCKET_MS), now_ms=NOW_MS)
    first = rows(3, 100)
    store.append_many(*columns(first))
    store.commit()
    batch = rows(20)
    record_by_record = []
    monkeypatch.setattr(store._log, "append_many", record_by_record.append)
    store.append_many(*columns(batch[:12]))
    store.append(*batch[12])
    store.append_many(*columns(batch[13:]))
    entries = store.commit()
    assert record_by_record == []
    with open(store._log._segments[-1].path, "rb") as f:
        written = f.read(store._log.end_offset)
    bodies = [encode_delay_record(due, due - due % BUCKET_MS, message_id.encode(),
                                  subject.encode(), payload)
              for message_id, subject, due, payload in batch]
    bodies[:0] = [encode_delay_record(due, due - due % BUCKET_MS, message_id.encode(),
                                      subject.encode(), payload)
                  for message_id, subject, due, payload in first]
    assert written == frame_records_python(bodies)
    assert [(record.message_id, record.subject, record.deliver_at_ms, record.payload)
            for record in map(store.read, entries)] == batch

