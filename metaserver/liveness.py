"""``ClientLiveness``: client heartbeats that change nothing but the time are kept in memory and
written in one batch, not one database write transaction each (issue 19).

A consumer heartbeats every few seconds; written one by one, 300 consumers made 60 write
transactions a second, and an elastic pool that scaled out kept paying for them while it
waited. Now:

- the first heartbeat of a client, or one that changes its app, group, role or subjects, is
  written at once as before (admin views and consumer groups see it at once), and remembered
  here (``known``);
- a heartbeat that repeats what is known only notes its time here (``pending``);
- ``flush`` writes every pending time in one statement, inside the expiry check's own write
  transaction (``Registry.expire_now``, every ``expiry_check_interval_ms``): the MetaServer's
  write transactions per second no longer grow with its clients, and expiry always sees the
  times noted before it;
- a leave, or an expiry that took clients offline, forgets what is known, so the next
  heartbeat is written in full again (it sets ``online``).

A flushed time only moves ``last_seen_ms`` forward (another MetaServer sharing the database may
have written a later one, or a leave). What it does NOT do: make a heartbeat durable before
its answer; a MetaServer that crashes loses at most one expiry interval of liveness times, which
the clients' next heartbeats restore well within ``client_expiry_ms``.

Owner: the event loop (the MetaServer's handlers and its expiry task).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import bindparam, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from metaserver.models import Client, ConsumerGroup

Signature = tuple[str, str, str, tuple[str, ...]]  # app, group, role, subjects


class ClientLiveness:
    """Known clients' signatures and the heartbeat times not yet written."""

    def __init__(self) -> None:
        self._known: dict[str, Signature] = {}  # client id -> what its row holds (online)
        self._pending: dict[str, int] = {}  # client id -> latest heartbeat time, in ms

    @staticmethod
    def signature(app: str, group: str, role: str, subjects: list[str]) -> Signature:
        """What a heartbeat says of a client besides the time."""
        return (app, group, role, tuple(subjects))

    def note(self, client_id: str, signature: Signature, now_ms: int) -> bool:
        """True (and the time noted) when the heartbeat repeats what the client's row holds;
        False when it must be written."""
        if self._known.get(client_id) != signature:
            return False
        self._pending[client_id] = now_ms
        return True

    def written(self, client_id: str, signature: Signature) -> None:
        """A heartbeat of ``client_id`` was written in full (its time with it)."""
        self._known[client_id] = signature
        self._pending.pop(client_id, None)

    def forget(self, client_id: str | None = None) -> None:
        """A client left (or, with None, clients expired): write its next heartbeat in full."""
        if client_id is None:
            self._known.clear()
            self._pending.clear()
        else:
            self._known.pop(client_id, None)
            self._pending.pop(client_id, None)

    @property
    def pending(self) -> int:
        """Heartbeat times waiting for the next flush."""
        return len(self._pending)

    async def flush(self, s: AsyncSession) -> int:
        """Write every pending time in one statement of the caller's transaction; how many."""
        if not self._pending:
            return 0
        rows: list[dict[str, Any]] = [{"id": client_id, "seen": seen_ms}
                                      for client_id, seen_ms in self._pending.items()]
        self._pending = {}
        await s.execute(_WRITE_TIMES, rows)
        return len(rows)


# The flush's statement, built once: building it cost the event loop more Python than its
# execution's cached compile.
_clients = Client.__table__.c
_WRITE_TIMES = (update(Client.__table__)
                .where(_clients.client_id == bindparam("id"),
                       _clients.last_seen_ms < bindparam("seen"))
                .values(last_seen_ms=bindparam("seen"), online=True))


async def write_clients(s: AsyncSession, clients: list[dict[str, Any]], now_ms: int) -> None:
    """Write these clients' rows in full (online, seen at ``now_ms``: each a heartbeat's fields)
    and the consumer groups of their (group, subject) pairs that are new, in the caller's
    transaction: a process's new consumers cost one transaction, not one each."""
    pairs: set[tuple[str, str]] = set()
    rows = {row.client_id: row for row in (await s.execute(
        select(Client).where(Client.client_id.in_([c["client_id"] for c in clients]))
    )).scalars()}
    for item in clients:
        client = rows.get(item["client_id"])
        if client is None:
            client = Client(client_id=item["client_id"], first_seen_ms=now_ms)
            s.add(client)
        client.app = item["app"]
        client.group_name = item["group"]
        client.role = item["role"]
        client.subjects = item["subjects"]
        client.online = True
        client.last_seen_ms = now_ms
        if item["role"] == "consumer":
            pairs.update((item["group"], subject) for subject in item["subjects"])
    if not pairs:
        return
    known = {(name, subject) for name, subject in (await s.execute(
        select(ConsumerGroup.name, ConsumerGroup.subject)
        .where(ConsumerGroup.name.in_({group for group, _ in pairs}))
    )).all()}
    for group, subject in sorted(pairs - known):
        s.add(ConsumerGroup(name=group, subject=subject, created_at_ms=now_ms))


__all__ = ["ClientLiveness", "write_clients"]
