"""Roles, epochs, leases and promotions in the MetaServer database (docs/REPLICATION.md 3-9).

The rules are pure functions in ``metaserver/failover.py``; this module reads the rows they
need and carries their decisions out. Every change of a group's master happens in a
transaction that holds the group's row lock (``SELECT ... FOR UPDATE``; on SQLite the
registry's write lock) and re-checks the ``epoch``, ``master_id`` and ``lease_renewals`` it
decided on, so two MetaServers over one PostgreSQL can never promote two masters from one epoch.

Used by ``Registry`` (register, heartbeat, deregister) and by ``ReplicationOps`` (the failover
check, switchover, settings, the admin view).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from metaserver.errors import BadRequest, Conflict, NotFound
from metaserver.failover import (
    GroupState,
    LeaseWatch,
    Promotion,
    ServerState,
    SwitchoverRefused,
    choose_successor,
    handover_completes,
    plan_failover,
    plan_switchover,
    switchover_verdict,
)
from metaserver.models import Broker, BrokerGroup, Subject, SubjectRoute
from metaserver.row_copies import read_groups_and_servers
from metaserver.validation import REPLICA_FIELDS, REPLICATION_MODES, SERVER_ROLES

if TYPE_CHECKING:
    from metaserver.registry import Registry

log = logging.getLogger(__name__)

# Why a group's master changed: the label of qmq_meta_failovers_total.
PROMOTION_REASONS = ("lease expired", "switchover", "master shut down", "unclean")
# Longest the failover check skips its read while every group is a lone master (monotonic
# ms): bounds how late another MetaServer's registration of a slave is seen by this one's
# check (the MetaServer that registered it checks at once: its write resets the quiet spell).
FAILOVER_QUIET_MS_MAX = 5_000


@dataclass(frozen=True)
class RoleRequest:
    """The replication fields of a register or heartbeat request (all optional on the wire)."""

    server_id: str
    epoch: int = 0
    role: str = "unknown"
    master_id: str | None = None
    replication: dict[str, Any] | None = None  # explicit {mode?, min_insync?} from flags
    replica: dict[str, Any] | None = None  # heartbeat: {position?, positions?, ..., insync?}


def synthetic_id(group: str, address: str) -> str:
    """The server id of a server that sends none: its group and address (migration 0004)."""
    return f"addr:{group}/{address}"


def is_online(broker: Broker, now_ms: int, expiry_ms: int) -> bool:
    """Online: not marked offline and heard from within the expiry."""
    return broker.state != "offline" and now_ms - broker.last_heartbeat_ms <= expiry_ms


def server_state(broker: Broker, now_ms: int, expiry_ms: int) -> ServerState:
    """The failover rules' view of one row."""
    return ServerState(broker.server_id, broker.role, broker.in_sync,
                       is_online(broker, now_ms, expiry_ms), broker.position)


def group_state(grp: BrokerGroup) -> GroupState:
    """The failover rules' view of a group row."""
    return GroupState(grp.name, grp.epoch, grp.master_id, grp.lease_renewals,
                      grp.switchover_to, grp.switchover_deadline_ms)


async def servers_of(s: AsyncSession, group: str) -> list[Broker]:
    """Every server row of ``group``."""
    rows = await s.execute(select(Broker).where(Broker.group_name == group)
                           .order_by(Broker.server_id))
    return list(rows.scalars())


async def find_server(s: AsyncSession, server_id: str) -> Broker | None:
    """The row of ``server_id``, if any."""
    rows = await s.execute(select(Broker).where(Broker.server_id == server_id))
    return rows.scalar_one_or_none()


def new_group(name: str, kind: str, req: RoleRequest, now_ms: int) -> BrokerGroup:
    """A group row made by its first registration. The epoch continues from the one the
    registrant remembers (a lost database must not send epochs back); a registrant that says it
    was a slave of M names M master, so a slave that comes back first cannot take over."""
    master = req.master_id if req.role == "slave" and req.master_id else req.server_id
    return BrokerGroup(name=name, kind=kind, readonly=False, created_at_ms=now_ms,
                       epoch=max(1, req.epoch + 1), master_id=master, replication="sync",
                       min_insync=0, lease_renewals=0, epoch_started_at_ms=now_ms,
                       switchover_to=None, switchover_deadline_ms=None, writable=True)


def apply_settings(grp: BrokerGroup, settings: dict[str, Any] | None, server_id: str) -> None:
    """Explicit ``--replication``/``--min-insync`` of a registering server: the last wins."""
    if not settings:
        return
    mode, min_insync = settings.get("mode"), settings.get("min_insync")
    if mode is not None and mode != grp.replication:
        log.warning("group %s replication %s -> %s (set by server %s)", grp.name,
                    grp.replication, mode, server_id)
        grp.replication = mode
    if min_insync is not None and min_insync != grp.min_insync:
        log.warning("group %s min_insync %d -> %d (set by server %s)", grp.name,
                    grp.min_insync, min_insync, server_id)
        grp.min_insync = min_insync


def settle_role(grp: BrokerGroup, broker: Broker, req: RoleRequest, now_ms: int) -> bool:
    """Decide the role of ``broker`` from the group row (the group's row lock is held); a
    master's call renews its lease. True when the group's master changed here."""
    changed = False
    if req.epoch > grp.epoch:
        # The database is behind what a server saw (it was restored or replaced): move past it.
        log.warning("server %s of group %s reports epoch %d, the database has %d; raising it",
                    broker.server_id, grp.name, req.epoch, grp.epoch)
        grp.epoch = req.epoch + 1
        grp.epoch_started_at_ms = now_ms
        if req.role == "master":
            grp.master_id = broker.server_id
        changed = True
    if grp.master_id is None:
        grp.master_id = broker.server_id
        grp.epoch += 1
        grp.epoch_started_at_ms = now_ms
        changed = True
    if grp.master_id == broker.server_id:
        broker.role = "master"
        broker.in_sync = True
        grp.lease_renewals += 1
    else:
        broker.role = "slave"
    broker.reported_epoch = req.epoch
    return changed


def apply_replica(grp: BrokerGroup, broker: Broker, servers: list[Broker],
                  req: RoleRequest) -> bool:
    """Store a heartbeat's ``replica`` figures; from the current master at the current epoch,
    also its in-sync proposal and ``writable``. True when routing may have changed."""
    replica = req.replica
    if replica is None:
        return False
    broker.position = replica.get("position")
    broker.positions = replica.get("positions")
    broker.lag_bytes = replica.get("lag_bytes")
    broker.lag_ms = replica.get("lag_ms")
    broker.undecodable_at = replica.get("undecodable_at")
    if broker.role != "master" or req.epoch != grp.epoch:
        return False
    proposed = set(replica.get("insync") or [])
    for other in servers:
        if other.server_id != broker.server_id:
            other.in_sync = other.server_id in proposed
    writable = replica.get("writable", True) is not False
    changed = writable != grp.writable
    grp.writable = writable
    return changed


async def promote(s: AsyncSession, grp: BrokerGroup, promotion: Promotion, now_ms: int,
                  expiry_ms: int, *, unclean: bool = False) -> bool:
    """Carry ``promotion`` out if the row (locked by the caller) is still as decided: the epoch
    goes up by one and routes are re-versioned. False (nothing changed) when it moved on."""
    if (grp.epoch, grp.master_id, grp.lease_renewals) != (
            promotion.epoch, promotion.from_id, promotion.lease_renewals):
        return False
    servers = {b.server_id: b for b in await servers_of(s, grp.name)}
    target = servers.get(promotion.to_id)
    if target is None or not is_online(target, now_ms, expiry_ms):
        return False
    if not target.in_sync and not unclean:
        return False
    grp.epoch += 1
    grp.master_id = target.server_id
    grp.epoch_started_at_ms = now_ms
    grp.switchover_to = grp.switchover_deadline_ms = None
    grp.writable = True
    old = servers.get(promotion.from_id or "")
    if old is not None:
        old.role = "slave"
        # After a handover the old master holds exactly what the new one holds.
        old.in_sync = promotion.reason == "switchover"
    target.role = "master"
    target.in_sync = True
    await bump_route_versions(s, grp.name, now_ms)
    await s.flush()
    log.warning("group %s: %s promoted to master at epoch %d (%s; was %s)", grp.name,
                target.server_id, grp.epoch, promotion.reason, promotion.from_id)
    return True


async def bump_route_versions(s: AsyncSession, group: str, now_ms: int) -> None:
    """Raise the route version of every subject ever routed to ``group`` (its addresses in
    route answers change with its master). Subjects are locked in name order, as elsewhere."""
    names = select(SubjectRoute.subject).where(SubjectRoute.group_name == group)
    rows = await s.execute(select(Subject).where(Subject.name.in_(names))
                           .order_by(Subject.name).with_for_update())
    for subject in rows.scalars():
        subject.version += 1
        subject.updated_at_ms = now_ms


def role_answer(grp: BrokerGroup, broker: Broker, servers: list[Broker],
                lease_ms: int, heartbeat_interval_ms: int) -> dict[str, Any]:
    """The replication fields of a register or heartbeat answer (docs/REPLICATION.md 13.4)."""
    master = next((b for b in servers if b.server_id == grp.master_id), None)
    insync = [b.server_id for b in servers if b.in_sync and b.server_id != grp.master_id]
    return {
        "server_id": broker.server_id,
        "role": "master" if grp.master_id == broker.server_id else "slave",
        "epoch": grp.epoch,
        "lease_ms": lease_ms,
        "lease_required": bool(insync),
        "master": ({"server_id": master.server_id, "address": master.address}
                   if master is not None else
                   {"server_id": grp.master_id, "address": None} if grp.master_id else None),
        "insync": insync,
        # Every other server registered in the group: the only fetchers a master counts.
        "slaves": [b.server_id for b in servers if b.server_id != grp.master_id],
        "replication": {"mode": grp.replication, "min_insync": grp.min_insync},
        "switchover_to": grp.switchover_to,
        "heartbeat_interval_ms": heartbeat_interval_ms,
        # The ``replica`` fields this MetaServer takes: a server sends a field added since
        # (``undecodable_at``) only when listed, as an older MetaServer answers it 400.
        "replica_fields": REPLICA_FIELDS,
    }


async def supersede(s: AsyncSession, group: str, address: str, server_id: str) -> None:
    """Mark offline every other server registered at ``(group, address)``: one address is one
    process, so a new data dir on an old port replaces the server that was there."""
    others = await s.execute(select(Broker).where(
        Broker.group_name == group, Broker.address == address, Broker.server_id != server_id,
        Broker.state != "offline"))
    for other in others.scalars():
        log.warning("server %s takes address %s of group %s from server %s", server_id,
                    address, group, other.server_id)
        other.state = "offline"


async def hand_over_on_leave(s: AsyncSession, grp: BrokerGroup, now_ms: int,
                             expiry_ms: int) -> bool:
    """The master deregistered (it stopped writing first): promote the best online in-sync
    slave at once, if there is one. True when it did."""
    rows = await servers_of(s, grp.name)
    best = choose_successor([server_state(b, now_ms, expiry_ms) for b in rows], grp.master_id)
    if best is None:
        return False
    promotion = Promotion(grp.name, grp.master_id, best.server_id, grp.epoch,
                          grp.lease_renewals, "master shut down")
    return await promote(s, grp, promotion, now_ms, expiry_ms)


def finish_handover(grp: BrokerGroup, broker: Broker, req: RoleRequest) -> Promotion | None:
    """The promotion a master's heartbeat completes (it reports the target has everything)."""
    ready = (req.replica or {}).get("handover_ready")
    return handover_completes(group_state(grp), broker.server_id, req.epoch, ready)


@dataclass
class FailoverStats:
    """Promotions this MetaServer made, by reason (for qmq_meta_failovers_total)."""

    promotions: Counter[str] = field(default_factory=Counter)


class ReplicationOps:
    """The failover check, switchover, replication settings and the admin view, over the
    registry's database. The lease watch is this MetaServer's own memory (docs 5, 6)."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        config = registry.config
        self.watch = LeaseWatch(config.lease_ms, config.lease_margin_ms)
        self.stats = FailoverStats()
        # (group generation, monotonic ms, wall ms): checks before both times, with no write
        # that may change a group since, find what the last one found: nothing to do.
        self._quiet: tuple[int, int, int] | None = None
        self.skipped = 0  # checks that skipped their read (tests, benchmarks)
        # What the last read held of the rows that heartbeat answers depend on (_answer_rows).
        self._answer_rows: tuple[Any, ...] | None = None

    @property
    def _expiry_ms(self) -> int:
        return self.registry.config.broker_expiry_ms

    async def check(self) -> list[Promotion]:
        """One failover round: watch every replicated group's lease, cancel switchovers that
        cannot finish, promote where a lease has surely expired. Returns what it promoted."""
        registry = self.registry
        now_ms, mono_ms = registry.clock(), registry.mono_clock()
        generation = registry.broker_liveness.generation
        quiet = self._quiet
        if quiet is not None and quiet[0] == generation and mono_ms < quiet[1] \
                and now_ms < quiet[2]:
            self.skipped += 1
            return []
        # One statement built once for both tables, read as row copies, not ORM objects (this
        # runs every failover_check_interval_ms): every group, each with its servers (None for
        # a group without any).
        async with registry._read() as s:
            pairs = await read_groups_and_servers(s)
        self._note_answer_rows(pairs)
        groups = list({grp.name: grp for grp, _ in pairs}.values())
        by_group: dict[str, list[ServerState]] = {}
        for grp, row in pairs:
            if row is not None:
                by_group.setdefault(grp.name, []).append(
                    server_state(row, now_ms, self._expiry_ms))
        done = []
        for grp in groups:
            state, servers = group_state(grp), by_group.get(grp.name, [])
            # A group whose master is offline is watched too, solo or not: an operator's
            # unclean promotion of it waits for the same lease expiry (docs/REPLICATION.md 11).
            master_online = any(x.online for x in servers if x.server_id == grp.master_id)
            if state.lease_required(servers) or not master_online:
                self.watch.observe(grp.name, grp.epoch, grp.lease_renewals, mono_ms)
            else:
                self.watch.forget(grp.name)
            reason = switchover_verdict(state, servers, now_ms)
            if reason is not None:
                await self._cancel_switchover(grp.name, state.switchover_to, reason)
            promotion = plan_failover(state, servers, self.watch, mono_ms)
            if promotion is not None and await self.carry_out(promotion):
                done.append(promotion)
        self._quiet = self._quiet_spell(pairs, generation, now_ms, mono_ms)
        return done

    def _note_answer_rows(self, pairs: list[Any]) -> None:
        """Heartbeat answers remembered in memory (metaserver.broker_liveness) go stale when
        another MetaServer changes a group (a promotion, a switchover, an expiry): when the
        fields those answers come from differ from the last read's, none is reused. So such a
        change reaches this MetaServer's answers within a failover check interval, not
        ``FULL_HEARTBEAT_MS``, whenever the check reads (every group with a slave)."""
        rows = tuple((grp.name, grp.epoch, grp.master_id, grp.readonly, grp.replication,
                      grp.min_insync, grp.switchover_to, grp.writable)
                     + ((row.server_id, row.address, row.state, row.in_sync)
                        if row is not None else ()) for grp, row in pairs)
        if self._answer_rows is not None and rows != self._answer_rows:
            self.registry.broker_liveness.changed()
        self._answer_rows = rows

    def _quiet_spell(self, pairs: list[Any], generation: int, now_ms: int,
                     mono_ms: int) -> tuple[int, int, int] | None:
        """When every group is a lone master (no other server row, no switchover), no check
        can act until a write changes a group (a server registers: the generation moves) or a
        master's heartbeat ages past ``broker_expiry_ms`` (its group's lease watch starts
        then, as before): the checks until then skip their read. None otherwise."""
        deadline_ms = now_ms + FAILOVER_QUIET_MS_MAX
        for grp, row in pairs:
            if grp.switchover_to is not None:
                return None
            if row is None:
                continue
            if row.server_id != grp.master_id:
                return None
            if is_online(row, now_ms, self._expiry_ms):
                deadline_ms = min(deadline_ms, row.last_heartbeat_ms + self._expiry_ms)
        return generation, mono_ms + FAILOVER_QUIET_MS_MAX, deadline_ms

    async def carry_out(self, promotion: Promotion, *, unclean: bool = False) -> bool:
        """Run ``promotion`` in its own transaction under the group's row lock."""

        async def body(s: AsyncSession) -> bool:
            grp = await s.get(BrokerGroup, promotion.group, with_for_update=True)
            if grp is None:
                return False
            ok = await promote(s, grp, promotion, self.registry.clock(), self._expiry_ms,
                               unclean=unclean)
            if ok:
                await self.registry._reconcile(s, self.registry.clock())
            return ok

        ok = await self.registry._write(body)
        if ok:
            self.stats.promotions[promotion.reason] += 1
            self.watch.forget(promotion.group)
        return ok

    async def _cancel_switchover(self, group: str, target: str | None, reason: str) -> None:
        async def body(s: AsyncSession) -> None:
            grp = await s.get(BrokerGroup, group, with_for_update=True)
            if grp is not None and grp.switchover_to == target and target is not None:
                grp.switchover_to = grp.switchover_deadline_ms = None
                log.warning("group %s: switchover to %s cancelled: %s", group, target, reason)

        await self.registry._write(body)

    async def switchover(self, group: str, to: str | None, unclean: bool) -> dict[str, Any]:
        """Start a planned switchover (or run an unclean promotion at once)."""
        registry = self.registry

        async def body(s: AsyncSession) -> dict[str, Any]:
            now_ms = registry.clock()
            grp = await s.get(BrokerGroup, group, with_for_update=True)
            if grp is None:
                raise NotFound(f"broker group {group!r} does not exist")
            rows = await servers_of(s, group)
            servers = [server_state(b, now_ms, self._expiry_ms) for b in rows]
            if unclean:
                return await self._unclean(s, grp, servers, to, now_ms)
            try:
                target = plan_switchover(group_state(grp), servers, to)
            except SwitchoverRefused as exc:
                raise Conflict(str(exc)) from None
            grp.switchover_to = target
            grp.switchover_deadline_ms = now_ms + registry.config.switchover_timeout_ms
            log.warning("group %s: switchover from %s to %s requested", group, grp.master_id,
                        target)
            return {"group": group, "from": grp.master_id, "to": target, "epoch": grp.epoch,
                    "state": "requested", "deadline_ms": grp.switchover_deadline_ms}

        return await registry._write(body)

    async def _unclean(self, s: AsyncSession, grp: BrokerGroup, servers: list[ServerState],
                       to: str | None, now_ms: int) -> dict[str, Any]:
        """Promote ``to`` although it may not be in sync: only once the master's lease has
        surely expired by this MetaServer's watch (docs/REPLICATION.md 9)."""
        if to is None:
            raise BadRequest("an unclean switchover needs the server to promote (to)")
        master = next((x for x in servers if x.server_id == grp.master_id), None)
        mono_ms = self.registry.mono_clock()
        self.watch.observe(grp.name, grp.epoch, grp.lease_renewals, mono_ms)
        if master is not None and master.online:
            raise Conflict(f"the master {grp.master_id} of group {grp.name} is online; use a "
                           "planned switchover")
        if not self.watch.expired(grp.name, mono_ms):
            silent = self.watch.silent_ms(grp.name, mono_ms) or 0
            raise Conflict(f"the lease of master {grp.master_id} of group {grp.name} has not "
                           f"surely expired: this MetaServer has seen no renewal for {silent} "
                           f"ms of the {self.watch.wait_ms} ms it waits; try again")
        target = next((x for x in servers if x.server_id == to), None)
        if target is None or not target.online:
            raise Conflict(f"server {to} of group {grp.name} is not an online server of it")
        promotion = Promotion(grp.name, grp.master_id, to, grp.epoch, grp.lease_renewals,
                              "unclean")
        if not await promote(s, grp, promotion, now_ms, self._expiry_ms, unclean=True):
            raise Conflict(f"group {grp.name} changed while promoting; try again")
        await self.registry._reconcile(s, now_ms)
        self.stats.promotions["unclean"] += 1
        self.watch.forget(grp.name)
        return {"group": grp.name, "from": promotion.from_id, "to": to, "epoch": grp.epoch,
                "state": "done", "deadline_ms": None}

    async def set_settings(self, group: str, mode: str | None,
                           min_insync: int | None) -> dict[str, Any]:
        """``POST /api/admin/replication``: change a group's mode and/or min_insync."""

        async def body(s: AsyncSession) -> dict[str, Any]:
            grp = await s.get(BrokerGroup, group, with_for_update=True)
            if grp is None:
                raise NotFound(f"broker group {group!r} does not exist")
            apply_settings(grp, {"mode": mode, "min_insync": min_insync}, "(admin)")
            return {"group": group, "replication": grp.replication,
                    "min_insync": grp.min_insync}

        return await self.registry._write(body)

    async def list_groups(self) -> list[dict[str, Any]]:
        """``GET /api/admin/replication``: per group its epoch, master, settings, in-sync set."""
        registry = self.registry
        now_ms, mono_ms = registry.clock(), registry.mono_clock()
        async with registry._read() as s:
            groups = list((await s.execute(select(BrokerGroup).order_by(BrokerGroup.name)))
                          .scalars())
            rows = list((await s.execute(select(Broker).order_by(Broker.server_id))).scalars())
        out = []
        for grp in groups:
            mine = [b for b in rows if b.group_name == grp.name]
            master = next((b for b in mine if b.server_id == grp.master_id), None)
            out.append({
                "group": grp.name, "kind": grp.kind, "epoch": grp.epoch,
                "master_id": grp.master_id,
                "master_address": master.address if master is not None else None,
                "master_online": master is not None and is_online(master, now_ms,
                                                                  self._expiry_ms),
                "replication": grp.replication, "min_insync": grp.min_insync,
                "insync": [b.server_id for b in mine if b.in_sync
                           and b.server_id != grp.master_id],
                "slaves": [b.server_id for b in mine if b.server_id != grp.master_id],
                "writable": grp.writable, "lease_renewals": grp.lease_renewals,
                "renewal_silent_ms": self.watch.silent_ms(grp.name, mono_ms),
                "epoch_started_at_ms": grp.epoch_started_at_ms,
                "switchover_to": grp.switchover_to,
                "switchover_deadline_ms": grp.switchover_deadline_ms,
                # Per server whose copy is stopped at a record it cannot decode: where.
                "undecodable": self._undecodable(mine),
            })
        return out

    def _undecodable(self, servers: list[Broker]) -> dict[str, Any]:
        """Server id -> its ``undecodable_at`` as last reported (a heartbeat noted in memory
        since the last flush first), for the servers that report one."""
        out: dict[str, Any] = {}
        for broker in servers:
            noted = self.registry.broker_liveness.noted(broker.server_id) \
                if broker.state != "offline" else None
            at = noted.get("undecodable_at") if noted and "position" in noted \
                else broker.undecodable_at
            if at:
                out[broker.server_id] = at
        return out


__all__ = [
    "PROMOTION_REASONS",
    "REPLICATION_MODES",
    "ReplicationOps",
    "RoleRequest",
    "SERVER_ROLES",
    "apply_replica",
    "apply_settings",
    "choose_successor",
    "finish_handover",
    "hand_over_on_leave",
    "is_online",
    "new_group",
    "promote",
    "role_answer",
    "servers_of",
    "settle_role",
    "supersede",
    "synthetic_id",
]
