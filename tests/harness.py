"""Starting real pyqmq processes for end-to-end tests: port 0, loopback only, always stopped.

Each server prints a "listening on" line once ready; the harness reads it to learn the port.
``Cluster`` keeps every process a test started so one ``stop_all()`` ends them all;
``run_qmq`` runs one CLI command to completion; ``admin`` reads the MetaServer's admin API.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
_READY_TIMEOUT_S = 30
_LISTEN = re.compile(r"listening on (?:http://)?(\S+?)[ /]")
# ``qmq up`` prints "  metaserver  http://HOST:PORT ...", "  realtime    HOST:PORT ...",
# "  delay       HOST:PORT ..." and then "Ctrl-C stops everything." once all of it runs.
_UP_READY = re.compile(r"^(Ctrl-C) stops everything")
_UP_META = re.compile(r"^\s+metaserver\s+(http://\S+)\s")
_UP_REALTIME = re.compile(r"^\s+realtime\s+(\S+)\s")
_UP_DELAY = re.compile(r"^\s+delay\s+(\S+:\d+)\s")
# Longest run of one CLI command (python start-up alone takes about a second here).
CLI_TIMEOUT_S = 60


@dataclass
class ServerProcess:
    """One running server subprocess and the address it printed."""

    name: str
    args: list[str]
    process: subprocess.Popen[str]
    address: str
    output: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        """``http://address`` (for the MetaServer)."""
        return f"http://{self.address}"

    @property
    def port(self) -> int:
        """The TCP port the server listens on."""
        return int(self.address.rsplit(":", 1)[1])

    @property
    def running(self) -> bool:
        """True until the process has exited."""
        return self.process.poll() is None

    def kill9(self) -> None:
        """SIGKILL: no flush, no checkpoint, no deregistration."""
        if self.running:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)

    def terminate(self, timeout_s: float = 20) -> int:
        """SIGTERM and wait for the graceful exit; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        return self.process.returncode

    def records(self) -> list[dict[str, Any]]:
        """The JSON object lines the process printed (a consumer worker's deliveries)."""
        out = []
        for line in list(self.output):
            if line.startswith("{"):
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if "id" in record:
                    out.append(record)
        return out

    def text(self) -> str:
        """Everything the process printed so far (stdout and stderr)."""
        return "".join(self.output)


def _spawn(name: str, cmd: list[str], ready: re.Pattern[str],
           env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], list[str], str]:
    """Start ``cmd`` and wait for a line matching ``ready``; returns (process, output, group 1)."""
    process = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **(env or {})}, cwd=REPO_ROOT,
    )
    output: list[str] = []
    found_event = threading.Event()
    found: dict[str, str] = {}

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            output.append(line)
            match = ready.search(line + " ")
            if match and not found_event.is_set():
                found["value"] = match.group(1)
                found_event.set()
        found_event.set()

    threading.Thread(target=pump, daemon=True).start()
    if not found_event.wait(_READY_TIMEOUT_S) or "value" not in found:
        process.kill()
        process.wait(10)
        raise RuntimeError(f"{name} did not start: {''.join(output)[-2000:]}")
    return process, output, found["value"]


def spawn(name: str, cmd: list[str], ready: re.Pattern[str],
          env: dict[str, str] | None = None) -> ServerProcess:
    """Run any command (``cmd``) and wait for its ready line (``ready`` group 1 is the
    address); ``tests/netns.py`` runs servers inside namespaces with it."""
    process, output, address = _spawn(name, cmd, ready, env)
    return ServerProcess(name, cmd, process, address, output)


def start_server(name: str, args: list[str], env: dict[str, str] | None = None,
                 ready: re.Pattern[str] = _LISTEN, wrapper: tuple[str, ...] = (),
                 log_level: str = "warning") -> ServerProcess:
    """Run ``qmq <args>`` and wait for its ready line (``ready`` group 1 is the address).
    ``wrapper``: a command it runs under (``("prlimit", "--nofile=128:256")``)."""
    cmd = [*wrapper, sys.executable, "-m", "qmq", "--log-level", log_level, *args]
    process, output, address = _spawn(name, cmd, ready, env)
    return ServerProcess(name, args, process, address, output)


_WORKER_READY = re.compile(r'("ready")')


def start_consumer_worker(meta_url: str, group: str, subject: str, consumer_id: str,
                          *extra: str) -> ServerProcess:
    """``tests/e2e/consumer_worker.py`` in its own process, once subscribed. Its ``records()``
    are the messages it got; ``--hold`` makes it keep them unacked."""
    args = ["--meta", meta_url, "--group", group, "--subject", subject,
            "--consumer-id", consumer_id, *extra]
    cmd = [sys.executable, "-m", "tests.e2e.consumer_worker", *args]
    process, output, _ = _spawn(f"consumer {consumer_id}", cmd, _WORKER_READY)
    return ServerProcess(f"consumer {consumer_id}", args, process, "", output)


def start_metaserver(db_path: str, port: int = 0) -> ServerProcess:
    """A MetaServer subprocess on a SQLite file (``port`` 0 = any free port)."""
    return start_server("metaserver", ["metaserver", "--db", f"sqlite+aiosqlite:///{db_path}",
                                       "--port", str(port)])


def start_realtime(meta_url: str, data_dir: str, group: str, *extra: str,
                   port: int = 0) -> ServerProcess:
    """A realtime broker subprocess registered with ``meta_url``."""
    return start_server(f"realtime {group}", ["realtime", "--meta", meta_url, "--data-dir",
                                               data_dir, "--group", group, "--port", str(port),
                                               *_free_metrics_port(extra), *extra])


def start_delay(meta_url: str, data_dir: str, group: str, *extra: str,
                port: int = 0) -> ServerProcess:
    """A delay server subprocess registered with ``meta_url`` (``extra``: ``--bucket-ms N``,
    ``--clock-offset-ms N``, ``--max-delay-ms N``, ``--flush async``)."""
    return start_server(f"delay {group}", ["delay", "--meta", meta_url, "--data-dir", data_dir,
                                            "--group", group, "--port", str(port),
                                            *_free_metrics_port(extra), *extra])


def _free_metrics_port(extra: tuple[str, ...]) -> list[str]:
    """``--metrics-port 0`` unless the test chose one: a broker restarted on a fixed data port
    would otherwise take data port + 10, which another process may hold."""
    return [] if "--metrics-port" in extra or "--no-metrics" in extra else ["--metrics-port", "0"]


@dataclass
class UpProcess(ServerProcess):
    """A running ``qmq up``: ``address`` is its realtime broker's; also its MetaServer URL and
    its delay server's address (empty when it printed none)."""

    meta_url: str = ""
    delay_address: str = ""


def start_up(data_dir: str, *extra: str) -> UpProcess:
    """Run ``qmq up`` with every port 0 and parse where its servers listen."""
    server = start_server("qmq up", ["up", "--data-dir", data_dir, "--meta-port", "0",
                                     "--realtime-port", "0", "--delay-port", "0", *extra],
                          ready=_UP_READY)

    def printed(pattern: re.Pattern[str]) -> str:
        found = [m.group(1) for m in map(pattern.search, list(server.output)) if m]
        return found[0] if found else ""

    meta_url, realtime = printed(_UP_META), printed(_UP_REALTIME)
    if not meta_url or not realtime:
        server.kill9()
        raise RuntimeError(f"qmq up did not say where it listens: {server.text()[-2000:]}")
    return UpProcess(server.name, server.args, server.process, realtime, server.output,
                     meta_url=meta_url, delay_address=printed(_UP_DELAY))


def free_port() -> int:
    """A loopback TCP port that is free now (for a server that must come back on the same URL)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Cluster:
    """Every process one test started, under one directory; ``stop_all`` ends them all."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.processes: list[ServerProcess] = []
        self.meta: ServerProcess | None = None

    @property
    def meta_url(self) -> str:
        assert self.meta is not None, "start_meta() first"
        return self.meta.url

    def start_meta(self, port: int = 0) -> ServerProcess:
        """A MetaServer on ``root/meta.db`` (the same file on every restart)."""
        self.meta = self.keep(start_metaserver(str(self.root / "meta.db"), port))
        return self.meta

    def start_broker(self, group: str, *extra: str, port: int = 0) -> ServerProcess:
        """A realtime broker of ``group`` on ``root/<group>`` (the same dir on every restart)."""
        return self.keep(start_realtime(self.meta_url, str(self.root / group), group, *extra,
                                         port=port))

    def start_delay(self, group: str, *extra: str, port: int = 0) -> ServerProcess:
        """A delay server of ``group`` on ``root/<group>`` (the same dir on every restart)."""
        return self.keep(start_delay(self.meta_url, str(self.root / group), group, *extra,
                                     port=port))

    def start_consumer_worker(self, group: str, subject: str, consumer_id: str,
                              *extra: str) -> ServerProcess:
        """A killable consumer process (``tests/e2e/consumer_worker.py``)."""
        return self.keep(start_consumer_worker(self.meta_url, group, subject, consumer_id,
                                                *extra))

    def start_up(self, *extra: str) -> UpProcess:
        """``qmq up`` on ``root/up``."""
        up = start_up(str(self.root / "up"), *extra)
        self.keep(up)
        return up

    def keep(self, server: ServerProcess) -> Any:
        """Stop ``server`` with the rest at the end (for processes started by hand)."""
        self.processes.append(server)
        return server

    def stop_all(self) -> None:
        """SIGTERM everything still running (SIGKILL after a grace period)."""
        for server in reversed(self.processes):
            try:
                server.terminate(timeout_s=15)
            except Exception:  # keep stopping the others
                server.process.kill()

    def dump(self) -> str:
        """What each process printed, for a failing test's report."""
        return "\n".join(f"----- {s.name} {s.args} (exit {s.process.poll()})\n{s.text()[-4000:]}"
                         for s in self.processes)


def run_qmq(*args: str, timeout_s: float = CLI_TIMEOUT_S, env: dict[str, str] | None = None,
            input_text: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run one ``qmq`` CLI command to completion and return its exit code and output."""
    return subprocess.run(
        [sys.executable, "-m", "qmq", *args], capture_output=True, text=True, timeout=timeout_s,
        input=input_text, env={**os.environ, **(env or {})},
    )


def admin(meta_url: str, what: str) -> list[dict[str, Any]]:
    """``GET /api/admin/<what>`` (brokers, subjects, groups) as a list of rows."""
    with urllib.request.urlopen(f"{meta_url}/api/admin/{what}", timeout=5) as response:
        return json.loads(response.read())[what]


def admin_or_none(meta_url: str, what: str) -> list[dict[str, Any]] | None:
    """Like ``admin`` but None while the MetaServer cannot be reached."""
    try:
        return admin(meta_url, what)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def broker_states(meta_url: str) -> dict[tuple[str, str], str]:
    """(kind, group) -> state ("rw", "readonly", "offline") of every broker group the
    MetaServer lists; a group with an online broker (a restart on a new port leaves the old
    broker's row "offline") takes that broker's state. Empty while it cannot be reached."""
    states: dict[tuple[str, str], str] = {}
    for row in admin_or_none(meta_url, "brokers") or []:
        key = (row["kind"], row["group"])
        if states.get(key, "offline") == "offline":
            states[key] = row["state"]
    return states


def group_lag(meta_url: str, subject: str, group: str) -> tuple[int, int] | None:
    """(lag, brokers reporting) of (subject, group) as the brokers last reported it, or None."""
    for row in admin_or_none(meta_url, "groups") or []:
        if row["subject"] == subject and row["group"] == group:
            return row["lag"], row["brokers"]
    return None


def wait_until(condition, timeout_s: float, what: str, interval_s: float = 0.05):
    """Poll ``condition`` until it returns something truthy; fail naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)


async def wait_for(condition, timeout_s: float, what: str, interval_s: float = 0.05,
                   in_thread: bool = False):
    """``wait_until`` for async tests: ``condition`` may be sync or async; the loop keeps running.

    ``in_thread=True`` runs a sync condition that blocks (an HTTP call, a CLI command) in a
    thread, so the consumers and producers of the test keep working meanwhile.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if inspect.iscoroutinefunction(condition):
            value = await condition()
        elif in_thread:
            value = await asyncio.to_thread(condition)
        else:
            value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(interval_s)


# ---------------------------------------------------------------------------- delayed deliveries


def wait_registered(meta_url: str, expected: dict[tuple[str, str], str],
                    timeout_s: float = 20) -> None:
    """Block until every (kind, group) in ``expected`` has its state (e.g. "rw") at the
    MetaServer; other brokers may be listed too."""
    def ready() -> bool:
        states = broker_states(meta_url)
        return all(states.get(key) == state for key, state in expected.items())

    wait_until(ready, timeout_s, f"brokers {expected} at the MetaServer", interval_s=0.1)


def epoch_ms(clock_offset_ms: int = 0) -> int:
    """The wall clock in epoch ms, shifted like a server run with ``--clock-offset-ms``."""
    return time.time_ns() // 1_000_000 + clock_offset_ms


@dataclass(frozen=True)
class Arrival:
    """One message handed to the application, stamped with the (offset) wall clock."""

    id: str
    subject: str  # the user subject (a retry copy reports the subject it was first sent to)
    wire_subject: str  # where it was pulled from (``%retry%...`` for a retry copy)
    body: bytes
    retries: int
    redelivered: int
    properties: dict[str, str]
    deliver_at_ms: int | None
    at_ms: int  # epoch ms (plus the clock offset) when the application got it

    @property
    def lateness_ms(self) -> int:
        """How long after its deliver_at it arrived (negative: early)."""
        return self.at_ms - (self.deliver_at_ms if self.deliver_at_ms is not None else self.at_ms)


class Arrivals:
    """Every message a test's consumers got, with the receive time to compare with deliver_at.

    ``clock_offset_ms`` is the servers' test clock offset, so "early" is judged in the clock the
    delay server schedules by."""

    def __init__(self, clock_offset_ms: int = 0) -> None:
        self.clock_offset_ms = clock_offset_ms
        self.items: list[Arrival] = []

    def record(self, msg: Any) -> Arrival:
        """Record a ``qmq.ReceivedMessage`` now."""
        message = msg.message
        arrival = Arrival(msg.id, msg.subject, msg.wire_subject, bytes(msg.body), msg.retries,
                          msg.redelivered, dict(msg.properties), message.deliver_at_ms,
                          epoch_ms(self.clock_offset_ms))
        self.items.append(arrival)
        return arrival

    @property
    def ids(self) -> set[str]:
        return {a.id for a in self.items}

    def of(self, message_id: str) -> list[Arrival]:
        return [a for a in self.items if a.id == message_id]

    def duplicates(self) -> dict[str, int]:
        """Ids handed out more than once, with their counts."""
        counts: dict[str, int] = {}
        for arrival in self.items:
            counts[arrival.id] = counts.get(arrival.id, 0) + 1
        return {i: n for i, n in counts.items() if n > 1}

    def early(self) -> list[Arrival]:
        """Arrivals before their deliver_at (the delay server must never allow one)."""
        return [a for a in self.items if a.lateness_ms < 0]

    def lateness_summary(self) -> str:
        """``p50 / p99 / max`` lateness in ms, for the test's output."""
        values = sorted(a.lateness_ms for a in self.items if a.deliver_at_ms is not None)
        if not values:
            return "no delayed arrivals"

        def pick(fraction: float) -> int:
            return values[min(len(values) - 1, max(0, round(fraction * len(values)) - 1))]

        return (f"{len(values)} delayed arrivals, lateness p50 {pick(0.5)} ms, "
                f"p99 {pick(0.99)} ms, max {values[-1]} ms")


async def consume_into(subscription: Any, arrivals: Arrivals, *, ack: bool = True) -> None:
    """Record (and ack) everything ``subscription`` yields until the consumer closes; run it
    as a task."""
    async for msg in subscription:
        arrivals.record(msg)
        if ack:
            await msg.ack()


def start_delay_cluster(cluster: Cluster, *, realtime_flags: tuple[str, ...] = (),
                        delay_flags: tuple[str, ...] = (), realtime_group: str = "rt1",
                        delay_group: str = "d1") -> tuple[ServerProcess, ServerProcess]:
    """A MetaServer, one realtime broker and one delay server, all registered rw; returns
    (realtime, delay). One realtime group, so a re-dispatch always meets the broker that can
    de-duplicate it."""
    cluster.start_meta()
    realtime = cluster.start_broker(realtime_group, *realtime_flags)
    delay = cluster.start_delay(delay_group, *delay_flags)
    wait_registered(cluster.meta_url, {("realtime", realtime_group): "rw",
                                       ("delay", delay_group): "rw"})
    return realtime, delay
