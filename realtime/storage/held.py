"""Held messages in the message store: handed to the broker ahead of their visible time, logged
durably as held records (``control_record``) with no consumer-log entry, and made visible (a
visible-message record per message, its payload written again, plus the consumer-log entries
pointing at those records, in one call) or cancelled later (docs/FORMATS.md "Held messages", docs/BENCHMARKS.md "Hand-off ahead of the due time").

``HeldSet`` is the derived, in-memory set of held records neither made visible nor cancelled;
recovery and a slave's copy rebuild it from the records (``note_control``). The functions here
write on behalf of ``MessageStore``, on its owner thread; nothing reads the clock.
"""

from __future__ import annotations

from itertools import repeat
from operator import attrgetter
from typing import Callable, Mapping, NamedTuple, Sequence

from logstore import CorruptRecord
from realtime.storage.consumer_log import ConsumerLog
from realtime.storage.control_record import (
    KIND_CANCELLED,
    KIND_DROPPED,
    KIND_HELD,
    KIND_VISIBLE_MESSAGE,
    control_kind,
    decode_cancelled,
    decode_dropped,
    decode_held,
    decode_visible_message,
    encode_cancelled,
    encode_dropped,
    encode_held,
    encode_visible_messages,
    is_control,
)
from realtime.storage.dedup import DedupIndex
from realtime.storage.message_record import decode_message_header, tag_bloom

# The sequence the dedup index keeps for a held id (it has none until made visible): a
# send of the same id is a duplicate all the same.
HELD_SEQUENCE = (1 << 64) - 1
# The sequence the dedup index keeps for an id a cancel_held dropped (a dropped record): a
# send or hold of it is a duplicate, and a retried cancel_held learns it was dropped before.
DROPPED_SEQUENCE = (1 << 64) - 2


class Held(NamedTuple):
    """A held record not yet made visible or cancelled."""

    offset: int  # its message-log offset
    size_bytes: int  # its body size (what a consumer-log entry records)
    visible_at_ms: int
    tag_bloom: int
    subject: str
    message_id: str


_KEY_OF = attrgetter("subject", "message_id")  # a Held's key in HeldSet._by_key
_OFFSET_OF = attrgetter("offset")


class HeldSet:
    """The held records neither made visible nor cancelled, by offset and by (subject, id).
    Single-owner: the store's thread."""

    def __init__(self) -> None:
        self.by_offset: dict[int, Held] = {}
        self._by_key: dict[tuple[str, str], int] = {}

    def __len__(self) -> int:
        return len(self.by_offset)

    @property
    def keys(self) -> Mapping[tuple[str, str], int]:
        """(subject, message id) -> offset of every held record (read only)."""
        return self._by_key

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

    def pop_many(self, offsets: Sequence[int]) -> None:
        """``pop`` of each offset (those not held are ignored)."""
        by_key = self._by_key
        # A Held is a non-empty tuple, so filter(None) keeps exactly the records found.
        found = list(filter(None, map(self.by_offset.pop, offsets, repeat(None))))
        keys = list(map(_KEY_OF, found))
        # Popped without Python code per key; a key that stood for another offset (held
        # again at another offset: recovery, a slave's copy) is put back, unless that record
        # left too (popped here as well, in either order).
        popped = list(map(by_key.pop, keys, repeat(None)))
        if popped != list(map(_OFFSET_OF, found)):
            by_offset = self.by_offset
            for key, offset, held in zip(keys, popped, found):
                if offset is not None and offset != held.offset and offset in by_offset:
                    by_key[key] = offset

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


def is_held_control(body: bytes | memoryview) -> bool:
    """True for a held or cancelled record: the control records that only change the held set
    (a visible-message record is a message: ``message_header``)."""
    return is_control(body) and control_kind(body) != KIND_VISIBLE_MESSAGE


def message_header(body: bytes | memoryview) -> tuple[int, int, int, str, str, int | None]:
    """(timestamp_ms, sequence, tag_bloom, subject, message_id, held_offset) of a message
    record (held_offset None) or a visible-message record; ValueError on any defect."""
    if is_control(body):
        record, sequence, held_offset, _at = decode_visible_message(body)
        return (record.timestamp_ms, sequence, record.tag_bloom, record.subject,
                record.message_id, held_offset)
    timestamp_ms, sequence, bloom, subject, message_id, _at = decode_message_header(body)
    return timestamp_ms, sequence, bloom, subject, message_id, None


def note_control(body: bytes, offset: int, held: HeldSet, dedup: DedupIndex | None,
                 cutoff_ms: int, directory: str) -> None:
    """Apply one held, cancelled or dropped record at ``offset`` (recovery, a slave's copy):
    a held record joins ``held`` (and ``dedup`` when younger than ``cutoff_ms``), a cancelled or
    dropped record's offsets leave ``held`` (a dropped record's ids go into ``dedup`` as
    dropped, when younger than ``cutoff_ms``). CorruptRecord if it does not decode."""
    kind = control_kind(body)
    try:
        if kind == KIND_HELD:
            record, _at = decode_held(body)
            held.add(Held(offset, len(body), record.visible_at_ms, record.tag_bloom,
                          record.subject, record.message_id))
            if dedup is not None and record.timestamp_ms > cutoff_ms:
                dedup.add(record.subject, record.message_id, HELD_SEQUENCE, record.timestamp_ms)
        elif kind == KIND_CANCELLED:
            for held_offset in decode_cancelled(body)[1]:
                held.pop(held_offset)
        elif kind == KIND_DROPPED:
            timestamp_ms, subject, offsets, message_ids = decode_dropped(body)
            held.pop_many(offsets)
            if dedup is not None and timestamp_ms > cutoff_ms:
                for message_id in message_ids:
                    dedup.add(subject, message_id, DROPPED_SEQUENCE, timestamp_ms)
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
    if len(set(subjects)) == 1:  # the usual hand-off: one subject, its ids checked at once
        all_keys = dedup.keys(subjects[0], message_ids)
        held_keys = held.keys
        if (dedup.lookup_many(all_keys, timestamp_ms) is None
                and len(set(all_keys)) == len(all_keys)
                and not any(map(held_keys.__contains__, zip(subjects, message_ids)))):
            # No duplicate of any kind: every message is held (the loop below says the same
            # with three lookups per message).
            return (list(map(encode_held, repeat(timestamp_ms), visible_at_ms,
                             map(tag_bloom, tag_hashes), subjects, message_ids,
                             map(bytes, payloads))),
                    list(range(len(all_keys))), all_keys)
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


def visible_bodies(timestamp_ms: int, due: Sequence[Held], payloads: Mapping[int, bytes],
                   consumer_log: Callable[[str], ConsumerLog],
                   ) -> tuple[list[bytes], list[tuple[str, int, list[Held]]]]:
    """The visible-message records making ``due`` visible (``payloads`` by held offset), in
    that order within each subject, numbered after each subject's consumer-log end: (bodies,
    then (subject, first sequence, the records) per subject), bodies grouped by subject."""
    by_subject: dict[str, list[Held]] = {}
    if len(set(map(attrgetter("subject"), due))) == 1:  # the usual hot slot: one subject
        by_subject[due[0].subject] = list(due)
    else:
        for held in due:
            by_subject.setdefault(held.subject, []).append(held)
    bodies: list[bytes] = []
    runs: list[tuple[str, int, list[Held]]] = []
    for subject, items in by_subject.items():
        first = consumer_log(subject).end
        runs.append((subject, first, items))
        offsets = [h.offset for h in items]
        bodies += encode_visible_messages(
            timestamp_ms, subject, range(first, first + len(items)),
            [h.tag_bloom for h in items], offsets,
            [h.message_id.encode("utf-8") for h in items], list(map(payloads.__getitem__, offsets)))
    return bodies, runs


def cancelled_body(timestamp_ms: int, offsets: Sequence[int]) -> bytes:
    """The cancelled record dropping the held records at ``offsets``."""
    return encode_cancelled(timestamp_ms, offsets)


def dropped_body(timestamp_ms: int, subject: str, dropped: Sequence[Held]) -> bytes:
    """The dropped record of held records of ``subject`` a cancel dropped."""
    return encode_dropped(timestamp_ms, subject, [h.offset for h in dropped],
                          [h.message_id for h in dropped])


__all__ = ["DROPPED_SEQUENCE", "HELD_SEQUENCE", "Held", "HeldSet", "cancelled_body",
           "dropped_body", "encode_held_bodies",
           "is_held_control", "message_header", "note_control", "visible_bodies"]
