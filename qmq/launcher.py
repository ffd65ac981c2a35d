"""Running servers from the CLI: ``qmq metaserver``, ``qmq realtime`` and the all-in-one ``qmq up``."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from typing import Any

from delayserver.config import DelayConfig
from delayserver.server import DelayServer
from metaserver.app import start_metaserver
from metaserver.config import MetaConfig, sqlite_url
from metaserver.tokens import new_secret
from realtime.config import RealtimeConfig
from realtime.server import RealtimeServer
from serverkit.server import offset_clock

log = logging.getLogger(__name__)


def _print(line: str) -> None:
    print(line, flush=True)


async def _wait_for_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def _metrics_note(url: str | None) -> str:
    return f", metrics {url}" if url else ", no metrics"


async def run_metaserver_command(config: MetaConfig) -> None:
    """Serve the MetaServer until SIGTERM/SIGINT."""
    async with start_metaserver(config) as server:
        _print(f"metaserver listening on {server.url} (db {config.db_url}, metrics "
               f"{server.url}/metrics)")
        await _wait_for_signal()
        _print("metaserver stopping")
    _print("metaserver stopped: in-flight requests finished, database closed")


async def _serve(kind: str, server: RealtimeServer | DelayServer) -> None:
    """Serve one broker until SIGTERM/SIGINT, then stop it gracefully."""
    config = server.config
    await server.start()
    _print(f"{kind} group {config.group} listening on {server.address} (data {config.data_dir}, "
           f"flush {config.flush}{_metrics_note(server.metrics_url)})")
    await _wait_for_signal()
    _print(f"{kind} server stopping")
    _print(await server.stop())


async def run_realtime_command(config: RealtimeConfig) -> None:
    """Serve one realtime broker until SIGTERM/SIGINT, then stop it gracefully."""
    await _serve("realtime", RealtimeServer(config, offset_clock(config.clock_offset_ms)))


async def run_delay_command(config: DelayConfig) -> None:
    """Serve one delay server until SIGTERM/SIGINT, then stop it gracefully."""
    await _serve("delay", DelayServer(config))


async def run_up(data_dir: str, meta_port: int, realtime_port: int, delay_port: int, host: str,
                 *, flush: str = "sync", clock_offset_ms: int = 0, trace: bool = True,
                 realtime_options: dict[str, Any] | None = None,
                 admin_token: str | None = None,
                 realtime_metrics_port: int | None = None,
                 delay_metrics_port: int | None = None) -> None:
    """The all-in-one service: a MetaServer on SQLite, one realtime broker and one delay
    server, sharing one data dir. ``realtime_options``: more ``RealtimeConfig`` fields (ack
    timeout, consumer expiry, retry schedule), so one command can run short test timeouts.
    Auth is off unless ``admin_token`` is given or tokens are created; the two brokers hold a
    fresh internal token so they keep working either way. Each server serves /metrics: the
    MetaServer on its own port, the others on ``*_metrics_port`` when given."""
    os.makedirs(data_dir, exist_ok=True)
    internal_token = new_secret()
    meta_config = MetaConfig(
        db_url=sqlite_url(os.path.join(data_dir, "metaserver.db")), host=host, port=meta_port,
        admin_token=admin_token, internal_token=internal_token,
    )
    clock = offset_clock(clock_offset_ms)
    async with start_metaserver(meta_config) as meta:
        # What the two servers of one `qmq up` share (ServerConfig's fields).
        shared: dict[str, Any] = dict(
            meta_url=meta.url, host=host, flush=flush,
            heartbeat_interval_ms=meta_config.heartbeat_interval_ms,
            clock_offset_ms=clock_offset_ms, trace=trace, token=internal_token,
        )
        realtime_config = RealtimeConfig(
            data_dir=os.path.join(data_dir, "realtime"), group="realtime-1", port=realtime_port,
            metrics_port=realtime_metrics_port, **shared, **(realtime_options or {}),
        )
        realtime = RealtimeServer(realtime_config, clock)
        await realtime.start()
        delay_config = DelayConfig(
            data_dir=os.path.join(data_dir, "delay"), group="delay-1", port=delay_port,
            metrics_port=delay_metrics_port, **shared,
        )
        delay = DelayServer(delay_config, clock)
        await delay.start()
        _print("pyqmq is up:")
        _print(f"  metaserver  {meta.url}   (SQLite {meta_config.db_url})")
        _print(f"  realtime    {realtime.address}   group realtime-1, data {realtime_config.data_dir}")
        _print(f"  delay       {delay.address}   group delay-1, data {delay_config.data_dir}")
        _print(f"  auth        {'on' if admin_token else 'off (until a token is created)'}")
        _print(f"  metrics     {meta.url}/metrics   (metaserver)")
        for url, name in ((realtime.metrics_url, "realtime"), (delay.metrics_url, "delay")):
            if url:
                _print(f"              {url}   ({name})")
        _print(f"try: qmq send demo hello --meta {meta.url}")
        _print(f"     qmq send demo later --delay-ms 5000 --meta {meta.url}")
        _print(f"     qmq consume demo --group g1 --start earliest --meta {meta.url}")
        _print("Ctrl-C stops everything.")
        await _wait_for_signal()
        _print("stopping")
        _print(await delay.stop())
        _print(await realtime.stop())
        _print("metaserver stopping")
    _print("metaserver stopped: in-flight requests finished, database closed")


def setup_logging(level: str) -> None:
    """Log to stderr at ``level``."""
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # Alembic narrates every migration check at INFO; only its warnings matter to an operator.
    logging.getLogger("alembic").setLevel(max(logging.WARNING, logging.getLogger().level))
