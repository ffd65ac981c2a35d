"""``Follower``: a slave's side of replication (docs/REPLICATION.md 8.2, 8.4, 8.6). It copies
each replicated log from the master over one pipelined connection: catch-up first (fetches
back to back), then tail (a fetch waits at the master's end up to ``wait_ms``), each from its
own offset, which acknowledges what it has.

* An answer's records are checked before anything is written (CRC, framing); a bad copy is
  fetched again, up to ``CRC_RETRIES`` times in a row before backing off, and counted.
* ``diverging``: the copy is cut where the histories agree (``cut_io``), or thrown away and
  copied again when the store cannot cut there (``CopyReset``).
* An offset below the master's log start: the copy starts again there (``reset_io``), or, for a
  log whose state cannot be rebuilt from a later point (the pull log), from the master's newest
  checkpoint (``snapshot``).
* A record whose CRC holds but whose body this server cannot decode (``UndecodableRecord``:
  a later release's body version) comes back the same on every fetch: the copy stops there,
  whole, counted (``undecodable_records``) and shown (``undecodable_at``), logged as an error
  once per place, fetched again with the backoff until this server is upgraded.
* ``requires``: an answer is applied only once the copies of the logs its records refer to
  reach the ends the master named, so a slave never holds an action about a message it lacks.
* Record kinds: each fetch says which gated record kinds of its log this server reads
  (``reads``, ``serverkit.kind_gate``); a master answers a fetch at a record of a kind it
  does not read ``unreadable_record`` and serves nothing past it: the copy is kept as it is,
  the refusal is logged as an error once per place and counted, and the fetch is retried with
  the backoff until this server is upgraded or the master's log moves on.
* A scrub reads the copy back in the background (``Scrub``: passes over every log at
  ``bytes_per_s``, a rest of ``pause_ms`` between passes): a rotten record is cut with
  everything after it, and fetched again.

Event loop only; the stores are called through each log's runner (their owner threads).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Awaitable, Callable

from logstore import CopyReset, CorruptRecord, UndecodableRecord
from serverkit.config import SCRUB_BYTES_PER_S_DEFAULT, SCRUB_PAUSE_MS_DEFAULT
from serverkit.replica_log import (
    ReplicatedLog, apply_position_io, cut_io, end_io, position_io, reset_io, scrub_io,
)
from wire.errors import ConnectionLost, QmqError, StaleEpoch, UnreadableRecord
from wire.limits import MAX_FETCH_BYTES
from wire.replication import (
    fetch_request,
    parse_fetch_answer,
    parse_snapshot_answer,
    snapshot_request,
)

log = logging.getLogger(__name__)

FETCH_WAIT_MS = 500  # a caught-up fetch waits this long at the master's end
CRC_RETRIES = 3  # a bad copy is fetched again this many times in a row before backing off
BACKOFF_MS_MIN = 50
BACKOFF_MS_MAX = 2_000
REQUEST_TIMEOUT_MS = 10_000  # beyond the fetch's own wait
SCRUB_STEP_BYTES = 1 << 20  # the scrub reads at most this much per call on the owner thread



@dataclass(frozen=True)
class Scrub:
    """The background scrub's settings (``ServerConfig.scrub_bytes_per_s``/``scrub_pause_ms``)."""

    bytes_per_s: int = SCRUB_BYTES_PER_S_DEFAULT  # pace of a pass; 0: no scrub at all
    pause_ms: int = SCRUB_PAUSE_MS_DEFAULT  # rest after a pass over every log


Connect = Callable[[str], Awaitable["object"]]  # address -> an sdk Connection (request, close)


class Follower:
    """The slave's side (module docstring). ``clock_ms`` is monotonic, in ms."""

    def __init__(self, group: str, server_id: str, logs: list[ReplicatedLog], connect: Connect,
                 clock_ms: Callable[[], int], on_trouble: Callable[[], None],
                 fetch_bytes_max: int = MAX_FETCH_BYTES, wait_ms: int = FETCH_WAIT_MS,
                 scrub: Scrub = Scrub()) -> None:
        self.group = group
        self.server_id = server_id
        self.logs = {item.name: item for item in logs}
        self._connect = connect
        self._clock_ms = clock_ms
        self._on_trouble = on_trouble  # heartbeat soon: the master may have changed
        self.fetch_bytes_max = fetch_bytes_max
        self.wait_ms = wait_ms
        self.scrub = scrub
        self.epoch = 0
        self.master_address: str | None = None
        self._connection: object | None = None
        self._connecting: asyncio.Lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        # Steps waiting for another log's copy to reach an end (``_wait_end``), woken when a
        # copy's end moves (``_moved_to``: with none waiting, it makes no object).
        self._end_waiters: list[asyncio.Future[None]] = []
        # log -> (the copy's end as the last apply left it, the next fetch's (offset,
        # last_epoch) read in that apply): used while the end has not moved since.
        self._positions: dict[str, tuple[int, tuple[int, int]]] = {}
        # Event loop figures (metrics, reports): per log.
        self.ends: dict[str, int] = {name: 0 for name in self.logs}  # the copy's end
        self.master_ends: dict[str, int] = {name: 0 for name in self.logs}  # as last answered
        self.caught_up_ms: dict[str, int | None] = {name: None for name in self.logs}
        self.bytes_copied: dict[str, int] = {name: 0 for name in self.logs}
        self.crc_errors = 0
        # Fetches the master refused at a record of a kind this server does not read
        # (qmq_replication_unreadable_records_total), and the last refusal's message.
        self.unreadable_records = 0
        self.unreadable_why: str | None = None
        # Copied records whose CRC held but whose body this server cannot decode (a later
        # release's body version): qmq_replication_undecodable_records_total, and where the
        # copy stopped ({log, offset, kind, version, reason}; None: not stopped at one now).
        self.undecodable_records = 0
        self.undecodable_at: dict[str, object] | None = None
        self.scrub_repairs = 0
        self.scrub_passes = 0  # whole passes over every copy since the scrub started
        self.running = False

    # ------------------------------------------------------------------ start and stop

    def start(self, master_address: str, epoch: int) -> None:
        """Follow the master at ``master_address`` in ``epoch`` (one task per log + scrub)."""
        assert not self.running, "stop() the follower before starting it again"
        self.master_address, self.epoch, self.running = master_address, epoch, True
        self._positions.clear()
        # Another master's log (a failover) may hold another record there, or one past it.
        self.undecodable_at = None
        self._tasks = [asyncio.create_task(self._follow(item), name=f"follow-{name}")
                       for name, item in self.logs.items()]
        if self.scrub.bytes_per_s > 0:
            self._tasks.append(asyncio.create_task(self._scrub(), name="scrub"))
        log.info("group %s: following master %s at epoch %d", self.group, master_address, epoch)

    async def stop(self) -> None:
        """Stop fetching and wait until no copied record is still being written."""
        self.running = False
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        for item in self.logs.values():  # a thread runs calls in order: this one comes last
            await item.run(_nothing)
        connection, self._connection = self._connection, None
        if connection is not None:
            await connection.close()  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ figures

    def lag_bytes(self) -> int:
        """Bytes the copy lacked as of the last answers, over every log."""
        return sum(max(0, self.master_ends[name] - self.ends[name]) for name in self.logs)

    def lag_ms(self, now_ms: int) -> int | None:
        """0 when every log is caught up; else how long since the least recent one was (None
        when one never was)."""
        if self.lag_bytes() == 0 and all(v is not None for v in self.caught_up_ms.values()):
            return 0
        times = list(self.caught_up_ms.values())
        if any(t is None for t in times):
            return None
        return max(0, now_ms - min(times))  # type: ignore[type-var]

    def caught_up(self) -> bool:
        """Every log copied up to the master's end as last answered."""
        return self.lag_bytes() == 0 and all(v is not None for v in self.caught_up_ms.values())

    # ------------------------------------------------------------------ copying one log

    async def _request(self, op: dict, timeout_ms: int) -> dict:
        connection = self._connection
        if connection is None or connection.closed:  # type: ignore[attr-defined]
            # Connect, one step at a time; the usual fetch finds the connection open and
            # takes no lock (its acquire and release were ~7 Python calls a fetch).
            connection = await self._connected()
        try:
            return await connection.request(op, timeout_ms)  # type: ignore[attr-defined]
        except ConnectionLost:
            if self._connection is connection:
                self._connection = None
            raise

    async def _connected(self) -> object:
        async with self._connecting:
            if self._connection is None or self._connection.closed:  # type: ignore[attr-defined]
                assert self.master_address is not None
                self._connection = await self._connect(self.master_address)
            return self._connection

    async def _follow(self, item: ReplicatedLog) -> None:
        backoff_ms = BACKOFF_MS_MIN
        bad_copies = 0
        wait_ms = 0
        while True:
            try:
                wait_ms = await self._step(item, wait_ms)
                backoff_ms = BACKOFF_MS_MIN
                bad_copies = 0
                stopped = self.undecodable_at
                if stopped is not None and stopped["log"] == item.name \
                        and self.ends[item.name] > stopped["offset"]:  # type: ignore[operator]
                    self.undecodable_at = None  # moved past it (the master's record mended)
                continue
            except asyncio.CancelledError:
                raise
            except UndecodableRecord as exc:
                self._undecodable(item, exc)
            except CorruptRecord as exc:
                self.crc_errors += 1
                bad_copies += 1
                log.warning("group %s: copy of %s failed its check (%s); fetching it again",
                            self.group, item.name, exc)
                if bad_copies <= CRC_RETRIES:
                    continue
            except StaleEpoch as exc:
                log.info("group %s: %s", self.group, exc)
                self._on_trouble()
            except UnreadableRecord as exc:
                # The master is not at fault, nor is the copy: this server is older than a
                # record kind in the master's log. Nothing was written; the copy stays whole.
                self.unreadable_records += 1
                if exc.message != self.unreadable_why:
                    log.error("group %s: copying %s stopped: %s", self.group, item.name, exc)
                    self.unreadable_why = exc.message
            except (ConnectionLost, QmqError) as exc:
                log.info("group %s: fetching %s from %s: %s", self.group, item.name,
                         self.master_address, exc)
                self._on_trouble()
            except Exception:
                log.exception("group %s: copying %s failed", self.group, item.name)
            await asyncio.sleep(backoff_ms / 1000)
            backoff_ms = min(BACKOFF_MS_MAX, backoff_ms * 2)
            wait_ms = 0

    def _undecodable(self, item: ReplicatedLog, exc: UndecodableRecord) -> None:
        """A copied record whose CRC holds but whose body this server cannot decode: the same
        bytes come back on every fetch, so the copy stops there (whole: nothing of the range
        was written) until this server is upgraded or the master's record is mended. Counted,
        kept for ``GET /replication``, logged as an error once per place; fetched again with
        the backoff (never the quick re-fetches of a bad CRC)."""
        self.undecodable_records += 1
        at = {"log": item.name, "offset": exc.offset, "kind": exc.kind,
              "version": exc.version, "reason": exc.reason}
        if at != self.undecodable_at:
            log.error("group %s: copying %s stopped at offset %d, a record this server "
                      "cannot decode (%s); upgrade this server", self.group, item.name,
                      exc.offset, exc.reason)
            self.undecodable_at = at

    def _forget_undecodable(self, *names: str) -> None:
        """The copy of ``names`` was cut, reset or replaced: the place it stopped at is no
        longer where it stands (review s14 rva); a fetch that meets the record again shows
        it again, logged again."""
        stopped = self.undecodable_at
        if stopped is not None and stopped["log"] in names:
            self.undecodable_at = None

    async def _step(self, item: ReplicatedLog, wait_ms: int) -> int:
        """One fetch of ``item`` and what follows from it; returns the next fetch's wait."""
        name = item.name
        known = self._positions.pop(name, None)
        if known is not None and known[0] == self.ends[name]:  # nothing cut or reset since
            offset, last_epoch = known[1]
        else:
            offset, last_epoch = await item.run(position_io, item)
        self._moved_to(name, offset)
        reads = item.kinds.reads if item.kinds is not None else ()
        raw = await self._request(fetch_request(self.server_id, self.epoch, name, offset,
                                                last_epoch, self.fetch_bytes_max, wait_ms,
                                                reads), wait_ms + REQUEST_TIMEOUT_MS)
        answer = parse_fetch_answer(raw)
        self.master_ends[name] = answer.log_end
        if answer.diverging is not None:
            try:
                point = await item.run(cut_io, item, answer.diverging)
                self._forget_undecodable(name)
                log.warning("group %s: %s copy diverged from the master's (epoch %d ended at "
                            "%d there): cut at %d", self.group, name, answer.diverging[0],
                            answer.diverging[1], point)
            except CopyReset as exc:
                log.warning("group %s: %s; copying it again", self.group, exc)
                await self._copy_again(item)
            return 0
        if answer.offset < answer.log_start:
            if item.snapshots:
                await self._install_snapshot(item)
            else:
                await self._reset(item, answer.log_start, answer.epochs)
                log.warning("group %s: %s copy starts again at the master's log start %d",
                            self.group, name, answer.log_start)
            return 0
        for other, end in answer.requires.items():
            await self._wait_end(other, end)
        try:
            end, position = await item.run(apply_position_io, item, offset, answer.data,
                                           answer.epochs)
        except ValueError as exc:  # the copy moved meanwhile (a reset by another log)
            log.info("group %s: %s copy moved (%s); fetching again", self.group, name, exc)
            return 0
        self.bytes_copied[name] += len(answer.data)
        self._moved_to(name, end)
        self._positions[name] = (end, position)
        if end >= answer.log_end:
            self.caught_up_ms[name] = self._clock_ms()
            return self.wait_ms
        return 0

    async def _copy_again(self, item: ReplicatedLog) -> None:
        """``item``'s copy cannot be cut back: throw it away from offset 0, with every log its
        store cannot keep apart from it (``reset_with``, ``empties``), and copy them again."""
        await self._reset(self.logs[item.reset_with] if item.reset_with else item, 0, ())

    async def _reset(self, item: ReplicatedLog, start: int,
                     epochs: tuple[tuple[int, int], ...]) -> None:
        """Start ``item``'s copy empty at ``start``; the logs it ``empties`` start at 0."""
        emptied = tuple(self.logs[name] for name in item.empties)
        await item.run(reset_io, item, start, epochs, emptied)
        self._forget_undecodable(item.name, *item.empties)
        self._moved_to(item.name, start)
        for other in emptied:
            self._moved_to(other.name, 0)

    async def _install_snapshot(self, item: ReplicatedLog) -> None:
        """Copy the master's newest checkpoint of ``item`` and install it."""
        sequence, position, parts = 0, 0, []
        while True:
            raw = await self._request(snapshot_request(
                self.server_id, self.epoch, item.name, sequence, position,
                self.fetch_bytes_max), REQUEST_TIMEOUT_MS)
            answer = parse_snapshot_answer(raw)
            if sequence and answer.sequence != sequence:
                sequence, position, parts = 0, 0, []
                continue
            sequence = answer.sequence
            parts.append(answer.data)
            position += len(answer.data)
            if position >= answer.size:
                break
        payload = b"".join(parts)
        await item.run(_install_io, item, payload, answer.covers_offset, answer.epochs)
        self._forget_undecodable(item.name)
        log.warning("group %s: %s copy installed the master's checkpoint %d (%d bytes, covers "
                    "offset %d)", self.group, item.name, sequence, len(payload),
                    answer.covers_offset)

    def _moved_to(self, name: str, end: int) -> None:
        """The copy of ``name`` ends at ``end`` now: the steps waiting for an end look again."""
        self.ends[name] = end
        if self._end_waiters:  # twice a fetch: nothing made or called while none waits
            waiters, self._end_waiters = self._end_waiters, []
            for waiter in waiters:
                if not waiter.done():  # a cancelled step's
                    waiter.set_result(None)

    async def _wait_end(self, name: str, end: int) -> None:
        """Wait until the copy of ``name`` reaches ``end``."""
        while self.ends.get(name, end) < end:
            waiter = asyncio.get_running_loop().create_future()
            self._end_waiters.append(waiter)
            await waiter

    # ------------------------------------------------------------------ scrubbing

    async def _scrub(self) -> None:
        """Pass over every copy at ``scrub.bytes_per_s``, rest ``scrub.pause_ms``, again; a
        rotten record is cut for a re-fetch. No scrub at all with a pace of 0."""
        while True:
            for name, item in self.logs.items():
                await self._scrub_pass(name, item)
            self.scrub_passes += 1
            await asyncio.sleep(self.scrub.pause_ms / 1000)

    async def _scrub_pass(self, name: str, item: ReplicatedLog) -> None:
        """One pass over the copy of ``name``, up to where the copy ended when it began."""
        step = min(SCRUB_STEP_BYTES, self.scrub.bytes_per_s)
        pass_end = await item.run(end_io, item)
        offset = 0
        while True:
            self._positions.pop(name, None)  # the scrub may cut: read the position again
            try:
                next_offset, bad = await item.run(scrub_io, item, offset, step)
            except CopyReset as exc:
                log.error("group %s: rotten record in the %s copy (%s); copying again",
                          self.group, name, exc)
                await self._copy_again(item)
                self.scrub_repairs += 1
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("group %s: scrubbing the %s copy failed", self.group, name)
                return
            if bad is not None:
                self.scrub_repairs += 1
                log.error("group %s: rotten record at offset %d of the %s copy: cut there, "
                          "fetching it again", self.group, bad, name)
                self._forget_undecodable(name)
                self._moved_to(name, bad)
                return
            await asyncio.sleep(step / self.scrub.bytes_per_s)
            # scrub_io starts over at the copy's first offset once it reached the end.
            if next_offset <= offset or next_offset >= pass_end:
                return
            offset = next_offset


def _nothing() -> None:
    """A call that only marks its place in a thread's queue."""


def _install_io(item: ReplicatedLog, payload: bytes, covers_offset: int,
                epochs: tuple[tuple[int, int], ...]) -> None:
    """Owner thread: install a master checkpoint and start the history with ``epochs``."""
    item.store.install_snapshot(payload, covers_offset)  # type: ignore[attr-defined]
    item.history.truncate(0)
    for epoch, start in epochs:
        if epoch > item.history.last_epoch:
            item.history.append(epoch, start)


__all__ = ["CRC_RETRIES", "FETCH_WAIT_MS", "Follower", "Scrub"]
