"""``FreshCommitsMixin``: a master hands a tailing slave the records a commit just wrote from
memory (docs/REPLICATION.md 8.3). ``wrote_io``, called on the log's owner thread right after a
commit, keeps the bytes written since the last commit while a slave tails the log; the fetch the
commit wakes ships them (``_fresh_answer``) with no trip to that thread, which is usually busy
with the next commit by then. ``written_io`` keeps them earlier still where the store allows it: a
commit of the message or the delay log tells it its records once written, before their fsync
(``SegmentedLog.on_written``; only once nothing in this run can cut them any more), and it wakes
the tailing fetch at once, so the slave copies and fsyncs them while the master fsyncs (the
overlap, docs/REPLICATION.md 8.3). Part of ``serverkit.replica_source.ReplicaSource``, whose fields
it reads (``logs``, ``group``, ``epoch``, ``ends``, ``_shipped``, ``_log_starts``); the owner
thread of each of its own fields is written where ``_init_fresh`` sets it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from functools import partial

from serverkit.replica_log import ReplicatedLog, read_range
from wire.replication import Fetch, FetchAnswer

log = logging.getLogger("serverkit.replica_source")  # its records, as before the move

# The most bytes one commit hands its tailing slaves from memory (``wrote_io``); a bigger
# commit is read by the fetch on the store's thread, as before.
FRESH_CHUNK_BYTES_MAX = 1 << 20
# The most fresh commits kept for tailing slaves per log (at most FRESH_CHUNK_BYTES_MAX
# each): past it a commit keeps nothing and the fetch reads the store, as before.
FRESH_CHUNKS_MAX = 16
# A log's commits are handed from memory while a slave fetched it at its end within this long
# (ms); after that (the slave stopped, or lags) a commit costs nothing more than before.
FRESH_TAIL_MS = 1_000


class FreshCommitsMixin:
    """A ``ReplicaSource``'s fresh commits (module docstring)."""

    # Set by ReplicaSource.__init__ (declared for the type checker).
    logs: dict[str, ReplicatedLog]
    group: str
    epoch: int
    ends: dict[str, int]
    _shipped: dict[tuple[str, str], int]
    _log_starts: dict[str, int]
    active: bool

    def advanced(self, name: str, end: int) -> None: ...  # ReplicaSource's

    def _init_fresh(self, logs: dict[str, ReplicatedLog]) -> None:
        """The fields of the fresh commits, one entry per log, none kept yet."""
        # Fresh commits handed from memory (``wrote_io``, docs/REPLICATION.md 8.3). Owners:
        # ``fresh_wanted`` and ``_generation`` are written on the loop and read on the owner
        # thread (a stale read costs one store read, or a chunk nobody uses: a chunk names its
        # generation, and one of another generation is never shipped); ``_fresh`` is appended
        # on the log's owner thread and read and trimmed on the loop (deque appends and pops
        # are atomic); ``_fresh_from`` (where the next chunk starts) is the owner thread's.
        self.fresh_wanted: dict[str, bool] = {name: False for name in logs}
        self._generation = 0  # a new epoch, a stop: chunks and starts of before are void
        self._fresh: dict[str, deque[tuple[int, int, bytes]]] = {name: deque() for name in logs}
        self._fresh_from: dict[str, tuple[int, int] | None] = {name: None for name in logs}
        self._tail_fetch_ms: dict[str, int] = {name: 0 for name in logs}
        self.fresh_answers: dict[str, int] = {name: 0 for name in logs}
        self.fresh_failures = 0  # commits whose read-back failed (the fetch read the store)
        # The loop ``written_io`` wakes (the loop's, set by the first tailing fetch), and the
        # commits it kept before their fsync, per log (figures; the owner thread's).
        self._loop: asyncio.AbstractEventLoop | None = None
        self.fresh_before_fsync: dict[str, int] = {name: 0 for name in logs}

    def _forget_fresh(self) -> None:
        """No fresh commit is handed from memory until a slave tails a log again (a new
        epoch, or no longer the master: the log may be cut and written again meanwhile)."""
        self._generation += 1
        for name in self.logs:
            self.fresh_wanted[name] = False
            self._fresh[name].clear()
            self._written_hook(name, False)

    def _written_hook(self, name: str, on: bool) -> None:
        """Loop: have log ``name``'s commits tell ``written_io`` of their records before their
        fsync (``on``), or stop (a store that cannot tell has no ``written_hook``)."""
        hook = getattr(self.logs[name].store, "written_hook", None)
        if hook is not None:
            hook(partial(self.written_io, name) if on else None)

    def written_io(self, name: str, start: int, framed: bytes) -> None:
        """Owner thread of log ``name``, inside a commit: its records ``framed`` from offset
        ``start`` reached the OS and nothing in this run can cut them any more (the store
        calls this only then, ``SegmentedLog.sync_then``'s ``ship``); their fsync follows.
        Keep them as the next chunk (when they continue the last one) and wake the tailing
        slave's fetch now, so it ships them while this log fsyncs; the commit's own answer
        still waits for that fsync and for the slave (docs/REPLICATION.md 8.3 and 5)."""
        if not self.fresh_wanted[name]:
            return
        generation = self._generation
        size = len(framed)
        if (self._fresh_from[name] != (generation, start) or size > FRESH_CHUNK_BYTES_MAX
                or len(self._fresh[name]) >= FRESH_CHUNKS_MAX or self._loop is None):
            return  # ``wrote_io`` after the commit does what it can, as before
        end = start + size
        self._fresh_from[name] = (generation, end)
        self._fresh[name].append((generation, start, framed))
        self.fresh_before_fsync[name] += 1
        try:
            self._loop.call_soon_threadsafe(self._written, generation, name, end)
        except RuntimeError:  # the loop closed (the server stopping): nothing to wake
            pass

    def _written(self, generation: int, name: str, end: int) -> None:
        """Loop: a commit's records kept before its fsync (``written_io``) end at ``end``:
        the tailing fetch ships them now (``advanced``), unless the role changed since."""
        if generation == self._generation and self.active:
            self.advanced(name, end)

    def wrote_io(self, name: str) -> None:
        """Owner thread of log ``name``, right after a commit to it: while a slave tails the
        log, keep the bytes written since the last such call, so the fetch woken by the
        commit ships them from memory instead of queueing a read behind the store thread's
        next commit and its fsync (docs/REPLICATION.md 8.3). Whole records: each chunk runs
        from one commit's end to the next's. Nothing is read while no slave tails."""
        if not self.fresh_wanted[name]:
            self._fresh_from[name] = None
            return
        generation = self._generation
        store = self.logs[name].store
        end = store.copy_bounds()[1]
        last, self._fresh_from[name] = self._fresh_from[name], (generation, end)
        if last is None or last[0] != generation or not 0 < end - last[1] <= \
                FRESH_CHUNK_BYTES_MAX:
            return  # the first commit seen, of another generation, or too big: a store read
        if len(self._fresh[name]) >= FRESH_CHUNKS_MAX:
            return  # the slave is not taking them (slow, or gone): it reads the store
        start = last[1]
        try:
            data = read_range(store, start, end)
        except Exception as exc:  # never fail the commit that called: the fetch reads the store
            self._fresh_from[name] = None
            self.fresh_failures += 1
            log.warning("group %s: reading back the %s log's commit [%d, %d) for the slaves "
                        "failed (%s: %s); their fetch reads the store instead", self.group, name,
                        start, end, type(exc).__name__, exc)
            return
        self._fresh[name].append((generation, start, data))

    def _fresh_answer(self, log_: ReplicatedLog, request: Fetch) -> FetchAnswer | None:
        """The answer to a tailing slave's fetch from the commits kept in memory (``wrote_io``),
        or None (the store is read): only for a fetch that continues exactly what this master
        shipped it in this epoch (nothing there can diverge), from a chunk of this generation
        that starts where the slave is, up to the end the last commit told and ``max_bytes``."""
        name = log_.name
        if self._shipped.get((request.server_id, name)) != request.offset:
            return None
        chunks = self._fresh[name]
        # What starts below the slave goes: fetched past, or cut by a store read's answer
        # (a second, slower slave reads the store). Only this loop takes chunks out.
        while chunks and chunks[0][1] < request.offset:
            chunks.popleft()
        told = self.ends.get(name, 0)
        parts: list[bytes] = []
        offset, size = request.offset, 0
        for generation, start, data in list(chunks):  # a copy: the owner thread appends
            if (generation != self._generation or start != offset or start + len(data) > told
                    or size + len(data) > request.max_bytes):
                break
            parts.append(data)
            size += len(data)
            offset += len(data)
        if not parts:
            return None
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        epochs = tuple((entry.epoch, entry.start_offset)
                       for entry in log_.history.entries_between(request.offset, offset))
        self.fresh_answers[name] += 1
        return FetchAnswer(self.epoch, name, request.offset, data, offset,
                           self._log_starts[name], max(offset, told), epochs, None)

    def _tailing(self, name: str, now_ms: int) -> None:
        """A slave fetched log ``name`` at its end: hand it the next commits from memory."""
        self._tail_fetch_ms[name] = now_ms
        if not self.fresh_wanted[name]:
            self.fresh_wanted[name] = True
            if self._loop is None:
                try:
                    self._loop = asyncio.get_running_loop()
                except RuntimeError:  # called off a loop (a test): commits are kept after
                    return
            self._written_hook(name, True)


__all__ = ["FRESH_CHUNK_BYTES_MAX", "FRESH_CHUNKS_MAX", "FRESH_TAIL_MS", "FreshCommitsMixin"]
