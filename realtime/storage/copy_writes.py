"""``CopyWrites``: the message store's replication side (a master's reads of its log as stored,
a slave's appends, cuts and resets of its copy, the sequence-starts snapshot), apart from
``store.py`` for its size. ``MessageStore`` inherits them; they use its message log, consumer
logs, dedup index, held set and checkpoints, on its owner thread (docs/REPLICATION.md 8.2)."""

from __future__ import annotations

import logging
import shutil
from typing import TYPE_CHECKING

from logstore import CorruptRecord, LogStoreError, LogWriteFailed
from realtime.storage.copying import (
    checkpoints_to, cut_indexes, index_copied, install_sequence_starts, sequence_starts,
)
from realtime.storage.errors import StoreFailed
from realtime.storage.sequence_starts import (
    StartsSnapshot, decode_sequence_starts, encode_sequence_starts,
)

if TYPE_CHECKING:
    from logstore import CheckpointStore
    from realtime.storage.consumer_log import ConsumerLog
    from realtime.storage.dedup import DedupIndex
    from realtime.storage.held import HeldSet
    from realtime.storage.message_log import MessageLog
    from realtime.storage.write_batch import WriteBatch

log = logging.getLogger(__name__)


class CopyWrites:
    """The replication half of ``MessageStore`` (see the module docstring)."""

    # MessageStore's, set by its constructor:
    data_dir: str
    _batch: WriteBatch
    _held: HeldSet
    _dedup: DedupIndex
    _message_log: MessageLog
    _consumer_logs: dict[str, ConsumerLog]
    _checkpoints: CheckpointStore
    _failed: Exception | None
    _closed: bool

    def _check_writable(self) -> None: ...  # MessageStore's
    def _check_open(self) -> None: ...  # MessageStore's
    def _maybe_checkpoint(self) -> None: ...  # MessageStore's
    def _open_consumer_log(self, subject: str) -> ConsumerLog: ...  # MessageStore's
    def _write_checkpoint(self) -> bool: ...  # MessageStore's

    def copy_bounds(self) -> tuple[int, int]:
        """(first offset, end offset) of the message log as a copy may read it: everything
        written to the OS (a master ships committed records; docs/REPLICATION.md 8.2)."""
        self._check_open()
        log_ = self._message_log.log
        return log_.first_offset, log_.flushed_offset

    def copy_end(self) -> int:
        """``copy_bounds()[1]``: the message log's end as a copy may read it (what a commit
        tells the slaves' fetches, read after every commit)."""
        if self._closed:
            self._check_open()  # raises
        return self._message_log.log.flushed_offset

    def read_copy(self, offset: int, max_bytes: int) -> bytes:
        """Whole message-log records from ``offset`` as stored (``SegmentedLog.read_raw``)."""
        self._check_open()
        return self._message_log.log.read_raw(offset, max_bytes)

    def append_copy(self, offset: int, data: bytes) -> int:
        """A slave: append records copied from the master's message log at ``offset`` (this
        log's end), make them durable per the flush mode, then index them (consumer logs, dedup)
        as a commit does. Nothing is appended unless every record checks out (CorruptRecord).
        Returns the new end offset."""
        self._check_writable()
        if self._batch.bodies:
            raise ValueError("a slave's message store has uncommitted appends of its own")
        message_log = self._message_log
        try:
            bodies = message_log.append_copy_durably(offset, data)
        except LogWriteFailed as exc:
            self._failed = exc
            raise
        try:
            index_copied(bodies, offset, self._consumer_logs, self._open_consumer_log,
                         self._dedup, message_log.directory, self._held)
        except (StoreFailed, CorruptRecord) as exc:
            # The records are durable but not indexed: recovery indexes them at the next open.
            self._failed = exc
            raise
        except LogStoreError as exc:
            # A consumer-log write failed (a full disk): the copy is undone, indexes, held set,
            # dedup and records, so the next fetch copies it again from here; left in place,
            # its records would be skipped and their sequences read as missing (review s14
            # rvc-2). An undo that fails too makes the store sticky.
            try:
                self.truncate_copy(offset)
            except (LogStoreError, OSError) as cut_exc:
                self._failed = self._failed or StoreFailed(message_log.directory, cut_exc)
            raise exc
        self._maybe_checkpoint()
        return message_log.end_offset

    def truncate_copy(self, offset: int) -> int:
        """Cut the message log at ``offset`` (a record boundary) with every index entry and
        dedup id of what is cut, durably, and checkpoint the result: a rejoining slave drops
        a tail its master does not have, or a slave drops a rotten record to fetch it again.
        Returns the bytes cut."""
        self._check_writable()
        message_log = self._message_log
        if offset >= message_log.end_offset:
            return 0
        base = checkpoints_to(self._checkpoints, offset)
        cut_indexes(message_log, self._consumer_logs, self._dedup, offset, self._held, base)
        try:
            cut = message_log.log.truncate(offset)
            message_log.log.sync()
        except LogWriteFailed as exc:
            self._failed = exc
            raise
        self._write_checkpoint()
        log.warning("message store %s: cut %d bytes of copied log at offset %d", self.data_dir,
                    cut, offset)
        return cut

    def reset_copy(self, offset: int) -> None:
        """Throw every record and index away and start the message log empty at ``offset``:
        a slave whose master's retention deleted what it would fetch next."""
        self._check_writable()
        for clog in self._consumer_logs.values():
            clog.close()
            shutil.rmtree(clog.directory)
        self._consumer_logs.clear()
        self._dedup.clear()
        self._held.clear()
        self._checkpoints.delete_after(0)  # they describe records the reset throws away
        self._message_log.log.reset(offset)
        self._write_checkpoint()

    def newest_checkpoint(self, sequence: int) -> tuple[StartsSnapshot, int] | None:
        """The master: what a slave installs before it copies from this log's start
        (``sequence_starts``), and the start it covers; None when ``sequence`` (an earlier
        answer's log start) is not the start any more (retention moved it: ask again)."""
        self._check_open()
        first = self._message_log.log.first_offset
        if sequence and sequence != first:
            return None
        payload = encode_sequence_starts(sequence_starts(self._consumer_logs, first), first)
        return StartsSnapshot(first, payload), first

    def install_snapshot(self, payload: bytes, covers_offset: int) -> None:
        """A slave: start the copy empty at the master's log start ``covers_offset``, every
        subject's consumer log at the master's sequence there (``sequence_starts``)."""
        try:
            starts, covered = decode_sequence_starts(payload)
        except ValueError as exc:
            raise CorruptRecord("<master sequence starts>", covers_offset, str(exc)) from exc
        if covered != covers_offset:
            raise CorruptRecord("<master sequence starts>", covers_offset,
                                f"covers offset {covered}, the answer said {covers_offset}")
        self.reset_copy(covers_offset)
        install_sequence_starts(self._consumer_logs, self._open_consumer_log, starts)
        self._write_checkpoint()

    def verify_copy(self, offset: int, max_bytes: int) -> tuple[int, int | None]:
        """Scrub about ``max_bytes`` of the message log from ``offset``: (where to go on, the
        offset of the first record that fails its checks or None)."""
        self._check_open()
        next_offset, problem = self._message_log.log.verify(offset, max_bytes)
        return next_offset, problem.offset if problem is not None else None
