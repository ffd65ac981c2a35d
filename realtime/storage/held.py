"""Held messages in the message store: handed to the broker ahead of their visible time, logged
durably as held records (``control_record``) with no consumer-log entry, and made visible (a
visible record plus the consumer-log entries of everything due, in one write) or cancelled
later (docs/FORMATS.md "Held messages", docs/BENCHMARKS.md "Hand-off ahead of the due time").

``HeldSet`` is the derived, in-memory set of held records neither made visible nor cancelled;
recovery and a slave's copy rebuild it from the records (``note_control``). The functions here
write on behalf of ``MessageStore``, on its owner thread; nothing reads the clock.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

from logstore import CorruptRecord
from realtime.storage.consumer_log import ConsumerLog, encode_entries
from realtime.storage.control_record import (
    KIND_CANCELLED,
    KIND_HELD,
    KIND_VISIBLE,
    VISIBLE_ENTRIES_PER_RECORD_MAX,
    VisibleRun,
    control_kind,
    decode_cancelled,
    decode_held,
    decode_visible,
    encode_cancelled,
    encode_held,
    encode_visible,
)
from realtime.storage.dedup import DedupIndex
from realtime.storage.message_record import tag_bloom

# The sequence the dedup index keeps for a held id (it has none until made visible): a
# send of the same id is a duplicate all the same.
HELD_SEQUENCE = (1 << 64) - 1


class Held(NamedTuple):
    """A held record not yet made visible or cancelled."""

    offset: int  # its message-log offset
    size_bytes: int  # its body size (what a consumer-log entry records)
    visible_at_ms: int
    tag_bloom: int
    subject: str
    message_id: str


class HeldSet:
    """The held records neither made visible nor cancelled, by offset and by (subject, id).
    Single-owner: the store's thread."""

    def __init__(self) -> None:
        self.by_offset: dict[int, Held] = {}
        self._by_key: dict[tuple[str, str], int] = {}

    def __len__(self) -> int:
        return len(self.by_offset)

    def add(self, held: Held) -> None:
        """Remember ``held`` (replacing what was at its offset)."""
        self.by_offset[held.offset] = held
        self._by_key[(held.subject, held.message_id)] = held.offset

    def pop(self, offset: int) -> Held | None:
        """Forget the record at ``offset``; returns it, or None if it was not held."""
        held = self.by_offset.pop(offset, None)
        if held is not None and self._by_key.get((held.subject, held.message_id)) == offset:
            del self._by_key[(held.subject, held.message_id)]
        return held

    def find(self, subject: str, message_id: str) -> Held | None:
        """The held record of ``message_id`` of ``subject``, or None."""
        offset = self._by_key.get((subject, message_id))
        return None if offset is None else self.by_offset[offset]

    def clear(self) -> None:
        """Forget every record."""
        self.by_offset.clear()
        self._by_key.clear()

    def from_offset(self, end_offset: int) -> int:
        """The lowest held offset, or ``end_offset`` when nothing is held: a replay from here
        sees every held record (the checkpoint's held_from_offset)."""
        return min(self.by_offset, default=end_offset)


def note_control(body: bytes, offset: int, held: HeldSet,
                 index: Callable[[str, int, int, int, int, int], None],
                 dedup: DedupIndex | None, cutoff_ms: int, directory: str) -> None:
    """Apply one control record at ``offset`` (recovery, a slave's copy): a held record joins
    ``held`` (and ``dedup`` when younger than ``cutoff_ms``), a visible record's entries go to
    ``index(subject, sequence, timestamp_ms, held_offset, size_bytes, tag_bloom)`` and leave
    ``held``, a cancelled record's offsets leave ``held``. CorruptRecord if it does not decode."""
    kind = control_kind(body)
    try:
        if kind == KIND_HELD:
            record, _at = decode_held(body)
            held.add(Held(offset, len(body), record.visible_at_ms, record.tag_bloom,
                          record.subject, record.message_id))
            if dedup is not None and record.timestamp_ms > cutoff_ms:
                dedup.add(record.subject, record.message_id, HELD_SEQUENCE, record.timestamp_ms)
        elif kind == KIND_VISIBLE:
            timestamp_ms, runs = decode_visible(body)
            for subject, first, entries in runs:
                for index_in_run, (held_offset, size_bytes, bloom) in enumerate(entries):
                    held.pop(held_offset)
                    index(subject, first + index_in_run, timestamp_ms, held_offset, size_bytes,
                          bloom)
        elif kind == KIND_CANCELLED:
            for held_offset in decode_cancelled(body)[1]:
                held.pop(held_offset)
        else:
            raise ValueError(f"unknown control record kind {kind}")
    except ValueError as exc:
        raise CorruptRecord(directory, offset, f"bad control record: {exc}") from exc


def encode_held_bodies(timestamp_ms: int, subjects: Sequence[str], message_ids: Sequence[str],
                       tag_hashes: Sequence[Sequence[int]], payloads: Sequence[bytes],
                       visible_at_ms: Sequence[int], dedup: DedupIndex, held: HeldSet,
                       ) -> tuple[list[bytes], list[int], list[str]]:
    """The held records to write for messages given column by column, skipping duplicates (an
    id the dedup index or the held set knows, or one twice here): (bodies, the index of each
    body's message, their dedup keys). The caller checked the fields (``check_message``)."""
    bodies: list[bytes] = []
    kept: list[int] = []
    keys: list[str] = []
    seen: set[str] = set()
    for index, (subject, message_id, hashes, payload, visible_at) in enumerate(zip(
            subjects, message_ids, tag_hashes, payloads, visible_at_ms)):
        (key,) = dedup.keys(subject, (message_id,))
        found = dedup.lookup_many((key,), timestamp_ms)
        if key in seen or (found is not None and found[0] is not None) \
                or held.find(subject, message_id) is not None:
            continue
        seen.add(key)
        bodies.append(encode_held(timestamp_ms, visible_at, tag_bloom(hashes), subject,
                                  message_id, bytes(payload)))
        kept.append(index)
        keys.append(key)
    return bodies, kept, keys


def visible_bodies(timestamp_ms: int, due: Sequence[Held],
                   consumer_log: Callable[[str], ConsumerLog],
                   ) -> tuple[list[bytes], list[VisibleRun]]:
    """The visible records that make ``due`` visible, in that order within each subject,
    numbered after each subject's consumer-log end: (bodies, the runs, one per subject)."""
    by_subject: dict[str, list[Held]] = {}
    for held in due:
        by_subject.setdefault(held.subject, []).append(held)
    runs: list[VisibleRun] = []
    for subject, items in by_subject.items():
        runs.append((subject, consumer_log(subject).end,
                     [(h.offset, h.size_bytes, h.tag_bloom) for h in items]))
    bodies: list[bytes] = []
    pieces: list[VisibleRun] = []
    room = VISIBLE_ENTRIES_PER_RECORD_MAX
    for subject, first, entries in runs:
        at = 0
        while at < len(entries):
            take = min(room, len(entries) - at)
            pieces.append((subject, first + at, entries[at:at + take]))
            at += take
            room -= take
            if room == 0:
                bodies.append(encode_visible(timestamp_ms, pieces))
                pieces, room = [], VISIBLE_ENTRIES_PER_RECORD_MAX
    if pieces:
        bodies.append(encode_visible(timestamp_ms, pieces))
    return bodies, runs


def index_visible(timestamp_ms: int, runs: Sequence[VisibleRun],
                  consumer_logs: dict[str, ConsumerLog]) -> None:
    """Append the consumer-log entries of ``runs`` (written durably first)."""
    for subject, _first, entries in runs:
        consumer_logs[subject].append_encoded(encode_entries(
            [timestamp_ms] * len(entries), [e[0] for e in entries], [e[1] for e in entries],
            [e[2] for e in entries]))


def cancelled_body(timestamp_ms: int, offsets: Sequence[int]) -> bytes:
    """The cancelled record dropping the held records at ``offsets``."""
    return encode_cancelled(timestamp_ms, offsets)


__all__ = ["HELD_SEQUENCE", "Held", "HeldSet", "cancelled_body", "encode_held_bodies",
           "index_visible", "note_control", "visible_bodies"]
