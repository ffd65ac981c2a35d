"""The schedule runner: hands each schedule's next occurrence to a delay server, the durable timer.

One runner per MetaServer, on its event loop. A pass has three steps:

1. **Claim** (one short transaction): the rows whose ``action_ms`` has come, locked with
   ``FOR UPDATE SKIP LOCKED`` (so two MetaServers over one PostgreSQL take different rows). For
   each, the planner (``metaserver.schedule_plan``) says which occurrences to hand over; they are
   written into the row's ``doubt`` list with this runner as ``doubt_owner`` and a lease
   (``action_ms`` = now + ``lease_ms``), and the row's progress ``after_ms`` moves past them.
   A row whose ``doubt`` list another runner left (it died, or its send failed) is claimed to be
   *resolved* instead.
2. **Hand over** (no transaction open): each occurrence is sent as a delayed message with id
   ``sched-<schedule id>-<fire ms>`` to the delay group chosen for the schedule. Resolving first
   cancels every listed occurrence at its delay group: one that was ``already_dispatched`` was
   delivered; any other answer means no copy is left, and (if the schedule is still active) it
   is sent again. So a crash between sending and confirming never leaves two copies.
3. **Confirm** (one short transaction): if the row still lists exactly what this runner claimed,
   the occurrences become the row's pending one and the list is cleared; if the schedule was
   paused or deleted meanwhile, what was sent goes onto the list to cancel instead.

Who sends is thus settled by a row lock and a lease in the database, never by the broker's
de-duplication (which stays a second line behind it: the ids are fixed by fire time).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from sqlalchemy import bindparam, delete, func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from metaserver.models import Schedule
from metaserver.registry import Registry
from metaserver.schedule_plan import FireTimes, SchedulePlanner, ScheduleSpecError, TriggerSpec
from metaserver.schedules import (
    ACTIVE,
    DELETED,
    FINISHED,
    occurrence_id,
    occurrence_properties,
    trigger_spec,
)
from sdk.connection import ConnectionPool
from wire.errors import NoRoute, QmqError
from wire.limits import MAX_SEND_BATCH_MESSAGES
from wire.message import Message, encode_message

log = logging.getLogger(__name__)

# Rows one pass claims at most (one transaction each way).
CLAIM_ROWS_MAX = 1000
# How long a claim is this runner's alone, in ms: longer than a send and a cancel can take.
LEASE_MS_DEFAULT = 30_000
# Wait for a delay server's answer, in ms.
REQUEST_TIMEOUT_MS_DEFAULT = 5_000
# Passes whose hand-over runs while the next batch is claimed, at most.
PASSES_IN_FLIGHT_MAX = 2
# Shortest sleep after a pass that found nothing it could claim, in ms.
IDLE_MS_MIN = 10
# After a failed hand-over or cancel, or with no delay group to send to, look again after this.
RETRY_AFTER_MS = 2_000
# A schedule whose definition cannot be planned (its time zone vanished) is tried this seldom.
BROKEN_RETRY_MS = 60_000
# Triggers kept built (an APScheduler trigger costs ~150 us to build, ~60 us to ask).
TRIGGER_CACHE_MAX = 200_000
# Cancel answers after which no copy of an occurrence is left at the delay group.
GONE_STATUSES = frozenset({"cancelled", "unknown", "already_cancelled"})
# Cancel answers saying the occurrence was (or is being) delivered.
DELIVERED_STATUSES = frozenset({"already_dispatched", "already_past"})
ERROR_CHARS_MAX = 500


# The table, read and written with Core in the runner's transactions: loading and flushing
# ORM objects cost several times the planning itself at 1,000 rows a pass.
_TABLE = Schedule.__table__
# The earliest action_ms of any row, read every poll while nothing is due: a Core statement
# built once (through the ORM it cost the event loop about 1.3 ms per read in `qmq up`).
_EARLIEST_ACTION = select(func.min(_TABLE.c.action_ms))
# What the runner changes in a row; written back with one executemany UPDATE per transaction.
_PROGRESS = ("state", "after_ms", "pending_fire_ms", "pending_group", "sent_count",
             "skipped_count", "doubt", "doubt_owner", "action_ms", "last_error")
_STORE = (update(_TABLE).where(_TABLE.c.id == bindparam("p_id"))
          .values({name: bindparam(f"p_{name}", type_=_TABLE.c[name].type)
                   for name in _PROGRESS}))


async def _load(s: AsyncSession, statement: Any) -> list[SimpleNamespace]:
    """The rows of ``statement`` as plain objects with one attribute per column."""
    return [SimpleNamespace(**row) for row in (await s.execute(statement)).mappings()]


async def _store(s: AsyncSession, rows: list[SimpleNamespace]) -> None:
    """Write the runner's columns of ``rows`` back."""
    if rows:
        await s.execute(_STORE, [{"p_id": row.id, **{f"p_{name}": getattr(row, name)
                                                    for name in _PROGRESS}} for row in rows])


@dataclass
class _Job:
    """One claimed row: what to hand over or resolve, and what came of it."""

    row_id: int
    name: str | None
    subject: str
    body: bytes
    tags: list[str]
    properties: dict[str, str]
    tz: str
    doubt: list[list[Any]]  # [fire_ms, group, resend] as claimed
    resolve: bool  # the list was left by another runner (or is a list to cancel)
    active: bool  # the row was active at claim time
    wake_ms: int | None = None  # a fresh plan's next wake (None: no occurrence left)
    sent: list[int] = field(default_factory=list)  # fire times now held by a delay group
    delivered: list[int] = field(default_factory=list)  # found already dispatched
    unsettled: list[list[Any]] = field(default_factory=list)
    group: str | None = None  # where ``sent`` went
    error: str | None = None


def runner_id() -> str:
    """``host-pid-random``: names this runner in ``doubt_owner``."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class ScheduleRunner:
    """Hands occurrences over to delay servers; see the module doc. Runs on one event loop."""

    def __init__(self, registry: Registry, planner: SchedulePlanner, *, token: str | None,
                 ssl_context: Any = None, poll_interval_ms: int = 1_000,
                 lease_ms: int = LEASE_MS_DEFAULT,
                 request_timeout_ms: int = REQUEST_TIMEOUT_MS_DEFAULT,
                 metrics: Any = None) -> None:
        self.registry = registry
        self.planner = planner
        self.owner = runner_id()
        self.poll_interval_ms = poll_interval_ms
        self.lease_ms = lease_ms
        self.request_timeout_ms = request_timeout_ms
        self.metrics = metrics
        self.pool = ConnectionPool(client_id=f"metaserver-{self.owner}", app="qmq-schedules",
                                   token=token, ssl_context=ssl_context)
        self._wakeup = asyncio.Event()
        self._triggers: dict[TriggerSpec, FireTimes] = {}

    def poke(self) -> None:
        """Look at the schedules now (one was created, paused, resumed or deleted)."""
        self._wakeup.set()

    async def close(self) -> None:
        """Close the connections to the delay servers."""
        await self.pool.close()

    async def run(self) -> None:
        """Run passes until cancelled, sleeping until the next row's ``action_ms`` (at most
        ``poll_interval_ms``: another MetaServer may have made work) or a poke. While full
        batches are due, the next batch is claimed while the last is handed over (at most
        PASSES_IN_FLIGHT_MAX at once)."""
        in_flight: set[asyncio.Task[None]] = set()
        try:
            while True:
                # Cleared before looking, so a poke made while a read runs is not lost.
                self._wakeup.clear()
                try:
                    # Nothing due yet (the usual case: no schedule, or the next one later):
                    # one small read says so. A claim pass (the delay route and a write
                    # transaction) every poll was most of an idle MetaServer's schedule CPU.
                    wait_ms = await self._idle_ms()
                    if wait_ms > 0:
                        await self._sleep(wait_ms)
                        continue
                    claimed, jobs, targets = await self._claim_pass()
                    if jobs:
                        task = asyncio.create_task(self._finish_logged(jobs, targets))
                        in_flight.add(task)
                        task.add_done_callback(in_flight.discard)
                    if claimed >= CLAIM_ROWS_MAX:
                        while len(in_flight) >= PASSES_IN_FLIGHT_MAX:
                            await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
                        continue
                    # Nothing claimable although rows are due: another MetaServer holds them
                    # locked right now; do not spin on them.
                    wait_ms = max(await self._idle_ms(), 0 if claimed else IDLE_MS_MIN)
                except Exception:
                    # A database hiccup must not end the runner; the next pass retries.
                    log.exception("schedule runner pass failed; retrying in %d ms",
                                  RETRY_AFTER_MS)
                    wait_ms = RETRY_AFTER_MS
                await self._sleep(wait_ms)
        finally:
            for task in list(in_flight):
                task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)

    async def _sleep(self, wait_ms: int) -> None:
        """Wait ``wait_ms`` or until poked (since the loop last looked), whichever is first."""
        # asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a cancel that arrives
        # as the event is set, and the runner then outlived its MetaServer's shutdown.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_ms / 1000):
                await self._wakeup.wait()

    async def _finish_logged(self, jobs: list[_Job], targets: list[dict[str, Any]]) -> None:
        try:
            await self._finish(jobs, targets)
        except Exception:
            # The rows stay claimed until their lease ends; then any runner resolves them.
            log.exception("handing over %d schedule(s) failed; resolved after the lease",
                          len(jobs))

    async def _idle_ms(self) -> int:
        """Milliseconds until the earliest ``action_ms``, capped at the poll interval."""
        engine = self.registry.engine
        assert engine is not None, "Registry.open() was not called"
        async with engine.connect() as conn:  # a read: no ORM session needed
            earliest = (await conn.execute(_EARLIEST_ACTION)).scalar()
        if earliest is None:
            return self.poll_interval_ms
        return max(0, min(self.poll_interval_ms, earliest - self.registry.clock()))

    async def run_once(self) -> int:
        """One pass: claim, hand over, confirm. Returns the number of rows claimed."""
        claimed, jobs, targets = await self._claim_pass()
        if jobs:
            await self._finish(jobs, targets)
        return claimed

    async def _claim_pass(self) -> tuple[int, list[_Job], list[dict[str, Any]]]:
        """Step 1: (rows claimed, the jobs among them, the delay groups to send to)."""
        now_ms = self.registry.clock()
        targets = await self.registry.delay_route("producer")
        # Schedule rows only: remembered broker heartbeat answers stay good (structural).
        claimed, jobs = await self.registry._write(lambda s: self._claim(s, now_ms, targets),
                                                   structural=False)
        return claimed, jobs, targets

    async def _finish(self, jobs: list[_Job], targets: list[dict[str, Any]]) -> None:
        """Steps 2 and 3."""
        await self._resolve(jobs)
        await self._hand_over(jobs, targets)
        await self.registry._write(lambda s: self._confirm(s, jobs), structural=False)

    # -- 1. claim -------------------------------------------------------------------------------

    async def _claim(self, s: AsyncSession, now_ms: int,
                     targets: list[dict[str, Any]]) -> tuple[int, list[_Job]]:
        rows = await _load(s, select(_TABLE).where(_TABLE.c.action_ms <= now_ms)
                           .order_by(_TABLE.c.action_ms).limit(CLAIM_ROWS_MAX)
                           .with_for_update(skip_locked=True))
        jobs = []
        for row in rows:
            if row.doubt is not None:
                jobs.append(self._job(row, resolve=True))
                self._own(row, now_ms)
            elif row.state != ACTIVE:
                row.action_ms = None
            elif row.pending_fire_ms is not None and row.pending_fire_ms > now_ms:
                row.action_ms = row.pending_fire_ms  # woke early: it has not fired yet
            elif not targets:
                row.last_error = "no delay group is usable: nothing can be handed over"
                row.action_ms = now_ms + RETRY_AFTER_MS
            else:
                job = self._plan(row, now_ms, targets)
                if job is not None:
                    jobs.append(job)
        await _store(s, rows)
        return len(rows), jobs

    def _plan(self, row: Any, now_ms: int, targets: list[dict[str, Any]]) -> _Job | None:
        """Plan one active row; a job when there is something to hand over."""
        try:
            plan = self.planner.plan(self._fire_times(trigger_spec(row)), row.after_ms, now_ms,
                                     row.misfire)
        except ScheduleSpecError as exc:
            log.error("schedule %r cannot be planned: %s", row.name, exc)
            row.last_error = str(exc)[:ERROR_CHARS_MAX]
            row.action_ms = now_ms + BROKEN_RETRY_MS
            return None
        if plan.skipped:
            # No silent give-up: say which schedule skipped how many, and why.
            log.warning("schedule %r: %s%d missed occurrence(s) up to %d skipped (misfire %s, "
                        "grace %d ms)", row.name, "at least " if plan.skipped_more else "",
                        plan.skipped, plan.after_ms, row.misfire, self.planner.grace_ms)
            row.skipped_count += plan.skipped
            self._count("skipped", plan.skipped)
        row.after_ms = plan.after_ms
        if not plan.fires_ms:
            row.state = FINISHED if plan.finished else row.state
            row.action_ms = plan.wake_ms
            return None
        group = targets[row.id % len(targets)]["group"]
        row.doubt = [[fire_ms, group, 1] for fire_ms in plan.fires_ms]
        job = self._job(row, resolve=False)
        job.wake_ms = plan.wake_ms
        self._own(row, now_ms)
        return job

    def _own(self, row: Any, now_ms: int) -> None:
        row.doubt_owner = self.owner
        row.action_ms = now_ms + self.lease_ms

    @staticmethod
    def _job(row: Any, resolve: bool) -> _Job:
        return _Job(row.id, row.name, row.subject, row.body, list(row.tags),
                    dict(row.properties), row.tz, [list(entry) for entry in row.doubt],
                    resolve, row.state == ACTIVE)

    def _fire_times(self, spec: TriggerSpec) -> FireTimes:
        times = self._triggers.get(spec)
        if times is None:
            if len(self._triggers) >= TRIGGER_CACHE_MAX:
                self._triggers.clear()
            times = self._triggers[spec] = FireTimes(spec)
        return times

    # -- 2. hand over ---------------------------------------------------------------------------

    async def _resolve(self, jobs: list[_Job]) -> None:
        """Cancel every occurrence on a list another runner left; note what is to be resent."""
        by_group: dict[str, list[tuple[_Job, list[Any]]]] = defaultdict(list)
        for job in jobs:
            if job.resolve:
                for entry in job.doubt:
                    by_group[entry[1]].append((job, entry))
        consumer_groups = {g["group"]: g for g in await self.registry.delay_route("consumer")}
        for group, items in by_group.items():
            ids = [occurrence_id(job.row_id, entry[0]) for job, entry in items]
            fires = [entry[0] for _job, entry in items]
            try:
                answer = await self._request(consumer_groups.get(group),
                                             {"op": "cancel", "ids": ids, "deliver_at_ms": fires})
                statuses = [r.get("status") for r in answer["results"]]
            except QmqError as exc:
                statuses = [f"error {exc.code}: {exc.message}"] * len(items)
            for (job, entry), status in zip(items, statuses):
                if status in DELIVERED_STATUSES:
                    job.delivered.append(entry[0])
                elif status in GONE_STATUSES:
                    if entry[2] and job.active:
                        job.unsettled.append(entry)  # to send again below
                else:
                    job.unsettled.append([*entry[:2], 0, status])  # still in doubt

    async def _hand_over(self, jobs: list[_Job], targets: list[dict[str, Any]]) -> None:
        """Send the claimed occurrences (and those a resolve found gone) to their delay group."""
        by_group: dict[str, list[tuple[_Job, int]]] = defaultdict(list)
        for job in jobs:
            entries = job.doubt if not job.resolve else job.unsettled
            keep = []
            for entry in entries:
                if len(entry) > 3:  # a cancel that failed: stays in doubt
                    keep.append(entry[:3])
                    job.error = f"cancel of {entry[0]} at {entry[1]}: {entry[3]}"
                else:
                    by_group[entry[1]].append((job, entry[0]))
            job.unsettled = keep
        groups = {g["group"]: g for g in targets}
        now_ms = self.registry.clock()
        for group, items in by_group.items():
            payloads = [self._payload(job, fire_ms, now_ms) for job, fire_ms in items]
            results: list[Any] = []
            try:
                for start in range(0, len(payloads), MAX_SEND_BATCH_MESSAGES):
                    chunk = payloads[start:start + MAX_SEND_BATCH_MESSAGES]
                    answer = await self._request(groups.get(group),
                                                 {"op": "send", "messages": chunk})
                    results += answer["results"]
            except QmqError as exc:
                results += [{"error": {"code": exc.code, "message": exc.message}}] * (
                    len(items) - len(results))
            for (job, fire_ms), result in zip(items, results):
                if result.get("status") == "stored":
                    job.sent.append(fire_ms)
                    job.group = group
                else:
                    job.unsettled.append([fire_ms, group, 1])
                    error = result.get("error") or {}
                    job.error = (f"hand-over of {fire_ms} to {group}: {error.get('code')}: "
                                 f"{error.get('message')}")

    def _payload(self, job: _Job, fire_ms: int, now_ms: int) -> bytes:
        props = occurrence_properties(job.name, job.tz, job.properties, fire_ms)
        message = Message.create(job.subject, job.body, now_ms=now_ms, tags=job.tags,
                                 properties=props, deliver_at_ms=fire_ms,
                                 id=occurrence_id(job.row_id, fire_ms))
        return encode_message(message)

    async def _request(self, group: dict[str, Any] | None, op: dict[str, Any]) -> dict[str, Any]:
        """``op`` to the first address of ``group`` that answers."""
        if group is None or not group["addresses"]:
            raise NoRoute("the delay group has no live broker")
        last: QmqError | None = None
        for address in group["addresses"]:
            try:
                return await self.pool.request(address, op, self.request_timeout_ms)
            except QmqError as exc:
                if not exc.retriable:
                    raise
                last = exc
        assert last is not None
        raise last

    # -- 3. confirm -----------------------------------------------------------------------------

    async def _confirm(self, s: AsyncSession, jobs: list[_Job]) -> None:
        now_ms = self.registry.clock()
        rows = {row.id: row for row in await _load(
            s, select(_TABLE).where(_TABLE.c.id.in_([job.row_id for job in jobs]))
            .order_by(_TABLE.c.id).with_for_update())}
        mine = []
        for job in jobs:
            row = rows.get(job.row_id)
            if row is None or row.doubt_owner != self.owner or row.doubt != job.doubt:
                continue  # our lease ran out and another runner took over: its resolve decides
            mine.append(row)
            self._count("sent", len(job.sent))
            if job.unsettled:
                self._count("failed", len(job.unsettled))
                log.warning("schedule %r: %d occurrence(s) not settled, retrying in %d ms: %s",
                            job.name, len(job.unsettled), RETRY_AFTER_MS, job.error)
            if row.state == ACTIVE and job.active:
                self._settle_active(row, job, now_ms)
            else:
                await self._settle_stopped(s, row, job, now_ms)
        await _store(s, [row for row in mine if not getattr(row, "deleted", False)])

    def _settle_active(self, row: Any, job: _Job, now_ms: int) -> None:
        done = job.sent + job.delivered
        if job.sent:
            row.pending_fire_ms = max(job.sent)
            row.pending_group = job.group
        row.sent_count += len(done)
        if done:
            row.after_ms = max(row.after_ms, max(done))
        if job.unsettled:
            row.doubt, row.doubt_owner = job.unsettled, None
            row.action_ms = now_ms + RETRY_AFTER_MS
            row.last_error = (job.error or "")[:ERROR_CHARS_MAX]
            return
        row.doubt = row.doubt_owner = row.last_error = None
        if not job.resolve:
            row.action_ms = job.wake_ms
            row.state = FINISHED if job.wake_ms is None else ACTIVE
        else:  # plan again once the pending occurrence has fired
            pending = row.pending_fire_ms
            row.action_ms = pending if pending is not None and pending > now_ms else now_ms

    async def _settle_stopped(self, s: AsyncSession, row: Any, job: _Job,
                              now_ms: int) -> None:
        """The row was paused or deleted (before or during this pass)."""
        to_cancel = [[fire_ms, job.group, 0] for fire_ms in job.sent]
        to_cancel += [[fire_ms, group, 0] for fire_ms, group, *_rest in job.unsettled]
        if row.pending_fire_ms is not None and row.pending_group:
            to_cancel.append([row.pending_fire_ms, row.pending_group, 0])
            row.pending_fire_ms = row.pending_group = None
        if to_cancel:
            row.doubt, row.doubt_owner = to_cancel, None
            row.action_ms = now_ms if not job.unsettled else now_ms + RETRY_AFTER_MS
            return
        if row.state == DELETED:
            await s.execute(delete(Schedule).where(Schedule.id == row.id))
            row.deleted = True
            return
        row.doubt = row.doubt_owner = None
        row.action_ms = now_ms if row.state == ACTIVE else None  # resumed meanwhile: plan

    def _count(self, what: str, count: int) -> None:
        if count and self.metrics is not None:
            self.metrics.schedule_occurrences.labels(what).inc(count)
