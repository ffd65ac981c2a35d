"""Durability under injected faults (FaultPlan): sticky write/fsync failures, short writes, full
disks, the durable offset, and async-mode ticking on a fake clock."""

from __future__ import annotations

import os
import time

import pytest

from logstore import fileio
from logstore import DiskFull, LogConfig, LogWriteFailed, OsFile, SegmentedLog
from logstore.faults import FaultPlan
from logstore.record import HEADER_SIZE_BYTES
from tests.twins import built_twin

BODY_SIZE = 100
FRAMED_SIZE = HEADER_SIZE_BYTES + BODY_SIZE


def body(i: int) -> bytes:
    return (b"body%06d" % i * 12)[:BODY_SIZE]


def append_range(log: SegmentedLog, start: int, count: int) -> list[tuple[int, bytes]]:
    return [(log.append(body(i)), body(i)) for i in range(start, start + count)]


def records_on_disk(directory: str, config: LogConfig) -> tuple[SegmentedLog, list]:
    """Reopen with real files (no faults) and read everything."""
    log = SegmentedLog(directory, config)
    return log, list(log.iterate())


def assert_every_write_is_refused_with(log: SegmentedLog, failure: LogWriteFailed) -> None:
    for use in (lambda: log.append(b"more"), log.sync, log.flush, lambda: log.tick(10**9)):
        with pytest.raises(LogWriteFailed) as caught:
            use()
        assert caught.value is failure


def test_an_fsync_failure_is_sticky_until_reopen_and_the_reopened_log_holds_the_synced_records(
    log_dir, tiny_config
):
    plan = FaultPlan()
    log = SegmentedLog(log_dir, tiny_config, opener=plan.opener)
    synced = append_range(log, 0, 80)
    log.sync()
    durable = log.durable_offset
    plan.fail_sync_at = plan.syncs + 1
    append_range(log, 80, 20)
    with pytest.raises(LogWriteFailed) as caught:
        log.sync()
    failure = caught.value
    assert failure.operation == "fsync"
    assert not failure.retriable
    assert "must be reopened" in str(failure)
    assert log.durable_offset == durable
    assert_every_write_is_refused_with(log, failure)
    log.close()  # does not try to sync a failed log, and does not raise
    reopened, records = records_on_disk(log_dir, tiny_config)
    assert records[: len(synced)] == synced
    reopened.append(b"writable again")
    reopened.close()


def test_a_failed_write_is_sticky_until_reopen_and_loses_nothing_synced(log_dir):
    plan = FaultPlan()
    config = LogConfig(segment_size_bytes_max=4096, write_buffer_bytes_max=1 << 20)
    log = SegmentedLog(log_dir, config, opener=plan.opener)
    synced = append_range(log, 0, 60)  # two segments, room for 5 more in the second
    log.sync()
    plan.fail_write_at = plan.writes + 1
    append_range(log, 60, 5)
    with pytest.raises(LogWriteFailed) as caught:
        log.flush()
    assert caught.value.operation == "write"
    assert_every_write_is_refused_with(log, caught.value)
    log.close()
    reopened, records = records_on_disk(log_dir, config)
    assert records == synced  # the failed write wrote nothing
    assert reopened.recovery.truncation is None
    reopened.close()


def test_a_short_write_leaves_a_torn_tail_that_reopen_cuts(log_dir, tiny_config):
    plan = FaultPlan()
    config = LogConfig(segment_size_bytes_max=4096, write_buffer_bytes_max=1 << 20)
    log = SegmentedLog(log_dir, config, opener=plan.opener)
    synced = append_range(log, 0, 60)  # rolls: 36 records of 112 bytes fill a segment
    log.sync()
    pending = append_range(log, 60, 7)
    assert len({os.path.basename(i.path) for i in log.segments()}) >= 2
    plan.short_write_at = plan.writes + 1
    with pytest.raises(LogWriteFailed):
        log.sync()
    with pytest.raises(LogWriteFailed):
        log.append(b"refused")
    log.close()
    half = 7 * FRAMED_SIZE // 2  # 392 bytes: 3 whole records and 56 bytes of the fourth
    reopened, records = records_on_disk(log_dir, config)
    assert records == synced + pending[:3]
    truncation = reopened.recovery.truncation
    assert (truncation.offset, truncation.bytes_cut) == (pending[3][0], half - 3 * FRAMED_SIZE)
    assert truncation.reason.startswith("torn record")
    reopened.close()


def test_a_full_disk_raises_retriable_disk_full_from_append_and_recovers_after_space_returns(
    log_dir, tiny_config
):
    plan = FaultPlan(disk_capacity_bytes=10_000)
    log = SegmentedLog(log_dir, tiny_config, opener=plan.opener)
    accepted: list[tuple[int, bytes]] = []
    synced_end = 0
    with pytest.raises(DiskFull) as caught:
        for i in range(1000):
            accepted.append((log.append(body(i)), body(i)))
            if i % 10 == 9:
                synced_end = log.sync()
    error = caught.value
    assert error.retriable
    assert error.dropped_records > 0
    assert "disk full" in str(error)
    # Appends that returned but were dropped are the ones at or past the new end.
    end_after_drop = log.end_offset
    assert synced_end <= end_after_drop < accepted[-1][0] + FRAMED_SIZE
    survivors = [r for r in accepted if r[0] < end_after_drop]
    assert len(accepted) - len(survivors) == error.dropped_records - 1  # the raising one had no offset
    assert log.durable_offset == synced_end
    assert plan.bytes_written <= 10_000

    with pytest.raises(DiskFull):  # still full: not sticky, but still no room
        for i in range(1000, 1020):
            log.append(body(i))
    assert log.end_offset == end_after_drop

    plan.free_space(100_000)
    after = append_range(log, 2000, 50)
    assert after[0][0] == end_after_drop
    assert log.sync() == log.end_offset
    log.close()
    reopened, records = records_on_disk(log_dir, tiny_config)
    assert reopened.recovery.truncation is None
    assert records == survivors + after
    reopened.close()


def test_a_full_disk_raises_disk_full_from_sync_and_keeps_what_was_synced(log_dir):
    plan = FaultPlan(disk_capacity_bytes=6000)
    config = LogConfig(segment_size_bytes_max=4096, write_buffer_bytes_max=1 << 20)
    log = SegmentedLog(log_dir, config, opener=plan.opener)
    synced = append_range(log, 0, 40)  # 4480 bytes: rolls after 36
    assert log.sync() == 40 * FRAMED_SIZE
    append_range(log, 40, 20)  # 2240 bytes more do not fit in the 1520 left
    with pytest.raises(DiskFull) as caught:
        log.sync()
    assert caught.value.dropped_records == 20
    assert log.end_offset == log.durable_offset == 40 * FRAMED_SIZE
    assert list(log.iterate()) == synced
    plan.free_space(2000)
    later = append_range(log, 60, 10)
    log.sync()
    log.close()
    reopened, records = records_on_disk(log_dir, config)
    assert records == synced + later
    reopened.close()


def test_durable_offset_advances_only_on_sync(log_dir, tiny_config):
    log = SegmentedLog(log_dir, tiny_config)
    assert log.durable_offset == 0
    append_range(log, 0, 5)
    assert log.durable_offset == 0
    log.flush()
    assert os.path.getsize(os.path.join(log_dir, f"{0:020d}.log")) == 5 * FRAMED_SIZE
    assert log.durable_offset == 0
    append_range(log, 5, 60)  # rolls and auto-flushes
    assert log.durable_offset == 0
    assert log.sync() == log.durable_offset == log.end_offset == 65 * FRAMED_SIZE
    log.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_sync_or_flush_fsyncs_under_flush_sync_and_only_writes_to_the_os_under_async(log_dir, mode):
    plan = FaultPlan()
    log = SegmentedLog(log_dir, LogConfig(segment_size_bytes_max=4096, flush_mode=mode),
                       opener=plan.opener)
    append_range(log, 0, 3)
    log.sync_or_flush()
    assert os.path.getsize(os.path.join(log_dir, f"{0:020d}.log")) == 3 * FRAMED_SIZE
    assert log.flushed_offset == log.end_offset == 3 * FRAMED_SIZE
    assert log.durable_offset == (3 * FRAMED_SIZE if mode == "sync" else 0)
    assert plan.syncs == (1 if mode == "sync" else 0)
    log.close()


def test_async_tick_fsyncs_only_after_the_interval_with_data_pending(log_dir):
    plan = FaultPlan()
    config = LogConfig(segment_size_bytes_max=4096, flush_mode="async", flush_interval_ms=100)
    log = SegmentedLog(log_dir, config, opener=plan.opener)
    assert log.tick(1_000) is False  # nothing pending
    log.append(body(0))
    assert log.tick(1_050) is False  # pending, but only 50 ms
    assert plan.syncs == 0
    assert log.durable_offset == 0
    assert os.path.getsize(os.path.join(log_dir, f"{0:020d}.log")) == FRAMED_SIZE  # flushed
    assert log.tick(1_099) is False
    assert log.tick(1_100) is True
    assert plan.syncs == 1
    assert log.durable_offset == FRAMED_SIZE
    assert log.tick(1_300) is False  # idle: no fsync however long it has been
    assert log.tick(5_000) is False
    assert plan.syncs == 1
    append_range(log, 1, 40)  # rolls into a second segment
    assert log.tick(5_099) is False
    assert plan.syncs == 1
    assert log.tick(5_100) is True
    assert plan.syncs == 3  # one fsync for each of the two segments touched since the last
    assert log.durable_offset == log.end_offset == 41 * FRAMED_SIZE
    log.close()


@pytest.mark.parametrize("through", ["pwrite", "write_sync"])
def test_a_real_enospc_from_the_os_raises_disk_full_and_the_log_takes_appends_again(
        log_dir, tiny_config, monkeypatch, through):
    # A real file, not the fault wrapper: the OS refuses the write itself, as a full tmpfs does,
    # whether the sync writes through os.pwrite (no C twin) or the C write_sync (its contract:
    # the errno returned, not raised).
    log = SegmentedLog(log_dir, tiny_config)
    synced = append_range(log, 0, 3)
    log.sync()
    real_pwrite, real_write_sync = os.pwrite, fileio._write_sync_c

    def full_disk(fd, data, offset):
        raise OSError(28, "No space left on device")

    if through == "pwrite":
        monkeypatch.setattr(fileio, "_write_sync_c", None)
        monkeypatch.setattr(os, "pwrite", full_disk)
    else:
        monkeypatch.setattr(fileio, "_write_sync_c", lambda fd, data, offset: (0, 28, 0, 0, 0))
    append_range(log, 3, 2)
    with pytest.raises(DiskFull) as caught:
        log.sync()
    assert caught.value.dropped_records == 2
    monkeypatch.setattr(os, "pwrite", real_pwrite)
    monkeypatch.setattr(fileio, "_write_sync_c", real_write_sync)
    later = append_range(log, 5, 2)
    log.sync()
    log.close()
    reopened, records = records_on_disk(log_dir, tiny_config)
    assert records == synced + later
    reopened.close()


@pytest.mark.parametrize("twin", ["c", "python"])
def test_an_fsync_that_fails_after_the_write_in_one_call_is_sticky_and_the_bytes_count_as_written(
        log_dir, tiny_config, monkeypatch, twin):
    # append_and_sync wrote every byte, then fsync said EIO: the log is failed (sticky), and the
    # records written stay in the file for the reopened log to verify, as after a flush.
    log = SegmentedLog(log_dir, tiny_config)
    synced = append_range(log, 0, 3)
    log.sync()

    def write_then_eio(fd, data, offset):
        return os.pwrite(fd, data, offset), 0, 5, 0, 0

    def fsync_eio(fd):
        raise OSError(5, "Input/output error")

    if twin == "c":
        monkeypatch.setattr(fileio, "_write_sync_c", write_then_eio)
    else:
        monkeypatch.setattr(fileio, "_write_sync_c", None)
        monkeypatch.setattr(os, "fdatasync", fsync_eio)  # a log's file sync (fileio)
    unsynced = append_range(log, 3, 2)
    with pytest.raises(LogWriteFailed) as caught:
        log.sync()
    assert caught.value.operation == "fsync"
    assert log.durable_offset == 3 * FRAMED_SIZE
    assert_every_write_is_refused_with(log, caught.value)
    monkeypatch.undo()
    log.close()
    reopened, records = records_on_disk(log_dir, tiny_config)
    assert records == synced + unsynced
    reopened.close()


WRITE_SYNC_C = built_twin("logstore._framing", "write_sync")  # even under QMQ_NO_EXTENSIONS


@pytest.mark.skipif(WRITE_SYNC_C is None, reason="the C twin write_sync was not built")
def test_a_write_the_os_refuses_in_the_c_write_sync_is_a_sticky_write_failure(
        log_dir, tiny_config, monkeypatch):
    monkeypatch.setattr(fileio, "_write_sync_c", WRITE_SYNC_C)  # the C path in both CI passes
    # A real refusal inside C: a descriptor the log believes open is closed under it (EBADF).
    log = SegmentedLog(log_dir, tiny_config)
    synced = append_range(log, 0, 3)
    log.sync()
    handle = log._segments[-1].handle
    os.close(handle._fd)
    handle._fd = os.open(os.devnull, os.O_RDONLY)  # a read-only descriptor: pwrite is EBADF
    append_range(log, 3, 2)
    with pytest.raises(LogWriteFailed) as caught:
        log.sync()
    assert caught.value.operation == "write"
    assert log.durable_offset == 3 * FRAMED_SIZE
    assert_every_write_is_refused_with(log, caught.value)
    log.close()
    reopened, records = records_on_disk(log_dir, tiny_config)
    assert records == synced
    reopened.close()


def test_an_os_file_append_and_sync_writes_at_its_end_and_says_how_long_the_fsync_took(tmp_path):
    handle = OsFile(str(tmp_path / "both.bin"))
    handle.append(b"head-")
    before_ns = time.monotonic_ns()
    handle.append_and_sync(b"0123456789")
    assert handle.size() == 15
    assert handle.pread(0, 100) == b"head-0123456789"
    if fileio._write_sync_c is not None:
        assert handle.synced_at_ns >= before_ns
    else:  # the Python twin reads no clock (storage's rule): the mark is "not known"
        assert handle.synced_at_ns == 0
    assert handle.fsync_s >= 0.0
    handle.close()


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_an_os_file_append_the_os_writes_short_is_written_whole_by_further_writes(
        tmp_path, monkeypatch, kind):
    # A real file whose pwrite takes at most 5 bytes a call: every byte still lands, in order.
    real_pwrite = os.pwrite
    calls = []

    def short_pwrite(fd, data, offset):
        calls.append(len(data))
        return real_pwrite(fd, bytes(data)[:5], offset)

    handle = OsFile(str(tmp_path / "short.bin"))
    handle.append(b"head-")
    monkeypatch.setattr(os, "pwrite", short_pwrite)
    handle.append(kind(b"0123456789abcdef"))
    monkeypatch.setattr(os, "pwrite", real_pwrite)
    handle.append(b"-tail")
    assert calls == [16, 11, 6, 1]
    assert handle.size() == 26
    assert handle.pread(0, 100) == b"head-0123456789abcdef-tail"
    handle.close()


def test_a_segment_rolled_past_is_fsynced_by_the_next_sync_even_after_the_new_one_hit_a_full_disk(
        log_dir):
    # sync() looks only at the segments written since the last one: the old segment that the
    # roll's flush wrote must still be among them when the new segment's write failed.
    plan = FaultPlan()
    config = LogConfig(segment_size_bytes_max=4096)
    log = SegmentedLog(log_dir, config, opener=plan.opener)
    per_segment = 4096 // FRAMED_SIZE
    synced = append_range(log, 0, 3)
    log.sync()
    assert plan.syncs == 1
    plan.disk_capacity_bytes = plan.bytes_written + (per_segment - 3) * FRAMED_SIZE
    flushed = append_range(log, 3, per_segment - 3)
    append_range(log, per_segment, 1)  # rolls: the old segment's records are written first
    assert len(log.segments()) == 2
    with pytest.raises(DiskFull):
        log.sync()  # the new segment's one record finds the disk full
    plan.free_space(1 << 20)
    log.sync()
    assert plan.syncs == 2  # the old segment, written since the last sync
    assert log.durable_offset == log.end_offset == per_segment * FRAMED_SIZE
    log.close()
    reopened, records = records_on_disk(log_dir, config)
    assert records == synced + flushed
    reopened.close()


def test_a_record_written_after_a_cut_is_fsynced_by_the_next_sync(tmp_path):
    # review s14 rvb-5: after a flush without a sync, a cut into an earlier segment and a
    # write there, sync() fsynced nothing and still called the end durable.
    plan = FaultPlan()
    log = SegmentedLog(str(tmp_path / "log"), LogConfig(segment_size_bytes_max=4096),
                       opener=plan.opener)
    per_segment = 4096 // FRAMED_SIZE
    append_range(log, 0, per_segment + 2)  # segment 0 full, 2 records in segment 1
    log.sync()
    append_range(log, per_segment + 2, 2)
    log.flush()  # written to the OS, not fsynced, in segment 1
    log.truncate(FRAMED_SIZE * 3)  # a cut inside segment 0: segment 1 goes
    append_range(log, 3, 1)
    syncs = plan.syncs
    assert log.sync() == log.end_offset == 4 * FRAMED_SIZE
    assert plan.syncs > syncs, "sync() called the record durable but fsynced nothing"
    log.close()
