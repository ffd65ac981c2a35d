"""``ReplicaSource``: a master's side of replication (docs/REPLICATION.md 7, 8.2, 8.3). It
answers its slaves' ``fetch`` and ``snapshot`` requests, learns from each fetch offset what the
slave has (``InSyncTracker``), proposes the in-sync set, and holds a ``sync`` write's answer
until every slave it waits for has fetched past the write.

Record kinds (``serverkit.kind_gate``): each fetch says which gated kinds of its log the slave
reads; an answer never carries a record of a kind it did not say (it ends before the first one,
or the fetch is refused ``unreadable_record``), and ``kind_refusal`` tells the write path whether
every slave counted reads a kind it is about to write.

A fetch at the end of a log waits (up to its ``wait_ms``) until the server says the log advanced
(``advanced``: a commit, a flush of the pull log, a done record), parked with no task
(``serverkit.parked_fetch``): ``advanced`` answers it directly. What a fetch ships is what the
store has written to the OS; its end, as ``advanced`` last said it, bounds what other logs'
records may refer to (``FetchAnswer.requires``).

A tailing slave's fetch ships the records a commit just wrote from memory (``wrote_io``,
called on the log's owner thread right after a commit; ``_fresh_answer``): no trip to that
thread, which is usually busy with the next commit by then (``serverkit.fresh_commits``).

Event loop only, but ``wrote_io`` (the log's owner thread; the comments on the fields it
touches say which thread owns each); the stores are read on their own threads through each
``ReplicatedLog.run``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from functools import partial
from typing import Callable

from serverkit.fresh_commits import FRESH_TAIL_MS, FreshCommitsMixin
from serverkit.insync import InSyncTracker
from serverkit.kind_gate import KindReads, first_unread
from serverkit.parked_fetch import ParkedFetch, ParkedFetches
from serverkit.replica_log import ReplicatedLog, answer_fetch_io, snapshot_io
from serverkit.run_fence import RunFence
from wire.errors import NotEnoughReplicas, NotFound, NotMaster, StaleEpoch, UnreadableRecord
from wire.replication import Fetch, FetchAnswer, Snapshot

log = logging.getLogger(__name__)

# How a sync write waiting for its slaves hears the end of its wait: None once they have it,
# else the error (NotMaster) that refuses it (``ReplicaSource.park_replicated``).
Replicated = Callable[[BaseException | None], None]

# A slave not caught up on every log for this long leaves the in-sync set (Kafka's
# replica.lag.time.max.ms plays this part), in ms.
INSYNC_LAG_MAX_MS_DEFAULT = 5_000


class ReplicaSource(FreshCommitsMixin):
    """The master's side (module docstring). ``clock_ms`` is a monotonic clock in ms."""

    replicating = True

    def __init__(self, group: str, logs: dict[str, ReplicatedLog], clock_ms: Callable[[], int],
                 on_insync_change: Callable[[], None],
                 insync_lag_max_ms: int = INSYNC_LAG_MAX_MS_DEFAULT) -> None:
        self.group = group
        self.logs = logs
        self._clock_ms = clock_ms
        self._on_insync_change = on_insync_change
        self.insync_lag_max_ms = insync_lag_max_ms
        self.tracker = InSyncTracker(tuple(logs), insync_lag_max_ms, clock_ms())
        self.epoch = 0
        self.active = False  # serving fetches as this epoch's master
        self.mode = "sync"
        self.min_insync = 0
        self.ends: dict[str, int] = {name: 0 for name in logs}  # committed ends, as told
        # Fetches waiting at a log's end, answered when it advances (or their wait ends).
        self.parked = ParkedFetches(logs, clock_ms, self._resume)
        self._parked = self.parked.by_log
        self._reads: set[asyncio.Task[None]] = set()  # a woken fetch's store read, running
        # Sync writes waiting for their slaves, per log: (end, done), ``done(None)`` once they
        # have it, ``done(error)`` when refused (``park_replicated``; a future's for
        # ``wait_replicated``).
        self._waiters: dict[str, list[tuple[int, Replicated]]] = defaultdict(list)
        self._last_proposal: tuple[str, ...] = ()
        self._degraded_logged: bool | None = None
        self._strangers: set[str] = set()  # fetchers not counted, already logged
        # (slave, log) -> where this epoch's last answer to that slave's fetch of that log
        # ended (``next_offset``): a fetch at or below it acknowledges at once (``_ack_shipped``).
        self._shipped: dict[tuple[str, str], int] = {}
        # What this run as master shipped each fetcher past the end it began with: a fetch
        # past both is cut at that end (``_fenced``, docs/REPLICATION.md 8.3).
        self.fence = RunFence()
        # Figures for metrics and reports: bytes shipped, per log.
        self.bytes_shipped: dict[str, int] = {name: 0 for name in logs}
        # What each fetcher reads of the logs with gated record kinds (serverkit.kind_gate).
        self.kind_reads = KindReads({name: item.kinds for name, item in logs.items()
                                     if item.kinds is not None})
        self._init_fresh(logs)
        self._log_starts: dict[str, int] = {name: 0 for name in logs}  # as last read

    # ------------------------------------------------------------------ the role

    def start(self, epoch: int, ends: dict[str, int], confirmed: tuple[str, ...]) -> None:
        """This server is the master of ``epoch`` with its logs ending at ``ends`` (sealed)."""
        self.epoch = epoch
        self.active = True
        self.ends = dict(ends)
        self.tracker = InSyncTracker(tuple(self.logs), self.insync_lag_max_ms, self._clock_ms())
        self.tracker.set_confirmed(confirmed)
        self._last_proposal = ()
        self._shipped.clear()
        self.fence.begin(ends)
        self.kind_reads.clear()
        self._forget_fresh()
        self._wake_fetches()

    def _wake_fetches(self) -> None:
        """End every fetch waiting at a log's end (each is answered as this master now can:
        refused when it stopped). A later fetch at that end waits again, so a slave caught up
        on a log nobody writes to does not fetch it in a busy loop (a broker's message log
        while only delays arrive: ~600 fetches/s per log, half a core)."""
        self.parked.wake_all()

    def stop(self, why: str) -> None:
        """No longer the master: every write waiting for its slaves is refused (retriable)."""
        self.active = False
        self._shipped.clear()
        self.fence.end()
        self._forget_fresh()
        self.refuse_waiters(why)
        self._wake_fetches()

    def refuse_waiters(self, why: str) -> None:
        """Refuse (retriable) every write waiting for its slaves: its answer could not be
        given anyway (the role refuses writes now), and a slave it waits for may never come
        (a master cut off from its slaves and the MetaServer keeps them in the database's set)."""
        error = NotMaster(f"group {self.group}: {why}; refresh the route and resend")
        refused = []
        for waiters in self._waiters.values():
            refused += waiters
            waiters.clear()
        for _end, done in refused:  # after: a callback may park another write
            _call(done, error)

    def settings(self, mode: str, min_insync: int, confirmed: tuple[str, ...],
                 members: tuple[str, ...]) -> None:
        """The group's settings, the database's in-sync set and the group's registered slaves
        (the only fetchers counted), from the last answer."""
        self.mode, self.min_insync = mode, min_insync
        self.tracker.set_members(members)
        self.tracker.set_confirmed(confirmed)
        self.kind_reads.listed(members + confirmed, self._clock_ms())
        self.check_waiters()

    # ------------------------------------------------------------------ writes

    def kind_refusal(self, name: str, kind: int) -> str | None:
        """None when every slave this master counts (``KindReads.counted``: the group's
        registered slaves, the database's in-sync set, recent fetchers) said it reads ``kind``
        of log ``name``; else why not, naming them."""
        if not self.active:
            return f"this server is not serving as the master of group {self.group}"
        listed = set(self.tracker.members) | set(self.tracker.confirmed)
        why = self.kind_reads.refusal(name, kind, listed, self._clock_ms())
        return None if why is None else f"group {self.group}: {why}"

    def advanced(self, name: str, end: int) -> None:
        """The master committed (or flushed) ``name`` up to ``end``: answer its long polls
        now (``_resume``: from the commit kept in memory, usually), with no task to wake. A
        second call for the same end (published, then in ``wait_replicated``) does nothing."""
        if end > self.ends.get(name, 0):
            self.ends[name] = end
            if self._parked.get(name):
                self.parked.wake(name)

    def refusal(self) -> str | None:
        """Why writes are refused now (``min_insync`` not met), or None."""
        if self.min_insync <= 0:
            return None
        insync = self.tracker.proposal(self._clock_ms())
        if len(insync) >= self.min_insync:
            return None
        return (f"group {self.group} has {len(insync)} slave(s) in sync, fewer than its "
                f"min_insync {self.min_insync}: the write is refused so that no machine alone "
                f"acknowledges it; retry, or send to another group")

    def check_writable(self) -> None:
        """Raise NotEnoughReplicas (retriable) when ``min_insync`` refuses writes."""
        if self.min_insync <= 0:  # every send asks: no call to ``refusal`` when none can be
            return
        reason = self.refusal()
        if reason is not None:
            raise NotEnoughReplicas(reason)

    def waits(self) -> bool:
        """True when a ``sync`` write now waits for some slave."""
        return (self.active and self.mode == "sync"
                and bool(self.tracker.waiting_set(self._clock_ms())))

    def replicated_now(self, name: str, end: int) -> bool:
        """True when a write of ``name`` up to ``end`` waits for no slave now (``async``, no
        slave in sync: degraded, or every one it waits for has it): what ``wait_replicated``
        returns at once for. NotMaster when this server stopped being master. The caller
        told ``advanced`` of ``end`` already (a send's publishing; ``wait_replicated``)."""
        if not self.active:
            raise NotMaster(f"group {self.group}: this server stopped being master before "
                            f"its slaves had the write; refresh the route and resend")
        if self.mode != "sync":
            return True
        tracker = self.tracker
        if not tracker.slaves and not tracker.confirmed:
            # No slave ever fetched and none in the database's set (``waiting_set`` is empty
            # at any time): a group without slaves asks this every commit, with no clock read.
            return True
        replicated = tracker.replicated(name, self._clock_ms())
        return replicated is None or replicated >= end

    async def wait_replicated(self, name: str, end: int) -> None:
        """Return once every slave a ``sync`` write waits for has fetched ``name`` past
        ``end`` (at once under ``async``, or with no slave in sync: degraded). NotMaster when
        this server stops being master meanwhile."""
        if self.active:  # the slaves' fetches hear of the end first (replicated_now refuses)
            self.advanced(name, end)
        if self.replicated_now(name, end):
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters[name].append((end, partial(_settle, future)))
        await future

    def park_replicated(self, name: str, end: int, done: Replicated) -> None:
        """``wait_replicated`` with no coroutine or task: ``done(None)`` once every slave a
        ``sync`` write waits for has ``name`` past ``end``, ``done(error)`` (NotMaster) when
        this server stops being master first; never from inside this call. The caller asked
        ``replicated_now(name, end)`` in this step, which said False (and told ``advanced``)."""
        self._waiters[name].append((end, done))

    def check_waiters(self, now_ms: int | None = None) -> None:
        """Answer every waiting write its slaves now have (after a fetch, a change of the
        in-sync set or of the settings); ``now_ms``: the caller's read of the clock."""
        ready: list[tuple[int, Replicated]] = []
        for name, waiters in self._waiters.items():
            if not waiters:
                continue
            if now_ms is None:  # no clock read while nothing waits
                now_ms = self._clock_ms()
            replicated = self.tracker.replicated(name, now_ms) if self.mode == "sync" else None
            keep: list[tuple[int, Replicated]] = []
            for waiter in waiters:
                (ready if replicated is None or replicated >= waiter[0] else keep).append(waiter)
            waiters[:] = keep
        for _end, done in ready:  # after the walk: a callback may park another write
            _call(done, None)

    def tick(self) -> tuple[str, ...]:
        """Re-judge the in-sync set (a slave silent too long leaves it); returns the proposal.
        A change asks for a heartbeat at once, so the database follows quickly."""
        now_ms = self._clock_ms()
        for name, fetched_ms in self._tail_fetch_ms.items():
            if self.fresh_wanted[name] and now_ms - fetched_ms > FRESH_TAIL_MS:
                self.fresh_wanted[name] = False  # no slave tails it: commits read nothing
                self._fresh[name].clear()
        proposal = self.tracker.proposal(now_ms)
        if proposal != self._last_proposal:
            log.info("group %s: slaves in sync now %s (were %s)", self.group,
                     list(proposal) or "none", list(self._last_proposal) or "none")
            self._last_proposal = proposal
            self._on_insync_change()
        degraded = self.active and not proposal and self.mode == "sync"
        if degraded != self._degraded_logged:
            if degraded and self._degraded_logged is not None:
                log.warning("group %s has no slave in sync: writes are acknowledged by the "
                            "master alone", self.group)
            self._degraded_logged = degraded
        self.check_waiters()
        return proposal

    # ------------------------------------------------------------------ fetch and snapshot

    def _fence(self, server_id: str, epoch: int) -> None:
        if not self.active:
            raise NotMaster(f"this server is not the master of group {self.group}")
        if epoch < self.epoch:
            raise StaleEpoch(f"fetch from {server_id} at epoch {epoch}, older than group "
                             f"{self.group}'s epoch {self.epoch}: ask the MetaServer for the "
                             f"master")

    async def fetch(self, request: Fetch) -> dict | ParkedFetch:
        """Answer a slave's fetch (the caller fenced a higher epoch through the role): the
        answer, or the ``ParkedFetch`` (a ``Later``) that a fetch at the log's end waits as."""
        self._fence(request.server_id, request.epoch)
        log_ = self.logs.get(request.log)
        if log_ is None:
            raise NotFound(f"group {self.group} replicates no log {request.log!r}; it has "
                           f"{', '.join(self.logs)}")
        name = log_.name
        now_ms = self._clock_ms()  # one read for the whole step (issue 18: ~15 a message)
        if log_.kinds is not None:
            self.kind_reads.announced(request.server_id, name, request.reads, now_ms)
        if (self._ack_shipped(request, now_ms) and request.wait_ms
                and request.offset == self.ends.get(name, 0)):
            # The slave has everything this master shipped it, and that reaches the end the
            # last commit told: caught up, and straight to the wait, with no read of the store.
            self.tracker.on_fetch(request.server_id, name, request.offset, request.offset,
                                  now_ms)
            self._tailing(name, now_ms)
            return self._park(log_, request, now_ms)
        told = self.ends.get(name, 0)  # before any await: an advance during the read is seen
        answer = await self._answer(log_, request)
        if (not answer.data and answer.diverging is None and request.wait_ms
                and request.offset == answer.log_end >= answer.log_start and self.active):
            if self.ends.get(name, 0) == told:
                return self._park(log_, request, self._clock_ms())
            # The log advanced while the store's thread read: answered again at once.
            self._fence(request.server_id, request.epoch)
            answer = await self._answer(log_, request)
        return answer.to_wire()

    def _park(self, log_: ReplicatedLog, request: Fetch, now_ms: int) -> ParkedFetch:
        parked = ParkedFetch(request, log_, now_ms + request.wait_ms)  # waits with no task
        self.parked.park(parked, now_ms)
        return parked

    def _resume(self, parked: ParkedFetch) -> None:
        """A parked fetch woken (its log advanced; this master started or stopped) or past
        its deadline: fenced again, then answered now from memory (``_answer_now``) when it
        can be, else after a read on the store's thread, in a task."""
        request = parked.request
        try:
            self._fence(request.server_id, request.epoch)
            answer = self._answer_now(parked.log, request)
        except Exception as exc:  # its refusal (NotMaster, StaleEpoch, ...) is its answer
            parked.answer(exc)
            return
        if answer is not None:
            parked.answer(answer.to_wire())
            return
        task = asyncio.get_running_loop().create_task(self._answer_read(parked))
        self._reads.add(task)
        task.add_done_callback(self._reads.discard)

    async def _answer_read(self, parked: ParkedFetch) -> None:
        try:  # a woken fetch whose answer needs the store's thread (``_resume``)
            answer = await self._answer(parked.log, parked.request)
        except Exception as exc:
            parked.answer(exc)
            return
        parked.answer(answer.to_wire())

    def _ack_shipped(self, request: Fetch, now_ms: int) -> bool:
        """A slave's fetch at or below the end of what this master shipped it last (same log,
        this epoch) acknowledges its offset now, on the loop: those bytes are this master's
        own, checked against its history when they were shipped, so the owner thread's check
        (``_answer``, queued behind the next commit and its fsync) cannot find them diverging.
        A sync write waiting for them is answered a thread hop sooner. True when the fetch
        continues what was shipped (whether or not that raised anything)."""
        shipped = self._shipped.get((request.server_id, request.log))
        if shipped is None or request.offset > shipped:
            return False
        if self.tracker.acknowledge(request.server_id, request.log, request.offset):
            self.check_waiters(now_ms)
        return True

    def _fenced(self, log_: ReplicatedLog, request: Fetch) -> FetchAnswer | None:
        """A ``diverging`` answer to a fetch past the end this run began with, at an offset
        this run never shipped that fetcher up to (``RunFence``); else None. The slave holds
        records of this epoch this master lost before their fsync; it cuts them at that end.
        No answered message is cut: a send's answer waits for this master's fsync, and what it
        fsynced is in the log it restarted with (an ack past it may be: redelivered, 8.3)."""
        name = log_.name
        fence = self.fence.crossed(request.server_id, name, request.offset)
        if fence is None:
            return None
        ended = log_.history.end_of(request.last_epoch, fence)
        log.warning("group %s: %s fetches the %s log at offset %d, past the end %d this master "
                    "began its run of epoch %d with and past all this run shipped it: it holds "
                    "records this master lost before their fsync; it cuts them at %d",
                    self.group, request.server_id, name, request.offset, fence, self.epoch,
                    ended.end_offset)
        return FetchAnswer(self.epoch, name, request.offset, b"", request.offset,
                           self._log_starts[name], max(fence, self.ends.get(name, 0)), (),
                           (ended.epoch, ended.end_offset))

    def _ship_mark(self, server_id: str, name: str, end: int) -> None:
        """This run gave ``server_id`` log ``name`` up to ``end``: never fenced below it."""
        if self.active:
            self.fence.mark(server_id, name, end)

    async def _answer(self, log_: ReplicatedLog, request: Fetch) -> FetchAnswer:
        """The answer: on the loop when it can be (``_answer_now``), else a store read."""
        answer = self._answer_now(log_, request)
        if answer is None:
            answer = await log_.run(answer_fetch_io, log_, self.epoch, request.offset,
                                    request.last_epoch, request.max_bytes)
            self._log_starts[log_.name] = answer.log_start
            answer = self._answered(log_, request, answer)
        return answer

    def _answer_now(self, log_: ReplicatedLog, request: Fetch) -> FetchAnswer | None:
        """The answer given on the loop: ``diverging`` past the run's fence, or the records
        a tailing slave lacks from the commits kept in memory; else None (the store is read)."""
        fenced = self._fenced(log_, request)
        if fenced is not None:
            return fenced
        answer = self._fresh_answer(log_, request) if self.active else None
        return None if answer is None else self._answered(log_, request, answer)

    def _answered(self, log_: ReplicatedLog, request: Fetch, answer: FetchAnswer
                  ) -> FetchAnswer:
        """What an answer (not fenced) tells the master: what it shipped the fetcher, the
        offset the fetcher holds (``InSyncTracker``), the kinds it may read."""
        refused: UnreadableRecord | None = None
        if answer.data and log_.kinds is not None and not log_.kinds.reads <= request.reads:
            answer, refused = self._readable_part(log_, request, answer)
        if answer.diverging is None:
            # What this run shipped the fetcher, or where it told it to start again.
            self._ship_mark(request.server_id, log_.name,
                            max(answer.next_offset, answer.log_start))
        if answer.diverging is None and answer.offset >= answer.log_start:
            now_ms = self._clock_ms()
            if self.tracker.on_fetch(request.server_id, log_.name, request.offset,
                                     answer.log_end, now_ms):
                if self.active and answer.epoch == self.epoch:  # not a stale epoch's answer
                    self._shipped[(request.server_id, log_.name)] = answer.next_offset
                self.check_waiters(now_ms)
            elif request.server_id not in self._strangers:
                self._strangers.add(request.server_id)
                # Info: a new slave fetches before the master's next answer names it.
                log.info("group %s: %s fetches with an admin token but is not (yet) a "
                         "registered slave of the group: served, not counted as holding a "
                         "write", self.group, request.server_id)
        self.bytes_shipped[log_.name] += len(answer.data)
        if log_.requires:
            # Read after the records were: every record they refer to was committed before.
            answer.requires.update({name: self.ends.get(name, 0) for name in log_.requires})
        if refused is not None:
            raise refused  # after the fetch acknowledged the slave's offset, as any fetch does
        return answer

    def _readable_part(self, log_: ReplicatedLog, request: Fetch, answer: FetchAnswer
                       ) -> tuple[FetchAnswer, UnreadableRecord | None]:
        """``answer`` up to the first record of a gated kind the slave does not read (it would
        fail to decode it, and its store with it), and the refusal ``unreadable_record`` to
        raise when that is the first record (the answer is then empty). Only a slave that
        lacks some kind this master knows costs this walk over the records' headers."""
        assert log_.kinds is not None
        found = first_unread(answer.data, request.reads, log_.kinds.kind_of)
        if found is None:
            return answer, None
        position, kind = found
        offset = answer.offset + position
        if self.kind_reads.stopped(request.server_id, log_.name, offset, kind):
            log.warning("group %s: slave %s does not read record kind %d of the %s log (it "
                        "said it reads %s): its copy stops before offset %d until it is "
                        "upgraded", self.group, request.server_id, kind, log_.name,
                        sorted(request.reads) or "none", offset)
        refused = None
        if position == 0:
            refused = UnreadableRecord(
                f"group {self.group}: the record at offset {offset} of the {log_.name} log is "
                f"of kind {kind}, which {request.server_id} did not say it reads (fetch.reads "
                f"{sorted(request.reads)}): nothing is served past it; upgrade that server")
        epochs = tuple(e for e in answer.epochs if e[1] <= offset) or answer.epochs[:1]
        return FetchAnswer(answer.epoch, answer.log, answer.offset, answer.data[:position],
                           offset, answer.log_start, answer.log_end, epochs, None,
                           answer.requires), refused

    async def snapshot(self, request: Snapshot) -> dict:
        """Answer a slave's request for part of this master's newest checkpoint of a log."""
        self._fence(request.server_id, request.epoch)
        log_ = self.logs.get(request.log)
        if log_ is None or not log_.snapshots:
            raise NotFound(f"group {self.group} keeps no snapshot of log {request.log!r}")
        answer = await log_.run(snapshot_io, log_, self.epoch, request.sequence,
                                request.position, request.max_bytes)
        if answer is None:
            raise NotFound(f"checkpoint {request.sequence} of log {request.log} is gone; ask "
                           f"again with sequence 0")
        # The slave's copy starts where the checkpoint ends: never fenced below it.
        self._ship_mark(request.server_id, log_.name, answer.covers_offset)
        return answer.to_wire()

    # ------------------------------------------------------------------ reporting

    def slave_lag(self, server_id: str) -> int:
        """Bytes the slave lacks, over every log, as its last fetches acknowledged."""
        return sum(max(0, end - self.tracker.acked(server_id, name))
                   for name, end in self.ends.items())


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    """``wait_replicated``'s ``Replicated``: its future ends (unless it was cancelled)."""
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _call(done: Replicated, error: BaseException | None) -> None:
    """Tell one waiting write how its wait ended; a callback's own failure is logged (it must
    not keep the other writes from their answers)."""
    try:
        done(error)
    except Exception:
        log.exception("a sync write's answer failed after its slaves' copy was settled")


__all__ = ["INSYNC_LAG_MAX_MS_DEFAULT", "NoWriteReplication", "ReplicaSource",
           "WriteReplication"]
