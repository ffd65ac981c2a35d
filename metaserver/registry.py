"""The MetaServer's state operations: brokers, routes, clients, expiry and the admin views.

Every write is one database transaction. On SQLite, writes of this process are also serialized by
an asyncio lock (SQLite has one writer anyway); on PostgreSQL, several MetaServers may share the
database: the subject row is locked while its route changes, and a transaction that loses an
insert race (IntegrityError) is retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from metaserver.backlog import (
    backlog_summaries, backlog_views, master_backlog_rows, store_backlog)
from metaserver.broker_liveness import BrokerLiveness
from metaserver.config import MetaConfig
from metaserver.db import make_engine, upgrade_database
from metaserver.errors import BadRequest, NoRoute, NotFound
from metaserver.liveness import ClientLiveness, write_clients
from metaserver.models import Broker, BrokerGroup, Client, ConsumerGroup, Subject, SubjectRoute
from metaserver.replication import (
    ReplicationOps,
    RoleRequest,
    apply_replica,
    apply_settings,
    find_server,
    finish_handover,
    hand_over_on_leave,
    new_group,
    promote,
    role_answer,
    servers_of,
    settle_role,
    supersede,
    synthetic_id,
)
from metaserver.routing import (
    GroupView,
    broker_state,
    consumer_groups,
    delay_groups,
    plan_route,
    producer_groups,
)
from serverkit.periodic import run_every

log = logging.getLogger(__name__)

Clock = Callable[[], int]
T = TypeVar("T")

# Counts a realtime broker's heartbeat backlog rows carry since it started, summed per
# (group, subject) over the online brokers by list_consumer_groups.
GROUP_COUNTS = ("redelivered", "retried", "dead")
# Attempts of a write transaction that lost an insert race to another MetaServer.
WRITE_ATTEMPTS_MAX = 3
# How long route reads reuse the broker groups' view (every group, its master's address), in
# ms. A committed write of this MetaServer drops it at once, so only another MetaServer's change
# (an expiry, a promotion) is seen up to this late: the default failover check interval. At
# 1,000 idle consumers refreshing their routes the view was read ~70 times a second.
GROUP_VIEWS_CACHE_MS = 250
# Route answers kept for GROUP_VIEWS_CACHE_MS at most; past this many the cache starts again
# (each is a few hundred bytes; a MetaServer of 10,000 subjects answers both roles).
ROUTE_ANSWERS_CACHED_MAX = 50_000


class _RaceLost(Exception):
    """A concurrent transaction of another MetaServer changed what we read; run ours again."""


class Registry:
    """Brokers, routes and clients over the MetaServer database; time comes from ``clock`` (wall
    ms, stored in rows) and ``mono_clock`` (monotonic ms, for lease watches only)."""

    def __init__(self, config: MetaConfig, clock: Clock, mono_clock: Clock | None = None) -> None:
        self.config = config
        self.clock = clock
        self.mono_clock = mono_clock or clock
        self.engine: AsyncEngine | None = None
        self.revision: str | None = None
        self._sessions: async_sessionmaker[AsyncSession] | None = None
        self._write_lock: contextlib.AbstractAsyncContextManager[Any] = contextlib.nullcontext()
        self._started_ms = 0
        self.write_transactions = 0  # committed write transactions (the event loop's; metrics)
        self.liveness = ClientLiveness()  # client heartbeats that only say "still here"
        self.broker_liveness = BrokerLiveness()  # likewise for broker heartbeats
        self.replication = ReplicationOps(self)
        # Bumped by every committed write; a cached view read under an older one is not kept.
        self._write_generation = 0
        # (generation, monotonic expiry s, views) for route reads; read-only to its users.
        self._views_cache: tuple[int, float, dict[str, GroupView]] | None = None
        # (subject, role) -> (generation, monotonic expiry s, answer) of realtime route reads.
        self._route_answers: dict[tuple[str, str], tuple[int, float, dict[str, Any]]] = {}

    async def open(self) -> None:
        """Open the database and apply pending migrations."""
        self.engine = make_engine(self.config.db_url)
        try:
            self.revision = await upgrade_database(self.engine)
        except BaseException:
            await self.engine.dispose()
            raise
        if self.engine.dialect.name == "sqlite":
            self._write_lock = asyncio.Lock()
        self._sessions = async_sessionmaker(self.engine, expire_on_commit=False)
        self._started_ms = self.clock()

    async def close(self) -> None:
        """Write the heartbeat times still pending, then close the database connections."""
        if self.engine is not None and (self.liveness.pending or self.broker_liveness.pending):
            async def body(s: AsyncSession) -> None:
                await self.liveness.flush(s)
                await self.broker_liveness.flush(s)

            try:
                await self._write(body, structural=False)
            except Exception:  # closing anyway: the next heartbeats restore them
                log.warning("heartbeat times not written at close", exc_info=True)
        if self.engine is not None:
            await self.engine.dispose()
            self.engine = None

    # -- transactions ---------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _read(self) -> AsyncIterator[AsyncSession]:
        """Yield a session for reading."""
        assert self._sessions is not None, "Registry.open() was not called"
        async with self._sessions() as session:
            yield session

    async def _write(self, body: Callable[[AsyncSession], Awaitable[T]],
                     structural: bool | Callable[[T], bool] = True) -> T:
        """Run ``body`` in one write transaction, retrying when it lost an insert race.
        ``structural`` (or, called with the result, what it says): the write may have changed
        a broker group's rows or a heartbeat's answer, so remembered heartbeat answers are not
        reused (metaserver.broker_liveness). Only writes known to touch neither say False."""
        assert self._sessions is not None, "Registry.open() was not called"
        for attempt in range(1, WRITE_ATTEMPTS_MAX + 1):
            try:
                async with self._write_lock, self._sessions() as session, session.begin():
                    result = await body(session)
                self.write_transactions += 1
                self._write_generation += 1
                self._views_cache = None
                if structural is True or (callable(structural) and structural(result)):
                    self.broker_liveness.changed()
                return result
            except (IntegrityError, _RaceLost):
                if attempt == WRITE_ATTEMPTS_MAX:
                    raise
                log.info("write transaction lost a race (attempt %d); retrying", attempt)
        raise AssertionError("unreachable")

    # -- brokers --------------------------------------------------------------------------------

    async def register_broker(
        self, group: str, kind: str, address: str, state: str, role: RoleRequest | None = None
    ) -> dict[str, Any]:
        """Register (or re-register after a restart) a server of ``group``: the server id in
        ``role`` names it (``addr:<group>/<address>`` when it sent none); the answer says its
        role, epoch and lease (docs/REPLICATION.md 3)."""
        req = role or RoleRequest(server_id=synthetic_id(group, address))

        async def body(s: AsyncSession) -> dict[str, Any]:
            now = self.clock()
            grp = await s.get(BrokerGroup, group, with_for_update=True)
            if grp is None:
                grp = new_group(group, kind, req, now)
                s.add(grp)
                await s.flush()
            elif grp.kind != kind:
                raise BadRequest(f"broker group {group!r} is a {grp.kind} group, not {kind}")
            broker = await find_server(s, req.server_id)
            if broker is not None and broker.group_name != group:
                raise BadRequest(f"server {req.server_id} belongs to group "
                                 f"{broker.group_name!r}, not {group!r}: its data is that "
                                 "group's")
            effective = broker_state(grp.readonly)
            await supersede(s, group, address, req.server_id)
            if broker is None:
                broker = Broker(group_name=group, kind=kind, address=address, stats=None,
                                server_id=req.server_id, role="slave", in_sync=False)
                s.add(broker)
            broker.address = address
            broker.reported_state = state
            broker.state = effective
            broker.last_heartbeat_ms = now
            broker.registered_at_ms = now
            apply_settings(grp, req.replication, req.server_id)
            settle_role(grp, broker, req, now)
            await s.flush()
            await self._reconcile(s, now)
            return {
                "broker_id": broker.id,
                "state": effective,
                **role_answer(grp, broker, await servers_of(s, group), self.config.lease_ms,
                              self.config.heartbeat_interval_ms),
            }

        return await self._write(body)

    async def heartbeat_broker(
        self,
        group: str,
        kind: str,
        address: str,
        state: str,
        backlog: list[Any] | dict[str, Any] | None,
        stats: dict[str, Any] | None,
        backlog_base: int | None = None,
        backlog_changes: list[dict[str, Any]] | None = None,
        backlog_removed: list[list[str]] | None = None,
        role: RoleRequest | None = None,
    ) -> dict[str, Any]:
        """Record a heartbeat: a master's renews its lease and carries its in-sync proposal;
        what it says of its backlog is applied (metaserver.backlog; none: the last one stays).
        NotFound when the server must register (again)."""
        req = role or RoleRequest(server_id=synthetic_id(group, address))
        signature = self.broker_liveness.signature(
            group, kind, address, state, req.epoch, req.role, req.master_id, req.replication,
            req.replica)
        answer = self.broker_liveness.answer(req.server_id, signature, req.replica,
                                             self.clock(), self.mono_clock())
        if answer is None:
            answer = await self._heartbeat_write(group, kind, address, state, req, signature)
        if backlog is not None or backlog_base is not None or stats is not None:
            # An older broker's backlog on its heartbeat: stored in a transaction of its own,
            # after the renewal's, as a report would be (the renewal never waits for rows).
            version = await self.report_backlog(
                group, address, backlog=backlog, backlog_base=backlog_base,
                backlog_changes=backlog_changes, backlog_removed=backlog_removed, stats=stats,
                server_id=req.server_id)
            if backlog_base is not None or isinstance(backlog, list):
                answer["backlog_version"] = version["backlog_version"]
        return answer

    async def _heartbeat_write(self, group: str, kind: str, address: str, state: str,
                               req: RoleRequest, signature: tuple[Any, ...]) -> dict[str, Any]:
        """A heartbeat written in full (renewal, role, replica figures and proposal); its
        answer is remembered when its group needs no lease (metaserver.broker_liveness)."""
        generation = self.broker_liveness.generation

        async def body(s: AsyncSession) -> tuple[dict[str, Any], bool]:
            now = self.clock()
            broker = await find_server(s, req.server_id)
            if broker is None or broker.state == "offline" or broker.group_name != group:
                raise NotFound(
                    f"broker {address!r} (server {req.server_id}) of group {group!r} is not "
                    "registered" + (" (marked offline)" if broker is not None else "")
                    + "; register again"
                )
            if broker.kind != kind:
                raise BadRequest(f"broker {address!r} is a {broker.kind} broker, not {kind}")
            grp = await s.get(BrokerGroup, group, with_for_update=True)
            assert grp is not None, f"broker {broker.id} has no group row"
            effective = broker_state(grp.readonly)
            changed = effective != broker.state or broker.address != address
            broker.address = address
            broker.reported_state = state
            broker.state = effective
            broker.last_heartbeat_ms = now
            changed |= settle_role(grp, broker, req, now)
            servers = await servers_of(s, group)
            insync_before = [other.in_sync for other in servers]
            changed |= apply_replica(grp, broker, servers, req)
            # Another server's in-sync flag changed: other servers' answers change too.
            structural = changed or insync_before != [other.in_sync for other in servers]
            handover = finish_handover(grp, broker, req)
            if handover is not None and await promote(s, grp, handover, now,
                                                      self.config.broker_expiry_ms):
                self.replication.stats.promotions["switchover"] += 1
                changed = True
            if changed:
                await s.flush()
                await self._reconcile(s, now)
                # A promotion or the reconcile may have changed the group's rows: read them
                # again. Otherwise ``servers`` are the rows as they stand (the session's identity
                # map holds one object per row, changed in place), and a second query would
                # cost a flush and a select on every renewal for nothing.
                servers = await servers_of(s, group)
            answer: dict[str, Any] = {
                "ok": True,
                "state": effective,
                **role_answer(grp, broker, servers, self.config.lease_ms,
                              self.config.heartbeat_interval_ms),
            }
            return answer, structural

        answer, _ = await self._write(body, structural=lambda result: result[1])
        self.broker_liveness.written(req.server_id, signature, answer, self.mono_clock(),
                                     generation)
        return answer

    async def report_backlog(
        self,
        group: str,
        address: str,
        *,
        backlog: list[Any] | dict[str, Any] | None,
        stats: dict[str, Any] | None,
        backlog_base: int | None = None,
        backlog_changes: list[dict[str, Any]] | None = None,
        backlog_removed: list[list[str]] | None = None,
        server_id: str | None = None,
        kind: str | None = None,
    ) -> dict[str, Any]:
        """Apply a server's backlog report (metaserver.backlog) in a transaction that writes
        only the backlog tables; ``{ok, backlog_version}``. NotFound when the server is not
        registered (its heartbeats will register it again)."""
        wanted = server_id or synthetic_id(group, address)

        async def body(s: AsyncSession) -> dict[str, Any]:
            broker = await find_server(s, wanted)
            if broker is None or broker.state == "offline" or broker.group_name != group:
                raise NotFound(f"server {wanted} of group {group!r} is not registered")
            if kind is not None and broker.kind != kind:
                raise BadRequest(f"server {wanted} is a {broker.kind} server, not {kind}")
            version = await store_backlog(
                s, wanted, backlog=backlog, base=backlog_base, changes=backlog_changes or [],
                removed=backlog_removed or [], stats=stats)
            return {"ok": True, "backlog_version": version}

        return await self._write(body, structural=False)  # the backlog tables only

    async def deregister_broker(self, group: str, address: str,
                                server_id: str | None = None) -> dict[str, Any]:
        """Mark a broker offline at once (a clean shutdown). A master that leaves a group with an
        online in-sync slave hands it over at once: the master stopped writing before it left."""
        wanted = server_id or synthetic_id(group, address)

        async def body(s: AsyncSession) -> dict[str, Any]:
            now = self.clock()
            broker = await find_server(s, wanted)
            if broker is None or broker.group_name != group:
                raise NotFound(f"broker {address!r} (server {wanted}) of group {group!r} is "
                               "not registered")
            broker.state = "offline"
            grp = await s.get(BrokerGroup, group, with_for_update=True)
            assert grp is not None, f"broker {broker.id} has no group row"
            if grp.master_id == broker.server_id and await hand_over_on_leave(
                    s, grp, now, self.config.broker_expiry_ms):
                self.replication.stats.promotions["master shut down"] += 1
            await s.flush()
            await self._reconcile(s, now)
            return {"ok": True}

        return await self._write(body)

    async def set_group_readonly(self, group: str, readonly: bool) -> dict[str, Any]:
        """Set or clear the admin's readonly flag of a broker group."""

        async def body(s: AsyncSession) -> dict[str, Any]:
            now = self.clock()
            grp = await s.get(BrokerGroup, group)
            if grp is None:
                raise NotFound(f"broker group {group!r} does not exist")
            grp.readonly = readonly
            brokers = (await s.execute(select(Broker).where(Broker.group_name == group))).scalars()
            for broker in brokers:
                if broker.state != "offline":
                    broker.state = broker_state(readonly)
            await s.flush()
            await self._reconcile(s, now)
            return {"ok": True, "group": group, "readonly": readonly}

        return await self._write(body)

    # -- expiry ---------------------------------------------------------------------------------

    async def expire_now(self) -> dict[str, int]:
        """Mark brokers and clients whose last heartbeat is too old offline; return the counts.

        Nothing expires during the first expiry period after start, so a MetaServer that was down
        for a while does not drop every broker before they had a chance to heartbeat again.
        """

        async def body(s: AsyncSession) -> dict[str, int]:
            now = self.clock()
            brokers = clients = 0
            await self.liveness.flush(s)  # first: expiry must see every heartbeat noted
            await self.broker_liveness.flush(s)
            if now - self._started_ms > self.config.broker_expiry_ms:
                result = await s.execute(
                    update(Broker)
                    .where(
                        Broker.state != "offline",
                        Broker.last_heartbeat_ms < now - self.config.broker_expiry_ms,
                    )
                    .values(state="offline")
                )
                brokers = result.rowcount or 0
            if now - self._started_ms > self.config.client_expiry_ms:
                stale = (Client.online.is_(True),
                         Client.last_seen_ms < now - self.config.client_expiry_ms)
                expired = list((await s.execute(select(Client.client_id).where(*stale)))
                               .scalars())
                if expired:
                    result = await s.execute(update(Client).where(*stale).values(online=False))
                    clients = result.rowcount or 0
                    for client_id in expired:  # their next heartbeats must set them online
                        self.liveness.forget(client_id)
            if brokers:
                await self._reconcile(s, now)
            return {"brokers_offline": brokers, "clients_offline": clients}

        result = await self._write(body, structural=lambda counts: counts["brokers_offline"] > 0)
        if result["brokers_offline"] or result["clients_offline"]:
            log.info("expired %(brokers_offline)d broker(s), %(clients_offline)d client(s)", result)
        return result

    async def run_expiry_loop(self) -> None:
        """Run ``expire_now`` every ``expiry_check_interval_ms`` until cancelled (a database
        hiccup does not end it: the next round retries)."""
        await run_every(self.config.expiry_check_interval_ms, self.expire_now, log,
                        "expiry check")

    async def run_failover_loop(self) -> None:
        """Run the failover check every ``failover_check_interval_ms`` until cancelled."""
        interval_s = self.config.failover_check_interval_ms / 1000
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.replication.check()
            except Exception:
                # A database hiccup must not end failover for good; the next round retries.
                log.exception("failover check failed; retrying in %.3f s", interval_s)

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

    # -- clients --------------------------------------------------------------------------------

    async def client_heartbeat(
        self, client_id: str, app: str, group: str, subjects: list[str], role: str
    ) -> dict[str, Any]:
        """Record that a producer or consumer is alive, and the (group, subject) pairs it uses.
        A heartbeat that repeats what is stored is only noted, and written in a batch with the
        others by the next expiry check (metaserver.liveness)."""
        await self.client_heartbeats([{"client_id": client_id, "app": app, "group": group,
                                       "subjects": subjects, "role": role}], [])
        return {"ok": True}

    async def client_heartbeats(self, clients: list[dict[str, Any]],
                                left: list[str]) -> dict[str, Any]:
        """A client process's heartbeat for all of its clients at once (``clients``: each a
        single heartbeat's fields) and those that closed since (``left``). Heartbeats that
        repeat what is stored are only noted, as ``client_heartbeat``'s; the new or changed
        ones and the leaves go in one write transaction, not one each. Returns how many were
        written and noted."""
        for client_id in left:
            self.liveness.forget(client_id)
        gone = set(left)
        now_ms = self.clock()
        fresh: dict[str, dict[str, Any]] = {}
        noted = 0
        for client in clients:
            if client["client_id"] in gone:
                continue  # closed since: its leave wins
            signature = self.liveness.signature(client["app"], client["group"], client["role"],
                                                client["subjects"])
            if self.liveness.note(client["client_id"], signature, now_ms):
                noted += 1
            else:
                fresh[client["client_id"]] = client
        if not fresh and not left:
            return {"ok": True, "written": 0, "noted": noted}

        async def body(s: AsyncSession) -> None:
            await write_clients(s, list(fresh.values()), self.clock())
            if left:
                await s.execute(update(Client).where(Client.client_id.in_(left))
                                .values(online=False, last_seen_ms=self.clock()))

        await self._write(body, structural=False)  # client rows and consumer groups only
        for client in fresh.values():
            self.liveness.written(client["client_id"], self.liveness.signature(
                client["app"], client["group"], client["role"], client["subjects"]))
        return {"ok": True, "written": len(fresh), "noted": noted}

    async def client_leave(self, client_id: str) -> dict[str, Any]:
        """Mark a client offline now (it closed), instead of after ``client_expiry_ms``.
        ``known`` says whether the client had ever sent a heartbeat."""
        self.liveness.forget(client_id)

        async def body(s: AsyncSession) -> dict[str, Any]:
            client = await s.get(Client, client_id)
            if client is None:
                return {"ok": True, "known": False}
            client.online = False
            client.last_seen_ms = self.clock()
            return {"ok": True, "known": True}

        return await self._write(body, structural=False)

    # -- admin views ----------------------------------------------------------------------------

    async def list_brokers(self, *, backlog_rows: bool = True) -> list[dict[str, Any]]:
        """Return every broker with its state and the age of its last heartbeat. Without
        ``backlog_rows`` a realtime broker's ``stats`` carries ``backlog_total`` (sum of lag,
        number of rows) instead of its rows (``backlog_summaries``)."""
        now = self.clock()
        async with self._read() as s:
            groups = {g.name: g for g in (await s.execute(select(BrokerGroup))).scalars()}
            brokers = (
                await s.execute(select(Broker).order_by(Broker.group_name, Broker.address))
            ).scalars().all()
            backlogs = await (backlog_views(s) if backlog_rows else backlog_summaries(s))
            rows = []
            for b in brokers:
                noted = self.broker_liveness.noted(b.server_id) if b.state != "offline" else None
                seen = max(b.last_heartbeat_ms, noted["seen"]) if noted else b.last_heartbeat_ms
                figures = noted if noted and "position" in noted else {
                    "position": b.position, "lag_bytes": b.lag_bytes, "lag_ms": b.lag_ms}
                rows.append({
                    "broker_id": b.id,
                    "group": b.group_name,
                    "kind": b.kind,
                    "address": b.address,
                    "state": b.state,
                    "reported_state": b.reported_state,
                    "group_readonly": groups[b.group_name].readonly,
                    "last_heartbeat_ms": seen,
                    "heartbeat_age_ms": now - seen,
                    "registered_at_ms": b.registered_at_ms,
                    "stats": backlogs.get(b.server_id),
                    "server_id": b.server_id,
                    "role": b.role,
                    "epoch": groups[b.group_name].epoch,
                    "reported_epoch": b.reported_epoch,
                    "in_sync": b.in_sync,
                    "position": figures["position"],
                    "lag_bytes": figures["lag_bytes"],
                    "lag_ms": figures["lag_ms"],
                })
            return rows

    async def list_subjects(self) -> list[dict[str, Any]]:
        """Return every routed subject with its route version and groups (active and drained)."""
        # Columns, not ORM objects: a console page lists thousands of rows, and building an
        # instance per row was most of its time.
        async with self._read() as s:
            views = await _group_views(s)
            rows_by_subject: dict[str, list[tuple[str, bool]]] = defaultdict(list)
            routes = await s.execute(select(SubjectRoute.subject, SubjectRoute.group_name,
                                            SubjectRoute.active))
            for subject, group_name, active in routes.all():
                rows_by_subject[subject].append((group_name, active))
            subjects = await s.execute(select(Subject.name, Subject.version)
                                       .order_by(Subject.name))
            out = []
            for name, version in subjects.all():
                groups = [
                    {"group": group_name, "active": active,
                     "state": views[group_name].state if group_name in views else "offline"}
                    for group_name, active in sorted(rows_by_subject[name])
                ]
                out.append({"subject": name, "version": version, "groups": groups})
            return out

    async def list_consumer_groups(self) -> list[dict[str, Any]]:
        """Return (consumer group, subject) pairs with online clients and lag over live brokers.

        Lag is the sum of the latest heartbeat backlog of every online broker; offline brokers'
        figures are stale and left out.
        """
        async with self._read() as s:
            pairs: dict[tuple[str, str], dict[str, Any]] = {}

            def pair(group: str, subject: str) -> dict[str, Any]:
                key = (group, subject)
                if key not in pairs:
                    pairs[key] = {"group": group, "subject": subject, "online_clients": 0,
                                  "lag": 0, "brokers": 0, "broker_consumers": 0,
                                  "redelivered": 0, "retried": 0, "dead": 0}
                return pairs[key]

            # Columns, not ORM objects (see list_subjects).
            known = await s.execute(select(ConsumerGroup.name, ConsumerGroup.subject))
            for name, subject in known.all():
                pair(name, subject)
            clients = await s.execute(
                select(Client.group_name, Client.subjects)
                .where(Client.online.is_(True), Client.role == "consumer")
            )
            for group_name, subjects in clients.all():
                for subject in subjects or []:
                    pair(group_name, subject)["online_clients"] += 1
            # Masters only: a slave reports the backlog of its copy, which would count it twice.
            for entry in await master_backlog_rows(s):
                item = pair(entry.group_name, entry.subject)
                item["lag"] += entry.lag
                item["brokers"] += 1
                item["broker_consumers"] += entry.consumers
                for name in GROUP_COUNTS:
                    item[name] += getattr(entry, name)
            return [pairs[k] for k in sorted(pairs)]


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
