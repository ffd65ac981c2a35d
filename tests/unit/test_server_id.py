"""serverkit.server_id: the server.id file (docs/REPLICATION.md 13.1)."""

from __future__ import annotations

import os
import zlib

import pytest
from hypothesis import given, strategies as st

from serverkit import server_id


def test_the_first_start_makes_an_id_and_later_starts_read_the_same_one(tmp_path):
    first = server_id.load_or_create(str(tmp_path / "data"))
    assert len(first) == 16 and int(first, 16) >= 0
    assert server_id.load_or_create(str(tmp_path / "data")) == first
    assert os.path.getsize(tmp_path / "data" / "server.id") == server_id.FILE_BYTES == 20


def test_two_data_dirs_get_different_ids(tmp_path):
    assert server_id.load_or_create(str(tmp_path / "a")) != server_id.load_or_create(
        str(tmp_path / "b"))


def test_the_layout_is_magic_version_reserved_id_and_crc():
    data = server_id.encode(bytes.fromhex("0123456789abcdef"))
    assert data[:4] == b"QSID"
    assert data[4:6] == b"\x00\x01" and data[6:8] == b"\x00\x00"
    assert data[8:16] == bytes.fromhex("0123456789abcdef")
    assert int.from_bytes(data[16:20], "big") == zlib.crc32(data[:16])


@given(st.binary(min_size=8, max_size=8))
def test_every_id_round_trips(raw):
    assert server_id.decode(server_id.encode(raw)) == raw.hex()


@pytest.mark.parametrize("position", range(20))
def test_a_flipped_bit_anywhere_is_refused_not_replaced(tmp_path, position):
    server_id.write(str(tmp_path), bytes(8))
    path = tmp_path / "server.id"
    data = bytearray(path.read_bytes())
    data[position] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(server_id.ServerIdError):
        server_id.load_or_create(str(tmp_path))
    assert path.read_bytes() == bytes(data), "a bad file is never overwritten"


@pytest.mark.parametrize("size", [0, 19, 21])
def test_a_file_of_the_wrong_size_is_refused(size):
    with pytest.raises(server_id.ServerIdError, match=f"has {size} bytes, expected 20"):
        server_id.decode(b"x" * size)
