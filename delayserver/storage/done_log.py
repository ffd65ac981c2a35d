"""Dispatch and cancel records per bucket (``done_record`` format) and the touched logs
(``touched_record`` format), with a small cache of which entries of recently used buckets are done.

Every write is durable before it returns: the bucket is first written to the epoch's touched log
(fsynced once per bucket per epoch), then the records are appended to the bucket's file and the
file is fsynced (and its directory when the file is new). A torn or corrupt tail is cut when the
file is next read.
"""

from __future__ import annotations

import errno
import logging
import os
from collections import OrderedDict

from delayserver.storage import touched_record
from delayserver.storage.done_record import (
    KIND_CANCELLED,
    KIND_DISPATCHED,
    RECORD_SIZE_BYTES,
    DoneRecord,
    decode_done_records,
    encode_done_record,
    encode_done_records,
)
from delayserver.storage.errors import StoreFailed
from delayserver.storage.layout import DAY_MS, Layout
from delayserver.storage.schedule import read_whole
from logstore import DiskFull, FileHandle, Opener, fsync_directory

log = logging.getLogger(__name__)

DONE_CACHE_BUCKETS_MAX = 16  # buckets whose done keys are kept in memory
DONE_CACHE_KEYS_MAX = 1 << 20  # done keys kept in memory, all cached buckets together (~64 MB)


def done_key(delay_log_offset: int, id_hash: int) -> int:
    """The key an entry is matched by: its delay-log offset and id hash in one int."""
    return (delay_log_offset << 32) | id_hash


class DoneState:
    """Which entries of one bucket are dispatched or cancelled (by ``done_key``)."""

    __slots__ = ("dispatched", "cancelled")

    def __init__(self) -> None:
        self.dispatched: set[int] = set()
        self.cancelled: set[int] = set()

    def __len__(self) -> int:
        return len(self.dispatched) + len(self.cancelled)

    def is_done(self, key: int) -> bool:
        """True when the entry is dispatched or cancelled."""
        return key in self.dispatched or key in self.cancelled


def cut_tail(path: str, data: bytes, good_bytes: int, problem: str, repairs: list[str]) -> None:
    """Cut ``path`` to its first ``good_bytes`` bytes (fsynced) and note the repair."""
    os.truncate(path, good_bytes)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    note = f"{path}: cut {len(data) - good_bytes} bytes at byte {good_bytes} ({problem})"
    log.warning("delay store: %s", note)
    repairs.append(note)


class DoneLog:
    """The dispatch and cancel files of every bucket, and the touched logs."""

    def __init__(self, layout: Layout, opener: Opener, epoch: int) -> None:
        self.layout = layout
        self._opener = opener
        self.epoch = epoch
        self._touched: set[int] = set()
        self._cache: OrderedDict[int, DoneState] = OrderedDict()
        self._cached_keys = 0
        self.repairs: list[str] = []  # torn or corrupt tails cut, for the recovery report/tools
        os.makedirs(layout.touched_dir, exist_ok=True)

    # ------------------------------------------------------------------ reading

    def read_records(self, bucket_ms: int, kind: int) -> list[DoneRecord]:
        """Every record of the bucket's file of ``kind``, cutting a torn or corrupt tail."""
        path = self.layout.done_path(bucket_ms, kind)
        data = read_whole(path)
        records, good, problem = decode_done_records(data, kind)
        if good != len(data):
            cut_tail(path, data, good, problem, self.repairs)
        return records

    def state(self, bucket_ms: int) -> DoneState:
        """The done keys of the bucket (cached)."""
        state = self._cache.get(bucket_ms)
        if state is not None:
            self._cache.move_to_end(bucket_ms)
            return state
        state = DoneState()
        for record in self.read_records(bucket_ms, KIND_DISPATCHED):
            state.dispatched.add(done_key(record.delay_log_offset, record.id_hash))
        for record in self.read_records(bucket_ms, KIND_CANCELLED):
            state.cancelled.add(done_key(record.delay_log_offset, record.id_hash))
        self._cache[bucket_ms] = state
        self._cached_keys += len(state)
        self._evict()
        return state

    def _evict(self) -> None:
        while len(self._cache) > 1 and (len(self._cache) > DONE_CACHE_BUCKETS_MAX
                                        or self._cached_keys > DONE_CACHE_KEYS_MAX):
            _bucket, state = self._cache.popitem(last=False)
            self._cached_keys -= len(state)

    def forget(self, bucket_ms: int) -> None:
        """Drop the bucket from the cache (its files are being deleted)."""
        state = self._cache.pop(bucket_ms, None)
        if state is not None:
            self._cached_keys -= len(state)

    # ------------------------------------------------------------------ writing

    def _append_durably(self, path: str, data: bytes, records: int) -> None:
        """Append and fsync ``data`` (fsyncing the directory for a new file). ENOSPC: cut back and
        raise DiskFull; any other failure: StoreFailed."""
        directory = os.path.dirname(path)
        created = not os.path.exists(path)
        handle: FileHandle | None = None
        try:
            handle = self._opener(path)
            size_before = handle.size()
            try:
                handle.append(data)
                handle.sync()
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    try:
                        handle.truncate(size_before)
                    except OSError as cut_exc:
                        raise StoreFailed(path, cut_exc) from exc
                    raise DiskFull(path, records) from exc
                raise StoreFailed(path, exc) from exc
            if created:
                fsync_directory(directory)
        except OSError as exc:
            raise StoreFailed(path, exc) from exc
        finally:
            if handle is not None:
                handle.close()

    def touch(self, bucket_ms: int) -> None:
        """Record durably that the bucket gets dispatch/cancel records in this epoch."""
        if bucket_ms in self._touched:
            return
        self._append_durably(self.layout.touched_path(self.epoch),
                             touched_record.encode_touched(bucket_ms), 1)
        self._touched.add(bucket_ms)

    def write(self, bucket_ms: int, kind: int, records: list[DoneRecord]) -> None:
        """Append ``records`` to the bucket's file of ``kind``, durably, and update the cache."""
        if not records:
            return
        state = self.state(bucket_ms)  # before writing: cuts a torn tail first
        self.touch(bucket_ms)
        os.makedirs(self.layout.day_dir(bucket_ms // DAY_MS), exist_ok=True)
        data = b"".join(encode_done_record(record) for record in records)
        self._append_durably(self.layout.done_path(bucket_ms, kind), data, len(records))
        target = state.dispatched if kind == KIND_DISPATCHED else state.cancelled
        before = len(target)
        target.update(done_key(r.delay_log_offset, r.id_hash) for r in records)
        self._cached_keys += len(target) - before
        self._evict()

    def write_entries(self, bucket_ms: int, kind: int, offsets: list[int], id_hashes: list[int],
                      indexes: list[int]) -> None:
        """``write`` of one record per entry, given as parallel lists (delay-log offset, id
        hash, index) rather than a ``DoneRecord`` each: the batch path of dispatching."""
        if not offsets:
            return
        state = self.state(bucket_ms)  # before writing: cuts a torn tail first
        self.touch(bucket_ms)
        os.makedirs(self.layout.day_dir(bucket_ms // DAY_MS), exist_ok=True)
        data = encode_done_records(offsets, id_hashes, indexes, self.epoch, kind)
        self._append_durably(self.layout.done_path(bucket_ms, kind), data, len(offsets))
        target = state.dispatched if kind == KIND_DISPATCHED else state.cancelled
        before = len(target)
        # done_key of each entry, inlined: this runs once per dispatched message
        target.update([(offset << 32) | hashed for offset, hashed in zip(offsets, id_hashes)])
        self._cached_keys += len(target) - before
        self._evict()

    def new_epoch(self, epoch: int) -> None:
        """A checkpoint with sequence ``epoch`` was written: later records carry this epoch."""
        self.epoch = epoch
        self._touched = set()

    # ------------------------------------------------------------------ touched logs

    def touched_epochs(self) -> list[int]:
        """Epochs that have a touched log, ascending."""
        out = []
        for name in os.listdir(self.layout.touched_dir):
            stem = name[: -len(touched_record.FILE_SUFFIX)]
            if name.endswith(touched_record.FILE_SUFFIX) and len(stem) == 20 and stem.isdigit():
                out.append(int(stem))
        return sorted(out)

    def read_touched(self, epoch: int) -> list[int]:
        """The buckets of ``epoch``'s touched log, cutting a torn tail."""
        path = self.layout.touched_path(epoch)
        data = read_whole(path)
        buckets, good, problem = touched_record.decode_touched(data)
        if good != len(data):
            cut_tail(path, data, good, problem, self.repairs)
        return buckets

    def delete_touched_before(self, epoch: int) -> None:
        """Delete the touched logs of epochs below ``epoch``."""
        doomed = [e for e in self.touched_epochs() if e < epoch]
        for old in doomed:
            os.unlink(self.layout.touched_path(old))
        if doomed:
            fsync_directory(self.layout.touched_dir)


__all__ = ["DoneLog", "DoneState", "done_key", "KIND_CANCELLED", "KIND_DISPATCHED",
           "RECORD_SIZE_BYTES"]
