"""The MetaServer's admin views: brokers with their state and backlog, subjects, consumer groups;
the ``AdminViewsMixin`` part of ``metaserver.registry.Registry`` (split from it).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from metaserver.backlog import backlog_summaries, backlog_views, master_backlog_rows
from metaserver.broker_liveness import BrokerLiveness
from metaserver.models import Broker, BrokerGroup, Client, ConsumerGroup, Subject, SubjectRoute
from metaserver.registry_routes import _group_views


GROUP_COUNTS = ("redelivered", "retried", "dead")


class AdminViewsMixin:
    """The admin and console lists of ``Registry``, which sets these fields (event loop)."""

    clock: Callable[[], int]
    broker_liveness: BrokerLiveness
    _read: Callable[[], contextlib.AbstractAsyncContextManager[AsyncSession]]

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
                    "position": b.position, "lag_bytes": b.lag_bytes, "lag_ms": b.lag_ms,
                    "undecodable_at": b.undecodable_at}
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
                    # A slave's copy stopped at a record it cannot decode: where (else None).
                    "undecodable_at": figures["undecodable_at"] or None,
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
