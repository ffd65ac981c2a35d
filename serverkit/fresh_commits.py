"""``FreshCommitsMixin``: a master hands a tailing slave the records a commit just wrote from
memory (docs/REPLICATION.md 8.3). ``wrote_io``, called on the log's owner thread right after a
commit, keeps the bytes written since the last commit while a slave tails the log; the fetch the
commit wakes ships them (``_fresh_answer``) with no trip to that thread, which is usually busy
with the next commit by then. Part of ``serverkit.replica_source.ReplicaSource``, whose fields
it reads (``logs``, ``group``, ``epoch``, ``ends``, ``_shipped``, ``_log_starts``); the owner
thread of each of its own fields is written where ``_init_fresh`` sets it.
"""

from __future__ import annotations

import logging
from collections import deque

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

    def _forget_fresh(self) -> None:
        """No fresh commit is handed from memory until a slave tails a log again (a new
        epoch, or no longer the master: the log may be cut and written again meanwhile)."""
        self._generation += 1
        for name in self.logs:
            self.fresh_wanted[name] = False
            self._fresh[name].clear()

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
        self.fresh_wanted[name] = True


__all__ = ["FRESH_CHUNK_BYTES_MAX", "FRESH_CHUNKS_MAX", "FRESH_TAIL_MS", "FreshCommitsMixin"]
