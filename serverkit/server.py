"""``ServerBase``: what a realtime broker's and a delay server's process do alike around their
core (the broker, the scheduler): the frame server, the ``/metrics`` listener, registration
with the MetaServer, TLS contexts, the access gate, the trace writer, and the order of start-up
and graceful shutdown.

Start: raise the open-files limit -> open the core (storage recovered) -> listen -> metrics
listener -> register (and take the role the MetaServer gives). Stop: deregister -> stop the
metrics listener -> stop reading requests and finish those in flight (``shutdown_grace_ms``)
-> stop the core (commit, checkpoint, close) -> close the trace, the gate. A master of a replicated group refuses writes
first and deregisters last, after ``ReplicationStatus.drain``, so the MetaServer can hand the
group to an in-sync slave at once (docs/REPLICATION.md 9). Everything here runs on the event
loop.

The server's role (``serverkit.role.ServerRole``) decides who serves: ``_check_role`` raises
``not_master`` unless this server is the leased, active master of its group.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import time
from typing import Any, Awaitable, Callable, ClassVar, Protocol

from prometheus_client import CollectorRegistry

from serverkit.access import AccessCache, Gate, Grant
from serverkit.config import ServerConfig
from serverkit.frame_server import FrameServer, Later, Session
from serverkit.metrics_http import MetricsListener
from serverkit.open_files import OpenFilesLimit, raise_open_files_limit
from serverkit.registration import Registration, server_registration
from serverkit.follower import Scrub
from serverkit.replica import Replica, connect_master
from serverkit.replication import NoReplication, ReplicationStatus
from serverkit.role import ServerRole, boottime_ms
from serverkit.role_metrics import RoleMetrics
from serverkit.server_id import load_or_create
from tracelog.writer import TraceWriter
from wire.clock import wall_clock_ms
from wire.errors import NotSupported
from wire.protocol import Request, hello_response
from wire.replication import Fetch, Snapshot
from wire.tls import client_context, server_context

log = logging.getLogger(__name__)

# Garbage-collector thresholds for a server process. Every message makes a few short-lived
# objects (frames, results, a batch waiting for its commit); with CPython's default gen0
# threshold (700) the ones in flight at a collection are promoted, which soon triggers full
# collections that walk every long-lived object with the event loop stopped: 55-75 ms each with
# a few hundred thousand ids in a broker's dedup index, or 10^5 entries in a delay server's
# window, several per second at full load. Collecting young objects every 20,000 allocations
# lets batches die young; a young collection then takes a few ms, and full ones become rare.
# 5,000 and 10,000 shorten the young passes at 2,000 msg/s (4-6 ms -> 1-2 at 5,000) but
# promote a hot slot's 20,000 messages in flight: W2 then had a gen-1 pass of 14-42 ms that
# 20,000 never ran (docs/BENCHMARKS.md, session 19, "GC_THRESHOLDS 20,000 kept").
GC_THRESHOLDS = (20_000, 20, 100)
# Longest work that only a master may do (a delay server's dispatch) waits for the role to
# settle (the first answer, a new master sealing its logs) before it is refused, in ms.
ROLE_SETTLE_WAIT_MS = 10_000


def tune_gc() -> None:
    """Apply GC_THRESHOLDS to this process and, the first time, move what exists now (modules,
    a server's recovered storage state) out of the collector's way (``gc.freeze``)."""
    if gc.get_threshold()[0] < GC_THRESHOLDS[0]:
        gc.set_threshold(*GC_THRESHOLDS)
        gc.freeze()


def freeze_started() -> None:
    """Collect what start-up left behind, then move every object that exists now (modules, the
    recovered state of every server in this process, their connections) out of the collector's
    way (``gc.freeze``): a command calls it once, when all its servers have started.

    ``tune_gc`` freezes only on its first call, so in ``qmq up`` what the delay server, the
    slaves and the MetaServer built after the realtime broker's recovery stayed young: the first
    passes after start-up scanned and promoted it. Not called by ``start()``: a process that
    starts servers again and again (the tests) would freeze each one's unreachable cycles for
    good; a command starts its servers once."""
    gc.collect()
    gc.freeze()


def offset_clock(offset_ms: int) -> Callable[[], int]:
    """The wall clock in ms, shifted by ``offset_ms`` (TEST ONLY: prove 40-day delays quickly);
    the wall clock itself when the offset is 0."""
    if not offset_ms:
        return wall_clock_ms

    def now_ms() -> int:
        return wall_clock_ms() + offset_ms

    return now_ms


class ServerMetrics(Protocol):
    """What ``ServerBase`` needs of a server's metrics."""

    registry: CollectorRegistry

    def count_error(self, code: str) -> None:
        """Count one error response to a whole request."""

    async def refresh(self) -> None:
        """Recompute the scrape-time gauges."""


class WritableCore(Protocol):
    """What ``ServerBase`` needs of a server's core to follow the MetaServer's state."""

    readonly: bool  # refuse sends (the MetaServer drains the group, or a sticky write failure)
    write_failed: bool  # a sticky write failure: read-only until restarted


class ServerBase:
    """One server process around its core; a subclass supplies the core and ``handle``.

    Subclass hooks: ``_open_core`` (recover storage, build the core), ``_core`` (it, for the
    MetaServer's state), ``_report`` (the heartbeat's report), ``_begin_drain`` (before in-flight
    requests are finished), ``_close_core`` (stop it and the clients it holds) and ``handle_now``.
    """

    KIND: ClassVar[str]  # "realtime" or "delay": the registration kind and the trace name
    HOLDS: ClassVar[bool] = False  # takes hold/cancel_held (its hello says so)
    # The logs this kind of server's slaves copy (docs/REPLICATION.md 8.1), the primary first.
    REPLICATED_LOGS: ClassVar[tuple[str, ...]]
    # What a stop did between finishing requests and deregistering, for its summary line.
    STOP_SUMMARY: ClassVar[str]
    # Ops whose ``handle`` the frame server steps at once as they are read, without a task
    # while they do not suspend (``FrameServer`` inline_ops): only ops whose handling uses no
    # ``asyncio.timeout`` (nor anything else that needs a current task) before it suspends.
    INLINE_OPS: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: ServerConfig, metrics: ServerMetrics,
                 clock: Callable[[], int] | None = None,
                 replication: ReplicationStatus | None = None) -> None:
        server_ssl = server_context(config.tls_cert, config.tls_key)  # a bad pair fails first
        self.config = config
        # Who this server is and whether it may write (docs/REPLICATION.md): without a
        # MetaServer it is a standalone master; otherwise the MetaServer's answers decide, and
        # the data plane copies a master's logs as a slave and serves its slaves as a master.
        if replication is None and config.meta_url:
            replication = Replica(config.group, config.data_dir, self.REPLICATED_LOGS,
                                  self._connect_peer, scrub=Scrub(config.scrub_bytes_per_s,
                                                                  config.scrub_pause_ms))
        self.replication = replication or NoReplication()
        self.role = ServerRole(load_or_create(config.data_dir), standalone=not config.meta_url,
                               epoch=self.replication.last_epoch())
        self.role_metrics = RoleMetrics(self.role, self.replication, metrics.registry)
        # Set after every registration answer or activation (event-loop thread only).
        self._role_event = asyncio.Event()
        self.clock = clock or offset_clock(config.clock_offset_ms)
        self.metrics = metrics
        self.peer_ssl = client_context(config.tls_ca)  # for the MetaServer and peer servers
        self.trace = TraceWriter(config.trace_directory, f"{self.KIND}:{config.group}",
                                 enabled=config.trace)
        self.gate = Gate(AccessCache(config.meta_url, token=config.token,
                                     ttl_ms=config.auth_ttl_ms, ssl_context=self.peer_ssl)
                         if config.meta_url else None)
        self.frames = FrameServer(self.handle, host=config.host, port=config.port,
                                  on_error=metrics.count_error, ssl_context=server_ssl,
                                  inline_ops=self.INLINE_OPS, handler_now=self.handle_now)
        self.metrics_listener: MetricsListener | None = None
        if config.metrics_port is not None:
            self.metrics_listener = MetricsListener(
                metrics.registry, host=config.host, port=config.metrics_port,
                refresh=metrics.refresh, status=getattr(self.replication, "status", None))
        self.registration: Registration | None = None
        self.port: int | None = None
        self.open_files: OpenFilesLimit | None = None  # set by start()
        self._stopped = False

    @property
    def address(self) -> str:
        """``host:port`` clients connect to."""
        return f"{self.config.advertise_host or self.config.host}:{self.port}"  # never a wildcard (config)

    @property
    def metrics_url(self) -> str | None:
        """Where Prometheus scrapes this server (None without a metrics listener)."""
        return self.metrics_listener.url if self.metrics_listener is not None else None

    async def start(self) -> None:
        """Raise the open-files limit, recover the storage, listen, then register with the
        MetaServer (if configured)."""
        # First: the storage sizes its descriptor cache from the limit it finds.
        self.open_files = raise_open_files_limit()
        await self._open_core()
        self.port = await self.frames.start()
        self.config = dataclasses.replace(self.config, port=self.port)
        if self.metrics_listener is not None:
            metrics_port = await self.metrics_listener.start()
            self.config = dataclasses.replace(self.config, metrics_port=metrics_port)
        config = self.config
        if config.meta_url:
            self.registration = server_registration(
                config, kind=self.KIND, address=self.address, report=self._report,
                on_state=self._on_state, role=self.role, replication=self.replication,
                on_auth=self.gate.note_auth, on_role=self.role_metrics.changed,
                on_settled=self._role_event.set)
            await self.registration.start()
        if config.clock_offset_ms:
            log.warning("TEST ONLY: %s clock offset by %d ms", self.KIND, config.clock_offset_ms)
        # DEBUG: the launcher (qmq.launcher) says this line to the operator once.
        log.debug("%s group %s listening on %s%s", self.KIND, config.group, self.address,
                 f", metrics on {self.metrics_url}" if self.metrics_url else "")

    def _on_state(self, state: str) -> None:
        """The MetaServer's heartbeat answer: ``rw`` or ``readonly`` (a sticky write failure
        keeps the server read-only whatever it says)."""
        core = self._core()
        core.readonly = state == "readonly" or core.write_failed
        log.info("MetaServer set %s group %s to %s", self.KIND, self.config.group, state)

    async def stop(self) -> str:
        """Deregister, stop accepting, finish in-flight requests, stop the core (commit what is
        queued, checkpoint, close the storage). Returns what it did, for the log; a second
        call does nothing."""
        group = self.config.group
        if self._stopped:
            return f"{self.KIND} group {group} already stopped"
        self._stopped = True
        started = time.monotonic()
        deregistered = False
        handing_over = not self.role.solo and self.role.role == "master"
        if handing_over:
            self.role.step_down()
        elif self.registration is not None:
            deregistered = await self.registration.stop(deregister=True)
        if self.metrics_listener is not None:
            await self.metrics_listener.stop()
        self._begin_drain()
        in_flight = self.frames.requests_in_flight
        await self.frames.stop(self.config.shutdown_grace_ms)
        if handing_over and self.registration is not None:
            await self.replication.drain(self.config.shutdown_grace_ms)
            deregistered = await self.registration.stop(deregister=True)
        await self._close_core()
        await asyncio.get_running_loop().run_in_executor(None, self.trace.close)
        await self.gate.close()
        summary = (
            f"{self.KIND} group {group} stopped in "
            f"{(time.monotonic() - started) * 1000:.0f} ms: {in_flight} in-flight request(s) "
            f"finished, {self.STOP_SUMMARY}, "
            + ("deregistered from the MetaServer" if deregistered else "not deregistered")
        )
        log.debug("%s", summary)  # returned: the launcher says it once
        return summary

    # ------------------------------------------------------------------ roles

    def _check_role(self) -> None:
        """Raise NotMaster unless this server is the leased, active master of its group."""
        self.role.check_writable_now(self.config.group)

    async def _check_role_renewed(self) -> None:
        """``_check_role`` for a request that found the role refusing: when the lease alone ran
        out (the process stalled past it, a heartbeat answered late), ask the MetaServer at
        once and wait for its answer, at most one heartbeat's request timeout, before refusing.
        A producer then sees its send stored rather than ``not_master`` for up to a heartbeat
        interval on a master that is still the master. Nothing is written on a lapsed lease:
        only a renewal sent after it lapsed lets the request through (docs/REPLICATION.md 5)."""
        registration = self.registration
        if registration is not None and self.role.only_lease_ran_out(boottime_ms()):
            await asyncio.sleep(0)  # a request stepped inline needs a task for the timeout
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(registration.request_timeout_s):
                    await registration.renew_lease()
        self._check_role()

    @property
    def replica(self) -> Replica | None:
        """The data plane, when this server runs it (a server with a MetaServer)."""
        return self.replication if isinstance(self.replication, Replica) else None

    async def _connect_peer(self, address: str) -> object:
        """A connection to this group's master, for the follower's fetches (own token)."""
        return await connect_master(address, self.role.server_id, self.config.token,
                                    self.peer_ssl)

    def _heartbeat_soon(self) -> None:
        if self.registration is not None:
            self.registration.heartbeat_soon()

    async def _serve_replica(self, request: Fetch | Snapshot, grant: Grant
                             ) -> dict[str, Any] | Later:
        """A slave's ``fetch`` or ``snapshot``: answered whatever the lease (a master handing
        over is still fetched from); the data plane fences by epoch. Admin tokens only."""
        grant.check_admin(request.op)
        if self.replica is None:
            raise NotSupported(f"{self.KIND} group {self.config.group} is not replicated")
        return await self.replica.serve(request)

    def _hello(self) -> dict[str, Any]:
        """The answer to a ``hello``: this server, and its role and epoch."""
        view = self.role.view()
        return hello_response(self.KIND, self.config.group, self.address, view.role, view.epoch,
                              self.HOLDS)

    async def _settle_role(self) -> None:
        """Wait (at most ROLE_SETTLE_WAIT_MS) while the role is settling, so work only a master
        may do is not refused, and retried after a backoff, just because the first answer has
        not come yet."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ROLE_SETTLE_WAIT_MS / 1000
        while self.role.settling and loop.time() < deadline:
            self._role_event.clear()
            # asyncio.timeout: 3.11's wait_for can swallow a cancel arriving as it is set.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(deadline):
                    await self._role_event.wait()

    # ------------------------------------------------------------------ subclass hooks

    async def _open_core(self) -> None:
        """Recover the storage and make the core ready to answer requests."""
        raise NotImplementedError

    def _core(self) -> WritableCore:
        """The core whose ``readonly`` follows the MetaServer's state."""
        raise NotImplementedError

    def _report(self) -> Awaitable[Any]:
        """What each heartbeat reports to the MetaServer."""
        raise NotImplementedError

    def _begin_drain(self) -> None:
        """Called after deregistering, just before the frame server stops reading requests
        and finishes the ones in flight (a broker answers its long polls now)."""

    async def _close_core(self) -> None:
        """Stop the core: commit what is queued, checkpoint, close; and the clients it holds."""
        raise NotImplementedError

    async def handle(self, session: Session, request: Request) -> dict[str, Any] | Later:
        """Answer one data-plane request: ``handle_now``, awaiting what it leaves to an
        awaitable (the frame server's entry for a request that runs in a task)."""
        out = self.handle_now(session, request)
        if isinstance(out, (dict, Later)):
            return out
        return await out

    def handle_now(self, session: Session, request: Request
                   ) -> dict[str, Any] | Later | Awaitable[dict[str, Any] | Later]:
        """Answer one data-plane request now, with no coroutine when it can (the frame
        server's entry for its inline ops): the answer, a ``Later``, or, for a request that
        must wait (an uncached grant, a lapsed lease, a store thread, the replica ops), the
        awaitable that goes on with it and gives either. Raises ``QmqError`` for an error
        answer. What it does before it returns an awaitable is not done again by it."""
        raise NotImplementedError


__all__ = ["GC_THRESHOLDS", "ServerBase", "ServerMetrics", "WritableCore", "freeze_started",
           "offset_clock", "tune_gc"]
