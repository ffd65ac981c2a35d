"""The MetaServer's side of failover, as pure functions and one small class told the time.

The database code (``metaserver/replication.py``) reads rows into these plain values, asks
what to do, and carries the answer out in a transaction that re-checks what it read under the
group's row lock (docs/REPLICATION.md 5, 6, 9).

* ``LeaseWatch``: when has a master's lease *surely* expired? Each MetaServer remembers, per
  group, the ``(epoch, lease_renewals)`` pair it last saw and the moment it first saw it on
  its own monotonic clock. The lease has surely expired once that pair has not moved for
  ``lease_ms + lease_margin_ms``: the renewal behind it committed before it was seen, and the
  master counted its lease from before it sent that renewal.
* ``choose_successor``: the online in-sync slave with the highest position (ties: the smallest
  server id).
* ``plan_failover``: promote now, or not.
* The switchover steps: ``plan_switchover`` (may it start, and to whom), ``switchover_verdict``
  (carry on, or cancel and why), ``handover_completes`` (does this heartbeat finish it).
"""

from __future__ import annotations

from dataclasses import dataclass


class SwitchoverRefused(Exception):
    """A switchover cannot start; the message says why (the API answers 409 conflict)."""


@dataclass(frozen=True)
class ServerState:
    """One server of a group as the failover rules see it."""

    server_id: str
    role: str  # "master" or "slave"
    in_sync: bool  # in the database's in-sync set
    online: bool  # heartbeat within broker_expiry_ms and not deregistered
    position: int | None = None  # end of its primary log, as it last reported


@dataclass(frozen=True)
class GroupState:
    """One group's replication row."""

    name: str
    epoch: int
    master_id: str | None
    lease_renewals: int
    switchover_to: str | None = None
    switchover_deadline_ms: int | None = None

    def lease_required(self, servers: list[ServerState]) -> bool:
        """True when a slave is in sync: someone could be promoted, so the master needs a lease."""
        return any(s.in_sync and s.server_id != self.master_id for s in servers)


@dataclass(frozen=True)
class Promotion:
    """A decision to make ``to_id`` master of ``group`` at ``epoch + 1``."""

    group: str
    from_id: str | None
    to_id: str
    epoch: int  # the epoch it replaces; the transaction checks it is still current
    lease_renewals: int  # likewise
    reason: str  # "lease expired", "switchover", "master shut down", "unclean"


class LeaseWatch:
    """Per group, the ``(epoch, lease_renewals)`` last seen and when (``now_ms`` is this
    MetaServer's monotonic clock). Used by one task; not thread-safe."""

    def __init__(self, lease_ms: int, margin_ms: int) -> None:
        assert lease_ms > 0 and margin_ms >= 0, (lease_ms, margin_ms)
        self.wait_ms = lease_ms + margin_ms
        self._seen: dict[str, tuple[int, int, int]] = {}  # group -> (epoch, renewals, since)

    def observe(self, group: str, epoch: int, renewals: int, now_ms: int) -> None:
        """Note the group's pair as read at ``now_ms``; the clock restarts when it moved."""
        seen = self._seen.get(group)
        if seen is None or seen[:2] != (epoch, renewals):
            self._seen[group] = (epoch, renewals, now_ms)

    def expired(self, group: str, now_ms: int) -> bool:
        """True once the pair seen has not moved for ``lease_ms + margin``."""
        seen = self._seen.get(group)
        return seen is not None and now_ms - seen[2] >= self.wait_ms

    def silent_ms(self, group: str, now_ms: int) -> int | None:
        """How long the pair has not moved, or None when never seen."""
        seen = self._seen.get(group)
        return None if seen is None else now_ms - seen[2]

    def seen(self, group: str) -> tuple[int, int] | None:
        """The ``(epoch, lease_renewals)`` last seen."""
        seen = self._seen.get(group)
        return None if seen is None else seen[:2]

    def forget(self, group: str) -> None:
        """Drop what is known of ``group`` (it has no lease to watch any more)."""
        self._seen.pop(group, None)


def choose_successor(servers: list[ServerState], master_id: str | None, *,
                     require_in_sync: bool = True) -> ServerState | None:
    """The best server to promote: online, not the master, in sync (unless told otherwise), with
    the highest reported position; ties go to the smallest server id."""
    candidates = [s for s in servers if s.online and s.server_id != master_id
                  and (s.in_sync or not require_in_sync)]
    if not candidates:
        return None
    return min(candidates, key=lambda s: (-(s.position if s.position is not None else -1),
                                          s.server_id))


def plan_failover(group: GroupState, servers: list[ServerState], watch: LeaseWatch,
                  now_ms: int) -> Promotion | None:
    """Promote when the master's lease has surely expired and an in-sync slave is online."""
    if not group.lease_required(servers) or not watch.expired(group.name, now_ms):
        return None
    if watch.seen(group.name) != (group.epoch, group.lease_renewals):
        return None  # the row moved since it was observed: the watch restarts first
    successor = choose_successor(servers, group.master_id)
    if successor is None:
        return None
    return Promotion(group.name, group.master_id, successor.server_id, group.epoch,
                     group.lease_renewals, "lease expired")


def plan_switchover(group: GroupState, servers: list[ServerState], to: str | None) -> str:
    """The target of a switchover that may start now; SwitchoverRefused naming why not."""
    if group.switchover_to is not None:
        raise SwitchoverRefused(f"group {group.name} is already switching over to "
                                f"{group.switchover_to}")
    by_id = {s.server_id: s for s in servers}
    master = by_id.get(group.master_id or "")
    if master is None or not master.online:
        raise SwitchoverRefused(f"group {group.name} has no online master to hand over; a "
                                "failover (or --unclean) is what it needs")
    if to is None:
        best = choose_successor(servers, group.master_id)
        if best is None:
            raise SwitchoverRefused(f"group {group.name} has no online slave in sync")
        return best.server_id
    target = by_id.get(to)
    if target is None:
        raise SwitchoverRefused(f"server {to} is not a server of group {group.name}")
    if to == group.master_id:
        raise SwitchoverRefused(f"server {to} is already the master of group {group.name}")
    if not target.online:
        raise SwitchoverRefused(f"server {to} of group {group.name} is offline")
    if not target.in_sync:
        raise SwitchoverRefused(f"server {to} of group {group.name} is not in sync; wait "
                                "until it has caught up")
    return to


def switchover_verdict(group: GroupState, servers: list[ServerState], now_ms: int) -> str | None:
    """None while a switchover under way may go on; otherwise why it is cancelled."""
    if group.switchover_to is None:
        return None
    if group.switchover_deadline_ms is not None and now_ms > group.switchover_deadline_ms:
        return "its deadline passed before the master handed over"
    target = next((s for s in servers if s.server_id == group.switchover_to), None)
    if target is None or not target.online:
        return f"the target {group.switchover_to} went offline"
    if not target.in_sync:
        return f"the target {group.switchover_to} fell out of sync"
    master = next((s for s in servers if s.server_id == group.master_id), None)
    if master is None or not master.online:
        return "the master went offline"
    return None


def handover_completes(group: GroupState, reporter: str, epoch: int,
                       handover_ready: str | None) -> Promotion | None:
    """The promotion a master's heartbeat finishes: it is the master at the current epoch and
    says the switchover's target has everything."""
    if (group.switchover_to is None or handover_ready != group.switchover_to
            or reporter != group.master_id or epoch != group.epoch):
        return None
    return Promotion(group.name, reporter, group.switchover_to, group.epoch,
                     group.lease_renewals, "switchover")


__all__ = [
    "GroupState",
    "LeaseWatch",
    "Promotion",
    "ServerState",
    "SwitchoverRefused",
    "choose_successor",
    "handover_completes",
    "plan_failover",
    "plan_switchover",
    "switchover_verdict",
]
