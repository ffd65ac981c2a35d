"""The epoch history of one replicated log: the offset at which each epoch of its group began.

A server keeps one file per replicated log, ``<data_dir>/replication/<log>.epochs``
(docs/REPLICATION.md 4 and 13.2). A new master appends ``(epoch, its end offset)`` before it
accepts a write; a slave appends the entries its master's fetch answers name. The history says
which records a rejoining server must cut: the end of an epoch is the start of the next entry
(or the log's end for the newest), so two servers agree on a prefix exactly up to the end, in
the newer history, of the newest epoch both know (Kafka's leader epoch cache, KIP-101).

Each entry is 24 bytes, all integers big-endian::

    Offset | Size | Field
    -------+------+---------------------------------------------------------------
    0      | 8    | epoch: u64, the group's epoch
    8      | 8    | start_offset: u64, the first byte offset of the log written under it
    16     | 2    | magic: 0x4550 ("EP")
    18     | 1    | version: 1
    19     | 1    | reserved: 0
    20     | 4    | crc32: u32, CRC-32 (zlib) of bytes 0..19

Epochs increase strictly and start offsets never decrease from one entry to the next. An append
is fsynced before it returns (it happens once per change of master); a torn or bad tail (a short
entry, a CRC mismatch, an entry that breaks the order) is cut on open. ``truncate`` rewrites the
file whole (temp, fsync, rename, fsync of the directory).

What it does NOT guarantee: the CRC detects torn writes and bit rot, not tampering; an entry
cut as a bad tail is forgotten, so a server whose history lost its newest entry treats the
records of that epoch as the previous epoch's and may cut more than it had to when it rejoins
(never less: it then fetches them again).
"""

from __future__ import annotations

import bisect
import logging
import os
import struct
import zlib
from typing import NamedTuple

from logstore.fileio import Opener, OsFile, fsync_directory, write_file_atomically

log = logging.getLogger(__name__)

FIELDS = struct.Struct(
    ">Q"  # epoch
    "Q"  # start_offset
    "H"  # magic
    "B"  # version
    "B"  # reserved
)
CRC = struct.Struct(">I")  # crc32 of the 20 bytes above
ENTRY_SIZE_BYTES = FIELDS.size + CRC.size  # 24
MAGIC = 0x4550
VERSION = 1
U64_MAX = (1 << 64) - 1
FILE_SUFFIX = ".epochs"


class EpochEntry(NamedTuple):
    """One epoch and the log offset at which it began."""

    epoch: int
    start_offset: int


class EpochEnd(NamedTuple):
    """Where an epoch ended in one server's log (a fetch answer's ``diverging``)."""

    epoch: int
    end_offset: int


def encode_entry(entry: EpochEntry) -> bytes:
    """The 24 bytes of ``entry``; ValueError for a field outside u64 or epoch 0."""
    if not 1 <= entry.epoch <= U64_MAX or not 0 <= entry.start_offset <= U64_MAX:
        raise ValueError(f"epoch {entry.epoch} / start_offset {entry.start_offset} is outside "
                         f"1..{U64_MAX} / 0..{U64_MAX}")
    head = FIELDS.pack(entry.epoch, entry.start_offset, MAGIC, VERSION, 0)
    return head + CRC.pack(zlib.crc32(head))


def decode_entries(data: bytes) -> tuple[list[EpochEntry], int, str]:
    """Decode a whole file: (entries, bytes of the good prefix, the problem that stopped the
    scan or ""). Stops at a torn or bad entry or one out of order."""
    entries: list[EpochEntry] = []
    at = 0
    while at < len(data):
        if len(data) - at < ENTRY_SIZE_BYTES:
            return entries, at, f"torn entry: {len(data) - at} of {ENTRY_SIZE_BYTES} bytes"
        epoch, start, magic, version, reserved = FIELDS.unpack_from(data, at)
        (crc,) = CRC.unpack_from(data, at + FIELDS.size)
        if zlib.crc32(data[at : at + FIELDS.size]) != crc:
            return entries, at, "crc mismatch"
        if magic != MAGIC or version != VERSION or reserved:
            return entries, at, f"bad magic 0x{magic:04x}, version {version} or reserved byte"
        if epoch == 0 or (entries and (epoch <= entries[-1].epoch
                                       or start < entries[-1].start_offset)):
            return entries, at, (f"entry ({epoch}, {start}) does not follow "
                                 f"{entries[-1] if entries else 'nothing'}")
        entries.append(EpochEntry(epoch, start))
        at += ENTRY_SIZE_BYTES
    return entries, at, ""


class EpochHistory:
    """The epoch history file of one log (module docstring). Synchronous, one owner."""

    def __init__(self, path: str, opener: Opener = OsFile) -> None:
        self.path = path
        self._opener = opener
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        data = b""
        if os.path.exists(path):
            with open(path, "rb") as file:
                data = file.read()
        entries, good, problem = decode_entries(data)
        if good != len(data):
            log.warning("epoch history %s: cut %d bytes at byte %d (%s)", path,
                        len(data) - good, good, problem)
            write_file_atomically(path, data[:good])
        self._entries = entries
        self._starts = [entry.start_offset for entry in entries]

    @property
    def entries(self) -> tuple[EpochEntry, ...]:
        """Every entry, oldest first."""
        return tuple(self._entries)

    @property
    def last_epoch(self) -> int:
        """The newest epoch in the history, 0 when it is empty."""
        return self._entries[-1].epoch if self._entries else 0

    def append(self, epoch: int, start_offset: int) -> None:
        """Record that ``epoch`` began at ``start_offset``, durably (fsynced before returning).
        ValueError unless the epoch is newer than the last and the offset not below its start."""
        last = self._entries[-1] if self._entries else None
        if last is not None and (epoch <= last.epoch or start_offset < last.start_offset):
            raise ValueError(f"epoch {epoch} at offset {start_offset} does not follow the "
                             f"history's last entry (epoch {last.epoch} at {last.start_offset})")
        data = encode_entry(EpochEntry(epoch, start_offset))
        created = not os.path.exists(self.path)
        handle = self._opener(self.path)
        try:
            handle.append(data)
            handle.sync()
        finally:
            handle.close()
        if created:
            fsync_directory(os.path.dirname(os.path.abspath(self.path)))
        self._entries.append(EpochEntry(epoch, start_offset))
        self._starts.append(start_offset)

    def epoch_at(self, offset: int) -> int:
        """The epoch of the record that ends at ``offset`` (the newest entry starting before
        it); 0 when no entry does, as at offset 0."""
        index = bisect.bisect_left(self._starts, offset) - 1
        return self._entries[index].epoch if index >= 0 else 0

    def in_force(self, offset: int) -> EpochEntry | None:
        """The entry in force at ``offset``: the newest starting at or before it."""
        index = bisect.bisect_right(self._starts, offset) - 1
        return self._entries[index] if index >= 0 else None

    def end_of(self, epoch: int, log_end: int) -> EpochEnd:
        """The newest epoch of this history that is at most ``epoch``, with the offset where it
        ended (the next entry's start, or ``log_end`` for the newest). Epoch 0 ends at the first
        entry's start when the history has no such epoch."""
        epochs = [entry.epoch for entry in self._entries]
        index = bisect.bisect_right(epochs, epoch) - 1
        following = index + 1
        end = self._starts[following] if following < len(self._entries) else log_end
        return EpochEnd(self._entries[index].epoch if index >= 0 else 0, end)

    def fetch_epoch(self, offset: int, first_offset: int) -> int:
        """The ``last_epoch`` a follower whose log spans [first_offset, offset) sends: the
        epoch of its last record, or for an empty log the epoch in force where it starts
        (a copy that began at its source's retention point)."""
        if offset > first_offset:
            return self.epoch_at(offset)
        entry = self.in_force(offset)
        return entry.epoch if entry is not None else 0

    def diverging(self, last_epoch: int, offset: int, log_end: int) -> EpochEnd | None:
        """The source's side of a fetch (docs/REPLICATION.md 8.2): None when a follower whose
        last record is of ``last_epoch`` and ends at ``offset`` holds a prefix of this log;
        else the newest epoch of this history at most ``last_epoch`` and where it ended here,
        which tells the follower where to cut (``truncation_point``)."""
        ended = self.end_of(last_epoch, log_end)
        if ended.epoch == last_epoch and offset <= ended.end_offset:
            return None
        return ended

    def truncation_point(self, diverging: EpochEnd, log_end: int) -> int:
        """The follower's side: where to cut its log of ``log_end`` bytes after its source
        answered ``diverging`` (epoch E ended at offset X there): at X, or earlier where E (or
        the newest epoch before it) ended in this history (Kafka's follower truncation)."""
        own = self.end_of(diverging.epoch, log_end)
        return min(diverging.end_offset, own.end_offset, log_end)

    def entries_between(self, start_offset: int, end_offset: int) -> list[EpochEntry]:
        """The entry in force at ``start_offset`` and every later one that starts at or before
        ``end_offset``: what a follower copying [start_offset, end_offset) must record."""
        first = max(0, bisect.bisect_right(self._starts, start_offset) - 1)
        stop = bisect.bisect_right(self._starts, end_offset)
        return self._entries[first:stop]

    def truncate(self, offset: int) -> int:
        """Forget every entry that starts at or after ``offset`` (its log was cut there);
        rewrites the file whole. Returns how many entries went."""
        keep = bisect.bisect_left(self._starts, offset)
        dropped = len(self._entries) - keep
        if dropped:
            del self._entries[keep:]
            del self._starts[keep:]
            write_file_atomically(self.path, b"".join(map(encode_entry, self._entries)))
        return dropped


def history_path(directory: str, log_name: str) -> str:
    """``<directory>/<log_name>.epochs``."""
    return os.path.join(directory, log_name + FILE_SUFFIX)


__all__ = ["ENTRY_SIZE_BYTES", "EpochEnd", "EpochEntry", "EpochHistory", "decode_entries", "encode_entry",
           "history_path"]
