"""The epoch history (logstore.epoch_history): its file format, torn-tail repair, and the
divergence rules a fetch applies on both sides (docs/REPLICATION.md 8.2 and 8.6)."""

from __future__ import annotations

import os
import struct
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from logstore.epoch_history import (
    ENTRY_SIZE_BYTES,
    EpochEnd,
    EpochEntry,
    EpochHistory,
    decode_entries,
    encode_entry,
)


def history(tmp_path, *entries: tuple[int, int], name: str = "log") -> EpochHistory:
    h = EpochHistory(str(tmp_path / "replication" / f"{name}.epochs"))
    for epoch, start in entries:
        h.append(epoch, start)
    return h


def test_an_entry_is_24_bytes_laid_out_as_the_format_table_says():
    data = encode_entry(EpochEntry(7, 4096))
    assert len(data) == ENTRY_SIZE_BYTES == 24
    assert struct.unpack(">QQHBB", data[:20]) == (7, 4096, 0x4550, 1, 0)
    assert struct.unpack(">I", data[20:])[0] == zlib.crc32(data[:20])


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 1000), st.integers(0, 10**12)), max_size=20))
def test_entries_round_trip_through_the_codec(pairs):
    entries, at = [], 0
    for epoch, start in sorted(set(pairs)):
        if entries and (epoch <= entries[-1].epoch or start < entries[-1].start_offset):
            continue
        entries.append(EpochEntry(epoch, start))
    data = b"".join(map(encode_entry, entries))
    assert decode_entries(data) == (entries, len(data), "")


def test_appends_survive_reopen_and_must_move_forward(tmp_path):
    h = history(tmp_path, (1, 0), (3, 500))
    with pytest.raises(ValueError, match="does not follow"):
        h.append(3, 600)
    with pytest.raises(ValueError, match="does not follow"):
        h.append(4, 499)
    h.append(4, 500)  # an epoch that wrote nothing: the next one starts where it did
    reopened = EpochHistory(h.path)
    assert reopened.entries == (EpochEntry(1, 0), EpochEntry(3, 500), EpochEntry(4, 500))
    assert reopened.last_epoch == 4


def test_a_torn_or_rotten_tail_is_cut_on_open(tmp_path):
    h = history(tmp_path, (1, 0), (2, 100), (3, 200))
    with open(h.path, "r+b") as file:
        file.seek(2 * ENTRY_SIZE_BYTES + 3)
        file.write(b"\xff")
    assert EpochHistory(h.path).entries == (EpochEntry(1, 0), EpochEntry(2, 100))
    assert os.path.getsize(h.path) == 2 * ENTRY_SIZE_BYTES
    with open(h.path, "ab") as file:
        file.write(b"\x00" * 10)
    assert EpochHistory(h.path).last_epoch == 2


def test_epoch_at_names_the_epoch_of_the_record_ending_at_an_offset(tmp_path):
    h = history(tmp_path, (1, 0), (2, 100), (5, 300))
    assert [h.epoch_at(o) for o in (0, 1, 100, 101, 300, 301)] == [0, 1, 1, 2, 2, 5]
    assert h.fetch_epoch(300, first_offset=300) == 5  # an empty copy starting at 300
    assert h.fetch_epoch(300, first_offset=0) == 2


def test_a_follower_holding_a_prefix_of_the_same_epochs_does_not_diverge(tmp_path):
    source = history(tmp_path, (1, 0), (2, 100), name="source")
    assert source.diverging(0, 0, log_end=150) is None
    assert source.diverging(1, 100, log_end=150) is None
    assert source.diverging(2, 150, log_end=150) is None


def test_an_old_master_with_a_tail_of_its_own_epoch_is_cut_where_the_new_epoch_began(tmp_path):
    # The old master sealed epoch 2 at 100 and wrote up to 180; the slave promoted in epoch 3
    # had only 0..100 and has written 100..140 since.
    new_master = history(tmp_path, (1, 0), (3, 100), name="new")
    old_master = history(tmp_path, (1, 0), (2, 100), name="old")
    answer = new_master.diverging(old_master.fetch_epoch(180, 0), 180, log_end=140)
    assert answer == EpochEnd(1, 100)
    cut = old_master.truncation_point(answer, log_end=180)
    assert cut == 100
    old_master.truncate(cut)
    assert old_master.entries == (EpochEntry(1, 0),)
    assert new_master.diverging(old_master.fetch_epoch(cut, 0), cut, log_end=140) is None


def test_a_follower_ahead_of_its_source_in_the_same_epoch_is_cut_to_the_source_end(tmp_path):
    source = history(tmp_path, (1, 0), name="source")
    follower = history(tmp_path, (1, 0), name="follower")
    answer = source.diverging(1, 500, log_end=400)
    assert answer == EpochEnd(1, 400)
    assert follower.truncation_point(answer, log_end=500) == 400


def test_truncate_forgets_the_entries_starting_at_or_after_the_cut(tmp_path):
    h = history(tmp_path, (1, 0), (2, 100), (3, 100), (4, 250))
    assert h.truncate(100) == 3
    assert EpochHistory(h.path).entries == (EpochEntry(1, 0),)


def test_entries_between_names_the_epoch_in_force_and_those_starting_in_the_range(tmp_path):
    h = history(tmp_path, (1, 0), (2, 100), (3, 200), (4, 300))
    assert h.entries_between(150, 200) == [EpochEntry(2, 100), EpochEntry(3, 200)]
    assert h.entries_between(0, 0) == [EpochEntry(1, 0)]
    assert h.entries_between(350, 400) == [EpochEntry(4, 300)]
