"""``Replica``: the data plane of one realtime or delay server, as the control plane sees it
(``serverkit.replication.ReplicationStatus``, docs/REPLICATION.md 8, 9 and 12).

It owns the epoch histories of the server's replicated logs, a ``ReplicaSource`` (the master's
side: fetches, the in-sync set, sync waits) and a ``Follower`` (the slave's side), and moves the
server between the two when the MetaServer's answers change its role:

* becoming master (8.5): stop following and wait for the copies in flight, seal every log's
  epoch history at its end, let the core start its master's work (``Core.promote``), start
  answering fetches; only then does ``on_role`` return and the role let writes in;
* becoming a slave (8.6): stop answering fetches (waiting writes are refused), let the core
  stop its master's work (``Core.demote``), follow the new master from the copies' own ends,
  cutting whatever tail the master's history says it does not have;
* a switchover (9): the old master refuses writes; once the target has fetched every log to
  its end, the next heartbeat says ``handover_ready``.

The server builds it before its core (``last_epoch`` is asked at construction) and hands it the
core's logs once storage is open (``attach``). Event loop only.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from typing import Awaitable, Callable, Protocol

from logstore.epoch_history import EpochHistory, history_path
from sdk.connection import Connection
from serverkit.follower import Follower, Scrub
from serverkit.replica_log import ReplicatedLog, end_io, seal_io
from serverkit.parked_fetch import ParkedFetch
from serverkit.replica_source import INSYNC_LAG_MAX_MS_DEFAULT, ReplicaSource
from serverkit.replication import ReplicaReport
from serverkit.role import RoleView, ServerRole, boottime_ms
from wire.errors import NotMaster
from wire.replication import Fetch, Snapshot

log = logging.getLogger(__name__)

TICK_INTERVAL_MS = 250  # how often the in-sync set and a handover are looked at
HISTORY_DIRECTORY = "replication"


async def connect_master(address: str, server_id: str, token: str | None,
                         ssl_context: ssl.SSLContext | None) -> Connection:
    """A slave's connection to its master for fetches, said hello to with the server's own
    token (the master checks it is an admin token)."""
    return await Connection.open(address, client_id=f"replica-{server_id}", app="qmq-replica",
                                 token=token, ssl_context=ssl_context)


class Core(Protocol):
    """What the data plane needs of a server's core (the broker, the scheduler)."""

    async def promote(self) -> None:
        """Start the master's work over the copies (they are complete and sealed)."""

    async def demote(self) -> None:
        """Stop the master's work (writes are refused already); the stores become copies."""

    async def settle(self) -> None:
        """Make everything written so far readable by fetches (buffers to the OS) and tell
        ``advanced``: a switchover hands over only once the target has all of it."""


class Replica:
    """The data plane of one server (module docstring)."""

    def __init__(self, group: str, data_dir: str, log_names: tuple[str, ...],
                 connect: Callable[[str], Awaitable[object]],
                 insync_lag_max_ms: int = INSYNC_LAG_MAX_MS_DEFAULT,
                 clock_ms: Callable[[], int] = boottime_ms, scrub: Scrub = Scrub()) -> None:
        self.group = group
        directory = os.path.join(data_dir, HISTORY_DIRECTORY)
        self.histories = {name: EpochHistory(history_path(directory, name))
                          for name in log_names}
        self._connect = connect
        self._insync_lag_max_ms = insync_lag_max_ms
        self._clock_ms = clock_ms
        self._scrub = scrub
        self.source: ReplicaSource | None = None
        self.follower: Follower | None = None
        self._core: Core | None = None
        self._role: ServerRole | None = None
        self._heartbeat_soon: Callable[[], None] = lambda: None
        self._logs: list[ReplicatedLog] = []
        self._ticker: asyncio.Task[None] | None = None
        self._handover_ready: str | None = None
        self.serving_as: str = "none"  # "master", "slave" or "none": what the data plane does

    # ------------------------------------------------------------------ wiring

    def attach(self, logs: list[ReplicatedLog], core: Core, role: ServerRole,
               heartbeat_soon: Callable[[], None]) -> None:
        """The core's logs (storage open), the core, the role and a way to ask for a heartbeat."""
        assert [item.name for item in logs] == list(self.histories), "one log per history"
        self._logs, self._core, self._role = logs, core, role
        self._heartbeat_soon = heartbeat_soon
        source = self.source = ReplicaSource(self.group, {item.name: item for item in logs},
                                             self._clock_ms, self._insync_changed,
                                             self._insync_lag_max_ms)
        # Every send asks these (``realtime.sends``): from now on they are the source's own,
        # what the methods below pass through to, with no call in between (issue 18).
        self.check_writable = source.check_writable  # type: ignore[method-assign]
        self.replicated_now = source.replicated_now  # type: ignore[method-assign]
        self.park_replicated = source.park_replicated  # type: ignore[method-assign]
        self.follower = Follower(self.group, role.server_id, logs, self._connect, self._clock_ms,
                                 self._trouble, scrub=self._scrub)
        self._ticker = asyncio.create_task(self._tick_forever(), name="replica-ticks")

    def set_heartbeat_soon(self, heartbeat_soon: Callable[[], None]) -> None:
        """The registration exists now (it is made after the core)."""
        self._heartbeat_soon = heartbeat_soon

    def _insync_changed(self) -> None:
        self._heartbeat_soon()

    def _trouble(self) -> None:
        self._heartbeat_soon()

    async def close(self) -> None:
        """Stop following and ticking (the server is stopping)."""
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)
            self._ticker = None
        if self.follower is not None and self.follower.running:
            await self.follower.stop()
        if self.source is not None:
            self.source.stop("the server is stopping")

    # ------------------------------------------------------------------ the write path

    replicating = True  # WriteReplication: a server with a MetaServer tells and waits

    def check_writable(self) -> None:
        """Raise NotEnoughReplicas while ``min_insync`` refuses writes (before ``attach``;
        then the source's own method answers)."""
        if self.source is not None:
            self.source.check_writable()

    def waits(self) -> bool:
        """True when a ``sync`` write now waits for some slave."""
        return self.source is not None and self.source.waits()

    def advanced(self, name: str, end: int) -> None:
        """The master committed (or flushed) ``name`` up to ``end``: wake the slaves' fetches."""
        if self.source is not None and self.source.active:
            self.source.advanced(name, end)

    def wrote_io(self, name: str) -> None:
        """Owner thread of log ``name``, right after a commit to it: keep its bytes for the
        slaves tailing the log (``ReplicaSource.wrote_io``); nothing while none does."""
        source = self.source
        if source is not None:  # also while none tails: it forgets where the last chunk ended
            source.wrote_io(name)

    def replicated_now(self, name: str, end: int) -> bool:
        """True when a write of ``name`` up to ``end`` waits for no slave now
        (``ReplicaSource.replicated_now``, itself from ``attach`` on); NotMaster when no
        longer master."""
        return self.source is None or self.source.replicated_now(name, end)

    async def wait_replicated(self, name: str, end: int) -> None:
        """Return once the slaves a ``sync`` write waits for have ``name`` up to ``end``."""
        if self.source is not None:
            await self.source.wait_replicated(name, end)

    def park_replicated(self, name: str, end: int,
                        done: Callable[[BaseException | None], None]) -> None:
        """``wait_replicated`` with no task (``ReplicaSource.park_replicated``, itself from
        ``attach`` on; before it nothing waits: ``done(None)`` in the next loop turn)."""
        if self.source is not None:
            self.source.park_replicated(name, end, done)
        else:
            asyncio.get_running_loop().call_soon(done, None)

    def kind_refusal(self, name: str, kind: int) -> str | None:
        """None when a record of gated ``kind`` may be written to log ``name`` now: this server
        serves as master and every slave it counts reads the kind (``ReplicaSource``)."""
        if self.source is None or self.serving_as != "master":
            return f"server is not serving as the master of group {self.group}"
        return self.source.kind_refusal(name, kind)

    def kinds_view(self) -> dict[str, dict[str, object]]:
        """For the admin view: per slave counted by the kind gate, per log with gated kinds,
        what it reads and where its copy last stopped at a record it does not read (empty
        unless serving as master)."""
        source = self.source
        if source is None or self.serving_as != "master":
            return {}
        listed = set(source.tracker.members) | set(source.tracker.confirmed)
        return source.kind_reads.view(listed, self._clock_ms())

    def status(self) -> dict[str, object]:
        """``GET /replication`` on the metrics port: this server's role in the data plane and
        the record-kind gate (docs/REPLICATION.md 8.2). A master: per slave it counts, per log
        with gated kinds, what it reads and where its copy last stopped at a record it does not
        read; per gated kind, null when it may be written now, else why not (why holds or
        hand-offs are refused). A slave: the kinds it reads, its master's last refusal, and where
        its copy stopped at a record it cannot decode (``undecodable_at``)."""
        out: dict[str, object] = {"group": self.group, "serving_as": self.serving_as}
        source, follower = self.source, self.follower
        if source is not None and self.serving_as == "master":
            out["slaves"] = self.kinds_view()
            out["kinds"] = {log: {str(kind): source.kind_refusal(log, kind)
                                  for kind in sorted(kinds.reads)}
                            for log, kinds in source.kind_reads.kinds.items()}
        if follower is not None and self.serving_as == "slave":
            out["reads"] = {item.name: sorted(item.kinds.reads) for item in self._logs
                            if item.kinds is not None}
            out["unreadable_records"] = follower.unreadable_records
            out["unreadable_why"] = follower.unreadable_why
            out["undecodable_records"] = follower.undecodable_records
            out["undecodable_at"] = follower.undecodable_at
        return out

    # ------------------------------------------------------------------ ReplicationStatus

    def last_epoch(self) -> int:
        """The newest epoch any log's history holds."""
        return max((h.last_epoch for h in self.histories.values()), default=0)

    async def on_role(self, view: RoleView) -> None:
        """Move the data plane to what ``view`` says (module docstring)."""
        assert self.source is not None and self.follower is not None and self._core is not None
        if view.role == "master":
            if self.serving_as == "master" and self.source.epoch == view.epoch:
                self._apply_settings(view)  # a switchover began or ended
                return
            await self._become_master(view)
        elif view.role == "slave":
            await self._become_slave(view)
        else:
            await self._stop_serving("its role is not known")

    async def _become_master(self, view: RoleView) -> None:
        assert self.source is not None and self.follower is not None and self._core is not None
        if self.follower.running:
            await self.follower.stop()
        ends = {}
        for item in self._logs:
            ends[item.name] = await item.run(seal_io, item, view.epoch)
        if self.serving_as != "master":
            await self._core.promote()
        self.source.start(view.epoch, ends, _others(view))
        self._apply_settings(view)
        self.serving_as = "master"
        log.info("group %s: sealed epoch %d at %s; serving as master", self.group,
                    view.epoch, ends)

    async def _become_slave(self, view: RoleView) -> None:
        assert self.follower is not None
        await self._stop_serving(f"it is a slave at epoch {view.epoch}")
        if self.follower.running:
            await self.follower.stop()
        self.serving_as = "slave"
        if view.master_address and view.master_id != view.server_id:
            self.follower.start(view.master_address, view.epoch)

    async def _stop_serving(self, why: str) -> None:
        assert self.source is not None and self._core is not None
        if self.serving_as == "master":
            self.source.stop(why)
            await self._core.demote()
        self.serving_as = "none" if self.serving_as == "master" else self.serving_as
        self._handover_ready = None

    def _apply_settings(self, view: RoleView) -> None:
        assert self.source is not None
        self.source.settings(view.replication.mode, view.replication.min_insync,
                             _others(view), view.slaves)

    def report(self) -> ReplicaReport:
        """This server's figures for the next heartbeat (never blocks)."""
        if self.source is None or self.follower is None:
            return ReplicaReport()
        if self.serving_as == "master":
            ends = self.source.ends
            return ReplicaReport(
                position=ends.get(self._logs[0].name), positions=dict(ends), lag_bytes=0,
                lag_ms=0, insync=self.source.tick(), handover_ready=self._handover_ready,
                writable=self.source.refusal() is None)
        ends = self.follower.ends
        return ReplicaReport(position=ends.get(self._logs[0].name), positions=dict(ends),
                             lag_bytes=self.follower.lag_bytes() if self.follower.running else None,
                             lag_ms=self.follower.lag_ms(self._clock_ms())
                             if self.follower.running else None,
                             undecodable_at=self.follower.undecodable_at)

    def counters(self) -> dict[str, int]:
        """The follower's counts for metrics: CRC errors on arrival, scrub repairs, records
        refused or undecodable."""
        follower = self.follower
        if follower is None:
            return {}
        counts = {"crc_errors": follower.crc_errors, "scrub_repairs": follower.scrub_repairs,
                  "unreadable_records": follower.unreadable_records,
                  "undecodable_records": follower.undecodable_records}
        if self.source is not None:
            counts["unreadable_fetches"] = self.source.kind_reads.unreadable_fetches
        return counts

    async def drain(self, timeout_ms: int) -> None:
        """A master shutting down: wait (at most ``timeout_ms``) until its in-sync slaves have
        every log to its end."""
        source = self.source
        if source is None or self.serving_as != "master":
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_ms / 1000
        while loop.time() < deadline:
            waiting = source.tracker.waiting_set(self._clock_ms())
            if all(source.tracker.caught_up_to(slave, source.ends) for slave in waiting):
                return
            await asyncio.sleep(0.02)
        log.warning("group %s: shutting down before every in-sync slave had everything",
                    self.group)

    # ------------------------------------------------------------------ requests

    async def serve(self, request: Fetch | Snapshot) -> dict | ParkedFetch:
        """Answer a slave's fetch or snapshot (a fetch at a log's end: its ``ParkedFetch``). A request from a newer epoch means this server
        was replaced: it stops writing at once and asks the MetaServer who the master is."""
        assert self.source is not None and self._role is not None
        if request.epoch > self._role.epoch:
            self._role.observe_epoch(request.epoch)
            self.source.stop(f"a fetch came at epoch {request.epoch}")
            self._heartbeat_soon()
            raise NotMaster(f"server {self._role.server_id} was master of group {self.group} "
                            f"before epoch {request.epoch}; ask the MetaServer for the master")
        if self.serving_as != "master":
            raise NotMaster(f"server {self._role.server_id} is not the master of group "
                            f"{self.group}")
        if isinstance(request, Fetch):
            return await self.source.fetch(request)
        return await self.source.snapshot(request)

    # ------------------------------------------------------------------ ticks

    async def _tick_forever(self) -> None:
        while True:
            await asyncio.sleep(TICK_INTERVAL_MS / 1000)
            try:
                await self._tick()
            except Exception:
                log.exception("group %s: replication tick failed", self.group)

    async def _tick(self) -> None:
        source, role = self.source, self._role
        if source is None or role is None or self.serving_as != "master":
            return
        view = role.view()
        self._apply_settings(view)
        source.tick()
        refusal = role.refusal(boottime_ms())  # the clock the server checks its role on
        if refusal is not None:
            # Its answers would be refused after the wait anyway (the role is asked again
            # before a write is answered); don't hold them until a cut-off slave returns.
            source.refuse_waiters(f"this server stopped accepting writes: {refusal}")
        target = view.switchover_to
        if target is None:
            self._handover_ready = None
        elif self._handover_ready != target and await self._target_has_everything(target):
            self._handover_ready = target
            log.warning("group %s: switchover target %s has every log to its end", self.group,
                        target)
            self._heartbeat_soon()

    async def _target_has_everything(self, target: str) -> bool:
        """A master handing over (writes refused): has ``target`` fetched every log to its
        end? The ends are read afresh from the stores after the core flushed its buffers, so a
        pull answered just before the handover (its action still buffered) is on the target
        before it is promoted, and not handed out again by it."""
        assert self._core is not None and self.source is not None
        await self._core.settle()
        for item in self._logs:
            self.source.advanced(item.name, await item.run(end_io, item))
        return self.source.tracker.caught_up_to(target, self.source.ends)


def _others(view: RoleView) -> tuple[str, ...]:
    """The database's in-sync slaves other than this server."""
    return tuple(server for server in view.insync if server != view.server_id)


__all__ = ["Core", "HISTORY_DIRECTORY", "Replica", "TICK_INTERVAL_MS", "connect_master"]
