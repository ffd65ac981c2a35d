"""A master's message log after a write error other than ENOSPC (EIO, a short write): the log
is sticky-failed with part of a record in its file, and the server may go on answering its
slaves' fetches until it restarts. What a fetch reads (``copy_bounds`` / ``read_copy``, as
``serverkit.replica_log.answer_fetch_io`` does) stays whole records below the last write that
succeeded, and is a prefix of what the master holds after its restart (session 16, slavepar's
item 2), whether the short write is a flush's or the group commit's one write-and-fsync call."""

from __future__ import annotations

import dataclasses
import os

import pytest

from logstore import LogWriteFailed
from logstore.faults import FaultPlan, FaultyFile
from logstore.fileio import append_then
from logstore.record import split_records
from realtime.storage import MessageStore, StoreConfig

# 4 KiB segments, a 1 KiB write buffer: a batch of 12 x 200 bytes is written in several writes.
TINY = StoreConfig(segment_size_bytes_max=4096, record_size_bytes_max=2048,
                   consumer_log_entries_per_file=4, write_buffer_bytes_max=1024,
                   checkpoint_interval_bytes=2048, dedup_window_ms=60_000)
T0 = 1_700_000_000_000


class _OneCallFile(FaultyFile):
    """A ``FaultyFile`` with ``append_and_sync``, the write and fsync a group commit makes in
    one call with the real file (``SegmentedLog.sync_then``'s usual case), faults as the plan
    says."""

    fsync_s = 0.0
    calls = 0  # append_and_sync calls, all files

    def append_and_sync(self, data: bytes, then=None):
        _OneCallFile.calls += 1
        self.append(data)
        self.sync()
        return append_then(then)


def _one_call_opener(plan: FaultPlan):
    def opener(path: str) -> _OneCallFile:
        handle = _OneCallFile(path, plan)
        plan.files.append(handle)
        return handle
    return opener


def _served(store: MessageStore, max_bytes: int) -> bytes:
    """Every byte a fetching slave copies from the start, ``max_bytes`` per fetch, each
    answer checked as the slave's ``append_raw`` checks it (whole records, no partial one)."""
    first, end = store.copy_bounds()
    copied, offset = [], first
    while offset < end:
        data = store.read_copy(offset, max_bytes)
        bodies, used, problem = split_records(data, TINY.record_size_bytes_max)
        assert problem is None and used == len(data) > 0, (offset, used, len(data), problem)
        copied.append(data)
        offset += len(data)
    assert offset == end
    return b"".join(copied)


# The whole batch in one buffer and one segment: the commit writes it in the one call.
ONE_CALL = dataclasses.replace(TINY, segment_size_bytes_max=1 << 20,
                               write_buffer_bytes_max=64 << 10)


@pytest.mark.parametrize("one_call, failing_write", [(False, 1), (False, 2), (False, 3),
                                                     (True, 1)],
                         ids=["flush-write-1", "flush-write-2", "flush-write-3", "one-call"])
def test_after_a_short_write_fetches_read_only_whole_records_the_restarted_master_keeps(
        tmp_path, failing_write, one_call):
    data_dir = str(tmp_path / "data")
    plan = FaultPlan()
    opener = _one_call_opener(plan) if one_call else plan.opener
    config = ONE_CALL if one_call else TINY
    store = MessageStore(data_dir, config, now_ms=T0, opener=opener)
    for i in range(6):
        store.append("s", f"old{i}", [], T0, b"o" * 150)
    store.commit()
    committed_end = store.copy_bounds()[1]
    for i in range(12):
        store.append("s", f"new{i}", [], T0, b"n" * 200)
    plan.short_write_at = plan.writes + failing_write  # writes half its bytes, then EIO
    calls = _OneCallFile.calls
    with pytest.raises(LogWriteFailed):
        store.commit()
    assert (_OneCallFile.calls > calls) == one_call, "the path the case is about was taken"
    first, end = store.copy_bounds()
    assert end >= committed_end
    on_disk = sum(os.path.getsize(info.path) for info in store._message_log.log.segments())
    assert on_disk > end - first, "the failed write left part of its bytes in the file"
    served = [_served(store, max_bytes) for max_bytes in (1, 300, 1 << 20)]
    assert served[0] == served[1] == served[2]
    with pytest.raises(LogWriteFailed):
        store.append("s", "later", [], T0, b"x")
    store.close()

    reopened = MessageStore(data_dir, config, now_ms=T0)
    try:
        kept = _served(reopened, 1 << 20)
        assert kept.startswith(served[0]), "a slave's copy is a prefix of the restarted master"
        assert reopened.end_sequence("s") >= 6
    finally:
        reopened.close()
