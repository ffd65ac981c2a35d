"""A server's role in its group: master or slave, the epoch, and the master's lease.

``ServerRole`` is a pure state machine told the time: it reads no clock and does no I/O. The
registration feeds it the MetaServer's answers (``before_heartbeat`` / ``on_answer``), the
servers ask it before and after every client request (``check_writable``), and the data plane
tells it when it has sealed its logs as a new master (``activate``) or when a fetch revealed a
higher epoch (``observe_epoch``). docs/REPLICATION.md sections 3-5 explain the rules; in short:

* A master may accept writes while ``now_ms < sent_at_ms + lease_ms - guard``, where
  ``sent_at_ms`` is when it *sent* the heartbeat whose answer made it master at that epoch, read
  on ``CLOCK_BOOTTIME`` (``boottime_ms``), and ``guard`` is ``lease_ms // LEASE_GUARD_DIVISOR``.
* A master of a *solo* group (no slave in sync, so nobody can be promoted) needs no lease: it
  is solo when its last answer said ``lease_required: false`` and the heartbeat that earned it
  proposed no slave. Proposing a slave ends solo at once, before the heartbeat is sent.
* A new master (a change of epoch or of role) is not *active* until the data plane has sealed
  its logs and called ``activate(epoch)``; until then it refuses writes.
* A higher epoch seen anywhere demotes the server at once; an answer with a lower epoch than
  the server knows is ignored (it grants nothing).
* Without a MetaServer (``standalone``) the server is a master with no lease: tests and tools.

Heartbeats are sent one at a time (the registration holds a lock), so answers arrive in order.
The object is used only on the event loop's thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from wire.errors import NotMaster
from wire.limits import MIN_INSYNC_MAX

ROLES = ("unknown", "master", "slave")
REPLICATION_MODES = ("sync", "async")
# A master stops accepting writes this fraction of its lease before the lease ends, to cover a
# stall between its lease check and its answer leaving the process (docs/REPLICATION.md 5).
LEASE_GUARD_DIVISOR = 10


_clock_gettime_ns = time.clock_gettime_ns  # read by ``writable_now`` with no module lookup
_BOOTTIME = time.CLOCK_BOOTTIME


def boottime_ms() -> int:
    """Milliseconds of ``CLOCK_BOOTTIME``: monotonic, and counting time spent suspended, so a
    machine woken from suspend does not believe its lease is still young."""
    return _clock_gettime_ns(_BOOTTIME) // 1_000_000


@dataclass(frozen=True)
class ReplicationSettings:
    """A group's replication settings as the MetaServer holds them (docs/REPLICATION.md 7)."""

    mode: str = "sync"  # "sync": answer once every in-sync slave has the write; "async": at once
    min_insync: int = 0  # fewest in-sync slaves with which writes are accepted (0 = degrade)


@dataclass(frozen=True)
class RoleGrant:
    """What one register or heartbeat answer says about the server's role."""

    role: str  # "master" or "slave"
    epoch: int  # the group's epoch
    lease_ms: int  # how long after sending the request the master may accept writes
    lease_required: bool  # False: the group is solo and its master needs no lease
    master_id: str | None  # the master's server id (None: the group has none now)
    master_address: str | None  # where the master listens ("host:port")
    insync: tuple[str, ...] = ()  # the slaves the database counts as in sync
    replication: ReplicationSettings = field(default_factory=ReplicationSettings)
    switchover_to: str | None = None  # a planned switchover to this server is under way
    slaves: tuple[str, ...] = ()  # every other server registered in the group

    @classmethod
    def from_answer(cls, data: Any) -> RoleGrant | None:
        """The grant in a MetaServer answer, or None when the answer carries none (a MetaServer
        without replication) or a malformed one (then it grants nothing)."""
        if not isinstance(data, dict):
            return None
        role, epoch, lease_ms = data.get("role"), data.get("epoch"), data.get("lease_ms")
        if role not in ("master", "slave") or not _is_int(epoch) or not _is_int(lease_ms):
            return None
        if epoch < 0 or lease_ms <= 0:
            return None
        master = data.get("master")
        master_id = master.get("server_id") if isinstance(master, dict) else None
        master_address = master.get("address") if isinstance(master, dict) else None
        insync = data.get("insync")
        slaves = data.get("slaves")
        settings = data.get("replication")
        mode = settings.get("mode") if isinstance(settings, dict) else None
        min_insync = settings.get("min_insync") if isinstance(settings, dict) else None
        switchover = data.get("switchover_to")
        return cls(
            role=role, epoch=epoch, lease_ms=lease_ms,
            lease_required=data.get("lease_required") is not False,
            master_id=master_id if isinstance(master_id, str) else None,
            master_address=master_address if isinstance(master_address, str) else None,
            insync=tuple(x for x in insync if isinstance(x, str))
            if isinstance(insync, list) else (),
            replication=ReplicationSettings(
                mode if mode in REPLICATION_MODES else "sync",
                min_insync if _is_int(min_insync) and 0 <= min_insync <= MIN_INSYNC_MAX else 0),
            switchover_to=switchover if isinstance(switchover, str) else None,
            slaves=tuple(x for x in slaves if isinstance(x, str))
            if isinstance(slaves, list) else (),
        )


def check_settings(replication: str | None, min_insync: int | None) -> None:
    """Check a server's ``--replication`` / ``--min-insync``; ValueError naming key and value."""
    if replication is not None and replication not in REPLICATION_MODES:
        raise ValueError(f"replication {replication!r} is not one of {REPLICATION_MODES}")
    if min_insync is not None and (not _is_int(min_insync)
                                   or not 0 <= min_insync <= MIN_INSYNC_MAX):
        raise ValueError(f"min_insync {min_insync!r} must be 0..{MIN_INSYNC_MAX}")


def settings_of(replication: str | None, min_insync: int | None) -> dict[str, object] | None:
    """The explicit settings a server sends at registration (None when it was given none)."""
    out: dict[str, object] = {}
    if replication is not None:
        out["mode"] = replication
    if min_insync is not None:
        out["min_insync"] = min_insync
    return out or None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class RoleView:
    """A snapshot of the role for the data plane, metrics and logs."""

    server_id: str
    role: str  # "unknown", "master" or "slave"
    epoch: int
    active: bool  # a master whose data plane has sealed its logs for this epoch
    master_id: str | None
    master_address: str | None
    insync: tuple[str, ...]
    switchover_to: str | None
    lease_required: bool
    replication: ReplicationSettings
    standalone: bool
    slaves: tuple[str, ...] = ()  # the group's other registered servers (a master counts these)


@dataclass(frozen=True)
class RoleChange:
    """What an answer changed: ``changed`` when the role, epoch, master or switchover moved
    (the data plane's ``on_role`` must run); ``stale`` when the answer was older than what the
    server knows and was ignored."""

    view: RoleView
    changed: bool = False
    stale: bool = False


# ``ServerRole.writable_until_ms`` when no lease applies, and when writes are refused whatever
# the time: a write at ``now_ms`` is allowed exactly while ``now_ms < writable_until_ms()``.
_FOREVER = float("inf")
_NEVER = float("-inf")


class ServerRole:
    """The role state of one server (see the module docstring). Event-loop thread only.

    Every request asks ``check_writable_now`` once or twice, so what the state allows is worked
    out once per change of state, not per question: any assignment to an attribute (every state
    change is one) forgets it, and the next question works it out again from ``refusal``."""

    _until_ms: float | None  # what the state allows (see writable_until_ms); None: not known

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        object.__setattr__(self, "_until_ms", None)

    def __delattr__(self, name: str) -> None:
        object.__delattr__(self, name)
        object.__setattr__(self, "_until_ms", None)

    def __init__(self, server_id: str, *, standalone: bool = False, epoch: int = 0) -> None:
        self.server_id = server_id
        self.standalone = standalone
        self.role = "master" if standalone else "unknown"
        self.epoch = epoch
        self.active = standalone
        self.master_id: str | None = server_id if standalone else None
        self.master_address: str | None = None
        self.insync: tuple[str, ...] = ()
        self.slaves: tuple[str, ...] = ()
        self.switchover_to: str | None = None
        self.replication = ReplicationSettings()
        self.lease_ms = 0
        self.lease_until_ms: int | None = None  # on boottime_ms; None = no lease
        # Conservative until an answer says otherwise: a lease is needed.
        self.lease_required = True
        self._solo = standalone
        self._stepped_down = False
        self.changes = 0  # role changes seen (for metrics)

    # -- heartbeats -------------------------------------------------------------------------

    def before_heartbeat(self, now_ms: int, proposes_slaves: bool) -> int:
        """Note that a heartbeat is about to be sent at ``now_ms``; returns the ``sent_at_ms``
        to hand to ``on_answer``. A heartbeat proposing a slave in sync ends solo first."""
        if proposes_slaves:
            self._solo = False
        return now_ms

    def on_answer(self, sent_at_ms: int, grant: RoleGrant, proposed_slaves: bool) -> RoleChange:
        """Apply the answer to a heartbeat (or registration) sent at ``sent_at_ms``."""
        if self.standalone:
            return RoleChange(self.view())
        if grant.epoch < self.epoch:
            return RoleChange(self.view(), stale=True)
        changed = (grant.epoch != self.epoch or grant.role != self.role
                   or grant.master_id != self.master_id
                   or grant.master_address != self.master_address
                   or grant.switchover_to != self.switchover_to)
        new_mastership = grant.role == "master" and (grant.epoch != self.epoch
                                                     or self.role != "master")
        self.epoch = grant.epoch
        self.role = grant.role
        self.master_id = grant.master_id
        self.master_address = grant.master_address
        self.insync = grant.insync
        self.slaves = grant.slaves
        self.replication = grant.replication
        self.switchover_to = grant.switchover_to
        self.lease_ms = grant.lease_ms
        self.lease_required = grant.lease_required
        if grant.role == "master":
            if new_mastership:
                self.active = False
                self.lease_until_ms = None
            until = sent_at_ms + grant.lease_ms - grant.lease_ms // LEASE_GUARD_DIVISOR
            if self.lease_until_ms is None or until > self.lease_until_ms:
                self.lease_until_ms = until
            self._solo = not grant.lease_required and not proposed_slaves
        else:
            self._demote()
        if changed:
            self.changes += 1
        return RoleChange(self.view(), changed=changed)

    def on_roleless_answer(self) -> bool:
        """A MetaServer that knows nothing of roles (an older one, during an upgrade) answered:
        serve as the unreplicated master it takes every server for. True when this changed
        the role. Never used once an answer with a role was seen."""
        if self.standalone or self.changes:
            return False
        self.role, self.master_id, self.active, self._solo = "master", self.server_id, True, True
        return True

    def activate(self, epoch: int) -> bool:
        """The data plane sealed its logs for ``epoch``: a master of that epoch may now write.
        False (and nothing changes) when the role moved on meanwhile."""
        if self.role == "master" and self.epoch == epoch:
            self.active = True
            return True
        return False

    def observe_epoch(self, epoch: int) -> bool:
        """A higher ``epoch`` was seen (a fetch, a peer): stop writing at once, and learn who
        the master is from the next answer. True when this demoted the server."""
        if self.standalone or epoch <= self.epoch:
            return False
        self.epoch = epoch
        self.role = "unknown"
        self.master_id = self.master_address = None
        self.switchover_to = None
        self._demote()
        self.changes += 1
        return True

    def step_down(self) -> None:
        """Refuse writes from now on (a graceful shutdown of a master)."""
        self._stepped_down = True

    def _demote(self) -> None:
        self.active = False
        self.lease_until_ms = None
        self._solo = False

    # -- questions --------------------------------------------------------------------------

    def may_write(self, now_ms: int) -> bool:
        """True when this server may accept a client write at ``now_ms`` (``boottime_ms``)."""
        return self.refusal(now_ms) is None

    def refusal(self, now_ms: int) -> str | None:
        """Why a write at ``now_ms`` is refused, or None when it is allowed."""
        if self._stepped_down:
            return "it is shutting down"
        if self.standalone:
            return None
        if self.role == "unknown":
            return ("its role is not known yet: no MetaServer has answered since it started"
                    if self.epoch == 0 or self.changes == 0 else
                    f"it saw epoch {self.epoch} and waits for the MetaServer to name the master")
        if self.role == "slave":
            where = (f"; the master is {self.master_id} at {self.master_address}"
                     if self.master_id else "; the group has no master now")
            return f"it is a slave at epoch {self.epoch}{where}"
        if not self.active:
            return f"it became master at epoch {self.epoch} and is still sealing its logs"
        if self.switchover_to is not None:
            return f"it is handing the group over to {self.switchover_to}"
        if self._solo:
            return None
        if self.lease_until_ms is None or now_ms >= self.lease_until_ms:
            return (f"its lease ran out (epoch {self.epoch}): no MetaServer renewed it in time")
        return None

    def only_lease_ran_out(self, now_ms: int) -> bool:
        """True when a write at ``now_ms`` is refused for one reason alone: the lease ran out
        of a master still active at its epoch (not a slave, not sealing, not handing over,
        not stopping), which a renewal may restore in a moment."""
        refusal = self.refusal(now_ms)
        return refusal is not None and refusal.startswith("its lease ran out")

    def writable_until_ms(self) -> float:
        """Until when (``boottime_ms``) a write is allowed if nothing changes meanwhile:
        ``inf`` when no lease applies, ``-inf`` when the state refuses writes at any time,
        else the end of the lease. ``now_ms < writable_until_ms()`` exactly when
        ``refusal(now_ms) is None``."""
        until = self._until_ms
        if until is None:
            if self.refusal(-(1 << 62)) is not None:  # refused whatever the time
                until = _NEVER
            elif self.standalone or self._solo:
                until = _FOREVER
            else:
                assert self.lease_until_ms is not None  # else refusal() said the lease ran out
                until = float(self.lease_until_ms)
            object.__setattr__(self, "_until_ms", until)
        return until

    def writable_now(self) -> bool:
        """``may_write(boottime_ms())``, reading the clock only when a lease applies: the
        check every request makes (twice, most of them). The clock is read as ``boottime_ms``
        reads it, written out: a master with a lease (one with a slave in sync) makes no
        second Python call per check."""
        until = self._until_ms
        if until is None:
            until = self.writable_until_ms()
        return until == _FOREVER or _clock_gettime_ns(_BOOTTIME) // 1_000_000 < until

    def check_writable_now(self, group: str) -> None:
        """``check_writable(group, boottime_ms())``, as cheaply as ``writable_now``."""
        if not self.writable_now():
            self.check_writable(group, boottime_ms())

    def check_writable(self, group: str, now_ms: int) -> None:
        """Raise ``NotMaster`` (retriable, naming why) unless ``may_write(now_ms)``."""
        reason = self.refusal(now_ms)
        if reason is not None:
            raise NotMaster(f"server {self.server_id} is not the leased master of group "
                            f"{group}: {reason}; refresh the route and resend")

    def lease_remaining_ms(self, now_ms: int) -> int | None:
        """Milliseconds of lease left (0 when run out), or None when no lease applies."""
        if self.standalone or self._solo or self.role != "master":
            return None
        if self.lease_until_ms is None:
            return 0
        return max(0, self.lease_until_ms - now_ms)

    @property
    def settling(self) -> bool:
        """True in the passing states: role not known yet, or a new master still sealing its
        logs. Work that only a master may do can wait for them to end (not for a lease)."""
        if self.standalone or self._stepped_down:
            return False
        return self.role == "unknown" or (self.role == "master" and not self.active)

    @property
    def solo(self) -> bool:
        """True while this master needs no lease (its group has no slave in sync)."""
        return self._solo

    def view(self) -> RoleView:
        """A snapshot of the role."""
        return RoleView(
            server_id=self.server_id, role=self.role, epoch=self.epoch, active=self.active,
            master_id=self.master_id, master_address=self.master_address, insync=self.insync,
            switchover_to=self.switchover_to, lease_required=self.lease_required,
            replication=self.replication, standalone=self.standalone, slaves=self.slaves)


__all__ = [
    "LEASE_GUARD_DIVISOR",
    "MIN_INSYNC_MAX",
    "REPLICATION_MODES",
    "ROLES",
    "ReplicationSettings",
    "RoleChange",
    "RoleGrant",
    "RoleView",
    "ServerRole",
    "boottime_ms",
    "check_settings",
    "settings_of",
]
