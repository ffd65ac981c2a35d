"""Running servers from the CLI: ``qmq metaserver``, ``qmq realtime`` and the all-in-one ``qmq up``."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from typing import Any

from metaserver.app import start_metaserver
from metaserver.config import MetaConfig, sqlite_url
from realtime.config import RealtimeConfig
from realtime.server import RealtimeServer

log = logging.getLogger(__name__)


def _print(line: str) -> None:
    print(line, flush=True)


async def _wait_for_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def run_metaserver_command(config: MetaConfig) -> None:
    """Serve the MetaServer until SIGTERM/SIGINT."""
    async with start_metaserver(config) as server:
        _print(f"metaserver listening on {server.url} (db {config.db_url})")
        await _wait_for_signal()
        _print("metaserver stopping")


async def run_realtime_command(config: RealtimeConfig) -> None:
    """Serve one realtime broker until SIGTERM/SIGINT, then stop it gracefully."""
    server = RealtimeServer(config)
    await server.start()
    _print(f"realtime group {config.group} listening on {server.address} (data {config.data_dir}, "
           f"flush {config.flush})")
    await _wait_for_signal()
    _print("realtime server stopping")
    await server.stop()


async def run_up(data_dir: str, meta_port: int, realtime_port: int, host: str,
                 realtime_overrides: dict[str, Any] | None = None) -> None:
    """The all-in-one service: a MetaServer on SQLite and one realtime broker, one data dir."""
    os.makedirs(data_dir, exist_ok=True)
    meta_config = MetaConfig(
        db_url=sqlite_url(os.path.join(data_dir, "metaserver.db")), host=host, port=meta_port
    )
    async with start_metaserver(meta_config) as meta:
        realtime_config = RealtimeConfig(
            data_dir=os.path.join(data_dir, "realtime"),
            meta_url=meta.url,
            group="realtime-1",
            host=host,
            port=realtime_port,
            heartbeat_interval_ms=meta_config.heartbeat_interval_ms,
            **(realtime_overrides or {}),
        )
        realtime = RealtimeServer(realtime_config)
        await realtime.start()
        _print("pyqmq is up:")
        _print(f"  metaserver  {meta.url}   (SQLite {meta_config.db_url})")
        _print(f"  realtime    {realtime.address}   group realtime-1, data {realtime_config.data_dir}")
        _print("  delay       not available yet (the delay server is a later milestone)")
        _print(f"try: qmq send demo hello --meta {meta.url}")
        _print(f"     qmq consume demo --group g1 --start earliest --meta {meta.url}")
        _print("Ctrl-C stops everything.")
        await _wait_for_signal()
        _print("stopping")
        await realtime.stop()


def setup_logging(level: str) -> None:
    """Log to stderr at ``level``."""
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
