"""A server's backlog as the MetaServer keeps it, apart from its lease (the broker's side is
``serverkit.backlog.BacklogSync``).

A server reports its backlog in ``POST /api/brokers/backlog``, never in the heartbeat that
renews a master's lease: the renewal stays small and fast whatever the number of groups, and a
slow or refused backlog costs no master its lease (docs/METASERVER.md). The backlog lives in
its own tables (``models.BacklogHead``, ``models.BacklogRow``), never in the ``brokers`` row a
renewal writes, and a change writes only the rows that changed.

``plan_backlog`` says what one report makes of what is held (pure: no database, no clock):

- ``backlog`` given: a list of rows replaces every row held, under a new version; a delay
  server's stats object replaces the rows with itself (no version);
- ``backlog_base`` given: the changes and removals apply when the base is the version held
  (a new version if anything changed), and are refused with version None when it is not (the
  MetaServer lost it, or another report came between): the server then sends it whole again;
- neither: nothing held changes (only ``stats``, when given and different).

``store_backlog`` carries a plan out in the caller's transaction.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, cast

from sqlalchemy import Table, Update, bindparam, delete, func, select, tuple_, update
from sqlalchemy.ext.asyncio import AsyncSession

from metaserver.models import BacklogHead, BacklogRow, Broker

# The counts of a stored row, as the heartbeat's BACKLOG_ENTRY names them.
ROW_COUNTS = ("lag", "consumers", "redelivered", "retried", "dead")
# Keys per DELETE ... WHERE (subject, group_name) IN (...): two bound values each, far below
# SQLite's 32,766 and PostgreSQL's 65,535 bound values per statement.
KEYS_PER_STATEMENT_MAX = 500

Key = tuple[str, str]  # (subject, group)

_HEADS = cast(Table, BacklogHead.__table__)
# A server's head, locked (as the ORM's get with_for_update read it), and the head's insert.
_HEAD_FOR_UPDATE = (select(_HEADS.c.version, _HEADS.c.backlog, _HEADS.c.stats)
                    .where(_HEADS.c.server_id == bindparam("sid")).with_for_update())
_INSERT_HEAD = _HEADS.insert()
_ROWS = cast(Table, BacklogRow.__table__)
_DELETE_ROWS = delete(_ROWS).where(_ROWS.c.server_id == bindparam("sid"))
_DELETE_KEYS = delete(_ROWS).where(
    _ROWS.c.server_id == bindparam("sid"),
    tuple_(_ROWS.c.subject, _ROWS.c.group_name).in_(bindparam("keys", expanding=True)))
_INSERT_ROWS = _ROWS.insert()


@functools.cache
def _update_head(names: tuple[str, ...]) -> Update:
    """The head's UPDATE of these columns (bound as ``v_<name>``), built once per set."""
    return (update(_HEADS).where(_HEADS.c.server_id == bindparam("sid"))
            .values(**{name: bindparam(f"v_{name}") for name in names}))


@dataclass(frozen=True)
class BacklogPlan:
    """What one report writes: ``replace`` drops every row held first; ``upserts`` (by key) and
    ``removals`` are the rows written and deleted; ``version`` is answered (and stored when
    ``new_version``); ``head_backlog`` is a delay server's stats object (stored when
    ``replace``)."""

    version: int | None
    new_version: bool = False
    replace: bool = False
    upserts: dict[Key, dict[str, Any]] = field(default_factory=dict)
    removals: list[Key] = field(default_factory=list)
    head_backlog: dict[str, Any] | None = None

    @property
    def writes_rows(self) -> bool:
        """Whether the plan writes the head or any row."""
        return self.new_version or self.replace


def plan_backlog(held_version: int | None, *, backlog: Any, base: int | None,
                 changes: list[dict[str, Any]], removed: list[list[str]]) -> BacklogPlan:
    """The plan of one report over the version held (see the module docstring)."""
    next_version = (held_version or 0) + 1
    if isinstance(backlog, list):
        return BacklogPlan(next_version, new_version=True, replace=True,
                           upserts=_by_key(backlog))
    if backlog is not None:
        return BacklogPlan(None, replace=True, head_backlog=backlog)
    if base is None or base != held_version:
        return BacklogPlan(None)
    if not changes and not removed:
        return BacklogPlan(base)
    return BacklogPlan(next_version, new_version=True, upserts=_by_key(changes),
                       removals=[(subject, group) for subject, group in removed])


def _by_key(rows: list[dict[str, Any]]) -> dict[Key, dict[str, Any]]:
    """Rows by (subject, group); of two rows of one pair the later wins (a pair is one row)."""
    return {(row["subject"], row["group"]): row for row in rows}


async def store_backlog(s: AsyncSession, server_id: str, *, backlog: Any, base: int | None,
                        changes: list[dict[str, Any]], removed: list[list[str]],
                        stats: dict[str, Any] | None) -> int | None:
    """Apply one report of ``server_id`` in the transaction of ``s``; the version to answer.
    Core statements built once (``_HEAD_FOR_UPDATE``, ``_INSERT_HEAD``): a report every 3 s per
    server through the ORM's get and unit of work cost the event loop ~1-2.5 ms each."""
    head = (await s.execute(_HEAD_FOR_UPDATE, {"sid": server_id})).first()
    plan = plan_backlog(head.version if head is not None else None, backlog=backlog,
                        base=base, changes=changes, removed=removed)
    values: dict[str, Any] = {}
    if stats is not None and (head is None or stats != head.stats):
        values["stats"] = stats
    if plan.writes_rows:
        values["version"] = plan.version
        if plan.replace:
            values["backlog"] = plan.head_backlog
    if head is None and (plan.writes_rows or stats is not None):
        await s.execute(_INSERT_HEAD, {"server_id": server_id, "version": None,
                                       "backlog": None, "stats": None, **values})
    elif head is not None:
        # Only the columns whose value changes, as the ORM's unit of work wrote them.
        changed = {name: value for name, value in values.items() if value != head._mapping[name]}
        if changed:
            await s.execute(_update_head(tuple(sorted(changed))),
                            {"sid": server_id, **{f"v_{k}": v for k, v in changed.items()}})
    if not plan.writes_rows:
        return plan.version
    if plan.replace:
        await s.execute(_DELETE_ROWS, {"sid": server_id})
    else:
        for chunk in _chunks(plan.removals + list(plan.upserts)):
            await s.execute(_DELETE_KEYS, {"sid": server_id, "keys": chunk})
    if plan.upserts:
        await s.execute(_INSERT_ROWS, [
            {"server_id": server_id, "subject": subject, "group_name": group,
             **{name: row.get(name, 0) for name in ROW_COUNTS}}
            for (subject, group), row in plan.upserts.items()])
    return plan.version


def _chunks(keys: list[Key]) -> list[list[Key]]:
    return [keys[i:i + KEYS_PER_STATEMENT_MAX]
            for i in range(0, len(keys), KEYS_PER_STATEMENT_MAX)]


async def backlog_views(s: AsyncSession) -> dict[str, dict[str, Any]]:
    """Per server id, its backlog as the admin view of brokers shows it: ``{backlog, stats,
    backlog_version}``, ``backlog`` a list of ``{subject, group, lag, consumers, redelivered,
    retried, dead}`` (a realtime broker) or a delay server's stats object."""
    views: dict[str, dict[str, Any]] = {}
    for head in (await s.execute(select(BacklogHead))).scalars():
        views[head.server_id] = {"backlog": head.backlog if head.backlog is not None else [],
                                 "stats": head.stats, "backlog_version": head.version}
    rows = BacklogRow.__table__
    # Columns, not ORM objects: 10,000 groups are 10,000 rows.
    for row in (await s.execute(select(rows).order_by(rows.c.server_id, rows.c.subject,
                                                      rows.c.group_name))).all():
        view = views.get(row.server_id)
        if view is not None and isinstance(view["backlog"], list):
            view["backlog"].append({"subject": row.subject, "group": row.group_name,
                                    **{name: getattr(row, name) for name in ROW_COUNTS}})
    return views


async def backlog_summaries(s: AsyncSession) -> dict[str, dict[str, Any]]:
    """Per server id, what ``backlog_views`` gives without the rows: a realtime broker's
    ``backlog`` is ``[]`` and ``backlog_total`` holds its sum of ``lag`` and its number of
    (subject, group) rows, from one aggregate query. For pages and scrapes that need only
    totals: 100 brokers of 1,000 groups are 100,000 rows not read."""
    views: dict[str, dict[str, Any]] = {}
    for head in (await s.execute(select(BacklogHead))).scalars():
        views[head.server_id] = {"backlog": head.backlog if head.backlog is not None else [],
                                 "stats": head.stats, "backlog_version": head.version}
    rows = BacklogRow.__table__
    totals = await s.execute(select(rows.c.server_id, func.coalesce(func.sum(rows.c.lag), 0),
                                    func.count()).group_by(rows.c.server_id))
    for server_id, lag, pairs in totals.all():
        view = views.get(server_id)
        if view is not None and isinstance(view["backlog"], list):
            view["backlog_total"] = {"lag": int(lag), "pairs": int(pairs)}
    return views


async def master_backlog_rows(s: AsyncSession) -> list[Any]:
    """The backlog rows of every online realtime master (columns: subject, group_name and the
    counts); a slave's rows are its copy's, which would count twice."""
    rows = BacklogRow.__table__
    brokers = Broker.__table__
    return list((await s.execute(
        select(rows).join(brokers, brokers.c.server_id == rows.c.server_id)
        .where(brokers.c.state != "offline", brokers.c.kind == "realtime",
               brokers.c.role == "master"))).all())


__all__ = ["BacklogPlan", "KEYS_PER_STATEMENT_MAX", "ROW_COUNTS", "backlog_summaries",
           "backlog_views",
           "master_backlog_rows", "plan_backlog", "store_backlog"]
