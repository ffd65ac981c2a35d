"""The MetaServer's routes: where a subject's producers send and its consumers pull, planned and
kept per subject, with the answers and the groups' views cached between writes; the
``RoutesMixin`` part of ``metaserver.registry.Registry`` (split from it).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from metaserver.config import MetaConfig
from metaserver.errors import NoRoute
from metaserver.models import Broker, BrokerGroup, Subject, SubjectRoute
from metaserver.routing import GroupView, consumer_groups, delay_groups, plan_route, producer_groups

log = logging.getLogger("metaserver.registry")  # the registry's logger: these lines are its own

GROUP_VIEWS_CACHE_MS = 250
ROUTE_ANSWERS_CACHED_MAX = 50_000


class _RaceLost(Exception):
    """A concurrent transaction of another MetaServer changed what we read; run ours again."""


class RoutesMixin:
    """Route answers and planning of ``Registry``, which sets these fields (event loop)."""

    config: MetaConfig
    clock: Callable[[], int]
    _write_generation: int
    _views_cache: tuple[int, float, dict[str, GroupView]] | None
    _route_answers: dict[tuple[str, str], tuple[int, float, dict[str, Any]]]
    _read: Callable[[], contextlib.AbstractAsyncContextManager[AsyncSession]]
    _write: Callable[..., Awaitable[Any]]

    # -- routes ---------------------------------------------------------------------------------

    async def route(self, subject: str, role: str, kind: str) -> dict[str, Any]:
        """Return the route of ``subject`` for ``role``; creates the realtime assignment if new.
        A route that needs no change is answered from a read, not a write transaction: every
        client refreshes its routes every ``route_refresh_ms``."""
        if kind != "delay":
            unchanged = self._route_answer_cached(subject, role)
            if unchanged is not None:
                return unchanged
            generation = self._write_generation
            async with self._read() as s:
                unchanged = await self._route_unchanged(s, subject, role)
            if unchanged is not None and unchanged["groups"]:
                self._keep_route_answer(generation, subject, role, unchanged)
                return unchanged

        async def body(s: AsyncSession) -> dict[str, Any]:
            if kind == "delay":
                views = await _group_views(s)
                return {"subject": subject, "version": 0, "groups": delay_groups(role, views)}
            now = self.clock()
            # Lock the subject before reading its route: another MetaServer may be changing it.
            subj = await s.get(Subject, subject, with_for_update=True)
            views = await _group_views(s)
            rows = list(
                (await s.execute(select(SubjectRoute).where(SubjectRoute.subject == subject)))
                .scalars()
                .all()
            )
            if subj is None and rows:
                # Another MetaServer created the subject between our two reads.
                raise _RaceLost(f"subject {subject!r} appeared while being read")
            load = await _route_load(s)
            subj = await self._replan(s, subject, subj, rows, views, load, now)
            version = subj.version if subj is not None else 0
            if role == "producer":
                groups = producer_groups([r.group_name for r in rows if r.active], views)
            else:
                groups = consumer_groups([r.group_name for r in rows], views)
            return {"subject": subject, "version": version, "groups": groups}

        answer = await self._write(body)
        if not answer["groups"]:
            raise NoRoute(f"no live {kind} broker group can serve subject {subject!r}", subject)
        return answer

    def _route_answer_cached(self, subject: str, role: str) -> dict[str, Any] | None:
        """A route answer read less than GROUP_VIEWS_CACHE_MS ago with no write of ours
        committed since (the answer is shared: callers only read it)."""
        cached = self._route_answers.get((subject, role))
        if cached is None or cached[0] != self._write_generation \
                or cached[1] <= time.monotonic():
            return None
        return cached[2]

    def _keep_route_answer(self, generation: int, subject: str, role: str,
                           answer: dict[str, Any]) -> None:
        """Keep a route answer read under ``generation`` for GROUP_VIEWS_CACHE_MS: consumers
        in many processes ask for the same few routes (at 1,000 single-consumer processes on
        10 subjects, ~67 reads a second of 20 routes). Another MetaServer's change is seen as
        late as through the cached group views, and a write of ours drops it at once."""
        if generation != self._write_generation:
            return  # a write committed while we read: the answer may predate it
        if len(self._route_answers) >= ROUTE_ANSWERS_CACHED_MAX:
            self._route_answers.clear()
        self._route_answers[(subject, role)] = (
            generation, time.monotonic() + GROUP_VIEWS_CACHE_MS / 1000, answer)

    async def _route_unchanged(self, s: AsyncSession, subject: str,
                               role: str) -> dict[str, Any] | None:
        """The realtime route of ``subject`` read as it is, or None when it must be (re)planned
        (a write transaction does that under the subject's lock)."""
        subj = await s.get(Subject, subject)
        if subj is None:
            return None
        views = await self._group_views_cached(s)
        rows = list((await s.execute(
            select(SubjectRoute).where(SubjectRoute.subject == subject))).scalars().all())
        usable = {v.name for v in views.values() if v.kind == "realtime" and v.usable}
        active = [r.group_name for r in rows if r.active]
        # Whether the route must change does not depend on the load (which only picks the
        # groups to add), so the read path skips counting every subject's routes.
        if plan_route(active, usable, {}, self.config.route_groups_default) is not None:
            return None
        groups = (producer_groups(active, views) if role == "producer"
                  else consumer_groups([r.group_name for r in rows], views))
        return {"subject": subject, "version": subj.version, "groups": groups}

    async def _replan(
        self,
        s: AsyncSession,
        subject: str,
        subj: Subject | None,
        rows: list[SubjectRoute],
        views: dict[str, GroupView],
        load: dict[str, int],
        now: int,
    ) -> Subject | None:
        """Apply ``plan_route`` to one subject; updates ``rows`` and ``load`` in place."""
        usable = {v.name for v in views.values() if v.kind == "realtime" and v.usable}
        active = [r.group_name for r in rows if r.active]
        plan = plan_route(active, usable, load, self.config.route_groups_default)
        if plan is None:
            return subj
        if subj is None:
            subj = Subject(name=subject, version=1, created_at_ms=now, updated_at_ms=now)
            s.add(subj)
            await s.flush()
        else:
            subj.version += 1
            subj.updated_at_ms = now
        by_group = {r.group_name: r for r in rows}
        for row in rows:
            if row.active and row.group_name not in plan:
                row.active = False
                row.removed_at_ms = now
                load[row.group_name] = load.get(row.group_name, 1) - 1
        for name in plan:
            row = by_group.get(name)
            if row is None:
                row = SubjectRoute(subject=subject, group_name=name, added_at_ms=now)
                s.add(row)
                rows.append(row)
            elif row.active:
                continue
            row.active = True
            row.added_at_ms = now
            row.removed_at_ms = None
            load[name] = load.get(name, 0) + 1
        await s.flush()
        log.info("subject %r routed to %s (version %d)", subject, plan, subj.version)
        return subj

    async def _reconcile(self, s: AsyncSession, now: int) -> None:
        """Re-plan every subject after a broker or group changed state."""
        # Lock every subject (in name order, so two reconciles cannot deadlock) before reading
        # the routes, so a concurrent change on another MetaServer is not overwritten.
        locked = await s.execute(select(Subject).order_by(Subject.name).with_for_update())
        subjects = {x.name: x for x in locked.scalars()}
        views = await _group_views(s)
        load = await _route_load(s)
        rows_by_subject: dict[str, list[SubjectRoute]] = defaultdict(list)
        for row in (await s.execute(select(SubjectRoute))).scalars():
            rows_by_subject[row.subject].append(row)
        for name in sorted(subjects):
            await self._replan(s, name, subjects[name], rows_by_subject[name], views, load, now)

    async def delay_route(self, role: str) -> list[dict[str, Any]]:
        """The delay groups of a ``kind=delay`` route for ``role``, read without a write (the
        schedule runner asks on every pass)."""
        async with self._read() as s:
            return delay_groups(role, await self._group_views_cached(s))

    async def _group_views_cached(self, s: AsyncSession) -> dict[str, GroupView]:
        """``_group_views`` for read paths, reused for GROUP_VIEWS_CACHE_MS (see there)."""
        now_s = time.monotonic()
        cached = self._views_cache
        if cached is not None and cached[0] == self._write_generation and cached[1] > now_s:
            return cached[2]
        generation = self._write_generation
        views = await _group_views(s)
        if generation == self._write_generation:  # no write committed while we read
            self._views_cache = (generation, now_s + GROUP_VIEWS_CACHE_MS / 1000, views)
        return views


async def _group_views(s: AsyncSession) -> dict[str, GroupView]:
    """Return every broker group with its master's address (when the master is online): only
    masters serve clients, so only they are routed to (docs/REPLICATION.md 3)."""
    groups = {g.name: g for g in (await s.execute(select(BrokerGroup))).scalars()}
    views = {
        g.name: GroupView(name=g.name, kind=g.kind, readonly=g.readonly, epoch=g.epoch,
                          writable=g.writable)
        for g in groups.values()
    }
    online = await s.execute(select(Broker).where(Broker.state != "offline"))
    for broker in online.scalars():
        view = views.get(broker.group_name)
        if view is None:  # registered with a new group after the groups were read
            continue
        if broker.server_id != groups[broker.group_name].master_id:
            continue
        if broker.state == "rw":
            view.rw_addresses.append(broker.address)
        else:
            view.readonly_addresses.append(broker.address)
    return views


async def _route_load(s: AsyncSession) -> dict[str, int]:
    """Return the number of active subject routes per broker group."""
    result = await s.execute(
        select(SubjectRoute.group_name, func.count())
        .where(SubjectRoute.active.is_(True))
        .group_by(SubjectRoute.group_name)
    )
    return {name: count for name, count in result.all()}
