"""The delay server process: the scheduler behind a ``FrameServer``, dispatching to realtime
brokers found through the MetaServer, registered as a delay group, stopped gracefully."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import time
from typing import Any, Callable

from delayserver.config import DelayConfig
from delayserver.metrics import DelayMetrics
from delayserver.scheduler import Dispatch, Scheduler
from delayserver.tracing import DelayTracer
from logstore.fileio import Opener, OsFile
from serverkit.access import AccessCache, Gate
from wire.clock import wall_clock_ms
from wire.errors import Forbidden, NotSupported
from serverkit.frame_server import FrameServer, Session
from serverkit.metrics_http import MetricsListener
from serverkit.payload_sender import PayloadSender
from wire.protocol import Cancel, Hello, Request, Send, cancel_result, hello_response
from serverkit.registration import Registration
from wire.tls import client_context, server_context
from tracelog.events import TraceWriter

log = logging.getLogger(__name__)

# CPython's default thresholds run a full collection every few hundred thousand allocations; with
# a loaded window of 10^5 tracked entries (several objects each) one walks them all for 50 ms+,
# a stall of every due dispatch. Collecting young objects every 20,000 allocations lets a
# batch's objects die young and makes full collections rare (the realtime broker does the same).
GC_THRESHOLDS = (20_000, 20, 100)


def tune_gc() -> None:
    """Apply GC_THRESHOLDS to this process and, the first time, move what exists now out of the
    collector's way (``gc.freeze``)."""
    if gc.get_threshold()[0] < GC_THRESHOLDS[0]:
        gc.set_threshold(*GC_THRESHOLDS)
        gc.freeze()


def offset_clock(offset_ms: int) -> Callable[[], int]:
    """The wall clock in ms, shifted by ``offset_ms`` (test use: prove 40-day delays quickly)."""

    def now_ms() -> int:
        return wall_clock_ms() + offset_ms

    return now_ms


class DelayServer:
    """A running delay server: ``await start()`` recovers, listens and registers."""

    def __init__(
        self,
        config: DelayConfig,
        clock: Callable[[], int] | None = None,
        dispatch: Dispatch | None = None,
        opener: Opener = OsFile,
    ) -> None:
        self.config = config
        self.clock = clock or offset_clock(config.clock_offset_ms)
        self._sender: PayloadSender | None = None
        self.metrics = DelayMetrics(config.group)
        if dispatch is None:
            if not config.meta_url:
                raise ValueError("a delay server needs meta_url (or a dispatch function) to "
                                 "reach realtime brokers")
            # Dispatches go to realtime brokers under this server's own token.
            self._sender = PayloadSender(config.meta_url, kind="realtime",
                                         client_id=f"delay-{config.group}", token=config.token,
                                         ssl_context=client_context(config.tls_ca))
            dispatch = self._sender.send
        self.scheduler = Scheduler(config, self.clock, self.metrics.observe_dispatch(dispatch),
                                   opener)
        self.metrics.watch(self.scheduler)
        self.trace = TraceWriter(config.trace_directory, f"delay:{config.group}",
                                 enabled=config.trace)
        self.scheduler.tracer = DelayTracer(self.trace)
        self.frames = FrameServer(self.handle, host=config.host, port=config.port,
                                  on_error=self.metrics.count_error,
                                  ssl_context=server_context(config.tls_cert, config.tls_key))
        self.gate = Gate(AccessCache(config.meta_url, token=config.token,
                                     ttl_ms=config.auth_ttl_ms,
                                     ssl_context=client_context(config.tls_ca))
                         if config.meta_url else None)
        self.metrics_listener: MetricsListener | None = None
        if config.metrics_port is not None:
            self.metrics_listener = MetricsListener(
                self.metrics.registry, host=config.host, port=config.metrics_port,
                refresh=self.metrics.refresh)
        self.registration: Registration | None = None
        self.port: int | None = None
        self._stopped = False

    @property
    def address(self) -> str:
        """``host:port`` clients connect to."""
        return f"{self.config.advertise_host or self.config.host}:{self.port}"

    async def start(self) -> None:
        """Recover the store, load the window, listen, register with the MetaServer."""
        tune_gc()
        await self.scheduler.start()
        store = self.scheduler.store
        assert store is not None
        # Installed on the store's own thread, the only one that calls the store.
        await self.scheduler._io(store.observe_fsync, self.metrics.fsync_seconds.observe)
        self.port = await self.frames.start()
        self.config = dataclasses.replace(self.config, port=self.port)
        if self.metrics_listener is not None:
            metrics_port = await self.metrics_listener.start()
            self.config = dataclasses.replace(self.config, metrics_port=metrics_port)
        if self.config.meta_url:
            self.registration = Registration(
                self.config.meta_url,
                group=self.config.group,
                kind="delay",
                address=self.address,
                heartbeat_interval_ms=self.config.heartbeat_interval_ms,
                report=self.scheduler.report,
                on_state=self._on_state,
                token=self.config.token,
                ssl_context=client_context(self.config.tls_ca),
            )
            await self.registration.start()
        if self.config.clock_offset_ms:
            log.warning("TEST ONLY: delay clock offset by %d ms", self.config.clock_offset_ms)
        log.info("delay group %s listening on %s%s", self.config.group, self.address,
                 f", metrics on {self.metrics_url}" if self.metrics_url else "")

    @property
    def metrics_url(self) -> str | None:
        """Where Prometheus scrapes this server (None without a metrics listener)."""
        return self.metrics_listener.url if self.metrics_listener is not None else None

    def _on_state(self, state: str) -> None:
        self.scheduler.readonly = state == "readonly" or self.scheduler.write_failed

    async def stop(self) -> str:
        """Deregister, stop accepting, finish in-flight requests, commit queued sends, record
        dispatches, checkpoint and close the store. Returns what it did, for the log; a second
        call does nothing."""
        if self._stopped:
            return f"delay group {self.config.group} already stopped"
        self._stopped = True
        started = time.monotonic()
        deregistered = False
        if self.registration is not None:
            deregistered = await self.registration.stop(deregister=True)
        if self.metrics_listener is not None:
            await self.metrics_listener.stop()
        in_flight = self.frames.requests_in_flight
        await self.frames.stop(self.config.shutdown_grace_ms)
        await self.scheduler.stop()
        if self._sender is not None:
            await self._sender.close()
        await asyncio.get_running_loop().run_in_executor(None, self.trace.close)
        await self.gate.close()
        summary = (
            f"delay group {self.config.group} stopped in "
            f"{(time.monotonic() - started) * 1000:.0f} ms: {in_flight} in-flight request(s) "
            "finished, queued sends committed, dispatches recorded, delay store fsynced and "
            "checkpointed, "
            + ("deregistered from the MetaServer" if deregistered else "not deregistered")
        )
        log.info("%s", summary)
        return summary

    async def handle(self, session: Session, request: Request) -> dict[str, Any]:
        """Answer one data-plane request, after checking what the connection's token allows."""
        self.metrics.count_request(request.op)
        # Asked per request, not once per hello, so a revoked token stops within the cache TTL.
        grant = await self.gate.grant(session.token, session.app)
        if isinstance(request, Hello):
            return hello_response("delay", self.config.group, self.address)
        if isinstance(request, Send):
            self.gate.check_send(grant, request.messages)
            results = await self.scheduler.schedule(request.messages)
            self.metrics.count_schedule_results(results)
            return {"results": results}
        if isinstance(request, Cancel):
            # A cancel names no subject: any token that may produce somewhere may cancel.
            if not (grant.admin or grant.produce):
                raise Forbidden(f"app {grant.app!r} may not cancel: its token has no produce "
                                "patterns")
            results = []
            for message_id, deliver_at_ms in zip(request.ids, request.deliver_at_ms):
                status = await self.scheduler.cancel(message_id, deliver_at_ms)
                self.metrics.count_cancel(status)
                results.append(cancel_result(message_id, status))
            return {"results": results}
        raise NotSupported(f"op {request.op} is not served by delay servers; "
                           "pull and ack go to realtime brokers")


__all__ = ["DelayServer", "offset_clock"]
