"""``RowCopy``: a broker group's or server's row read with Core and changed in place, for the
write of a full broker heartbeat (``Registry._heartbeat_write``) and the failover check's read
(``ReplicationOps.check``, every ``failover_check_interval_ms``), issue 18.

A full heartbeat comes every 750 ms from each master that holds a lease and every 5 s from
every other server. Through the ORM (a get with FOR UPDATE, a select, the unit of work's flush)
each cost the event loop ~2 ms of Python besides its SQL. The rows are now read with statements
built once (``GROUP_FOR_UPDATE``, ``SERVERS_AND_SERVER``: the same SQL, the same row lock) into
copies that the replication rules (``metaserver.replication``: ``settle_role``,
``apply_replica``, ``finish_handover``, ``promote``) read and change as they would the ORM's
objects, and ``write_changes`` writes what changed as the unit of work would have: only the
columns whose value changed, by primary key, the group's row before its servers', the servers
in id order.

Owner: the event loop (one heartbeat's write transaction).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any, cast

from sqlalchemy import CursorResult, Table, Update, bindparam, or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from metaserver.models import Broker, BrokerGroup

_GROUPS = cast(Table, BrokerGroup.__table__)
_BROKERS = cast(Table, Broker.__table__)

# The group's row, locked (as ``AsyncSession.get(BrokerGroup, name, with_for_update=True)``).
GROUP_FOR_UPDATE = select(_GROUPS).where(_GROUPS.c.name == bindparam("name")).with_for_update()
# Every server row of the group and the row of the heartbeat's server (of any group), in one
# statement: a heartbeat's write needs both, and each statement costs a thread round trip.
SERVERS_AND_SERVER = (select(_BROKERS)
                      .where(or_(_BROKERS.c.group_name == bindparam("group"),
                                 _BROKERS.c.server_id == bindparam("sid")))
                      .order_by(_BROKERS.c.server_id))


# Every group, each with its servers (an outer join: NULL server columns for a group without
# any), for the failover check (``ReplicationOps.check``, every ``failover_check_interval_ms``
# while a group has a slave); the group's columns first, then the server's.
GROUPS_AND_SERVERS = (select(*_GROUPS.columns, *_BROKERS.columns)
                      .outerjoin(_BROKERS, _BROKERS.c.group_name == _GROUPS.c.name)
                      .order_by(_GROUPS.c.name, _BROKERS.c.id))


class RowCopy:
    """One row's columns as attributes (the ORM object's names; plain instance attributes, so
    reading one costs no Python call), changed in place; remembers the values as read (or
    last written) so ``changes`` says which columns to write."""

    def __init__(self, table: Table, row: Mapping[str, Any]) -> None:
        values = self.__dict__
        values.update(row)
        values["_table"] = table
        values["_written"] = dict(row)

    def __getattr__(self, name: str) -> Any:
        """Only reached for a name that is no column (a typo): say so."""
        raise AttributeError(f"{self._table.name} has no column {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        """Change a column; a name that is no column (a typo in a rule) raises, as the ORM's
        object would, instead of being kept in memory and never written."""
        if name not in self._written:
            raise AttributeError(f"{self._table.name} has no column {name!r}")
        self.__dict__[name] = value

    def changes(self) -> dict[str, Any]:
        """The columns whose value differs from the one read or last written."""
        values = self.__dict__
        return {name: values[name] for name, old in self._written.items()
                if values[name] != old}

    def key(self) -> dict[str, Any]:
        """The primary key's columns and values."""
        return {column.name: self.__dict__[column.name] for column in self._table.primary_key}

    def mark_written(self) -> None:
        """What ``changes`` named is in the database now."""
        self.__dict__["_written"] = {name: self.__dict__[name] for name in self._written}


async def read_group_and_servers(
        s: AsyncSession, group: str, server_id: str
) -> tuple[BrokerGroup | None, list[Broker], Broker | None]:
    """The group's row (locked first), then its servers and the row of ``server_id`` (read
    under the lock, so as another MetaServer's promotion left them), as copies. Typed as the
    ORM's classes: the replication rules read and set the same attributes on them."""
    row = (await s.execute(GROUP_FOR_UPDATE, {"name": group})).first()
    grp = RowCopy(_GROUPS, row._mapping) if row is not None else None
    rows = [RowCopy(_BROKERS, r._mapping)
            for r in (await s.execute(SERVERS_AND_SERVER, {"group": group, "sid": server_id}))]
    servers = [b for b in rows if b.group_name == group]
    broker = next((b for b in rows if b.server_id == server_id), None)
    return (cast(BrokerGroup | None, grp), cast(list[Broker], servers),
            cast(Broker | None, broker))


async def read_groups_and_servers(s: AsyncSession) -> list[tuple[BrokerGroup, Broker | None]]:
    """Every group with each of its servers (``GROUPS_AND_SERVERS``) as copies, one copy per
    group (as the ORM's identity map gave one object per row): (group, None) for a group
    without servers."""
    group_names = [column.name for column in _GROUPS.columns]
    broker_names = [column.name for column in _BROKERS.columns]
    width = len(group_names)
    groups: dict[str, RowCopy] = {}
    pairs: list[tuple[Any, Any]] = []
    for row in await s.execute(GROUPS_AND_SERVERS):
        grp = groups.get(row[0])
        if grp is None:
            grp = groups[row[0]] = RowCopy(_GROUPS, dict(zip(group_names, row[:width])))
        server = row[width:]
        pairs.append((grp, RowCopy(_BROKERS, dict(zip(broker_names, server)))
                      if server[0] is not None else None))
    return pairs


async def write_changes(s: AsyncSession, grp: Any, servers: Iterable[Any]) -> None:
    """Write what changed in these copies: the group's row first, then the servers' in id
    order (the unit of work's order, so row locks are taken in the same order)."""
    for copy in [grp, *sorted(servers, key=lambda b: b.id)]:
        changed = copy.changes()
        if not changed:
            continue
        key = copy.key()
        statement = _update(copy._table, tuple(key), tuple(sorted(changed)))
        result = cast(CursorResult[Any], await s.execute(statement, {
            **{f"k_{name}": value for name, value in key.items()},
            **{f"v_{name}": value for name, value in changed.items()}}))
        assert result.rowcount == 1, f"{copy._table.name} row {key} was not updated"
        copy.mark_written()


@functools.cache
def _update(table: Table, key: tuple[str, ...], names: tuple[str, ...]) -> Update:
    """The UPDATE of these columns of one row by its key (bound as ``k_``/``v_<name>``),
    built once per column set: building one cost more Python than its execution."""
    return (update(table).where(*[table.c[name] == bindparam(f"k_{name}") for name in key])
            .values(**{name: bindparam(f"v_{name}") for name in names}))


__all__ = ["GROUPS_AND_SERVERS", "GROUP_FOR_UPDATE", "SERVERS_AND_SERVER", "RowCopy",
           "read_group_and_servers", "read_groups_and_servers", "write_changes"]
