"""Building and running the MetaServer aiohttp application.

* ``create_app(config, clock=None)``: the application; opens the database and applies migrations
  on startup, runs the expiry loop in the background, closes everything on cleanup.
* ``start_metaserver(config)``: an async context manager serving the app (port 0 allowed) and
  yielding a ``RunningMetaServer`` with its ``url``.
* ``run_metaserver(config)``: serve until cancelled (the ``qmq metaserver`` command).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from aiohttp import web

from metaserver.config import MetaConfig
from metaserver.console import add_console_routes
from metaserver.gateway import add_gateway_routes
from metaserver.openapi import OPENAPI_PATH, serve_openapi
from metaserver.handlers import REGISTRY_KEY, add_routes, error_middleware
from metaserver.metrics import MetaMetrics
from metaserver.registry import Registry
from metaserver.schedule_api import RUNNER_KEY, SCHEDULES_KEY, add_schedule_routes
from metaserver.schedule_plan import SchedulePlanner
from metaserver.schedule_runner import ScheduleRunner
from metaserver.schedules import Schedules
from metaserver.tokens import TOKENS_KEY, Tokens, auth_middleware
from metaserver.validation import BODY_SIZE_BYTES_MAX
from serverkit.metrics_http import METRICS_PATH, scrape
from wire.clock import wall_clock_ms
from wire.tls import client_context, server_context

log = logging.getLogger(__name__)

METRICS_KEY = web.AppKey("metaserver_metrics", MetaMetrics)


def monotonic_ms() -> int:
    """Milliseconds of the monotonic clock: lease watches measure with it, never the wall."""
    return time.monotonic_ns() // 1_000_000


def create_app(config: MetaConfig, clock: Callable[[], int] | None = None,
               mono_clock: Callable[[], int] | None = None) -> web.Application:
    """Return the MetaServer application; ``clock`` returns wall ms and ``mono_clock``
    monotonic ms (tests pass one fake clock, which then drives both)."""
    if mono_clock is None:
        mono_clock = clock or monotonic_ms
    registry = Registry(config, clock or wall_clock_ms, mono_clock)
    metrics = MetaMetrics(registry)
    # The metrics middleware is outermost so it counts the answer the error middleware made;
    # error_middleware comes next so the auth middleware's refusals become JSON errors too.
    app = web.Application(middlewares=[metrics.middleware, error_middleware, auth_middleware],
                          client_max_size=BODY_SIZE_BYTES_MAX)
    app[REGISTRY_KEY] = registry
    app[TOKENS_KEY] = Tokens(registry)
    app[METRICS_KEY] = metrics
    app[SCHEDULES_KEY] = Schedules(registry)
    # The runner presents the configured admin (or internal) token to the delay servers.
    app[RUNNER_KEY] = ScheduleRunner(
        registry, SchedulePlanner(grace_ms=config.schedule_misfire_grace_ms),
        token=config.admin_token or config.internal_token,
        ssl_context=client_context(config.tls_ca),
        poll_interval_ms=config.schedule_poll_interval_ms, lease_ms=config.schedule_lease_ms,
        metrics=metrics)
    add_routes(app)
    add_schedule_routes(app)
    add_console_routes(app)
    add_gateway_routes(app)
    app.router.add_get(OPENAPI_PATH, serve_openapi)
    app.router.add_get(METRICS_PATH, _metrics)
    app.cleanup_ctx.append(_lifecycle)
    return app


async def _metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: the MetaServer's Prometheus metrics."""
    metrics = request.app[METRICS_KEY]
    return await scrape(metrics.registry, metrics.refresh)


def get_registry(app: web.Application) -> Registry:
    """Return the registry behind ``app`` (tests call ``get_registry(app).expire_now()``)."""
    return app[REGISTRY_KEY]


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    """Open the database (migrating it) and run the expiry loop and the schedule runner for
    the app's lifetime."""
    registry = app[REGISTRY_KEY]
    await registry.open()
    log.info("MetaServer database at revision %s", registry.revision)
    tasks = [asyncio.create_task(registry.run_expiry_loop(), name="metaserver-expiry"),
             asyncio.create_task(registry.run_failover_loop(), name="metaserver-failover"),
             asyncio.create_task(app[RUNNER_KEY].run(), name="metaserver-schedules")]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await app[RUNNER_KEY].close()
        await registry.close()


@dataclass
class RunningMetaServer:
    """A MetaServer being served: where it listens and its app and registry."""

    app: web.Application
    host: str
    port: int
    tls: bool = False  # serving https

    @property
    def url(self) -> str:
        """Base URL of the HTTP API, e.g. ``http://127.0.0.1:8090`` (https with TLS)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    @property
    def registry(self) -> Registry:
        """The registry behind the app."""
        return self.app[REGISTRY_KEY]

    async def expire_now(self) -> dict[str, int]:
        """Run the expiry check at once (with the app's clock)."""
        return await self.registry.expire_now()

    async def failover_now(self) -> list[object]:
        """Run the failover check at once (with the app's clocks); returns what it promoted."""
        return list(await self.registry.replication.check())


@contextlib.asynccontextmanager
async def start_metaserver(
    config: MetaConfig, clock: Callable[[], int] | None = None,
    mono_clock: Callable[[], int] | None = None,
) -> AsyncIterator[RunningMetaServer]:
    """Serve a MetaServer on ``config.host:config.port`` (0 = a free port) until the block ends."""
    app = create_app(config, clock, mono_clock)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        ssl_context = server_context(config.tls_cert, config.tls_key)
        site = web.TCPSite(runner, config.host, config.port, ssl_context=ssl_context)
        await site.start()
        host, port = runner.addresses[0][:2]
        server = RunningMetaServer(app=app, host=host, port=port, tls=ssl_context is not None)
        log.debug("MetaServer listening on %s", server.url)  # the launcher says it once
        yield server
    finally:
        await runner.cleanup()


async def run_metaserver(config: MetaConfig) -> None:
    """Serve a MetaServer until the task is cancelled."""
    async with start_metaserver(config):
        await asyncio.Event().wait()
