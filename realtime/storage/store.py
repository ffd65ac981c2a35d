"""MessageStore: the facade the realtime server calls (message log + consumer logs + dedup).

Layout of ``data_dir``::

    messagelog/<20-digit base offset>.log             every subject's records (logstore segments)
    consumerlog/<encoded subject>/<20-digit base>.clog one subject's index (fixed 32-byte entries)
    checkpoint/consumerlogs.<20-digit n>.ckpt          where the indexes are complete

Writes are batched: ``append`` buffers in memory, ``commit`` writes the batch to the message log,
makes it durable per ``flush_mode`` (one fsync per batch in sync mode), then indexes it; only then
is it visible. Synchronous and single-owner: the server calls it from one place, never from the
event loop. Time is passed in; nothing here reads the clock.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from logstore.descriptors import DescriptorCache
from logstore import (
    CheckpointStore,
    CorruptRecord,
    FileHandle,
    LogConfig,
    LogStoreError,
    LogWriteFailed,
    OffsetOutOfRange,
    Opener,
    OsFile,
)
from realtime.storage.config import (
    TAG_HASH_MAX,
    TIMESTAMP_MS_MAX,
    U64_MAX,
    StoreConfig,
)
from realtime.storage.commit_run import UsualCommit
from realtime.storage.consumer_log import ConsumerLog, Entry, encode_entries
from realtime.storage.dedup import DedupIndex
from realtime.storage.held import HeldSet
from realtime.storage.held_writes import HeldWrites
from realtime.storage.copy_writes import CopyWrites
from realtime.storage.errors import (
    CorruptEntry,
    SequenceOutOfRange,
    StorageError,
    StoreClosed,
    StoreFailed,
)
from realtime.storage.message_log import MessageLog
from realtime.storage.message_record import tag_bloom
from realtime.storage.recovery import StoreRecoveryReport, recover
from realtime.storage.retention import RetentionReport, apply_retention
from realtime.storage.store_checkpoint import (
    CHECKPOINT_NAME,
    StoreCheckpoint,
    decode_store_checkpoint,
    encode_store_checkpoint,
)
from realtime.storage.write_batch import WriteBatch, check_int, check_subject
from realtime.storage.subject_names import (
    encode_subject,
    is_hashed,
    subject_of_directory,
    write_subject_file,
)

log = logging.getLogger(__name__)
SCAN_READ_ENTRIES = 256  # consumer-log entries read per pread while scanning


@dataclass(frozen=True)
class Appended:
    """The outcome of one ``append``: the sequence it gets (provisional until ``commit``), or
    for a duplicate the original's sequence (None when the original is not committed yet)."""

    subject: str
    message_id: str
    sequence: int | None
    duplicate: bool


@dataclass(frozen=True)
class StoredMessage:
    """A committed message as read back; ``payload`` is byte-identical to what was appended."""

    subject: str
    sequence: int
    timestamp_ms: int
    message_id: str
    tag_bloom: int
    payload: bytes


def _stored_end_offset(directory: str) -> int:
    """The message log's end offset as its files say, before logstore opens them: past its
    data's end when the last file holds space allocated ahead, which logstore's recovery
    checks itself (a checkpoint in those zeros verifies that segment whole)."""
    if not os.path.isdir(directory):
        return 0
    names = sorted(n for n in os.listdir(directory) if n.endswith(".log") and n[:-4].isdigit())
    if not names:
        return 0
    return int(names[-1][:-4]) + os.path.getsize(os.path.join(directory, names[-1]))


class MessageStore(HeldWrites, CopyWrites, UsualCommit):
    """Per-subject dense sequences over one message log; see the module docstring."""

    def __init__(self, data_dir: str, config: StoreConfig = StoreConfig(), *,
                 opener: Opener = OsFile, now_ms: int) -> None:
        check_int("now_ms", now_ms, 0, TIMESTAMP_MS_MAX)
        self.data_dir = data_dir
        self.config = config
        # Every consumer-log file is opened through this cache, so a store with any number of
        # subjects keeps at most consumer_log_files_open_max of them open; the message log's
        # segments open through it too, so an open that finds no descriptor left is retried
        # after the cache closed its own (logstore.descriptors).
        self._files = DescriptorCache(opener, config.consumer_log_files_open_max)
        opener = self._files.opener(opener)
        self._opener = opener
        self._closed = False
        self._failed: StorageError | None = None
        self._batch = WriteBatch(config.record_size_bytes_max)
        # The batch being committed, and the consumer log whose entries of it the message
        # log's sync wrote (``_entries_for``), None when ``_index`` writes them.
        self._indexing = self._batch
        self._indexed_by_sync: ConsumerLog | None = None
        self._consumer_root = os.path.join(data_dir, "consumerlog")
        os.makedirs(self._consumer_root, exist_ok=True)
        self._checkpoints = CheckpointStore(os.path.join(data_dir, "checkpoint"), CHECKPOINT_NAME)
        checkpoint, problem = self._load_checkpoint()
        message_log_dir = os.path.join(data_dir, "messagelog")
        verify_from = checkpoint.message_log_offset if checkpoint else 0
        if verify_from > _stored_end_offset(message_log_dir):
            # The log is shorter than the checkpoint says: verify all of it, because logstore
            # skips every segment that ends before verify_from_offset.
            verify_from = 0
        self._message_log = MessageLog(
            message_log_dir,
            LogConfig(
                segment_size_bytes_max=config.segment_size_bytes_max,
                record_size_bytes_max=config.record_size_bytes_max,
                flush_mode=config.flush_mode,
                flush_interval_ms=config.flush_interval_ms,
                write_buffer_bytes_max=config.write_buffer_bytes_max,
                preallocate_step_bytes=config.preallocate_step_bytes,
            ),
            opener=opener,
            verify_from_offset=verify_from,
        )
        self._consumer_logs: dict[str, ConsumerLog] = {}
        for name in sorted(os.listdir(self._consumer_root)):
            try:
                subject = subject_of_directory(self._consumer_root, name)
            except ValueError as exc:
                log.warning("message store %s: skipping directory %r: %s", data_dir, name, exc)
                continue
            self._consumer_logs[subject] = self._open_consumer_log(subject)
        self._dedup = DedupIndex(config.dedup_window_ms, config.dedup_ids_max)
        self._held = HeldSet()
        self._held_keys = self._held.keys  # one mapping for the store's life, read per append
        self.recovery: StoreRecoveryReport = recover(
            self._message_log, self._consumer_logs, self._open_consumer_log, checkpoint, problem,
            self._dedup, now_ms, self._held)
        self._checkpoint_offset = checkpoint.message_log_offset if checkpoint else -1
        self._write_checkpoint()

    # ------------------------------------------------------------------ internals

    def _load_checkpoint(self) -> tuple[StoreCheckpoint | None, str | None]:
        loaded = self._checkpoints.load_latest()
        if loaded is None:
            return None, "no checkpoint file verifies"
        try:
            return decode_store_checkpoint(loaded.payload), None
        except (ValueError, UnicodeDecodeError) as exc:
            log.warning("checkpoint %s unusable: %s", loaded.path, exc)
            return None, f"checkpoint {loaded.path} unusable: {exc}"

    def _open_consumer_log(self, subject: str) -> ConsumerLog:
        name = encode_subject(subject)
        directory = os.path.join(self._consumer_root, name)
        created = not os.path.isdir(directory)
        clog = ConsumerLog(directory, subject, self.config.consumer_log_entries_per_file,
                           self._files)
        if created and is_hashed(name):
            self._files.retry_on_emfile(write_subject_file, directory, subject)
        return clog

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed(self.data_dir)

    def _check_writable(self) -> None:
        if self._closed or self._failed is not None:  # one test on the path of every commit
            self._check_open()
            raise self._failed  # type: ignore[misc]  # not None: the store is open

    def _write_checkpoint(self) -> bool:
        """Checkpoint the indexes when the message log is durable to its end; True if written."""
        message_log = self._message_log
        if message_log.durable_offset != message_log.end_offset or self._failed is not None:
            return False
        try:
            for clog in self._consumer_logs.values():
                clog.sync()
        except StoreFailed as exc:
            # The batch that led here is durable in the message log and already visible, so it
            # is not failed; the store refuses further writes until reopened, and recovery
            # rebuilds the consumer log whose fsync failed.
            log.error("message store %s: %s", self.data_dir, exc)
            self._failed = exc
            return False
        end = message_log.end_offset
        held_from = self._held.from_offset(end)
        payload = encode_store_checkpoint(StoreCheckpoint(
            end, {s: c.end for s, c in self._consumer_logs.items()},
            held_from if held_from < end else None, tuple(self._held.by_offset.values())))
        try:
            self._checkpoints.write(payload)
        except OSError as exc:
            # A checkpoint only shortens the replay at open; without it the data is still safe,
            # so the write that triggered it is not failed. Retried at the next interval.
            log.warning("message store %s: checkpoint write failed: %s", self.data_dir, exc)
            return False
        self._checkpoint_offset = message_log.end_offset
        return True

    def _maybe_checkpoint(self) -> None:
        if (self._message_log.log.end_offset - self._checkpoint_offset
                >= self.config.checkpoint_interval_bytes):
            self._write_checkpoint()

    # ------------------------------------------------------------------ writing

    def append(self, subject: str, message_id: str, tag_hashes: Sequence[int], timestamp_ms: int,
               payload: bytes) -> Appended:
        """Buffer one message (invisible until ``commit``); a recent id is a duplicate."""
        self._check_writable()
        batch = self._batch
        batch.add((subject,), (message_id,), (tag_hashes,), timestamp_ms, (payload,),
                  self._dedup, self._indexed_end, self._held_keys)
        return Appended(subject, message_id, batch.sequences[-1], batch.duplicates[-1])

    def append_many(self, subjects: Sequence[str], message_ids: Sequence[str],
                    tag_hashes: Sequence[Sequence[int]], timestamp_ms: int,
                    payloads: Sequence[bytes]) -> None:
        """``append`` of several messages, given column by column (one entry per message in
        each), all at ``timestamp_ms``; their outcomes come from ``commit_sequences``. All or
        nothing: on a ValueError (naming the message at fault) none of them is buffered."""
        if self._closed or self._failed is not None:  # the broker's path: no call to test it
            self._check_writable()  # raises
        self._batch.add(subjects, message_ids, tag_hashes, timestamp_ms, payloads, self._dedup,
                        self._indexed_end, self._held_keys)

    def commit(self) -> list[Appended]:
        """Write, make durable (per flush mode) and index every append since the last commit.

        Returns one ``Appended`` per appended message, in order. On a write failure
        (``DiskFull``, ``LogWriteFailed``) the whole batch is dropped, nothing of it becomes
        visible, and the error propagates.
        """
        batch = self._commit_batch()
        names = [(subject, message_id) for subject, message_ids in batch.appended
                 for message_id in message_ids]
        return [Appended(subject, message_id, sequence, duplicate)
                for (subject, message_id), sequence, duplicate
                in zip(names, batch.sequences, batch.duplicates)]

    def commit_sequences(self) -> list[int | None]:
        """``commit``, returning only each appended message's sequence, None for a duplicate
        (no object per message: the broker's path)."""
        batch = self._commit_batch()
        if not batch.duplicate_count:
            return batch.sequences
        return [None if duplicate else sequence
                for sequence, duplicate in zip(batch.sequences, batch.duplicates)]

    def discard(self) -> None:
        """Drop every append since the last commit (the caller will not commit them)."""
        self._batch = WriteBatch(self.config.record_size_bytes_max)

    def _commit_batch(self) -> WriteBatch:
        if self._closed or self._failed is not None:  # every commit's path: no call to test it
            self._check_writable()  # raises
        batch, self._batch = self._batch, WriteBatch(self.config.record_size_bytes_max)
        if not batch.bodies:
            return batch
        message_log = self._message_log
        self._indexing, self._indexed_by_sync = batch, None
        try:
            offsets, index_error = message_log.log.append_durably_then(batch.bodies,
                                                                       self._entries_for)
        except LogWriteFailed as exc:
            # Sticky: after a failed write or fsync the file's state is unknown until reopened.
            # Records of this batch that reached the file are never indexed; recovery treats
            # them as described in realtime.storage.recovery.
            self._failed = exc
            raise
        finally:
            self._indexing = self._batch  # not the committed batch: its bodies may be large
        clog = self._indexed_by_sync
        self._indexed_by_sync = None
        self._indexed(clog, len(offsets), index_error, offsets[0], (batch, offsets),
                      batch.fresh_keys, batch.fresh_sequences, batch.fresh_timestamps_ms)
        return batch

    def _indexed(self, clog: ConsumerLog | None, count: int, index_error: OSError | None,
                 start_offset: int, unindexed: tuple[WriteBatch, list[int]] | None,
                 keys: list[str], sequences: list[int], timestamps_ms: list[int]) -> None:
        """After a commit's ``count`` records, from ``start_offset`` on, are durable: index
        them (``clog``: its entries were written with them, ``index_error`` that write's
        failure; None: ``_index`` writes ``unindexed``'s), remember their ids (``keys``) and
        checkpoint when due. An index that failed cuts the records back too."""
        try:
            if clog is not None:  # the usual commit: its entries were written by the sync
                clog.appended(count, index_error)  # cuts itself back when it raises
            else:
                self._index(*unindexed)  # type: ignore[misc]
        except StoreFailed as exc:
            # A consumer log whose cut back failed: its state is unknown until reopened.
            self._failed = exc
            raise
        except LogStoreError as exc:
            # The consumer logs are cut back; the batch's records go too, or the next batch
            # would reuse their sequences over records a slave copies as written and a restart
            # indexes (review s14 rvc-1). A failed write is sticky, as the message log's is.
            try:
                self._message_log.log.cut_back(start_offset)  # where the log ended before
            except LogWriteFailed as cut_exc:
                self._failed = self._failed or cut_exc
            if isinstance(exc, LogWriteFailed):
                self._failed = self._failed or exc
            raise
        self._dedup.add_many(keys, sequences, timestamps_ms)
        self._maybe_checkpoint()

    def _entries_for(self, offsets: list[int]) -> tuple[FileHandle, bytes] | None:
        """The usual commit (one subject, its consumer log's last file open with room for
        it): that file and the batch's encoded entries, which the message log writes right
        after its fsync, in the same call (``SegmentedLog.append_durably_then``); else None
        and ``_index`` writes them."""
        batch = self._indexing
        if len(batch.runs) != 1:
            return None
        # One subject: its runs are the whole batch, in order.
        (subject,) = batch.runs
        clog = self._consumer_logs.get(subject)
        if clog is None:
            return None
        handle = clog.handle_for(len(offsets))
        if handle is None:
            return None
        self._indexed_by_sync = clog
        return handle, encode_entries(batch.fresh_timestamps_ms, offsets,
                                      list(map(len, batch.bodies)), batch.fresh_blooms)

    def _index(self, batch: WriteBatch, offsets: list[int]) -> None:
        """Append the batch's entries when ``_entries_for`` did not have the message log
        write them; on failure cut every touched consumer log back (a ``StoreFailed``, a cut
        that failed, propagates: the caller makes it sticky)."""
        ends = {}
        sizes = list(map(len, batch.bodies))
        timestamps, blooms = batch.fresh_timestamps_ms, batch.fresh_blooms
        try:
            for subject, slices in batch.runs.items():
                clog = self._consumer_logs.get(subject)
                if clog is None:
                    clog = self._consumer_logs[subject] = self._open_consumer_log(subject)
                ends[subject] = clog.end
                clog.append_columns(slices, timestamps, offsets, sizes, blooms)
        except LogStoreError:
            try:
                for subject, end in ends.items():
                    self._consumer_logs[subject].truncate(end)
            except OSError as cut_exc:
                self._failed = StoreFailed(self._consumer_logs[subject].directory, cut_exc)
            raise

    def observe_fsync(self, callback: Callable[[float], None] | None) -> None:
        """Call ``callback(seconds)`` after each message-log fsync, on this store's thread."""
        self._message_log.log.on_fsync = callback

    def tick(self, now_ms: int) -> None:
        """Async mode: fsync the message log every ``flush_interval_ms``; prune the dedup index."""
        self._check_open()
        check_int("now_ms", now_ms, 0, TIMESTAMP_MS_MAX)
        if self.config.flush_mode == "async" and self._failed is None:
            if self._message_log.log.tick(now_ms):
                self._maybe_checkpoint()
        self._dedup.prune(now_ms)

    # ------------------------------------------------------------------ reading

    def subjects(self) -> list[str]:
        """Every subject with a consumer log, sorted."""
        return sorted(self._consumer_logs)

    def first_sequence(self, subject: str) -> int:
        """The lowest sequence still readable (== end_sequence when none is); 0 if unknown."""
        clog = self._consumer_logs.get(check_subject(subject))
        return clog.first_sequence if clog else 0

    def end_sequence(self, subject: str) -> int:
        """The next sequence to be assigned (committed messages only); 0 for an unknown subject."""
        clog = self._consumer_logs.get(check_subject(subject))
        return clog.end if clog else 0

    def _indexed_end(self, subject: str) -> int:
        """``end_sequence`` of a subject already checked (``WriteBatch`` checks it first)."""
        clog = self._consumer_logs.get(subject)
        return clog.end if clog is not None else 0

    def end_sequences(self) -> dict[str, int]:
        """Every subject's end sequence."""
        return {subject: clog.end for subject, clog in self._consumer_logs.items()}

    def _check_range(self, subject: str, sequence: int, allow_end: bool) -> ConsumerLog | None:
        check_int("sequence", sequence, 0, U64_MAX)
        clog = self._consumer_logs.get(subject)
        first = clog.first_sequence if clog else 0
        end = clog.end if clog else 0
        if sequence < first or sequence > end or (sequence == end and not allow_end):
            raise SequenceOutOfRange(subject, sequence, first, end)
        return clog

    def read(self, subject: str, sequence: int) -> StoredMessage:
        """The committed message ``sequence`` of ``subject``; SequenceOutOfRange outside
        [first_sequence, end_sequence), CorruptEntry when the stored bytes fail verification."""
        self._check_open()
        clog = self._check_range(check_subject(subject), sequence, allow_end=False)
        return self._load(clog, sequence, clog.entry(sequence))

    def _load(self, clog: ConsumerLog, sequence: int, entry: Entry) -> StoredMessage:
        subject = clog.subject
        if entry.is_hole:
            raise SequenceOutOfRange(subject, sequence, clog.first_sequence, clog.end)
        try:
            record, size = self._message_log.read(entry.message_log_offset)
        except OffsetOutOfRange as exc:
            raise SequenceOutOfRange(subject, sequence, clog.first_sequence, clog.end) from exc
        except CorruptRecord as exc:
            raise CorruptEntry(subject, sequence, exc.path, exc.reason) from exc
        if (record.subject, record.subject_sequence, size) != (subject, sequence, entry.size_bytes):
            raise CorruptEntry(
                subject, sequence, clog.directory,
                f"entry points at offset {entry.message_log_offset}, which holds "
                f"{record.subject!r} sequence {record.subject_sequence} ({size} bytes)")
        return StoredMessage(subject, sequence, record.timestamp_ms, record.message_id,
                             record.tag_bloom, record.payload)

    def scan(self, subject: str, from_sequence: int, max_count: int,
             tag_hashes: Sequence[int] | None = None,
             max_entries: int = 10_000,
             unreadable: list[tuple[int, str | None]] | None = None,
             ) -> tuple[list[StoredMessage], int]:
        """Committed messages from ``from_sequence`` whose tag bloom shares a bit with any of
        ``tag_hashes`` (None or empty: all), at most ``max_count`` of them, looking at most at
        ``max_entries`` entries. Returns (messages, the next sequence to look at).

        The bloom is a pre-filter: a message whose tag merely shares a bit (h1 % 64 == h2 % 64)
        is returned too, so the caller checks the exact tags in the payload.

        A record that fails verification raises CorruptEntry, unless ``unreadable`` is given:
        then the scan passes over it and appends (sequence, its message id or None) there, the
        id decoded without the CRC check (``unverified_id``) so the caller can name what it
        gives up on.
        """
        self._check_open()
        check_int("max_count", max_count, 0, U64_MAX)
        check_int("max_entries", max_entries, 0, U64_MAX)
        clog = self._check_range(check_subject(subject), from_sequence, allow_end=True)
        for h in tag_hashes or ():
            check_int("tag hash", h, 0, TAG_HASH_MAX)
        mask = tag_bloom(tag_hashes) if tag_hashes else 0
        messages: list[StoredMessage] = []
        sequence = from_sequence
        stop = min(clog.end, from_sequence + max_entries) if clog else from_sequence
        while sequence < stop and len(messages) < max_count:
            for entry in clog.entries(sequence, min(SCAN_READ_ENTRIES, stop - sequence)):
                if not mask or entry.tag_bloom & mask:
                    try:
                        messages.append(self._load(clog, sequence, entry))
                    except CorruptEntry:
                        if unreadable is None:
                            raise
                        unreadable.append((sequence, self.unverified_id(subject, sequence)))
                sequence += 1
                if len(messages) == max_count:
                    break
        return messages, sequence

    def unverified_id(self, subject: str, sequence: int) -> str | None:
        """The message id of ``subject``'s ``sequence`` read WITHOUT the record's CRC check
        (a damaged body usually keeps its header), or None when the entry or the header is
        unreadable or names another message. Only to name a message given up on."""
        self._check_open()
        try:
            clog = self._check_range(check_subject(subject), sequence, allow_end=False)
            entry = clog.entry(sequence)
            if entry.is_hole:
                return None
            found = self._message_log.read_id_unverified(entry.message_log_offset)
        except (StorageError, LogStoreError):
            return None
        if found is None or found[:2] != (subject, sequence):
            return None
        return found[2]

    # ------------------------------------------------------------------ retention, closing

    def apply_retention(self, now_ms: int, keep_sequences: Mapping[str, int],
                        name_unconsumed: Callable[[bytes], str | None] | None = None,
                        ) -> RetentionReport:
        """Delete old message-log segments and the consumer-log files below them (see
        ``realtime.storage.retention``); the report says what went and why, and counts (and
        names, by ``name_unconsumed(payload)``) what a hard cap deleted before a pull-log
        group of its subject was past it."""
        self._check_open()
        check_int("now_ms", now_ms, 0, TIMESTAMP_MS_MAX)
        for subject, sequence in keep_sequences.items():
            check_subject(subject)
            check_int(f"keep_sequences[{subject!r}]", sequence, 0, U64_MAX)
        end = self._message_log.end_offset
        held_from = self._held.from_offset(end)
        report = apply_retention(self._message_log, self._consumer_logs, self.config, now_ms,
                                 keep_sequences, name_unconsumed,
                                 held_from if held_from < end else None)
        if report.deleted_segments:
            first = self._message_log.first_offset
            for held in [h for h in self._held.by_offset.values() if h.offset < first]:
                self._held.pop(held.offset)  # a hard cap deleted it: given up
                report.held_deleted.append((held.subject, held.message_id))
            self._write_checkpoint()
        return report

    def close(self) -> None:
        """Drop uncommitted appends, fsync, checkpoint and close every file. Idempotent."""
        if self._closed:
            return
        self._batch = WriteBatch(self.config.record_size_bytes_max)
        try:
            if self._failed is None:
                self._message_log.log.sync()
                self._write_checkpoint()
        finally:
            self._message_log.log.close()
            for clog in self._consumer_logs.values():
                clog.close()
            self._files.close()
            self._closed = True
