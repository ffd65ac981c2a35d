"""wire.packing.packb: msgpack.packb's bytes and errors from one reused Packer per thread."""

from __future__ import annotations

import threading

import msgpack
import pytest

from wire import packing
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
    kept = packing._local.packer
    large = {"b": b"x" * (PACKER_KEEP_BYTES_MAX + 1)}
    assert packb(large) == msgpack.packb(large, use_bin_type=True)
    assert getattr(packing._local, "packer", None) is not kept
    assert packb(SAMPLES[1]) == msgpack.packb(SAMPLES[1], use_bin_type=True)


def test_each_thread_packs_with_its_own_packer():
    packers = []

    def pack_in_thread() -> None:
        packb(SAMPLES[2])
        packers.append(packing._local.packer)

    threads = [threading.Thread(target=pack_in_thread) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    packb(SAMPLES[2])
    assert len({id(p) for p in packers + [packing._local.packer]}) == 3
