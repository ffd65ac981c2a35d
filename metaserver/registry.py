"""The MetaServer's state operations: brokers, routes, clients, expiry and the admin views.

Every write is one database transaction. On SQLite, writes of this process are also serialized by
an asyncio lock (SQLite has one writer anyway); on PostgreSQL, several MetaServers may share the
database: the subject row is locked while its route changes, and a transaction that loses an
insert race (IntegrityError) is retried.

Routes are in ``metaserver.registry_routes`` and the admin lists in ``metaserver.registry_views``
(mixins of ``Registry``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar, cast

from sqlalchemy import Table, bindparam, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from metaserver.backlog import store_backlog
from metaserver.broker_liveness import BrokerLiveness
from metaserver.config import MetaConfig
from metaserver.db import make_engine, upgrade_database
from metaserver.errors import BadRequest, NotFound
from metaserver.liveness import ClientLiveness, write_clients
from metaserver.models import Broker, BrokerGroup, Client
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
from metaserver.routing import GroupView, broker_state
from metaserver.row_copies import read_group_and_servers, write_changes
from metaserver.registry_routes import RoutesMixin, _RaceLost
from metaserver.registry_views import AdminViewsMixin
from serverkit.periodic import run_every

log = logging.getLogger(__name__)

Clock = Callable[[], int]
T = TypeVar("T")

# Counts a realtime broker's heartbeat backlog rows carry since it started, summed per
# (group, subject) over the online brokers by list_consumer_groups.
# Attempts of a write transaction that lost an insert race to another MetaServer.
WRITE_ATTEMPTS_MAX = 3
# What a backlog report reads of its server's row (Core, built once: ``find_server``'s ORM
# select cost a report more Python than its SQL).
_brokers = cast(Table, Broker.__table__).c
_SERVER_OF = (select(_brokers.state, _brokers.group_name, _brokers.kind)
              .where(_brokers.server_id == bindparam("sid")))
# The expiry check's statements, built once with the cutoff bound (``expire_now``, every
# ``expiry_check_interval_ms``): building them cost the check more Python than their SQL.
_EXPIRE_BROKERS = (update(Broker.__table__)
                   .where(_brokers.state != "offline",
                          _brokers.last_heartbeat_ms < bindparam("cutoff"))
                   .values(state="offline"))
_clients = cast(Table, Client.__table__).c
_STALE = (_clients.online.is_(True), _clients.last_seen_ms < bindparam("cutoff"))
_STALE_CLIENTS = select(_clients.client_id).where(*_STALE)
_EXPIRE_CLIENTS = update(Client.__table__).where(*_STALE).values(online=False)
# How long route reads reuse the broker groups' view (every group, its master's address), in
# ms. A committed write of this MetaServer drops it at once, so only another MetaServer's change
# (an expiry, a promotion) is seen up to this late: the default failover check interval. At
# 1,000 idle consumers refreshing their routes the view was read ~70 times a second.
# Route answers kept for GROUP_VIEWS_CACHE_MS at most; past this many the cache starts again
# (each is a few hundred bytes; a MetaServer of 10,000 subjects answers both roles).


class Registry(RoutesMixin, AdminViewsMixin):
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
            # The group's row lock first, then its servers and this one in one statement
            # (read under the lock, so as another MetaServer's promotion left them), as copies
            # written back by write_changes (metaserver.row_copies).
            grp, servers, broker = await read_group_and_servers(s, group, req.server_id)
            if (grp is None or broker is None or broker.state == "offline"
                    or broker.group_name != group):
                raise NotFound(
                    f"broker {address!r} (server {req.server_id}) of group {group!r} is not "
                    "registered" + (" (marked offline)" if broker is not None else "")
                    + "; register again"
                )
            if broker.kind != kind:
                raise BadRequest(f"broker {address!r} is a {broker.kind} broker, not {kind}")
            effective = broker_state(grp.readonly)
            changed = effective != broker.state or broker.address != address
            broker.address = address
            broker.reported_state = state
            broker.state = effective
            broker.last_heartbeat_ms = now
            changed |= settle_role(grp, broker, req, now)
            insync_before = [other.in_sync for other in servers]
            changed |= apply_replica(grp, broker, servers, req)
            # Another server's in-sync flag changed: other servers' answers change too.
            structural = changed or insync_before != [other.in_sync for other in servers]
            handover = finish_handover(grp, broker, req)
            # Written before a promotion reads the servers' rows through the ORM, and again
            # after it for the group's row it changed.
            await write_changes(s, grp, servers)
            if handover is not None and await promote(s, grp, handover, now,
                                                      self.config.broker_expiry_ms):
                await write_changes(s, grp, ())
                self.replication.stats.promotions["switchover"] += 1
                changed = True
            if changed:
                await s.flush()
                await self._reconcile(s, now)
                # A promotion or the reconcile may have changed the group's rows: read them
                # again. Otherwise ``servers`` are the rows as they stand (the copies, changed
                # and written in place), and a second query would cost a select on every
                # renewal for nothing.
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
            broker = (await s.execute(_SERVER_OF, {"sid": wanted})).first()
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
                    _EXPIRE_BROKERS, {"cutoff": now - self.config.broker_expiry_ms})
                brokers = result.rowcount or 0
            if now - self._started_ms > self.config.client_expiry_ms:
                cutoff = {"cutoff": now - self.config.client_expiry_ms}
                expired = list((await s.execute(_STALE_CLIENTS, cutoff)).scalars())
                if expired:
                    result = await s.execute(_EXPIRE_CLIENTS, cutoff)
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
