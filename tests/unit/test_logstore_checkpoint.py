"""CheckpointStore: atomic checkpoint files, the newest `keep` kept, damaged ones skipped."""

from __future__ import annotations

import os

import pytest

from logstore import CheckpointStore
from logstore.checkpoint import HEADER_SIZE_BYTES, encode_checkpoint
from logstore.faults import flip_bit


def checkpoint_files(directory: str) -> list[str]:
    return sorted(os.listdir(directory))


def test_an_empty_store_has_no_checkpoint(tmp_path):
    assert CheckpointStore(str(tmp_path), "offsets").load_latest() is None


def test_only_the_newest_keep_checkpoints_remain_and_the_newest_is_loaded(tmp_path):
    store = CheckpointStore(str(tmp_path), "offsets", keep=3)
    written = [store.write(b"state %d" % i) for i in range(1, 6)]
    assert [c.sequence for c in written] == [1, 2, 3, 4, 5]
    assert checkpoint_files(str(tmp_path)) == [f"offsets.{s:020d}.ckpt" for s in (3, 4, 5)]
    latest = store.load_latest()
    assert (latest.sequence, latest.payload, latest.path) == (5, b"state 5", written[-1].path)


@pytest.mark.parametrize("keep", [1, 2])
def test_keep_of_one_or_two_keeps_exactly_that_many(tmp_path, keep):
    store = CheckpointStore(str(tmp_path), "offsets", keep=keep)
    for i in range(4):
        store.write(b"%d" % i)
    assert len(checkpoint_files(str(tmp_path))) == keep
    assert store.load_latest().payload == b"3"


def test_keep_below_one_and_unsafe_names_are_refused(tmp_path):
    with pytest.raises(ValueError, match="keep 0 must be >= 1"):
        CheckpointStore(str(tmp_path), "offsets", keep=0)
    with pytest.raises(ValueError, match="must match"):
        CheckpointStore(str(tmp_path), "../escape")


def test_a_corrupted_newest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    store = CheckpointStore(str(tmp_path), "offsets", keep=3)
    store.write(b"older")
    newest = store.write(b"newer")
    flip_bit(newest.path, HEADER_SIZE_BYTES + 2, bit=5)
    latest = store.load_latest()
    assert (latest.sequence, latest.payload) == (1, b"older")


def test_a_truncated_newest_checkpoint_falls_back_and_none_when_all_are_damaged(tmp_path):
    store = CheckpointStore(str(tmp_path), "offsets", keep=2)
    first = store.write(b"one")
    second = store.write(b"two")
    os.truncate(second.path, 10)
    assert store.load_latest().payload == b"one"
    flip_bit(first.path, 0)
    assert store.load_latest() is None


def test_a_checkpoint_whose_content_names_another_sequence_is_skipped(tmp_path):
    store = CheckpointStore(str(tmp_path), "offsets")
    store.write(b"genuine")
    impostor = os.path.join(str(tmp_path), f"offsets.{9:020d}.ckpt")
    with open(impostor, "wb") as f:
        f.write(encode_checkpoint(2, b"copied"))
    assert store.load_latest().payload == b"genuine"


def test_a_temp_file_left_by_a_crash_mid_write_is_ignored_and_then_replaced(tmp_path):
    store = CheckpointStore(str(tmp_path), "offsets", keep=3)
    store.write(b"committed")
    torn = os.path.join(str(tmp_path), f"offsets.{2:020d}.ckpt.tmp")
    with open(torn, "wb") as f:
        f.write(encode_checkpoint(2, b"half written")[:15])
    assert store.load_latest().payload == b"committed"
    assert store.write(b"next").sequence == 2
    assert checkpoint_files(str(tmp_path)) == [f"offsets.{s:020d}.ckpt" for s in (1, 2)]
    assert store.load_latest().payload == b"next"


def test_stores_with_different_names_share_a_directory_without_touching_each_other(tmp_path):
    a = CheckpointStore(str(tmp_path), "a", keep=1)
    b = CheckpointStore(str(tmp_path), "b", keep=1)
    a.write(b"a1")
    b.write(b"b1")
    a.write(b"a2")
    assert (a.load_latest().payload, b.load_latest().payload) == (b"a2", b"b1")
    assert len(checkpoint_files(str(tmp_path))) == 2
