"""The broker's usual commit: ``write_run`` encodes, writes and fsyncs it in one call, and
``UsualCommit`` (the part of ``MessageStore`` that is ``append_commit``, apart from ``store.py``
for its size) does the bookkeeping around it.

The usual group commit is one subject, every message new, no tags. For it the store needs, from
the run of ids and payloads, the message records framed as logstore records back to back (one
buffer the message log writes as it is) and the consumer-log entries of those records (written
right after the fsync). ``encode_run`` makes both at once, and checks the run as ``WriteBatch``
does, answering None (naming nothing) when the general path must take the run: that path words
what is wrong. ``write_run`` is ``encode_run`` and the durable write of both in the same call
(the records at the message log's end, fsync, the entries at the consumer log's end:
``logstore._framing.write_sync``'s write, logstore/_framing.h), through the descriptors
``SegmentedLog.framed_target`` names; ``SegmentedLog.framed_written`` then does what
``append_framed_durably`` does after its write, with the same failures. Files that are not real
(a test's ``FaultyFile``) take ``encode_run`` and ``append_framed_durably``.

The C twins (``realtime.storage._codecs.encode_run``, ``write_run``) write every record
straight into the one framed buffer: no bytes object per record, no second copy to frame them.
The Python twin of ``encode_run`` is the composition of the twins the general path runs:
``check_run``, ``encode_subject_records``, ``frame_records`` and ``encode_entries``; that of
``write_run`` is it and ``logstore.fileio.write_sync_python``.
tests/unit/test_realtime_storage_commit_run.py and test_realtime_storage_write_run.py hold the
twins to the same answers and the one call to the general path's bytes and failures.
"""

from __future__ import annotations

from itertools import accumulate, repeat
from operator import add
from typing import TYPE_CHECKING, Sequence

from logstore import FileHandle, LogWriteFailed
from logstore.fileio import write_sync_python
from logstore.record import HEADER_SIZE_BYTES, frame_records
from logstore.twins import c_twin
from realtime.storage.config import MESSAGE_ID_BYTES_MAX, U64_MAX, StoreConfig
from realtime.storage.consumer_log import encode_entries
from realtime.storage.message_record import encode_subject_records, record_size_bytes
from realtime.storage.write_batch import WriteBatch, check_run

if TYPE_CHECKING:
    from realtime.storage.consumer_log import ConsumerLog
    from realtime.storage.dedup import DedupIndex
    from realtime.storage.message_log import MessageLog

U16_MAX = 0xFFFF


def encode_run_python(timestamp_ms: int, subject: str, first_sequence: int,
                      message_ids: Sequence[str], payloads: Sequence[bytes], log_offset: int,
                      room_bytes: int, id_bytes_max: int, record_bytes_max: int,
                      ) -> tuple[bytes, bytes] | None:
    """(the framed records, their consumer-log entries) of one subject's run of new messages
    with no tags, numbered from ``first_sequence`` and written at message-log offset
    ``log_offset``; None when the general path must take the run: what ``check_run`` refuses,
    a timestamp not an int in [0, 2**64), a record of the run's longest id and longest payload
    over ``record_bytes_max`` (``WriteBatch``'s bound), or framed bytes over ``room_bytes``."""
    if (type(message_ids) is not list or type(payloads) is not list
            or type(timestamp_ms) is not int or not 0 <= timestamp_ms <= U64_MAX
            or first_sequence < 0 or log_offset < 0):
        return None
    checked = check_run(message_ids, payloads, id_bytes_max)
    if checked is None:
        return None
    ids_utf8, id_longest, payload_longest = checked
    try:
        subject_utf8 = subject.encode("utf-8")
    except UnicodeEncodeError:
        return None
    if len(subject_utf8) > U16_MAX or record_size_bytes(
            len(subject_utf8), id_longest, payload_longest) > record_bytes_max:
        return None
    count = len(ids_utf8)
    blooms = [0] * count
    bodies = encode_subject_records(timestamp_ms, subject,
                                    list(range(first_sequence, first_sequence + count)),
                                    blooms, ids_utf8, payloads)
    sizes = list(map(len, bodies))
    if sum(sizes) + HEADER_SIZE_BYTES * count > room_bytes:
        return None
    offsets = list(accumulate(map(add, sizes, repeat(HEADER_SIZE_BYTES)), initial=log_offset))
    offsets.pop()
    return frame_records(bodies), encode_entries([timestamp_ms] * count, offsets, sizes, blooms)


class UsualCommit:
    """``MessageStore.append_commit``, apart from ``store.py`` for its size: ``MessageStore``
    inherits it; it uses the store's consumer logs, message log and dedup index, on its owner
    thread."""

    # MessageStore's, set by its constructor:
    config: StoreConfig
    _batch: WriteBatch
    _closed: bool
    _failed: Exception | None
    _held_keys: object
    _checkpoint_offset: int
    _dedup: DedupIndex
    _message_log: MessageLog
    _consumer_logs: dict[str, ConsumerLog]

    def append_many(self, subjects: Sequence[str], message_ids: Sequence[str],
                    tag_hashes: Sequence[Sequence[int]], timestamp_ms: int,
                    payloads: Sequence[bytes]) -> None: ...  # MessageStore's
    def commit_sequences(self) -> list[int | None]: ...  # type: ignore[empty-body]
    def _indexed(self, clog: ConsumerLog | None, count: int, index_error: OSError | None,
                 start_offset: int, unindexed: object, keys: list[str], sequences: list[int],
                 timestamps_ms: list[int]) -> None: ...  # MessageStore's
    def _write_checkpoint(self) -> bool: ...  # type: ignore[empty-body]  # MessageStore's

    def append_commit(self, subjects: Sequence[str], message_ids: Sequence[str],
                      tag_hashes: Sequence[Sequence[int]], timestamp_ms: int,
                      payloads: Sequence[bytes]) -> list[int | None]:
        """``append_many`` then ``commit_sequences`` (the broker's path), in one call.

        The usual commit (nothing else appended, one subject with a consumer log, no tags, no
        held message, every id new, sync flush) takes one call that encodes its records and
        entries and writes both with the fsync between (``commit_run.write_run``); anything
        else, or a run the encoder refuses, takes the general path, which words what is wrong.
        The same bytes on disk, the same outcomes and errors either way."""
        count = len(subjects)
        if (count and self._failed is None and not self._batch.sequences and not self._closed
                and not self._held_keys and not any(tag_hashes) and len(tag_hashes) == count
                and subjects.count(subjects[0]) == count):
            sequences = self._commit_run(subjects[0], message_ids, timestamp_ms, payloads,
                                         count)
            if sequences is not None:
                return sequences
        self.append_many(subjects, message_ids, tag_hashes, timestamp_ms, payloads)
        return self.commit_sequences()

    def _commit_run(self, subject: str, message_ids: Sequence[str], timestamp_ms: int,
                    payloads: Sequence[bytes], count: int) -> list[int] | None:
        """``append_commit``'s usual commit; None, having done nothing, when it is not one."""
        clog = self._consumer_logs.get(subject)
        if clog is None:
            return None
        handle = clog.handle_for(count)
        if handle is None:
            return None
        log = self._message_log.log
        target = log.framed_target(handle)
        if target is None:
            # Not a real file (a test's FaultyFile), or the log cannot take framed records.
            return self._commit_run_framed(subject, message_ids, timestamp_ms, payloads, count,
                                           clog, handle)
        dedup = self._dedup
        keys = dedup.fresh_keys(subject, message_ids, count)
        if keys is None:
            # An id seen before or twice in the run, or fewer or more ids than subjects (the
            # general path words that; write_run refuses payloads of another length).
            return None
        first = clog.end
        end, room_bytes, fd, file_offset, then_fd, then_offset = target
        outcome = write_run(fd, file_offset, then_fd, then_offset, timestamp_ms, subject, first,
                            message_ids, payloads, end, room_bytes, MESSAGE_ID_BYTES_MAX,
                            self.config.record_size_bytes_max)
        if outcome is None:
            return None
        try:
            index_error = log.framed_written(handle, outcome)  # type: ignore[arg-type]
        except LogWriteFailed as exc:
            self._failed = exc  # sticky, as in _commit_batch
            raise
        sequences = list(range(first, first + count))
        if index_error is not None:
            self._indexed(clog, count, index_error, end, None, keys, sequences,
                          [timestamp_ms] * count)
            return sequences
        # _indexed when the entries' write succeeded (the usual case), inline: appended
        # cannot fail without an error to report, and the checkpoint is due only past its
        # interval (_maybe_checkpoint).
        clog.appended(count, None)
        dedup.add_fresh(keys, first, timestamp_ms)  # fresh_keys' keys, nothing added since
        if end + outcome[0] - self._checkpoint_offset >= self.config.checkpoint_interval_bytes:
            self._write_checkpoint()
        return sequences

    def _commit_run_framed(self, subject: str, message_ids: Sequence[str], timestamp_ms: int,
                           payloads: Sequence[bytes], count: int, clog: ConsumerLog,
                           handle: FileHandle) -> list[int] | None:
        """``_commit_run`` through files that are not ``OsFile``s (a test's ``FaultyFile``):
        the records encoded (``encode_run``), then written by the log
        (``append_framed_durably``), the same bytes and failures as ``write_run``'s."""
        log = self._message_log.log
        room = log.framed_room()
        if room is None:
            return None
        keys = self._dedup.fresh_keys(subject, message_ids, count)
        if keys is None:
            return None
        first = clog.end
        encoded = encode_run(timestamp_ms, subject, first, message_ids, payloads, room[0],
                             room[1], MESSAGE_ID_BYTES_MAX, self.config.record_size_bytes_max)
        if encoded is None:
            return None
        framed, entries = encoded
        try:
            index_error = log.append_framed_durably(framed, (handle, entries))
        except LogWriteFailed as exc:
            self._failed = exc  # sticky, as in _commit_batch
            raise
        sequences = list(range(first, first + count))
        self._indexed(clog, count, index_error, room[0], None, keys, sequences,
                      [timestamp_ms] * count)
        return sequences


def write_run_python(fd: int, file_offset: int, then_fd: int, then_offset: int,
                     timestamp_ms: int, subject: str, first_sequence: int,
                     message_ids: Sequence[str], payloads: Sequence[bytes], log_offset: int,
                     room_bytes: int, id_bytes_max: int, record_bytes_max: int,
                     ) -> tuple[int, int, int, int, int, int, int, int] | None:
    """``encode_run`` (None, nothing written, where it answers None), then its framed records
    written at ``file_offset`` of ``fd``, fsynced, and its entries written at ``then_offset``
    of ``then_fd``: (the framed records' size, then ``write_sync``'s answer: written,
    write_errno, fsync_errno, fsync_ns, synced_at_ns, then_written, then_errno), an OS error
    an errno, never raised (``logstore.fileio.write_sync_python``)."""
    if file_offset < 0 or then_offset < 0:
        raise ValueError(f"offsets {file_offset}, {then_offset}: one is negative")
    encoded = encode_run_python(timestamp_ms, subject, first_sequence, message_ids, payloads,
                                log_offset, room_bytes, id_bytes_max, record_bytes_max)
    if encoded is None:
        return None
    framed, entries = encoded
    return (len(framed),) + write_sync_python(fd, framed, file_offset, then_fd, entries,
                                              then_offset)


# The C twin (realtime/storage/_codecs.c); optional, chosen by logstore.twins. One call either
# way: the store's commit calls ``encode_run`` with no wrapper in between.
encode_run = c_twin("realtime.storage._codecs", "encode_run") or encode_run_python
# The same, written and fsynced in that call (the usual commit through real files).
write_run = c_twin("realtime.storage._codecs", "write_run") or write_run_python

__all__ = ["UsualCommit", "encode_run", "encode_run_python", "write_run", "write_run_python"]
