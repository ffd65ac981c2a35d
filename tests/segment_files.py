"""What tests read of a log's segment files: the data alone, without the zeros a segment may
hold after it (space allocated ahead, docs/FORMATS.md "Space allocated ahead"), so two servers'
copies of a log compare equal whatever space each allocated, and a test cutting a file "to what
was on disk" cuts it at the data, not at the allocated size."""

from __future__ import annotations

import os
import struct

from logstore.record import HEADER_SIZE_BYTES

_ZERO_HEADER = bytes(HEADER_SIZE_BYTES)


def segment_data(data: bytes) -> bytes:
    """A segment file's bytes up to the first zero header (the records, walked by their
    stored lengths): the file's data without the zeros allocated after it."""
    position = 0
    while position + HEADER_SIZE_BYTES <= len(data):
        if data[position : position + HEADER_SIZE_BYTES] == _ZERO_HEADER:
            break
        (body_length,) = struct.unpack_from(">I", data, position)
        position += HEADER_SIZE_BYTES + body_length
    return data[: min(position, len(data))]


def read_segment_data(path: str | os.PathLike[str]) -> bytes:
    """``segment_data`` of the file at ``path``."""
    with open(path, "rb") as f:
        return segment_data(f.read())


def segment_data_bytes(path: str | os.PathLike[str]) -> int:
    """The size of the file's data (``segment_data``), not of the file."""
    return len(read_segment_data(path))
