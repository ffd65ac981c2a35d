"""The realtime server process: the broker behind a ``FrameServer``, registered with the
MetaServer, stopped gracefully on SIGTERM."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import signal
import time
from typing import Any, Callable

from logstore.fileio import Opener, OsFile
from realtime.admin import BrokerAdmin, StorageAdmin
from realtime.broker import Broker
from realtime.config import RealtimeConfig
from realtime.metrics import RealtimeMetrics
from realtime.nacks import NackHandler
from realtime.retries import RetryPolicies, RetryPolicy
from realtime.tracing import BrokerTracer
from serverkit.access import AccessCache, Gate
from wire.clock import wall_clock_ms
from wire.errors import NotSupported
from serverkit.frame_server import FrameServer, Session
from serverkit.metrics_http import MetricsListener
from serverkit.payload_sender import PayloadSender
from wire.protocol import (
    Ack, Browse, Cancel, Heartbeat, Hello, Leave, Nack, Pull, Purge, Request, Send, Subjects,
    hello_response, pull_response,
)
from serverkit.registration import Registration
from wire.tls import client_context, server_context
from tracelog.events import TraceWriter

log = logging.getLogger(__name__)

# Garbage-collector thresholds for a process that serves a broker. Every message makes a few
# short-lived objects (frames, results, a batch waiting for its commit); with CPython's default
# gen0 threshold (700) the ones in flight at a collection are promoted, which soon triggers full
# collections that walk every long-lived object with the event loop stopped: 55-75 ms each with
# a few hundred thousand ids in the dedup index, several per second at full load. Collecting
# young objects every 20,000 allocations lets batches die young; a young collection then takes
# a few ms, and full ones become rare.
GC_THRESHOLDS = (20_000, 20, 100)


def tune_gc() -> None:
    """Apply GC_THRESHOLDS to this process and, the first time, move what exists now (modules,
    the first broker's recovered storage state) out of the collector's way (``gc.freeze``)."""
    if gc.get_threshold()[0] < GC_THRESHOLDS[0]:
        gc.set_threshold(*GC_THRESHOLDS)
        gc.freeze()


class RealtimeServer:
    """A running realtime broker: ``await start()`` binds and registers, ``await stop()`` drains."""

    def __init__(
        self,
        config: RealtimeConfig,
        clock: Callable[[], int] = wall_clock_ms,
        opener: Opener = OsFile,
    ) -> None:
        self.config = config
        self.broker = Broker(config, clock, opener)
        self.trace = TraceWriter(config.trace_directory, f"realtime:{config.group}",
                                 enabled=config.trace)
        self.broker.tracer = BrokerTracer(self.trace)
        peer_ssl = client_context(config.tls_ca)
        self.gate = Gate(AccessCache(config.meta_url, token=config.token,
                                     ttl_ms=config.auth_ttl_ms, ssl_context=peer_ssl)
                         if config.meta_url else None)
        self.registration: Registration | None = None
        self.port: int | None = None
        self.admin: BrokerAdmin | None = None  # made on first use, once storage is open
        self._retry_sender: PayloadSender | None = None
        if config.meta_url:
            # Retry copies go to delay servers under this broker's own token.
            self._retry_sender = PayloadSender(config.meta_url, kind="delay",
                                               client_id=f"realtime-{config.group}",
                                               token=config.token, ssl_context=peer_ssl)
        self.nacks = NackHandler(
            self.broker,
            RetryPolicies(RetryPolicy(config.retry_backoff_ms, config.retries_max)),
            self._retry_sender.send if self._retry_sender else None,
            protect_dead_subject=lambda subject: self._admin().protect(subject),
        )
        self.metrics = RealtimeMetrics(self.broker, self.nacks, config.group)
        self.broker.on_commit = self.metrics.commit_batch_messages.observe
        self.frames = FrameServer(self.handle, host=config.host, port=config.port,
                                  on_error=self.metrics.count_error,
                                  ssl_context=server_context(config.tls_cert, config.tls_key))
        self.metrics_listener: MetricsListener | None = None
        if config.metrics_port is not None:
            self.metrics_listener = MetricsListener(
                self.metrics.registry, host=config.host, port=config.metrics_port,
                refresh=self.metrics.refresh)

    @property
    def address(self) -> str:
        """``host:port`` clients connect to."""
        return f"{self.config.advertise_host or self.config.host}:{self.port}"

    async def start(self) -> None:
        """Recover storage, listen, then register with the MetaServer (if configured)."""
        await self.broker.start()
        store = self.broker.store
        assert store is not None
        # Installed on the store's own thread, the only one that calls the store.
        await self.broker._store_io(store.observe_fsync, self.metrics.fsync_seconds.observe)
        tune_gc()
        self.port = await self.frames.start()
        self.config = dataclasses.replace(self.config, port=self.port)
        if self.metrics_listener is not None:
            metrics_port = await self.metrics_listener.start()
            self.config = dataclasses.replace(self.config, metrics_port=metrics_port)
        if self.config.meta_url:
            self.registration = Registration(
                self.config.meta_url,
                group=self.config.group,
                kind="realtime",
                address=self.address,
                heartbeat_interval_ms=self.config.heartbeat_interval_ms,
                report=self.broker.backlog,
                on_state=self._on_state,
                token=self.config.token,
                ssl_context=client_context(self.config.tls_ca),
            )
            await self.registration.start()
        log.info("realtime group %s listening on %s%s", self.config.group, self.address,
                 f", metrics on {self.metrics_url}" if self.metrics_url else "")

    @property
    def metrics_url(self) -> str | None:
        """Where Prometheus scrapes this broker (None without a metrics listener)."""
        return self.metrics_listener.url if self.metrics_listener is not None else None

    def _on_state(self, state: str) -> None:
        self.broker.readonly = state == "readonly" or self.broker.write_failed
        log.info("MetaServer set group %s to %s", self.config.group, state)

    async def stop(self) -> str:
        """Deregister, stop accepting, finish in-flight requests (long polls answer at once),
        commit queued sends, checkpoint and close the storage. Returns what it did, for the log."""
        started = time.monotonic()
        deregistered = False
        if self.registration is not None:
            deregistered = await self.registration.stop(deregister=True)
        if self.metrics_listener is not None:
            await self.metrics_listener.stop()
        self.broker.end_long_polls()
        in_flight = self.frames.requests_in_flight
        await self.frames.stop(self.config.shutdown_grace_ms)
        await self.broker.stop()
        await asyncio.get_running_loop().run_in_executor(None, self.trace.close)
        if self._retry_sender is not None:
            await self._retry_sender.close()
        await self.gate.close()
        summary = (
            f"realtime group {self.config.group} stopped in "
            f"{(time.monotonic() - started) * 1000:.0f} ms: {in_flight} in-flight request(s) "
            "finished, queued sends committed, message log fsynced and checkpointed, pull log "
            "fsynced and closed, "
            + ("deregistered from the MetaServer" if deregistered else "not deregistered")
        )
        log.info("%s", summary)
        return summary

    async def handle(self, session: Session, request: Request) -> dict[str, Any]:
        """Answer one data-plane request, after checking what the connection's token allows."""
        broker = self.broker
        self.metrics.count_request(request.op)
        # Asked per request, not once per hello, so a revoked token stops within the cache TTL.
        grant = await self.gate.grant(session.token, session.app)
        if isinstance(request, (Pull, Ack, Nack)):
            grant.check_consume(request.subject)
        elif isinstance(request, (Heartbeat, Leave)):
            for subject, _group in request.subscriptions:
                grant.check_consume(subject)
        elif isinstance(request, (Subjects, Browse, Purge)):
            grant.check_admin(request.op)
        if isinstance(request, Hello):
            return hello_response("realtime", self.config.group, self.address)
        if isinstance(request, Send):
            self.gate.check_send(grant, request.messages)
            if broker.readonly and not broker.write_failed and self.registration is not None:
                # The MetaServer may have switched us back to rw since our last heartbeat;
                # ask (rate-limited) rather than refuse a producer it already routes here.
                await self.registration.refresh_state()
            return {"results": await broker.send(request.messages)}
        if isinstance(request, Pull):
            return pull_response(*await broker.pull(request, gone=lambda: session.closed))
        if isinstance(request, Ack):
            return {"acked": await broker.ack(request)}
        if isinstance(request, Heartbeat):
            broker.heartbeat(request)
            return {"ok": True}
        if isinstance(request, Leave):
            return {"released": await broker.leave(request)}
        if isinstance(request, Nack):
            return {"nacked": await self.nacks.nack(request)}
        if isinstance(request, Cancel):
            raise NotSupported("cancel is answered by delay servers, not realtime servers")
        if isinstance(request, (Subjects, Browse, Purge)):
            return await self._admin().answer(request)
        raise NotSupported(f"op {request.op} is not served by realtime servers")

    def _admin(self) -> BrokerAdmin:
        """The admin ops (subjects, browse, purge) over the broker's storage, each step on the
        I/O thread of the store it touches."""
        if self.admin is None:
            broker = self.broker
            assert broker.store is not None and broker.pulllog is not None, "broker not started"
            self.admin = BrokerAdmin(StorageAdmin(broker.store, broker.pulllog),
                                     store_io=broker._store_io, pulllog_io=broker._pulllog_io,
                                     clock=broker.clock)
        return self.admin


async def run_realtime(config: RealtimeConfig, ready: Callable[[RealtimeServer], None] | None = None) -> None:
    """Run a realtime server until SIGTERM or SIGINT, then stop it gracefully."""
    server = RealtimeServer(config)
    await server.start()
    if ready is not None:
        ready(server)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping realtime group %s", config.group)
    await server.stop()
