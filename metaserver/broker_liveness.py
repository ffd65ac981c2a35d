"""``BrokerLiveness``: broker heartbeats that change nothing cost no SQL (issue 18).

Every server heartbeats every ``heartbeat_interval_ms`` (750 ms by default) whether anything
changed or not. Written in full, each was a write transaction of five ORM statements through
aiosqlite (~10 ms of CPU): the two servers of an idle ``qmq up`` spent half of its idle CPU on
them. Now, as for client heartbeats (``metaserver.liveness``):

- a heartbeat is written in full as before (and its answer remembered here, ``written``) when
  it is the server's first, when it says anything new (group, kind, address, state, epoch, role,
  master, replication settings, in-sync proposal, ``writable``, ``handover_ready``), when a
  write that may change a group was committed since (``changed``: registrations, expiries,
  promotions, switchovers, readonly, settings; a heartbeat's own write when it changed its
  group; or, read by the failover check, another MetaServer's), when the last full write is
  ``FULL_HEARTBEAT_MS`` old, when the server is the master of a group that needs a lease (an
  in-sync slave: every renewal must reach the database, where any MetaServer's lease watch
  reads it), or when its group has a switchover under way;
- any other heartbeat is answered from memory (the answer of its last full write: nothing it
  depends on has changed) and only its time and replica figures (``position``, ``positions``,
  ``lag_bytes``, ``lag_ms``, ``undecodable_at``) are noted (``pending``);
- ``flush`` writes the noted figures in one statement inside the expiry check's transaction
  (``Registry.expire_now``, every ``expiry_check_interval_ms``), before it expires anyone.

What is only in memory, and why losing it (a MetaServer restart or crash) is safe:

- the remembered answers: a restarted MetaServer has none, so every server's next heartbeat is
  written in full and rebuilds them;
- the noted times and figures: at most one expiry interval of them. A flushed time only moves
  ``last_heartbeat_ms`` forward, so the database holds a time no later than the true last
  heartbeat: a server may look older by up to ``heartbeat_interval_ms +
  expiry_check_interval_ms`` (1.75 s by default, against ``broker_expiry_ms`` 15 s), never
  younger. Expiry and promotion rules read it; an older time can only delay a promotion's
  target, never promote a dead one. Nothing expires in a restarted MetaServer's first
  ``broker_expiry_ms``, and the servers' heartbeats restore the times well within it;
- the lease renewals a noted heartbeat does not count (``lease_renewals``): a master's
  heartbeat takes this path only while its group needs no lease, and no MetaServer watches the
  lease of such a group (its master is online) or may promote in it (no in-sync slave). The
  master's first heartbeat after a slave joins the in-sync set is written in full, as is every
  one after it while the group needs a lease. A slave's heartbeat renews nothing, so a slave
  of a group with a lease takes this path too (``qmq up --replicas 2``, two masters and two
  slaves: all ~5.3 heartbeats a second were written, now only the masters' ~2.7). Its noted
  time only decides whether it is online, by the rule above.

Another MetaServer sharing the database (PostgreSQL) changes groups without telling this one:
what it changes reaches this MetaServer's answers at its next failover check that reads (every
``failover_check_interval_ms`` while any group has a slave: it compares the group and server
fields the answers come from with its last read, ``ReplicationOps._note_answer_rows``), and
within ``FULL_HEARTBEAT_MS`` in any case.

Owner: the event loop (the MetaServer's handlers and its expiry task).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import Table, Update, bindparam, update
from sqlalchemy.ext.asyncio import AsyncSession

from metaserver.models import Broker

# Longest a server's heartbeats are answered from memory before one is written in full again,
# in ms (monotonic): bounds how late another MetaServer's change of a group reaches this one's
# answers, and makes sure a row marked offline elsewhere is noticed.
FULL_HEARTBEAT_MS = 5_000
# The replica figures a noted heartbeat carries to the next flush (stored as figures only).
REPLICA_FIGURES = ("position", "positions", "lag_bytes", "lag_ms", "undecodable_at")

Signature = tuple[Any, ...]


@dataclass(frozen=True)
class _Known:
    """A server's last full write: what it said, the answer, when (monotonic ms) and the
    group generation it was read under."""

    signature: Signature
    answer: dict[str, Any]
    written_mono_ms: int
    generation: int


def needs_full_write(answer: dict[str, Any]) -> bool:
    """True when every heartbeat of the server this answer went to must be written in full:
    it is a master that holds a lease (each renewal must be recorded), or its group has a
    switchover under way. A slave's heartbeat renews nothing, even in a group with a lease."""
    lease = answer.get("lease_required") and answer.get("role") == "master"
    return bool(lease) or answer.get("switchover_to") is not None


class BrokerLiveness:
    """Remembered heartbeat answers of servers whose group needs no lease, and the heartbeat
    times and figures not yet written."""

    def __init__(self) -> None:
        self._known: dict[str, _Known] = {}  # server id -> its last full write
        self._pending: dict[str, dict[str, Any]] = {}  # server id -> time and figures to write
        # Bumped by every committed write that may change a group's rows or a heartbeat's
        # answer; an answer remembered under an older generation is not reused.
        self.generation = 0
        self.answered = 0  # heartbeats answered from memory (tests, benchmarks)

    @staticmethod
    def signature(group: str, kind: str, address: str, state: str, epoch: int, role: str,
                  master_id: str | None, replication: dict[str, Any] | None,
                  replica: dict[str, Any] | None) -> Signature:
        """What a heartbeat says besides its time and replica figures."""
        settings = tuple(sorted((replication or {}).items()))
        rep = replica or {}
        return (group, kind, address, state, epoch, role, master_id, settings,
                tuple(rep.get("insync") or ()), rep.get("writable", True) is not False,
                rep.get("handover_ready"), replica is None)

    def changed(self) -> None:
        """A write that may change a group was (or is about to be) committed."""
        self.generation += 1

    def answer(self, server_id: str, signature: Signature, replica: dict[str, Any] | None,
               now_ms: int, mono_ms: int) -> dict[str, Any] | None:
        """The remembered answer (a copy) when this heartbeat may skip its write, its time and
        figures then noted; None when it must be written in full."""
        known = self._known.get(server_id)
        if (known is None or known.signature != signature or known.generation != self.generation
                or mono_ms - known.written_mono_ms >= FULL_HEARTBEAT_MS):
            return None
        figures: dict[str, Any] = {"seen": now_ms}
        if replica is not None:
            figures.update({name: replica.get(name) for name in REPLICA_FIGURES})
        self._pending[server_id] = figures
        self.answered += 1
        return dict(known.answer)

    def written(self, server_id: str, signature: Signature, answer: dict[str, Any],
                mono_ms: int, generation: int) -> None:
        """A heartbeat of ``server_id`` was written in full, read under ``generation``: its
        answer may be reused unless it renews a lease or its group has a switchover under way
        (``needs_full_write``)."""
        self._pending.pop(server_id, None)
        if needs_full_write(answer):
            self._known.pop(server_id, None)
        else:
            self._known[server_id] = _Known(signature, dict(answer), mono_ms, generation)

    def noted(self, server_id: str) -> dict[str, Any] | None:
        """The time (``seen``) and figures of ``server_id``'s heartbeat noted since the last
        flush, for admin views to show instead of the row's older ones."""
        return self._pending.get(server_id)

    @property
    def pending(self) -> int:
        """Heartbeats whose time waits for the next flush."""
        return len(self._pending)

    async def flush(self, s: AsyncSession) -> int:
        """Write every noted time and figures in one statement of the caller's transaction;
        how many. A row marked offline meanwhile keeps its last written time."""
        if not self._pending:
            return 0
        rows = [{"sid": server_id, "seen": figures["seen"],
                 **{f"f_{name}": figures.get(name) for name in REPLICA_FIGURES}}
                for server_id, figures in self._pending.items()]
        with_figures = [row for row in rows if "position" in self._pending[row["sid"]]]
        bare = [row for row in rows if "position" not in self._pending[row["sid"]]]
        self._pending = {}
        if with_figures:
            await s.execute(_WRITE_FIGURES, with_figures)
        if bare:
            await s.execute(_WRITE_TIMES, bare)
        return len(rows)


def _flush_statements() -> tuple[Update, Update]:
    """The flush's two statements (times and figures; times only), built once: building one
    costs the event loop more Python than its execution's cached compile."""
    table = cast(Table, Broker.__table__)
    where = (table.c.server_id == bindparam("sid"), table.c.state != "offline",
             table.c.last_heartbeat_ms < bindparam("seen"))
    figures = update(table).where(*where).values(
        last_heartbeat_ms=bindparam("seen"),
        **{name: bindparam(f"f_{name}") for name in REPLICA_FIGURES})
    return figures, update(table).where(*where).values(last_heartbeat_ms=bindparam("seen"))


_WRITE_FIGURES, _WRITE_TIMES = _flush_statements()


__all__ = ["FULL_HEARTBEAT_MS", "BrokerLiveness", "needs_full_write"]
