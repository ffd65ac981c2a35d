"""Checkpoint files: a caller's state snapshot written atomically, the last few kept.

Each checkpoint is one file ``<name>.<20-digit sequence>.ckpt``::

    Offset | Size | Field
    -------+------+-----------------------------------------------------------
    0      | 4    | magic: 0x51434B50 ("QCKP")
    4      | 1    | version: 1
    5      | 3    | reserved, 0
    8      | 8    | sequence: u64, increases with every checkpoint written
    16     | 4    | payload_length: u32
    20     | 4    | crc32: CRC-32 of bytes 0..19 and the payload
    24     | N    | payload: the caller's bytes (opaque here)

Written temp -> fsync -> rename -> fsync directory. ``load_latest`` returns the newest checkpoint
whose CRC verifies, falling back to older ones. What it does NOT guarantee: the payload's meaning
is the caller's; a checkpoint describes state up to some point and the caller must replay its logs
from there.
"""

from __future__ import annotations

import logging
import os
import re
import struct
import zlib
from dataclasses import dataclass

from logstore.fileio import fsync_directory, write_file_atomically

log = logging.getLogger(__name__)

HEADER = struct.Struct(
    ">I"  # magic
    "B"  # version
    "3x"  # reserved
    "Q"  # sequence
    "I"  # payload_length
)
CRC = struct.Struct(">I")
MAGIC = 0x51434B50
VERSION = 1
HEADER_SIZE_BYTES = HEADER.size + CRC.size
PAYLOAD_SIZE_BYTES_MAX = 1 << 30  # a larger stored length is corruption


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint."""

    sequence: int
    payload: bytes
    path: str


def encode_checkpoint(sequence: int, payload: bytes) -> bytes:
    """Frame ``payload`` as a checkpoint file's bytes."""
    header = HEADER.pack(MAGIC, VERSION, sequence, len(payload))
    crc = zlib.crc32(payload, zlib.crc32(header))
    return header + CRC.pack(crc) + payload


def decode_checkpoint(data: bytes) -> tuple[int, bytes]:
    """Parse checkpoint bytes into (sequence, payload); raises ValueError on any defect."""
    if len(data) < HEADER_SIZE_BYTES:
        raise ValueError(f"{len(data)} bytes is shorter than the checkpoint header")
    magic, version, sequence, length = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ValueError(f"bad magic 0x{magic:08x}")
    if version != VERSION:
        raise ValueError(f"unknown version {version}")
    if length > PAYLOAD_SIZE_BYTES_MAX or HEADER_SIZE_BYTES + length != len(data):
        raise ValueError(f"payload length {length} does not match file size {len(data)}")
    (crc,) = CRC.unpack_from(data, HEADER.size)
    payload = data[HEADER_SIZE_BYTES:]
    if zlib.crc32(payload, zlib.crc32(data[: HEADER.size])) != crc:
        raise ValueError("crc mismatch")
    return sequence, payload


class CheckpointStore:
    """Writes and loads the checkpoints called ``name`` in ``directory``, keeping ``keep`` files."""

    def __init__(self, directory: str, name: str, keep: int = 3) -> None:
        if keep < 1:
            raise ValueError(f"keep {keep} must be >= 1")
        if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
            raise ValueError(f"checkpoint name {name!r} must match [A-Za-z0-9_-]+")
        self.directory = directory
        self.name = name
        self.keep = keep
        self._pattern = re.compile(rf"{re.escape(name)}\.(\d{{20}})\.ckpt")
        os.makedirs(directory, exist_ok=True)

    def _files(self) -> list[tuple[int, str]]:
        found = []
        for entry in os.listdir(self.directory):
            match = self._pattern.fullmatch(entry)
            if match:
                found.append((int(match.group(1)), os.path.join(self.directory, entry)))
        return sorted(found)

    def write(self, payload: bytes) -> Checkpoint:
        """Write a new checkpoint atomically and delete all but the newest ``keep``."""
        files = self._files()
        sequence = files[-1][0] + 1 if files else 1
        path = os.path.join(self.directory, f"{self.name}.{sequence:020d}.ckpt")
        write_file_atomically(path, encode_checkpoint(sequence, payload))
        stale = [p for _, p in files[: max(0, len(files) + 1 - self.keep)]]
        for old in stale:
            os.unlink(old)
        if stale:
            fsync_directory(self.directory)
        return Checkpoint(sequence, payload, path)

    def load_latest(self) -> Checkpoint | None:
        """The newest checkpoint that verifies, or None; damaged ones are logged and skipped."""
        return next(self._verified(), None)

    def load_all(self) -> list[Checkpoint]:
        """Every checkpoint kept that verifies, newest first (a replica cutting its log back
        looks for the newest one below the cut)."""
        return list(self._verified())

    def _verified(self):
        for sequence, path in reversed(self._files()):
            try:
                with open(path, "rb") as f:
                    stored_sequence, payload = decode_checkpoint(f.read())
            except (OSError, ValueError) as exc:
                log.warning("checkpoint %s unusable, trying an older one: %s", path, exc)
                continue
            if stored_sequence != sequence:
                log.warning("checkpoint %s says sequence %d; skipped", path, stored_sequence)
                continue
            yield Checkpoint(sequence, payload, path)

    def delete(self, checkpoints: list[Checkpoint]) -> None:
        """Delete these checkpoints (a cut log no longer has what they describe), durably."""
        for checkpoint in checkpoints:
            os.unlink(checkpoint.path)
        if checkpoints:
            fsync_directory(self.directory)

    def delete_after(self, sequence: int) -> int:
        """Delete every checkpoint numbered above ``sequence`` (they describe state a cut log
        no longer has); returns how many. Later writes keep numbering upwards from the newest
        file left, so a deleted number may be used again for a new checkpoint."""
        doomed = [path for number, path in self._files() if number > sequence]
        for path in doomed:
            os.unlink(path)
        if doomed:
            fsync_directory(self.directory)
        return len(doomed)
