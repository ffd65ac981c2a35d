"""The seam between the control plane (roles, leases, the MetaServer) and the data plane (log
shipping, sync waits, truncation): what a server's replication reports in each heartbeat, and
what it is told when its role changes. docs/REPLICATION.md section 12.

The data plane implements ``ReplicationStatus`` and hands it to ``RealtimeServer`` /
``DelayServer`` (``replication=``). ``NoReplication``, the default, copies nothing and
proposes no slave in sync, so every group stays solo and works as before replication existed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Collection
from typing import Any, Protocol

from serverkit.role import RoleView
from wire.limits import REPLICA_INSYNC_MAX, REPLICA_POSITIONS_MAX, UNDECODABLE_REASON_CHARS_MAX


@dataclass(frozen=True)
class ReplicaReport:
    """One heartbeat's replication figures. Every field is optional (None / empty = unknown)."""

    position: int | None = None  # end offset of the primary log held (message log / delay log)
    positions: dict[str, int] = field(default_factory=dict)  # log name -> end offset held
    lag_bytes: int | None = None  # slave: bytes behind the master, as of its last fetch
    lag_ms: int | None = None  # slave: age of the oldest record it lacks (0 = caught up)
    insync: tuple[str, ...] = ()  # master: the slaves it counts as in sync (its proposal)
    handover_ready: str | None = None  # master, in a switchover: the target has everything
    writable: bool = True  # master: False while min_insync refuses writes
    # slave: where its copy stopped at a record it cannot decode (Follower.undecodable_at)
    undecodable_at: dict[str, Any] | None = None

    def to_json(self, takes: Collection[str] = ()) -> dict[str, Any]:
        """The ``replica`` object of a heartbeat request (docs/REPLICATION.md 13.4); a field
        added since session 15 only when the MetaServer ``takes`` it (its answers' last
        ``replica_fields``: an older one answers an unknown field 400)."""
        out: dict[str, Any] = {"writable": self.writable}
        if self.position is not None:
            out["position"] = self.position
        if self.positions:
            out["positions"] = dict(list(self.positions.items())[:REPLICA_POSITIONS_MAX])
        if self.lag_bytes is not None:
            out["lag_bytes"] = self.lag_bytes
        if self.lag_ms is not None:
            out["lag_ms"] = self.lag_ms
        if self.insync:
            out["insync"] = list(self.insync[:REPLICA_INSYNC_MAX])
        if self.handover_ready is not None:
            out["handover_ready"] = self.handover_ready
        at = self.undecodable_at
        if at is not None and "undecodable_at" in takes and all(
                (type(at.get(name)) is int and at[name] >= 0) or (at.get(name) is None
                                                                   and name != "offset")
                for name in ("offset", "kind", "version")):
            # Only what the MetaServer checks passes: a refused heartbeat renews nothing.
            out["undecodable_at"] = {
                "log": str(at.get("log")), "offset": at["offset"], "kind": at.get("kind"),
                "version": at.get("version"),
                "reason": str(at.get("reason"))[:UNDECODABLE_REASON_CHARS_MAX]}
        return out


class ReplicationStatus(Protocol):
    """What the data plane gives the control plane (docs/REPLICATION.md 12)."""

    def report(self) -> ReplicaReport:
        """Figures for the next heartbeat; called on the event loop, must not block."""

    async def on_role(self, view: RoleView) -> None:
        """The role, epoch, master or switchover changed. For a new master: stop fetching and
        seal the logs (epoch history), then return; writes stay refused until it returns. For
        a slave: writes are already refused; stop the master's writers, truncate, and start
        following in a task of its own. It must return promptly: server start-up waits for the
        first call, and later changes queue behind it."""

    def last_epoch(self) -> int:
        """The newest epoch in this server's epoch history (0 for a new server)."""

    async def drain(self, timeout_ms: int) -> None:
        """A replicated master is shutting down: it refuses writes and has finished the ones in
        flight. Wait (at most ``timeout_ms``) until its in-sync slaves have everything, so the
        slave promoted when it deregisters lacks nothing it acknowledged (``async`` mode)."""


class NoReplication:
    """The default: nothing is copied, no slave is ever proposed, every group stays solo."""

    def report(self) -> ReplicaReport:
        """No figures: nothing is replicated."""
        return ReplicaReport()

    async def on_role(self, view: RoleView) -> None:
        """Nothing to seal or truncate."""

    def last_epoch(self) -> int:
        """No epoch history is kept."""
        return 0

    async def drain(self, timeout_ms: int) -> None:
        """Nothing to wait for."""


__all__ = ["NoReplication", "ReplicaReport", "ReplicationStatus"]
