"""``HeldWrites``: the message store's writes of held messages (``hold_many``, ``make_visible``,
``cancel_held``) and the held set it reads (``held``), apart from ``store.py`` for its size.
``MessageStore`` inherits them; they use its message log, consumer logs, dedup index, held set
and write batch, on its owner thread (docs/FORMATS.md "Held messages")."""

from __future__ import annotations

import logging
from itertools import repeat
from typing import TYPE_CHECKING, Mapping, Sequence

from logstore import CorruptRecord, LogStoreError, LogWriteFailed
from realtime.storage.config import (
    MESSAGE_ID_BYTES_MAX, TAG_HASH_MAX, TAG_HASHES_MAX, TIMESTAMP_MS_MAX,
)
from realtime.storage.consumer_log import ConsumerLog, encode_entries
from realtime.storage.control_record import decode_held
from realtime.storage.errors import HeldSetFull, StoreFailed
from realtime.storage.held import (
    DROPPED_SEQUENCE, HELD_SEQUENCE, Held, cancelled_body, dropped_body, encode_held_bodies,
    visible_bodies,
)
from realtime.storage.message_record import record_size_bytes
from realtime.storage.write_batch import check_int, check_message, check_subject

if TYPE_CHECKING:
    from realtime.storage.config import StoreConfig
    from realtime.storage.dedup import DedupIndex
    from realtime.storage.held import HeldSet
    from realtime.storage.message_log import MessageLog
    from realtime.storage.write_batch import WriteBatch

log = logging.getLogger(__name__)

class HeldWrites:
    """The held-message half of ``MessageStore`` (see the module docstring)."""

    # MessageStore's, set by its constructor:
    config: StoreConfig
    _batch: WriteBatch
    _held: HeldSet
    _dedup: DedupIndex
    _message_log: MessageLog
    _consumer_logs: dict[str, ConsumerLog]
    _consumer_root: str
    _failed: Exception | None

    def _check_writable(self) -> None: ...  # MessageStore's
    def _check_open(self) -> None: ...  # MessageStore's
    def _maybe_checkpoint(self) -> None: ...  # MessageStore's
    def _open_consumer_log(self, subject: str) -> ConsumerLog: ...  # MessageStore's

    def hold_many(self, subjects: Sequence[str], message_ids: Sequence[str],
                  tag_hashes: Sequence[Sequence[int]], timestamp_ms: int,
                  payloads: Sequence[bytes], visible_at_ms: Sequence[int],
                  refused: list[int] | None = None) -> list[int | None]:
        """Write held records of messages given column by column, durably (per flush mode),
        with no consumer-log entry: invisible until ``make_visible``. Returns each message's
        held offset, None for a duplicate (an id stored or held within the dedup window, or
        held still) or a message refused: the held set holds at most ``held_messages_max``,
        so the new messages past it (in order) are not held and their indexes are appended
        to ``refused`` (without that list, HeldSetFull is raised and nothing is held). All or
        nothing otherwise: a ValueError names the message at fault."""
        self._check_writable()
        if self._batch.bodies:
            raise ValueError("hold_many between append and commit")
        if not _fields_fit(subjects, message_ids, tag_hashes, payloads,
                           self.config.record_size_bytes_max):
            # Find and name the message at fault the way a send's check does.
            for subject, message_id, hashes, payload in zip(subjects, message_ids, tag_hashes,
                                                            payloads):
                check_message(subject, message_id, hashes, payload,
                              self.config.record_size_bytes_max)
        for visible_at in visible_at_ms:
            check_int("visible_at_ms", visible_at, 0, TIMESTAMP_MS_MAX)
        check_int("timestamp_ms", timestamp_ms, 0, TIMESTAMP_MS_MAX)
        bodies, kept, keys = encode_held_bodies(timestamp_ms, subjects, message_ids, tag_hashes,
                                                payloads, visible_at_ms, self._dedup, self._held)
        outcome: list[int | None] = [None] * len(subjects)
        room = self.config.held_messages_max - len(self._held)
        if len(bodies) > room:
            room = max(room, 0)
            if refused is None:
                raise HeldSetFull(len(self._held), self.config.held_messages_max,
                                  len(bodies) - room)
            refused += kept[room:]
            bodies, kept, keys = bodies[:room], kept[:room], keys[:room]
        if not bodies:
            return outcome
        assert len(bodies) <= room, (len(bodies), room)  # the held set stays within its max
        offsets = self._write_durably(bodies)
        for index, offset, body in zip(kept, offsets, bodies):
            outcome[index] = offset
            self._held.add(Held(offset, len(body), visible_at_ms[index],
                                int.from_bytes(body[16:24], "big"), subjects[index],
                                message_ids[index]))
        self._dedup.add_many(keys, [HELD_SEQUENCE] * len(keys), [timestamp_ms] * len(keys))
        self._maybe_checkpoint()
        return outcome

    def make_visible(self, offsets: Sequence[int], now_ms: int,
                     payloads: Mapping[int, bytes] | None = None,
                     dropped: list[Held] | None = None) -> list[tuple[str, int, list[Held]]]:
        """Make the held records at ``offsets`` visible (those still held; in that order
        within a subject): a visible-message record each (the payload from ``payloads`` by
        offset, else read back from the held record and added to ``payloads``), durably, then their consumer-log
        entries, in one call. A held record that no longer reads (rot) is given up in a
        cancelled record of the same write and appended to ``dropped``. Returns (subject,
        first sequence, the records) per subject."""
        self._check_writable()
        if self._batch.bodies:
            raise ValueError("make_visible between append and commit")
        check_int("now_ms", now_ms, 0, TIMESTAMP_MS_MAX)
        due = [h for h in map(self._held.by_offset.get, offsets) if h is not None]
        known = {} if payloads is None else payloads  # the caller's: those read back join it
        unreadable: list[Held] = []
        for h in due:
            if h.offset not in known:
                try:
                    body = self._message_log.log.read(h.offset)
                    known[h.offset] = bytes(body[decode_held(body)[1]:])
                except (CorruptRecord, ValueError) as exc:
                    log.error("message store: held record at %d of %r no longer reads (%s); "
                              "given up", h.offset, h.subject, exc)
                    unreadable.append(h)
        if unreadable:
            lost = {h.offset for h in unreadable}
            due = [h for h in due if h.offset not in lost]
        if not due and not unreadable:
            return []
        bodies, runs = visible_bodies(now_ms, due, known, self._consumer_log)
        if unreadable:
            bodies.append(cancelled_body(now_ms, [h.offset for h in unreadable]))
        at = self._write_durably(bodies)
        try:
            index = 0
            for subject, _first, items in runs:
                stop = index + len(items)
                self._consumer_logs[subject].append_encoded(encode_entries(
                    [now_ms] * len(items), at[index:stop],
                    [len(body) for body in bodies[index:stop]], [h.tag_bloom for h in items]))
                index = stop
        except (StoreFailed, LogStoreError) as exc:
            # Durable but not indexed: the store refuses writes until reopened, and recovery
            # indexes the visible-message records then (as for a slave's copy).
            self._failed = exc if isinstance(exc, StoreFailed) else StoreFailed(
                self._consumer_root, exc)
            raise self._failed from exc
        self._held.pop_many([h.offset for h in due])
        self._held.pop_many([h.offset for h in unreadable])
        keys: list[str] = []
        sequences: list[int] = []
        for subject, first, items in runs:
            keys += self._dedup.keys(subject, [h.message_id for h in items])
            sequences += range(first, first + len(items))
        self._dedup.settle_many(keys, sequences, [now_ms] * len(keys))
        if dropped is not None:
            dropped += unreadable
        self._maybe_checkpoint()
        return runs

    def cancel_held(self, subject: str, message_ids: Sequence[str], now_ms: int) -> list[bool]:
        """Drop held messages of ``subject`` by id with a dropped record (naming their ids),
        durably; their ids stay in the dedup index as dropped (``dropped_before``). Returns
        for each id whether it was held (False: never held here, made visible or dropped)."""
        self._check_writable()
        if self._batch.bodies:
            raise ValueError("cancel_held between append and commit")
        check_int("now_ms", now_ms, 0, TIMESTAMP_MS_MAX)
        found = [self._held.find(subject, message_id) for message_id in message_ids]
        dropped = list({h.offset: h for h in found if h is not None}.values())
        if dropped:
            self._write_durably([dropped_body(now_ms, subject, dropped)])
            self._held.pop_many([h.offset for h in dropped])
            self._dedup.add_many(self._dedup.keys(subject, [h.message_id for h in dropped]),
                                 [DROPPED_SEQUENCE] * len(dropped), [now_ms] * len(dropped))
            self._maybe_checkpoint()
        return [h is not None for h in found]

    def dropped_before(self, subject: str, message_ids: Sequence[str], now_ms: int
                       ) -> list[bool]:
        """For each id, whether a ``cancel_held`` dropped it (the dedup index remembers it as
        dropped: within ``dedup_window_ms`` of ``now_ms`` and ``dedup_ids_max`` ids)."""
        self._check_open()
        found = self._dedup.lookup_many(self._dedup.keys(subject, message_ids), now_ms)
        if found is None:
            return [False] * len(message_ids)
        return [sequence == DROPPED_SEQUENCE for sequence in found]

    def held_offsets(self, subject: str, message_ids: Sequence[str]) -> list[int | None]:
        """The held record's offset of each id of ``subject``, None for an id not held."""
        self._check_open()
        found = map(self._held.find, repeat(subject), message_ids)
        return [None if held is None else held.offset for held in found]

    def held(self) -> list[Held]:
        """Every held record neither made visible nor cancelled, in message-log order."""
        self._check_open()
        return sorted(self._held.by_offset.values())

    def _consumer_log(self, subject: str) -> ConsumerLog:
        clog = self._consumer_logs.get(subject)
        if clog is None:
            clog = self._consumer_logs[subject] = self._open_consumer_log(subject)
        return clog

    def _write_durably(self, bodies: list[bytes]) -> list[int]:
        """Append record bodies and make them durable per the flush mode; sticky on failure."""
        try:
            offsets = self._message_log.append_durably(bodies)
        except LogWriteFailed as exc:
            self._failed = exc
            raise
        return offsets


def _fields_fit(subjects: Sequence[str], message_ids: Sequence[str],
                tag_hashes: Sequence[Sequence[int]], payloads: Sequence[bytes],
                record_size_bytes_max: int) -> bool:
    """True when every message of a hand-off batch passes ``check_message``, found column by
    column for the usual batch (one subject, str ids, tuples of int tag hashes, bytes
    payloads); False when it might not: the caller then checks message by message."""
    if len(set(subjects)) != 1 or set(map(type, message_ids)) != {str} \
            or set(map(type, payloads)) != {bytes}:
        return False
    try:
        subject_size = len(check_subject(subjects[0]).encode("utf-8"))
        id_sizes = list(map(len, map(str.encode, message_ids)))
    except (ValueError, UnicodeEncodeError):
        return False
    if min(id_sizes) < 1 or max(id_sizes) > MESSAGE_ID_BYTES_MAX or record_size_bytes(
            subject_size, max(id_sizes), max(map(len, payloads))) > record_size_bytes_max:
        return False
    if not any(tag_hashes):
        return True
    if set(map(type, tag_hashes)) != {tuple}:
        return False
    return all(len(hashes) <= TAG_HASHES_MAX
               and all(type(h) is int and 0 <= h <= TAG_HASH_MAX for h in hashes)
               for hashes in set(tag_hashes))


__all__ = ["HeldWrites"]
