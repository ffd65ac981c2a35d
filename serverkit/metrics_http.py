"""The HTTP ``/metrics`` listener the realtime and delay servers share (their data port speaks
the frame protocol, so Prometheus scrapes a second, plain HTTP port).

It lives in ``serverkit`` beside ``frame_server`` because both servers need it and neither may
import the other; the SDK's clients never import it. Each server passes its own ``CollectorRegistry``
(never the process-global one), so several servers in one process (``qmq up``, tests) keep
separate figures.

The same listener answers ``GET /replication`` with what the server's replication says of
itself, as JSON (``Replica.status``): per slave which gated record kinds it reads, which kinds
may be written now and why not (docs/REPLICATION.md 8.2).

Gauges read from storage (backlog, pending counts) are refreshed at scrape time by the server's
``refresh`` coroutine, which goes through the stores' I/O threads; a refresh that fails is logged
and the scrape still answers with every other metric.
"""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

METRICS_PATH = "/metrics"
STATUS_PATH = "/replication"


async def scrape(registry: CollectorRegistry,
                 refresh: Callable[[], Awaitable[None]] | None = None) -> web.Response:
    """The ``/metrics`` response for ``registry``, after ``refresh`` updated its gauges."""
    if refresh is not None:
        try:
            await refresh()
        except Exception:  # a stuck or failed store must not hide the counters
            log.exception("refreshing gauges for /metrics failed; answering without them")
    return web.Response(body=generate_latest(registry),
                        headers={"Content-Type": CONTENT_TYPE_LATEST})


class MetricsListener:
    """An HTTP server answering ``GET /metrics`` from one registry; ``await start()`` binds
    (port 0 picks a free one) and returns the port, ``await stop()`` closes it."""

    def __init__(self, registry: CollectorRegistry, *, host: str = "127.0.0.1", port: int = 0,
                 refresh: Callable[[], Awaitable[None]] | None = None,
                 status: Callable[[], dict[str, Any]] | None = None) -> None:
        self._registry = registry
        self._status = status  # GET /replication's body; None: not answered
        self._host = host
        self._port = port
        self._refresh = refresh
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        """Where Prometheus scrapes, e.g. ``http://127.0.0.1:20891/metrics`` (once started)."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self.port}{METRICS_PATH}"

    async def start(self) -> int:
        """Listen; returns the bound port."""
        app = web.Application()
        app.router.add_get(METRICS_PATH, self._handle)
        if self._status is not None:
            app.router.add_get(STATUS_PATH, self._handle_status)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            site = web.TCPSite(runner, self._host, self._port)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        self.port = runner.addresses[0][1]
        return self.port

    async def stop(self) -> None:
        """Stop listening (idempotent)."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def _handle(self, request: web.Request) -> web.Response:
        return await scrape(self._registry, self._refresh)

    async def _handle_status(self, request: web.Request) -> web.Response:
        assert self._status is not None
        return web.json_response(self._status())


__all__ = ["METRICS_PATH", "MetricsListener", "STATUS_PATH", "scrape"]
