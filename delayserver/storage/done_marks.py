"""Dispatch and cancel marks of a delay store: a confirmed dispatch or a cancel written durably
(fsynced before the call returns) to the bucket's done file and the done journal, and the
search for a message by id and due time that a cancel needs. A mixin of ``DelayStore``
(``delayserver.storage.store``), which owns every field used here; same owner thread (the
delay-io thread), no clock reads."""

from __future__ import annotations

import struct
import zlib
from collections import Counter, defaultdict
from typing import Sequence

from delayserver.storage.bucket_reads import ScheduleEntry
from delayserver.storage.copying import journal_bodies_for_dispatch
from delayserver.storage.delay_record import U64_MAX, decode_delay_header
from delayserver.storage.done_journal import KIND_DROPPED, encode_journal_record
from delayserver.storage.done_log import DoneState, done_key
from delayserver.storage.done_record import KIND_CANCELLED, KIND_DISPATCHED, DoneRecord
from delayserver.storage.errors import StoreFailed
from delayserver.storage.schedule_entry import (
    ENTRY_SIZE_BYTES,
    FIELDS as ENTRY_FIELDS,
    RawEntry,
    check_schedule_entry,
)

_DELIVER_AT = struct.Struct(">Q")  # a schedule entry's first field, searched for by cancel


class DoneMarksMixin:
    """The dispatch and cancel side of ``DelayStore`` (module docstring)."""

    def _write_done(self, bucket_ms: int, kind: int, records: list[DoneRecord]) -> None:
        try:
            self._done.write(bucket_ms, kind, records)
        except StoreFailed as exc:
            raise self._fail(exc)

    def _check_entry(self, entry: ScheduleEntry) -> None:
        count = self._schedule.count(entry.bucket_ms)
        if not 0 <= entry.index < count:
            raise ValueError(f"entry {entry.index} of bucket {entry.bucket_ms} is not in the "
                             f"schedule (the bucket has {count} entries)")

    def record_dispatched(self, entries: Sequence[ScheduleEntry],
                          subjects: Sequence[str | None] | None = None) -> None:
        """Record confirmed dispatches durably (fsynced before this returns); ``load_bucket``
        never returns them again, before or after a restart. Entries already dispatched or
        cancelled are skipped. ``subjects`` (one per entry, from ``read_payloads``) saves
        looking each one up for the pending counts. Work is per bucket, not per entry: one
        write of all its records and one update of the counts."""
        self._check_writable()
        by_bucket: dict[int, list[int]] = defaultdict(list)  # bucket -> positions in entries
        for position, entry in enumerate(entries):
            by_bucket[entry.bucket_ms].append(position)
        for bucket, positions in by_bucket.items():  # every entry checked before any write
            count = self._schedule.count(bucket)
            for position in positions:
                if not 0 <= entries[position].index < count:
                    raise ValueError(f"entry {entries[position].index} of bucket {bucket} is "
                                     f"not in the schedule (the bucket has {count} entries)")
        journal: list[bytes] = []
        for bucket, positions in by_bucket.items():
            state = self._done.state(bucket)
            chosen_at = positions
            keys = [(entries[p].delay_log_offset << 32) | entries[p].id_hash  # done_key
                    for p in positions]
            if (len(set(keys)) != len(keys) or not state.dispatched.isdisjoint(keys)
                    or not state.cancelled.isdisjoint(keys)):
                # Some are done already or given twice (rare): keep the first of each.
                fresh: dict[int, int] = {}  # done key -> position
                for key, position in zip(keys, positions):
                    if not state.is_done(key) and key not in fresh:
                        fresh[key] = position
                chosen_at = list(fresh.values())
            if not chosen_at:
                continue
            chosen = [entries[position] for position in chosen_at]
            try:
                self._done.write_entries(bucket, KIND_DISPATCHED,
                                         [e.delay_log_offset for e in chosen],
                                         [e.id_hash for e in chosen], [e.index for e in chosen])
            except StoreFailed as exc:
                raise self._fail(exc)
            if subjects is None:
                per_subject = Counter(self._subject_of(e) for e in chosen)
            else:
                per_subject = Counter([subjects[position] for position in chosen_at])
            self._counts.remove_many(bucket, per_subject)
            self._lower_bucket_pending(bucket, len(chosen))
            self._done_since_checkpoint += len(chosen)
            journal.append(journal_bodies_for_dispatch(
                bucket, [e.delay_log_offset for e in chosen], [e.id_hash for e in chosen],
                [e.index for e in chosen], per_subject))
        self.journal_done(journal)
        self._maybe_checkpoint()

    def _lower_bucket_pending(self, bucket_ms: int, done: int) -> None:
        left = self._bucket_pending.get(bucket_ms)
        if left is not None:
            self._bucket_pending[bucket_ms] = max(0, left - done)

    def bucket_pending(self, bucket_ms: int) -> int | None:
        """The bucket's pending count when it is known without reading (loaded since open),
        else None."""
        return self._bucket_pending.get(bucket_ms)

    def _candidates(self, bucket_ms: int, deliver_at_ms: int,
                    hashed: int) -> list[tuple[int, RawEntry]]:
        """Entries of the bucket with this due time and id hash. The file is searched for the
        8 due-time bytes at C speed (a cancel into a 100,000-entry bucket must not decode every
        entry); when that finds nothing, or the file does not match the index, every entry is
        verified (and the bucket repaired if needed)."""
        data = self._schedule.read_file(bucket_ms)
        if len(data) == self._schedule.disk_count(bucket_ms) * ENTRY_SIZE_BYTES:
            data += self._schedule.buffered(bucket_ms)
            pattern = _DELIVER_AT.pack(deliver_at_ms)
            found = []
            at = data.find(pattern)
            while at >= 0:
                if at % ENTRY_SIZE_BYTES == 0:
                    entry = data[at : at + ENTRY_SIZE_BYTES]
                    if check_schedule_entry(entry) is not None:
                        break  # a bad entry: take the verifying path below
                    raw = RawEntry(*ENTRY_FIELDS.unpack_from(entry, 0)[:4])
                    if raw.id_hash == hashed:
                        found.append((at // ENTRY_SIZE_BYTES, raw))
                at = data.find(pattern, at + 1)
            else:
                if found:
                    return found
        # Nothing found (or a bad entry): verify the whole bucket, so an entry whose due-time
        # bytes rotted is repaired and found rather than answered "unknown".
        return [(index, raw) for index, raw in self._bucket_entries(bucket_ms)
                if raw.deliver_at_ms == deliver_at_ms and raw.id_hash == hashed]

    def _find(self, bucket_ms: int, deliver_at_ms: int, hashed: int,
              id_bytes: bytes) -> list[tuple[int, RawEntry, str]]:
        """Entries of the bucket for this message: (index, entry, subject), confirmed by reading
        the record."""
        if bucket_ms not in self._schedule.index:
            return []
        found = []
        for index, raw in self._candidates(bucket_ms, deliver_at_ms, hashed):
            _at, _bucket, stored_id, subject, _ = decode_delay_header(
                self._log.read(raw.delay_log_offset))
            if stored_id == id_bytes:
                found.append((index, raw, subject))
        return found

    def cancel(self, message_id: str, deliver_at_ms: int) -> str:
        """Cancel a message by id and due time; durable before it returns. Returns "cancelled",
        "already_dispatched", "already_cancelled", "already_past" (its due time's bucket is below
        the done watermark, finished and retired: too late, whatever happened to it) or
        "unknown" (never stored, or not committed yet)."""
        return self.cancel_detail(message_id, deliver_at_ms)[0]

    def subject_and_state(self, message_id: str, deliver_at_ms: int
                          ) -> tuple[str | None, str | None]:
        """(subject, state) of the stored message with this id and due time; state
        "pending" (some entry neither dispatched nor cancelled), "done" or None (not found);
        changes nothing."""
        subject, state, _handed = self.handed_state(message_id, deliver_at_ms)
        return subject, state

    def handed_state(self, message_id: str, deliver_at_ms: int
                     ) -> tuple[str | None, str | None, bool]:
        """``subject_and_state`` and whether a handed-entries record (done journal kind 6,
        ``record_handed_entries``) names one of its entries; changes nothing."""
        self._check_open()
        hashed = zlib.crc32(message_id.encode("utf-8"))
        natural = self.bucket_of(deliver_at_ms)
        for bucket in dict.fromkeys((natural, max(natural, self._done_before))):
            found = self._find(bucket, deliver_at_ms, hashed, message_id.encode("utf-8"))
            if found:
                state = self._done.state(bucket)
                keys = [done_key(raw.delay_log_offset, hashed) for _i, raw, _s in found]
                pending = any(not state.is_done(key) for key in keys)
                handed = any(key in self._journal.handed for key in keys)
                return found[0][2], "pending" if pending else "done", handed
        return None, None, False

    def _locate(self, message_id: str, deliver_at_ms: int, offset_end: int | None = None
                ) -> tuple[int, int, list[tuple[int, RawEntry, str]]]:
        """(id hash, bucket, entries) of the stored message with this id and due time: its
        due time's bucket, or the watermark's when it was filed late; no entries: not found.
        ``offset_end``: only entries stored below this delay-log offset count."""
        if not isinstance(deliver_at_ms, int) or not 0 <= deliver_at_ms <= U64_MAX:
            raise ValueError(f"deliver_at_ms {deliver_at_ms!r} is outside [0, {U64_MAX}]")
        id_bytes = message_id.encode("utf-8")
        hashed = zlib.crc32(id_bytes)
        natural = self.bucket_of(deliver_at_ms)
        candidates = [natural] if natural >= self._done_before else [self._done_before, natural]
        found: list[tuple[int, RawEntry, str]] = []
        bucket = natural
        for bucket in candidates:
            found = self._find(bucket, deliver_at_ms, hashed, id_bytes)
            if offset_end is not None:
                found = [item for item in found if item[1].delay_log_offset < offset_end]
            if found:
                break
        return hashed, bucket, found

    def cancel_detail(self, message_id: str, deliver_at_ms: int, offset_end: int | None = None
                      ) -> tuple[str, str | None]:
        """``cancel``, also returning the message's subject when it was found (for tracing).
        A handed message its broker dropped (``record_dropped``) is "already_cancelled".
        ``offset_end``: entries stored at or past this delay-log offset are left alone, as if
        not stored yet (the server's sends whose commit was not answered when the cancel
        began: see ``CancelsMixin._cancel_unloading``)."""
        self._check_writable()
        hashed, bucket, found = self._locate(message_id, deliver_at_ms, offset_end)
        if not found:
            if self.bucket_of(deliver_at_ms) < self._done_before:
                # Its due time's bucket is finished and retired: a message stored there was
                # dispatched (or cancelled before); either way it is too late to cancel.
                return "already_past", None
            return "unknown", None
        state: DoneState = self._done.state(bucket)
        open_ = [(i, raw, s) for i, raw, s in found
                 if not state.is_done(done_key(raw.delay_log_offset, hashed))]
        if not open_:
            keys = [done_key(raw.delay_log_offset, hashed) for _i, raw, _s in found]
            if any(k in state.dispatched and k not in state.cancelled for k in keys):
                return "already_dispatched", found[0][2]
            return "already_cancelled", found[0][2]
        epoch = self._done.epoch
        self._write_done(bucket, KIND_CANCELLED, [
            DoneRecord(raw.delay_log_offset, hashed, index, epoch, KIND_CANCELLED)
            for index, raw, _s in open_
        ])
        for _index, raw, subject in open_:
            self._subjects.pop(raw.delay_log_offset, None)
            self._counts.remove(bucket, subject)
        self._lower_bucket_pending(bucket, len(open_))
        self._done_since_checkpoint += len(open_)
        self.journal_done([encode_journal_record(
            KIND_CANCELLED, bucket, [raw.delay_log_offset for _i, raw, _s in open_],
            [hashed] * len(open_), [index for index, _raw, _s in open_],
            dict(Counter(subject for _i, _raw, subject in open_)))])
        self._maybe_checkpoint()
        return "cancelled", open_[0][2]

    def record_dropped(self, message_id: str, deliver_at_ms: int) -> str:
        """A broker dropped this handed message at a cancel: its entries recorded as
        dispatched get a cancel record too (bucket file and a dropped journal record, kind 5;
        fsynced before this returns; the pending counts do not change), so a later cancel
        answers "already_cancelled" after a restart or failover as well. Returns "dropped"
        (marked now), "already_cancelled" (marked before), "open" (not recorded as
        dispatched yet: in flight; the caller marks it once it is) or "unknown"."""
        self._check_writable()
        hashed, bucket, found = self._locate(message_id, deliver_at_ms)
        if not found:
            return "unknown"
        state: DoneState = self._done.state(bucket)
        marked = [(index, raw) for index, raw, _s in found
                  if done_key(raw.delay_log_offset, hashed) in state.dispatched
                  and done_key(raw.delay_log_offset, hashed) not in state.cancelled]
        if not marked:
            if all(state.is_done(done_key(raw.delay_log_offset, hashed))
                   for _i, raw, _s in found):
                return "already_cancelled"
            return "open"
        epoch = self._done.epoch
        self._write_done(bucket, KIND_CANCELLED, [
            DoneRecord(raw.delay_log_offset, hashed, index, epoch, KIND_CANCELLED)
            for index, raw in marked])
        self.journal_done([encode_journal_record(
            KIND_DROPPED, bucket, [raw.delay_log_offset for _i, raw in marked],
            [hashed] * len(marked), [index for index, _raw in marked], {})])
        return "dropped"
