"""``WriteBatch``: the appends a ``MessageStore`` buffers until its next ``commit``.

The broker appends a few hundred messages at a time, so a batch is kept column by column (ids,
sequences, record bodies ...) rather than as an object per message, and a run of messages of one
subject is checked, de-duplicated, numbered and encoded by ``map``/``list`` calls that do their
per-message work in C. A message that is not plain (a duplicate, an id seen before, tags) takes a
per-message path with the same outcome. Synchronous and single-owner, like the store; it writes
nothing: ``MessageStore.commit`` writes what it holds.
"""

from __future__ import annotations

from itertools import groupby, repeat
from typing import Callable, Container, Sequence

from realtime.storage.config import (
    MESSAGE_ID_BYTES_MAX,
    SUBJECT_BYTES_MAX,
    TAG_HASH_MAX,
    TAG_HASHES_MAX,
    TIMESTAMP_MS_MAX,
)
from realtime.storage.dedup import DedupIndex
from realtime.storage.held import HELD_SEQUENCE
from logstore.twins import c_twin
from realtime.storage.message_record import encode_subject_records, record_size_bytes, tag_bloom

# The C twin of check_run (realtime/storage/_codecs.c); optional, chosen by logstore.twins.
_check_run_c = c_twin("realtime.storage._codecs", "check_run")


def check_subject(subject: object) -> str:
    """``subject`` if it is a str of 1..SUBJECT_BYTES_MAX UTF-8 bytes, else ValueError."""
    if not isinstance(subject, str):
        raise ValueError(f"subject {subject!r} must be a str, not {type(subject).__name__}")
    try:
        size = len(subject.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise ValueError(f"subject {subject!r} is not encodable as UTF-8: {exc}") from exc
    if not 1 <= size <= SUBJECT_BYTES_MAX:
        raise ValueError(f"subject of {size} bytes is outside [1, {SUBJECT_BYTES_MAX}] bytes")
    return subject


def check_int(name: str, value: object, low: int, high: int) -> int:
    """``value`` if it is an int (not a bool) in [low, high], else ValueError naming it."""
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{name} {value!r} must be an int in [{low}, {high}]")
    return value


def check_message(subject: str, message_id: object, tag_hashes: Sequence[int], payload: object,
                  record_size_bytes_max: int) -> None:
    """Raise ValueError naming the value when one message's fields cannot be stored."""
    check_subject(subject)
    if not isinstance(message_id, str):
        raise ValueError(f"message_id {message_id!r} must be a str")
    try:
        id_size = len(message_id.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise ValueError(f"message_id {message_id!r} is not encodable as UTF-8") from exc
    if not 1 <= id_size <= MESSAGE_ID_BYTES_MAX:
        raise ValueError(
            f"message_id of {id_size} bytes is outside [1, {MESSAGE_ID_BYTES_MAX}] bytes")
    if len(tag_hashes) > TAG_HASHES_MAX:
        raise ValueError(f"{len(tag_hashes)} tag hashes exceed TAG_HASHES_MAX {TAG_HASHES_MAX}")
    for h in tag_hashes:
        check_int("tag hash", h, 0, TAG_HASH_MAX)
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise ValueError(f"payload must be bytes, not {type(payload).__name__}")
    size = record_size_bytes(len(subject.encode("utf-8")), id_size, len(payload))
    if size > record_size_bytes_max:
        raise ValueError(f"message record of {size} bytes exceeds record_size_bytes_max "
                         f"{record_size_bytes_max}")


def check_run(message_ids: Sequence[str], payloads: Sequence[bytes], id_bytes_max: int,
              ) -> tuple[list[bytes], int, int] | None:
    """One subject's run of ids and payloads, checked: (the ids as UTF-8, the longest id's
    bytes, the longest payload's bytes); None, naming nothing, when the run needs the slow
    path that names the message at fault (an id not a str, not UTF-8-encodable or outside
    [1, id_bytes_max] bytes, a payload not exactly bytes, no message, columns of different
    lengths). Lists take the C twin (``_codecs.check_run``): one call per run."""
    if _check_run_c is not None and type(message_ids) is list and type(payloads) is list:
        return _check_run_c(message_ids, payloads, id_bytes_max)
    if not message_ids or len(payloads) != len(message_ids):
        return None
    try:
        # str.encode (UTF-8, strict) raises TypeError for what is not a str and
        # UnicodeEncodeError for a lone surrogate.
        ids_utf8 = list(map(str.encode, message_ids))
    except (TypeError, UnicodeEncodeError):
        return None
    id_sizes = list(map(len, ids_utf8))
    if min(id_sizes) < 1 or max(id_sizes) > id_bytes_max:
        return None
    if set(map(type, payloads)) != {bytes}:
        return None  # a bytearray or memoryview is copied by the slow path
    return ids_utf8, max(id_sizes), max(map(len, payloads))


class WriteBatch:
    """Everything appended since the last commit, in append order, as columns.

    For every append: ``appended`` (runs of (subject, message ids)), ``sequences`` (the
    provisional sequence; for a duplicate the original's, None while that original is itself
    uncommitted) and ``duplicates``. For the fresh (not duplicate) ones, what the commit writes:
    ``fresh_keys`` (``DedupIndex.keys``), ``fresh_sequences``, ``fresh_timestamps_ms``,
    ``fresh_blooms``, ``bodies`` (encoded message records) and ``runs``: subject -> [start, stop)
    slices of the fresh columns, in order.
    """

    def __init__(self, record_size_bytes_max: int) -> None:
        self.record_size_bytes_max = record_size_bytes_max
        self.appended: list[tuple[str, Sequence[str]]] = []
        self.sequences: list[int | None] = []
        self.duplicates: list[bool] = []
        self.duplicate_count = 0
        self.fresh_keys: list[str] = []
        self.fresh_sequences: list[int] = []
        self.fresh_timestamps_ms: list[int] = []
        self.fresh_blooms: list[int] = []
        self.bodies: list[bytes] = []
        self.runs: dict[str, list[tuple[int, int]]] = {}
        self._fresh_ids: set[str] = set()
        self._fresh_counts: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self.sequences)

    def add(self, subjects: Sequence[str], message_ids: Sequence[str],
            tag_hashes: Sequence[Sequence[int]], timestamp_ms: int, payloads: Sequence[bytes],
            dedup: DedupIndex, end_sequence: Callable[[str], int],
            held: Container[tuple[str, str]] | None = None) -> None:
        """Check, de-duplicate (against ``dedup``, the (subject, id) keys of ``held`` messages
        and this batch), number (after the subject's ``end_sequence``) and encode messages
        given column by column. All or nothing: on a ValueError nothing of them is added."""
        count = len(subjects)
        if not count == len(message_ids) == len(tag_hashes) == len(payloads):
            raise ValueError(f"columns of {count} subjects, {len(message_ids)} ids, "
                             f"{len(tag_hashes)} tag-hash lists and {len(payloads)} payloads "
                             f"differ in length")
        if type(timestamp_ms) is not int or not 0 <= timestamp_ms <= TIMESTAMP_MS_MAX:
            check_int("timestamp_ms", timestamp_ms, 0, TIMESTAMP_MS_MAX)  # names what is wrong
        if count and subjects.count(subjects[0]) == count:
            # The broker's usual commit: one subject, one run, the columns as they came.
            ids, ids_utf8, blooms, run_payloads = self._check_run(subjects[0], message_ids,
                                                                  tag_hashes, payloads)
            self._add_run(subjects[0], ids, ids_utf8, blooms, run_payloads, timestamp_ms,
                          dedup, end_sequence, held)
            return
        runs = [(subject, len(list(group))) for subject, group in groupby(subjects)]
        # Check every run before adding any, so a ValueError leaves the batch as it was.
        checked = []
        start = 0
        for subject, run_count in runs:
            stop = start + run_count
            checked.append(self._check_run(subject, message_ids[start:stop],
                                           tag_hashes[start:stop], payloads[start:stop]))
            start = stop
        for (subject, _), (ids, ids_utf8, blooms, run_payloads) in zip(runs, checked):
            self._add_run(subject, ids, ids_utf8, blooms, run_payloads, timestamp_ms, dedup,
                          end_sequence, held)

    def _check_run(self, subject: str, message_ids: Sequence[str],
                   tag_hashes: Sequence[Sequence[int]], payloads: Sequence[bytes],
                   ) -> tuple[Sequence[str], list[bytes], list[int], Sequence[bytes]]:
        """The run's ids as UTF-8 and its tag blooms; ValueError (from ``check_message``, so
        worded the same as for one append) when any message cannot be stored."""
        try:
            # str.encode (UTF-8, strict) raises TypeError for what is not a str and
            # UnicodeEncodeError for a lone surrogate: both go to the slow path, which names it.
            subject_size = len(str.encode(subject))
            if not 1 <= subject_size <= SUBJECT_BYTES_MAX:
                raise ValueError
            checked = check_run(message_ids, payloads, MESSAGE_ID_BYTES_MAX)
            if checked is None:
                raise ValueError
            ids_utf8, id_longest, payload_longest = checked
            if record_size_bytes(subject_size, id_longest,
                                 payload_longest) > self.record_size_bytes_max:
                raise ValueError
            if any(tag_hashes):
                if set(map(type, tag_hashes)) == {tuple}:
                    # A batch's messages share a few tag sets: one bloom per distinct set.
                    bloom_of = {hashes: self._bloom(hashes) for hashes in set(tag_hashes)}
                    blooms = list(map(bloom_of.__getitem__, tag_hashes))
                else:
                    blooms = [self._bloom(hashes) for hashes in tag_hashes]
            else:
                blooms = [0] * len(payloads)
            return message_ids, ids_utf8, blooms, payloads
        except (ValueError, TypeError, UnicodeEncodeError):
            # Find and name the message at fault the way a single append does.
            for message_id, hashes, payload in zip(message_ids, tag_hashes, payloads):
                check_message(subject, message_id, hashes, payload, self.record_size_bytes_max)
            copies = [bytes(payload) for payload in payloads]
            return (message_ids, [m.encode("utf-8") for m in message_ids],
                    [tag_bloom(hashes) for hashes in tag_hashes], copies)

    @staticmethod
    def _bloom(hashes: Sequence[int]) -> int:
        if not hashes:
            return 0
        if len(hashes) > TAG_HASHES_MAX:
            raise ValueError
        for h in hashes:
            if type(h) is not int or not 0 <= h <= TAG_HASH_MAX:
                raise ValueError
        return tag_bloom(hashes)

    def _add_run(self, subject: str, message_ids: Sequence[str], ids_utf8: list[bytes],
                 blooms: list[int], payloads: Sequence[bytes], timestamp_ms: int,
                 dedup: DedupIndex, end_sequence: Callable[[str], int],
                 held: Container[tuple[str, str]] | None) -> None:
        count = len(message_ids)
        self.appended.append((subject, message_ids))
        keys = dedup.keys(subject, message_ids)
        found = dedup.lookup_many(keys, timestamp_ms)
        if held:
            # A held id is a duplicate even once the dedup index forgot it (dedup_ids_max,
            # or a hold older than the window): it will be made visible at its due time.
            hits = list(map(held.__contains__, zip(repeat(subject), message_ids)))
            if any(hits):
                found = [HELD_SEQUENCE if hit else (found[i] if found is not None else None)
                         for i, hit in enumerate(hits)]
        first = end_sequence(subject) + self._fresh_counts.get(subject, 0)
        fresh_ids = self._fresh_ids
        all_new = False  # the usual case: no id seen before, in the index or in this batch
        if found is None and fresh_ids.isdisjoint(keys):
            size = len(fresh_ids)
            fresh_ids.update(keys)
            all_new = len(fresh_ids) == size + count
            if not all_new:
                # An id twice in this run: none of its keys was there before, so this undoes it.
                fresh_ids.difference_update(keys)
        if all_new:
            sequences: list[int] = list(range(first, first + count))
            self.sequences.extend(sequences)
            self.duplicates.extend(repeat(False, count))
        else:
            fresh = []
            sequences = []
            for index, key in enumerate(keys):
                original = found[index] if found is not None else None
                if key in fresh_ids or original is not None:
                    self.sequences.append(None if key in fresh_ids else original)
                    self.duplicates.append(True)
                    self.duplicate_count += 1
                    continue
                fresh_ids.add(key)
                fresh.append(index)
                sequences.append(first + len(sequences))
                self.sequences.append(sequences[-1])
                self.duplicates.append(False)
            keys = [keys[i] for i in fresh]
            ids_utf8 = [ids_utf8[i] for i in fresh]
            blooms = [blooms[i] for i in fresh]
            payloads = [payloads[i] for i in fresh]
        fresh_count = len(sequences)  # one record body each
        if not fresh_count:
            return
        self._fresh_counts[subject] = self._fresh_counts.get(subject, 0) + fresh_count
        bodies = encode_subject_records(timestamp_ms, subject, sequences, blooms, ids_utf8,
                                        payloads)
        start = len(self.bodies)
        self.runs.setdefault(subject, []).append((start, start + fresh_count))
        self.bodies.extend(bodies)
        self.fresh_keys.extend(keys)
        self.fresh_sequences.extend(sequences)
        self.fresh_timestamps_ms.extend(repeat(timestamp_ms, fresh_count))
        self.fresh_blooms.extend(blooms)


__all__ = ["WriteBatch", "check_int", "check_run", "check_message", "check_subject"]
