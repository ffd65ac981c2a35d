"""Segments allocated ahead of their data (``LogConfig.preallocate_step_bytes``,
``logstore.segment_space``): recovery finds the data's end in the zeros, a torn record before
them is still cut and reported, a crash anywhere keeps every synced record, a full disk or a
filesystem that cannot allocate changes nothing but the file's size, and only the active
segment holds space after its data. A "kill -9" here is a log never closed: its files are
reopened as they are."""

from __future__ import annotations

import dataclasses
import logging
import os

import pytest

from logstore import DiskFull, LogConfig, SegmentedLog
from logstore.faults import FaultPlan
from logstore.fileio import OsFile
from logstore.record import HEADER_SIZE_BYTES, encode_record

STEP = 1024


@pytest.fixture
def config(tiny_config) -> LogConfig:
    """4 KiB segments allocated ahead 1 KiB at a time (several steps a segment)."""
    return dataclasses.replace(tiny_config, preallocate_step_bytes=STEP)


def body_of(i: int) -> bytes:
    return b"rec%05d" % i + bytes([i % 251]) * (i * 7 % 90)


def append_synced(log: SegmentedLog, first: int, count: int) -> list[tuple[int, bytes]]:
    written = [(log.append(body_of(i)), body_of(i)) for i in range(first, first + count)]
    log.sync()
    return written


def files(directory: str) -> list[str]:
    return sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".log"))


def reopened(directory: str, config: LogConfig, **kwargs) -> tuple[SegmentedLog, list]:
    log = SegmentedLog(directory, config, **kwargs)
    return log, list(log.iterate())


def data_bytes(log: SegmentedLog) -> int:
    """The active segment's data, in bytes."""
    info = log.segments()[-1]
    return info.end_offset - info.base_offset


def test_the_active_segment_is_allocated_ahead_and_rolled_ones_are_cut_back_to_their_data(
        log_dir, config):
    log = SegmentedLog(log_dir, config)
    written = append_synced(log, 0, 200)  # several segments
    infos = log.segments()
    assert len(infos) >= 3
    for info in infos[:-1]:
        assert os.path.getsize(info.path) == info.size_bytes  # exact: no space after its data
    active = infos[-1]
    assert os.path.getsize(active.path) > active.size_bytes  # the space allocated ahead
    # Readers see the data alone: never the zeros after it.
    assert list(log.iterate()) == written
    assert log.read_raw(log.end_offset, 1 << 20) == b""
    assert log.verify(0, 1 << 30) == (log.end_offset, None)
    log.close()
    assert [os.path.getsize(p) for p in files(log_dir)] == [i.size_bytes for i in infos]


def test_a_preallocated_segment_left_by_a_kill_recovers_its_data_with_no_truncation(
        log_dir, config, caplog):
    caplog.set_level(logging.INFO, logger="logstore.segment_log")
    log = SegmentedLog(log_dir, config)
    written = append_synced(log, 0, 30)
    path = files(log_dir)[-1]
    assert os.path.getsize(path) > data_bytes(log)  # zeros after the data
    again, records = reopened(log_dir, config)  # kill -9: the first one never closed
    assert records == written
    assert again.recovery.truncation is None
    assert again.end_offset == log.end_offset
    assert os.path.getsize(path) >= data_bytes(again)
    # Its own allocation, cut back: said at INFO, no warning (a log that allocates expects it).
    assert [r.levelno for r in caplog.records if "zero bytes" in r.getMessage()] == [
        logging.INFO]
    again.close()
    log.close()


def test_a_zero_tail_is_the_clean_end_even_without_allocating_and_is_logged_as_a_warning(
        log_dir, tiny_config, caplog):
    # A log that never allocated (step 0), its file longer than its data by zeros (as a crash
    # after an allocation leaves it, or a power cut that kept a new size and lost its blocks):
    # the data's end, not a bad record, but where the log does not allocate the operator is
    # told, since there unsynced writes were lost (review rv21-L2).
    caplog.set_level(logging.INFO, logger="logstore.segment_log")
    log = SegmentedLog(log_dir, tiny_config)
    written = append_synced(log, 0, 5)
    log.close()
    path = files(log_dir)[-1]
    with open(path, "ab") as f:
        f.write(bytes(500))
    again, records = reopened(log_dir, tiny_config)
    assert records == written
    assert again.recovery.truncation is None
    assert os.path.getsize(path) == data_bytes(again)  # cut back to its data
    assert [r.levelno for r in caplog.records if "zero bytes" in r.getMessage()] == [
        logging.WARNING]
    again.close()


@pytest.mark.parametrize("torn", ["header only", "half the body", "a bad crc"])
def test_a_torn_record_before_the_zeros_is_cut_and_reported(log_dir, config, torn):
    log = SegmentedLog(log_dir, config)
    written = append_synced(log, 0, 10)
    end = log.end_offset
    path = files(log_dir)[-1]
    position = data_bytes(log)
    assert os.path.getsize(path) > position + 200  # the torn write lands in allocated space
    record = encode_record(b"x" * 150)
    if torn == "header only":
        damaged = record[:HEADER_SIZE_BYTES]
    elif torn == "half the body":
        damaged = record[: HEADER_SIZE_BYTES + 75]
    else:
        damaged = record[:-1] + bytes([record[-1] ^ 1])
    fd = os.open(path, os.O_WRONLY)
    os.pwrite(fd, damaged, position)
    os.close(fd)
    again, records = reopened(log_dir, config)
    assert records == written
    assert again.recovery.truncation is not None
    assert again.recovery.truncation.offset == end
    assert again.end_offset == end
    again.close()
    log.close()


def test_a_zero_header_with_data_after_it_is_still_a_bad_record(log_dir, config):
    log = SegmentedLog(log_dir, config)
    written = append_synced(log, 0, 10)
    end = log.end_offset
    path = files(log_dir)[-1]
    fd = os.open(path, os.O_WRONLY)
    os.pwrite(fd, encode_record(b"after a hole"), data_bytes(log) + 64)  # zeros, then data
    os.close(fd)
    again, records = reopened(log_dir, config)
    assert records == written
    assert again.recovery.truncation.offset == end
    assert again.recovery.truncation.reason == "bad magic 0x0000"
    again.close()
    log.close()


def test_a_crash_between_allocating_a_new_segment_and_writing_it_keeps_every_record(
        log_dir, config):
    log = SegmentedLog(log_dir, config)
    written = []
    while len(log.segments()) < 3:
        written += append_synced(log, len(written), 1)
    # The roll allocated the new segment; nothing of it written yet.
    active = log.segments()[-1]
    log.flush()
    first_of_active = [w for w in written if w[0] >= active.base_offset]
    assert os.path.getsize(active.path) > 0
    # Kill -9 with the new segment allocated and empty: drop its one record's bytes.
    os.truncate(active.path, 0)
    os.truncate(active.path, STEP)
    again, records = reopened(log_dir, config)
    assert records == written[: len(written) - len(first_of_active)]
    assert again.recovery.truncation is None
    assert again.end_offset == active.base_offset
    again.close()
    log.close()


def test_a_rolled_segment_whose_cut_back_a_crash_lost_keeps_every_record(log_dir, config):
    # A roll cuts the old segment back to its data; a crash before that cut was durable
    # leaves zeros after its data while the next segment starts at the data's end. A
    # checkpoint in the next segment makes recovery skip the old one: its zeros must not be
    # taken for a gap (which cuts every later segment).
    log = SegmentedLog(log_dir, config)
    written = append_synced(log, 0, 200)
    log.close()
    paths = files(log_dir)
    assert len(paths) >= 3
    with open(paths[0], "ab") as f:
        f.write(bytes(STEP))
    checkpoint = written[-3][0]  # in the last segment
    again, records = reopened(log_dir, config, verify_from_offset=checkpoint)
    assert records == written
    assert again.recovery.truncation is None
    assert [os.path.getsize(p) for p in paths[:-1]] == [i.size_bytes
                                                        for i in again.segments()[:-1]]
    again.close()


@pytest.mark.parametrize("where", ["at the data's end", "past the data's end"])
def test_a_checkpoint_in_the_zeros_verifies_the_segment_from_its_start(log_dir, config, where):
    log = SegmentedLog(log_dir, config)
    written = append_synced(log, 0, 12)
    end = log.end_offset
    checkpoint = end if where == "at the data's end" else end + 40  # a checkpoint past the data
    again, records = reopened(log_dir, config, verify_from_offset=checkpoint)
    assert records == written
    assert again.end_offset == end
    assert again.recovery.truncation is None
    assert again.recovery.records_verified == len(written)  # the segment, verified whole
    again.close()
    log.close()


def test_reopen_append_reopen_goes_on_at_the_data_end_every_time(log_dir, config):
    written: list = []
    logs = []
    for round_ in range(5):
        log, records = reopened(log_dir, config)
        assert records == written
        assert log.recovery.truncation is None
        written += append_synced(log, len(written), 7 + round_)
        if round_ % 2:
            log.close()
        else:
            logs.append(log)  # kill -9: never closed, its files as they are
    log, records = reopened(log_dir, config)
    assert records == written
    log.close()
    for old in logs:
        old.close()


def test_a_full_disk_when_allocating_loses_nothing_and_allocating_resumes_when_space_returns(
        log_dir, config):
    plan = FaultPlan()
    log = SegmentedLog(log_dir, config, opener=plan.opener)
    written = append_synced(log, 0, 3)
    # Room for less than a step: the next allocation gets part of it, then ENOSPC.
    plan.disk_capacity_bytes = plan.bytes_written + STEP // 4
    allocations = plan.allocations
    dropped = False
    while not dropped:
        try:
            written += append_synced(log, len(written), 1)
        except DiskFull:
            dropped = True  # the write that found the disk full: that record alone dropped
    assert plan.allocations > allocations  # an allocation was tried and failed
    active = log.segments()[-1]
    assert os.path.getsize(active.path) == active.size_bytes  # its part given back
    assert list(log.iterate()) == written
    plan.free_space(1 << 20)
    written += append_synced(log, len(written), 30)  # not wedged: appends, rolls, allocates
    assert os.path.getsize(log.segments()[-1].path) > data_bytes(log)
    again, records = reopened(log_dir, config)  # kill -9
    assert records == written
    assert again.recovery.truncation is None
    again.close()
    log.close()


def test_a_filesystem_that_cannot_allocate_turns_it_off_and_the_log_grows_as_before(
        log_dir, config):
    plan = FaultPlan(allocate_unsupported=True)
    log = SegmentedLog(log_dir, config, opener=plan.opener)
    written = append_synced(log, 0, 60)
    assert plan.allocations == 1  # tried once, then never again for this log
    assert [os.path.getsize(i.path) for i in log.segments()] == [
        i.size_bytes for i in log.segments()]
    again, records = reopened(log_dir, config)
    assert records == written
    again.close()
    log.close()


def test_a_truncate_gives_the_space_back_and_the_next_append_allocates_again(log_dir, config):
    log = SegmentedLog(log_dir, config)
    written = append_synced(log, 0, 10)
    cut_at = written[6][0]
    log.truncate(cut_at)
    written = written[:6] + append_synced(log, 100, 3)
    assert os.path.getsize(log.segments()[-1].path) > data_bytes(log)
    again, records = reopened(log_dir, config)
    assert records == written
    again.close()
    log.close()


def test_an_os_file_allocates_ahead_without_moving_its_data_end(tmp_path):
    handle = OsFile(str(tmp_path / "f"))
    handle.append(b"abc")
    handle.allocate(4096)
    assert (handle.size(), handle.allocated_bytes()) == (3, 4096)
    assert os.path.getsize(tmp_path / "f") == 4096
    handle.append(b"def")
    assert handle.pread(0, 10) == b"abcdef" + bytes(4)
    handle.truncate(6)
    assert (handle.size(), handle.allocated_bytes(), os.path.getsize(tmp_path / "f")) == (6, 6, 6)
    handle.close()
