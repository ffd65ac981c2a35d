"""Running servers from the CLI: ``qmq metaserver``, ``qmq realtime`` and the all-in-one ``qmq up``."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
from typing import Any

from delayserver.config import DelayConfig
from delayserver.server import DelayServer
from metaserver.app import start_metaserver
from metaserver.config import MetaConfig, sqlite_url
from metaserver.tokens import new_secret
from realtime.config import RealtimeConfig
from realtime.server import RealtimeServer
from qmq.event_loop import loop_name
from qmq.logs import say
from serverkit.server import freeze_started, offset_clock

# Most servers one group of `qmq up --replicas` runs (a master and its slaves).
REPLICAS_MAX = 5

log = logging.getLogger(__name__)


def _stop_on_signal() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT, handled from now on: a command installs it before it
    starts anything, so a signal that comes while it starts (or just after its ready line) stops
    it gracefully instead of interrupting it."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


def _loop_note() -> str:
    """The ready lines' ``event loop uvloop`` (or ``asyncio``): which loop the process took."""
    return f"event loop {loop_name(asyncio.get_running_loop())}"


def _metrics_note(url: str | None) -> str:
    return f", metrics {url}" if url else ", no metrics"


async def run_metaserver_command(config: MetaConfig) -> None:
    """Serve the MetaServer until SIGTERM/SIGINT."""
    stop = _stop_on_signal()
    async with start_metaserver(config) as server:
        freeze_started()
        say(f"metaserver listening on {server.url} (db {config.db_url}, metrics "
            f"{server.url}/metrics, {_loop_note()})")
        await stop.wait()
        say("metaserver stopping")
    say("metaserver stopped: in-flight requests finished, database closed")


async def _serve(kind: str, server: RealtimeServer | DelayServer) -> None:
    """Serve one broker until SIGTERM/SIGINT, then stop it gracefully."""
    config = server.config
    stop = _stop_on_signal()
    await server.start()
    freeze_started()  # the recovered state out of the collector's way
    say(f"{kind} group {config.group} listening on {server.address} (data {config.data_dir}, "
        f"flush {config.flush}{_metrics_note(server.metrics_url)}, {_loop_note()})")
    await stop.wait()
    say(f"{kind} server stopping")
    say(await server.stop())


async def run_realtime_command(config: RealtimeConfig) -> None:
    """Serve one realtime broker until SIGTERM/SIGINT, then stop it gracefully."""
    await _serve("realtime", RealtimeServer(config, offset_clock(config.clock_offset_ms)))


async def run_delay_command(config: DelayConfig) -> None:
    """Serve one delay server until SIGTERM/SIGINT, then stop it gracefully."""
    await _serve("delay", DelayServer(config))


async def run_up(data_dir: str, meta_port: int, realtime_port: int, delay_port: int, host: str,
                 *, advertise_host: str | None = None, flush: str = "sync",
                 clock_offset_ms: int = 0, trace: bool = True,
                 realtime_options: dict[str, Any] | None = None,
                 meta_options: dict[str, Any] | None = None,
                 delay_options: dict[str, Any] | None = None,
                 admin_token: str | None = None,
                 realtime_metrics_port: int | None = None,
                 delay_metrics_port: int | None = None, replicas: int = 1) -> None:
    """The all-in-one service: a MetaServer on SQLite, one realtime broker and one delay
    server, sharing one data dir. ``meta_options``, ``realtime_options``, ``delay_options``:
    fields of each server's config that win over the ones set here (``--config`` tables, flags
    such as a short ack timeout for tests).
    Auth is off unless ``admin_token`` is given or tokens are created; the two brokers hold a
    fresh internal token so they keep working either way. Each server serves /metrics: the
    MetaServer on its own port, the others on ``*_metrics_port`` when given. ``replicas``: the
    servers each group has; the first is its master and the others slaves that copy it, on
    ports chosen by the OS (docs/REPLICATION.md), for trying failover out on one machine."""
    if not 1 <= replicas <= REPLICAS_MAX:
        raise ValueError(f"replicas {replicas} is outside 1..{REPLICAS_MAX}")
    stop = _stop_on_signal()
    os.makedirs(data_dir, exist_ok=True)
    internal_token = new_secret()
    meta_config = MetaConfig(**{
        "db_url": sqlite_url(os.path.join(data_dir, "metaserver.db")), "host": host,
        "port": meta_port, "admin_token": admin_token, "internal_token": internal_token,
        "trace_dirs": (os.path.abspath(data_dir),),  # the console's message lookup reads both
        **(meta_options or {})})
    clock = offset_clock(clock_offset_ms)
    async with start_metaserver(meta_config) as meta:
        # What the two servers of one `qmq up` share (ServerConfig's fields).
        shared: dict[str, Any] = dict(
            meta_url=meta.url, host=host, advertise_host=advertise_host, flush=flush,
            heartbeat_interval_ms=meta_config.heartbeat_interval_ms,
            clock_offset_ms=clock_offset_ms, trace=trace, token=internal_token,
        )
        realtime_config = RealtimeConfig(**{
            "data_dir": os.path.join(data_dir, "realtime"), "group": "realtime-1",
            "port": realtime_port, "metrics_port": realtime_metrics_port, **shared,
            **(realtime_options or {})})
        realtime = RealtimeServer(realtime_config, clock)
        await realtime.start()
        delay_config = DelayConfig(**{
            "data_dir": os.path.join(data_dir, "delay"), "group": "delay-1", "port": delay_port,
            "metrics_port": delay_metrics_port, **shared, **(delay_options or {})})
        delay = DelayServer(delay_config, clock)
        await delay.start()
        slaves: list[RealtimeServer | DelayServer] = []
        for n in range(1, replicas):
            slaves.append(RealtimeServer(dataclasses.replace(
                realtime_config, data_dir=f"{realtime_config.data_dir}-replica-{n}", port=0,
                metrics_port=None), clock))
            slaves.append(DelayServer(dataclasses.replace(
                delay_config, data_dir=f"{delay_config.data_dir}-replica-{n}", port=0,
                metrics_port=None), clock))
        for slave in slaves:
            await slave.start()
        freeze_started()  # every server's recovered state out of the collector's way
        say("pyqmq is up:")
        say(f"  metaserver  {meta.url}   (SQLite {meta_config.db_url})")
        say(f"  realtime    {realtime.address}   group realtime-1, data {realtime_config.data_dir}")
        say(f"  delay       {delay.address}   group delay-1, data {delay_config.data_dir}")
        for slave in slaves:
            say(f"  {slave.KIND:<10}  {slave.address}   slave of group {slave.config.group}, "
                f"data {slave.config.data_dir}")
        say(f"  event loop  {loop_name(asyncio.get_running_loop())}")
        say(f"  auth        {'on' if admin_token else 'off (until a token is created)'}")
        say(f"  metrics     {meta.url}/metrics   (metaserver)")
        for url, name in ((realtime.metrics_url, "realtime"), (delay.metrics_url, "delay")):
            if url:
                say(f"              {url}   ({name})")
        say(f"try: qmq send demo hello --meta {meta.url}")
        say(f"     qmq send demo later --delay-ms 5000 --meta {meta.url}")
        say(f"     qmq consume demo --group g1 --start earliest --meta {meta.url}")
        say("Ctrl-C stops everything.")
        await stop.wait()
        say("stopping")
        # Masters first: each hands its group to an in-sync slave, which then stops alone.
        say(await delay.stop())
        say(await realtime.stop())
        for slave in slaves:
            say(await slave.stop())
        say("metaserver stopping")
    say("metaserver stopped: in-flight requests finished, database closed")
