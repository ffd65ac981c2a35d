"""wire.packing.packb: msgpack.packb's bytes and errors from one reused Packer per thread."""

from __future__ import annotations

import threading

import msgpack
import pytest

from wire import packing
from wire.errors import TooLarge
from wire.framing import encode_frame
from wire.packing import PACKER_KEEP_BYTES_MAX, packb

SAMPLES = [{"i": "id", "s": "subject", "b": b"\x00" * 300, "c": 1 << 40, "d": None},
           [1, -1, 2.5, True, "é", b"", [], {}], {"messages": [b"x" * 330] * 32, "rid": 7}]


def test_it_packs_what_msgpack_packb_packs_call_after_call():
    for _ in range(3):
        for sample in SAMPLES:
            assert packb(sample) == msgpack.packb(sample, use_bin_type=True)


@pytest.mark.parametrize("bad,error", [({"a": "\ud800"}, ValueError), ({"a": 1 << 70}, OverflowError),
                                       ({"a": object()}, TypeError)])
def test_a_failed_pack_raises_as_packb_does_and_leaves_nothing_behind_for_the_next(bad, error):
    with pytest.raises(error):
        packb({"ok": 1, **bad})
    assert packb(SAMPLES[0]) == msgpack.packb(SAMPLES[0], use_bin_type=True)


def test_a_packer_that_packed_a_large_object_is_not_kept():
    packb(SAMPLES[0])
    kept = packing.packers.packer
    large = {"b": b"x" * (PACKER_KEEP_BYTES_MAX + 1)}
    assert packb(large) == msgpack.packb(large, use_bin_type=True)
    assert packing.packers.packer is not kept
    assert packb(SAMPLES[1]) == msgpack.packb(SAMPLES[1], use_bin_type=True)


def test_each_thread_packs_with_its_own_packer():
    packers = []

    def pack_in_thread() -> None:
        packb(SAMPLES[2])
        packers.append(packing.packers.packer)

    threads = [threading.Thread(target=pack_in_thread) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    packb(SAMPLES[2])
    assert len({id(p) for p in packers + [packing.packers.packer]}) == 3


def test_a_frame_encoded_through_the_threads_packer_leaves_a_large_one_behind_too():
    encode_frame({"ok": 1})
    kept = packing.packers.packer
    large = {"b": b"x" * (PACKER_KEEP_BYTES_MAX + 1)}
    frame = encode_frame(large, max_frame_bytes=2 * PACKER_KEEP_BYTES_MAX)
    assert frame[4:] == msgpack.packb(large, use_bin_type=True)
    assert packing.packers.packer is not kept
    assert encode_frame(SAMPLES[2])[4:] == msgpack.packb(SAMPLES[2], use_bin_type=True)


def test_a_frame_over_the_limit_is_refused_after_its_packer_is_replaced():
    kept = packing.packers.packer
    with pytest.raises(TooLarge):
        encode_frame({"b": b"x" * (PACKER_KEEP_BYTES_MAX + 1)},
                     max_frame_bytes=PACKER_KEEP_BYTES_MAX)
    assert packing.packers.packer is not kept
