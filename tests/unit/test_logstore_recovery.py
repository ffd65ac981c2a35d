"""Crash recovery: torn tails, garbage, bit rot, oversized lengths and missing segments."""

from __future__ import annotations

import os
import random
import struct

import pytest

from logstore import CorruptRecord, LogConfig, OsFile, SegmentedLog
from logstore.faults import flip_bit
from logstore.record import HEADER_SIZE_BYTES, MAGIC, VERSION
from logstore.segment_log import _SCAN_CHUNK_BYTES


def write_log(directory: str, config: LogConfig, count: int, size: int = 100) -> list[tuple[int, bytes]]:
    """A closed log of ``count`` records of ``size`` bytes; returns (offset, body) pairs."""
    log = SegmentedLog(directory, config)
    written = []
    for i in range(count):
        body = (b"rec%05d." % i * (size // 9 + 1))[:size]
        written.append((log.append(body), body))
    log.close()
    return written


def locate(directory: str, offset: int) -> tuple[str, int]:
    """(segment path, position in it) of a log offset, from the file names alone."""
    bases = sorted(int(n[:20]) for n in os.listdir(directory) if n.endswith(".log"))
    base = max(b for b in bases if b <= offset)
    return os.path.join(directory, f"{base:020d}.log"), offset - base


def reopen(directory: str, config: LogConfig, **kwargs) -> tuple[SegmentedLog, list[tuple[int, bytes]]]:
    log = SegmentedLog(directory, config, **kwargs)
    return log, list(log.iterate())


def test_a_tail_cut_at_every_byte_of_the_last_record_recovers_exactly_the_earlier_records(
    log_dir, tiny_config
):
    written = write_log(log_dir, tiny_config, 200, size=50)
    last_offset, _ = written[-1]
    path, position = locate(log_dir, last_offset)
    assert position > 0 and os.path.basename(path) != f"{0:020d}.log", "must have rolled"
    with open(path, "rb") as f:
        pristine = f.read()
    framed = len(pristine) - position
    assert framed == HEADER_SIZE_BYTES + 50
    for kept in range(framed):
        with open(path, "wb") as f:
            f.write(pristine[: position + kept])
        log, records = reopen(log_dir, tiny_config)
        assert records == written[:-1], f"cut after {kept} bytes"
        assert log.end_offset == last_offset
        if kept == 0:
            assert log.recovery.truncation is None
        else:
            truncation = log.recovery.truncation
            assert (truncation.offset, truncation.bytes_cut, truncation.path) == (
                last_offset, kept, path
            )
            assert truncation.reason.startswith("torn header" if kept < 12 else "torn record")
        assert os.path.getsize(path) == position
        log.close()


@pytest.mark.parametrize("seed", range(8))
def test_random_garbage_after_the_last_record_is_cut_and_reported(log_dir, tiny_config, seed):
    rng = random.Random(seed)
    written = write_log(log_dir, tiny_config, 80)
    end = written[-1][0] + HEADER_SIZE_BYTES + 100
    garbage = rng.randbytes(rng.choice([1, 11, 12, 13, 500, 3000]))
    path, _ = locate(log_dir, written[-1][0])
    with open(path, "ab") as f:
        f.write(garbage)
    log, records = reopen(log_dir, tiny_config)
    assert records == written
    assert log.recovery.truncation.offset == end
    assert log.recovery.truncation.bytes_cut == len(garbage)
    assert log.end_offset == end
    log.close()


def test_a_zero_filled_tail_is_the_clean_end_of_the_data_and_no_truncation(log_dir, tiny_config):
    # Zeros after the last record are space allocated ahead (logstore.segment_space), cut
    # off silently; zeros with data after them are still bad records (test_logstore_prealloc).
    written = write_log(log_dir, tiny_config, 30)
    path, _ = locate(log_dir, written[-1][0])
    size = os.path.getsize(path)
    with open(path, "ab") as f:
        f.write(b"\0" * 200)
    log, records = reopen(log_dir, tiny_config)
    assert records == written
    assert log.recovery.truncation is None
    assert os.path.getsize(path) == size
    log.close()


def middle_record(directory: str, written: list[tuple[int, bytes]]) -> int:
    """Index of a record in the middle of a middle segment."""
    names = sorted(n for n in os.listdir(directory) if n.endswith(".log"))
    assert len(names) >= 4
    middle = names[len(names) // 2]
    base = int(middle[:20])
    inside = [i for i, (o, _) in enumerate(written) if locate(directory, o)[0].endswith(middle)]
    index = inside[len(inside) // 2]
    assert written[index][0] > base
    return index


def test_a_flipped_bit_before_verify_from_offset_is_raised_on_read_and_iterate_never_returned(
    log_dir, tiny_config
):
    written = write_log(log_dir, tiny_config, 150)
    bad = middle_record(log_dir, written)
    bad_offset = written[bad][0]
    path, position = locate(log_dir, bad_offset)
    flip_bit(path, position + HEADER_SIZE_BYTES + 40, bit=3)
    end = written[-1][0] + HEADER_SIZE_BYTES + 100

    log = SegmentedLog(log_dir, tiny_config, verify_from_offset=end)
    assert log.recovery.truncation is None
    assert log.recovery.records_verified == 0
    with pytest.raises(CorruptRecord) as caught:
        log.read(bad_offset)
    assert (caught.value.path, caught.value.offset, caught.value.reason) == (
        path, bad_offset, "crc mismatch"
    )
    yielded = []
    with pytest.raises(CorruptRecord) as caught:
        for record in log.iterate():
            yielded.append(record)
    assert caught.value.offset == bad_offset
    assert yielded == written[:bad]
    # The records after it are intact and still readable by offset.
    assert list(log.iterate(written[bad + 1][0])) == written[bad + 1 :]
    log.close()


def test_a_flipped_bit_in_a_length_field_is_never_returned_as_data(log_dir, tiny_config):
    written = write_log(log_dir, tiny_config, 150)
    bad = middle_record(log_dir, written)
    path, position = locate(log_dir, written[bad][0])
    flip_bit(path, position + 3, bit=4)  # body_length 100 -> 116
    log = SegmentedLog(log_dir, tiny_config, verify_from_offset=10**9)
    with pytest.raises(CorruptRecord):
        log.read(written[bad][0])
    with pytest.raises(CorruptRecord):
        list(log.iterate(written[bad - 1][0]))
    log.close()


def test_a_flipped_bit_after_verify_from_offset_is_truncated_at_open_with_every_later_segment(
    log_dir, tiny_config
):
    written = write_log(log_dir, tiny_config, 150)
    bad = middle_record(log_dir, written)
    bad_offset = written[bad][0]
    path, position = locate(log_dir, bad_offset)
    flip_bit(path, position + HEADER_SIZE_BYTES + 7, bit=0)
    end = written[-1][0] + HEADER_SIZE_BYTES + 100
    verify_from = written[bad - 5][0]

    log, records = reopen(log_dir, tiny_config, verify_from_offset=verify_from)
    truncation = log.recovery.truncation
    assert (truncation.offset, truncation.bytes_cut, truncation.reason, truncation.path) == (
        bad_offset, end - bad_offset, "crc mismatch", path
    )
    assert log.recovery.records_verified == 5
    assert records == written[:bad]
    assert log.end_offset == bad_offset
    assert max(int(n[:20]) for n in os.listdir(log_dir)) <= bad_offset
    log.close()


def test_appends_continue_at_the_cut_after_a_recovery_truncation(log_dir, tiny_config):
    written = write_log(log_dir, tiny_config, 100)
    path, position = locate(log_dir, written[-3][0])
    with open(path, "r+b") as f:
        f.truncate(position + 30)
    log, records = reopen(log_dir, tiny_config)
    assert records == written[:-3]
    new = [(log.append(b"new %d" % i * 30), b"new %d" % i * 30) for i in range(60)]
    assert new[0][0] == written[-3][0]
    log.close()
    log, records = reopen(log_dir, tiny_config)
    assert log.recovery.truncation is None
    assert records == written[:-3] + new
    log.close()


def test_a_stored_length_above_the_limit_is_corruption_at_open_and_is_never_allocated(log_dir):
    config = LogConfig(segment_size_bytes_max=4096, record_size_bytes_max=64 << 20)
    written = write_log(log_dir, config, 50)
    path, _ = locate(log_dir, written[-1][0])
    bogus_length = config.record_size_bytes_max + 1
    with open(path, "ab") as f:
        f.write(struct.pack(">IIHBB", bogus_length, 0, MAGIC, VERSION, 0) + b"x" * 100)
    pread_sizes = []

    class RecordingFile(OsFile):
        def pread(self, offset, size):
            pread_sizes.append(size)
            return super().pread(offset, size)

    log = SegmentedLog(log_dir, config, opener=RecordingFile)
    assert log.recovery.truncation.reason == (
        f"stored length {bogus_length} exceeds record_size_bytes_max {config.record_size_bytes_max}"
    )
    assert log.recovery.truncation.bytes_cut == HEADER_SIZE_BYTES + 100
    assert max(pread_sizes) <= _SCAN_CHUNK_BYTES
    assert list(log.iterate()) == written
    log.close()


@pytest.mark.parametrize("delta", [-1, 0, 1])
def test_a_stored_record_at_the_limit_survives_reopen_and_one_over_is_cut(log_dir, delta):
    # Written under a generous limit, reopened under a limit of 1000 bytes.
    strict = LogConfig(segment_size_bytes_max=4096, record_size_bytes_max=1000)
    loose = LogConfig(segment_size_bytes_max=4096, record_size_bytes_max=2000)
    written = write_log(log_dir, loose, 40)  # rolls
    log = SegmentedLog(log_dir, loose)
    offset = log.append(b"L" * (1000 + delta))
    log.close()
    log, records = reopen(log_dir, strict)
    if delta <= 0:
        assert log.recovery.truncation is None
        assert records == written + [(offset, b"L" * (1000 + delta))]
    else:
        assert log.recovery.truncation.offset == offset
        assert "stored length 1001 exceeds record_size_bytes_max 1000" in (
            log.recovery.truncation.reason
        )
        assert records == written
    log.close()


def test_a_segment_missing_from_the_middle_is_reported_as_a_gap(log_dir, tiny_config):
    written = write_log(log_dir, tiny_config, 150)
    names = sorted(os.listdir(log_dir))
    missing = names[len(names) // 2]
    missing_base = int(missing[:20])
    following_bytes = sum(os.path.getsize(os.path.join(log_dir, n)) for n in names
                          if n > missing)
    os.unlink(os.path.join(log_dir, missing))
    log, records = reopen(log_dir, tiny_config)
    truncation = log.recovery.truncation
    assert truncation is not None
    assert truncation.offset == missing_base
    assert truncation.reason.startswith("gap")
    assert truncation.bytes_cut == following_bytes
    assert records == [(o, b) for o, b in written if o < missing_base]
    assert log.end_offset == missing_base
    log.close()


def test_a_clean_reopen_verifies_only_records_from_verify_from_offset(log_dir, tiny_config):
    written = write_log(log_dir, tiny_config, 100)
    log = SegmentedLog(log_dir, tiny_config, verify_from_offset=written[60][0])
    assert log.recovery.truncation is None
    assert log.recovery.records_verified == 40
    assert (log.recovery.first_offset, log.recovery.end_offset) == (0, log.end_offset)
    log.close()
