"""Helpers for the benchmarks: a loopback MetaServer + realtime broker as ``python -m qmq``
subprocesses, and small statistics helpers.

Every server listens on 127.0.0.1 port 0 and prints a "listening on HOST:PORT" line once ready;
``Cluster`` reads that line to learn the address. The cluster lives in a temp dir that is removed
on ``close()``; servers get SIGTERM (then SIGKILL after a grace period), so nothing outlives the
benchmark.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

# Replaces ``python -m qmq`` for the broker only, e.g. to profile it:
# QMQ_BENCH_BROKER_CMD="py-spy record -o broker.svg -- python -m qmq"
BROKER_CMD_ENV = "QMQ_BENCH_BROKER_CMD"
SERVER_READY_TIMEOUT_S = 30.0
SERVER_STOP_TIMEOUT_S = 20.0
_ADDRESS_RE = re.compile(r"listening on (?:http://)?([0-9.]+:[0-9]+)")


@dataclass
class Server:
    """One server subprocess: its address once ready and everything it printed."""

    name: str
    process: subprocess.Popen[str]
    address: str = ""
    lines: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self) -> None:
        """SIGTERM, wait for a graceful exit, SIGKILL if it does not come."""
        if self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(SERVER_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(SERVER_STOP_TIMEOUT_S)


def start_process(name: str, argv: list[str], ready: re.Pattern[str] = _ADDRESS_RE,
                  address: str = "", timeout_s: float = SERVER_READY_TIMEOUT_S,
                  cwd: str | None = None) -> Server:
    """Run ``argv`` (stderr merged into stdout) and wait until a line matches ``ready``. The
    server's address is ``address`` when given (a server told its port), else the pattern's
    first group (a server that picked its own port and printed it)."""
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               cwd=cwd)
    server = Server(name, process)
    seen = threading.Event()

    def read_output() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            server.lines.append(line.rstrip("\n"))
            match = ready.search(line)
            if match and not seen.is_set():
                server.address = address or match.group(1)
                seen.set()
        seen.set()  # the process ended: stop waiting

    threading.Thread(target=read_output, name=f"{name}-output", daemon=True).start()
    if not seen.wait(timeout_s) or not server.address:
        server.stop()
        tail = "\n".join(server.lines[-20:])
        raise RuntimeError(f"{name} was not ready within {timeout_s} s:\n{tail}")
    return server


def start_server(name: str, qmq_args: list[str], command: list[str] | None = None) -> Server:
    """Run ``python -m qmq --log-level warning <qmq_args>`` (or ``command`` in place of
    ``python -m qmq``) and wait for its address."""
    return start_process(
        name, [*(command or [sys.executable, "-m", "qmq"]), "--log-level", "warning", *qmq_args])


class Cluster:
    """A MetaServer on SQLite and one realtime broker, in a fresh temp dir."""

    def __init__(self, flush: str = "sync", broker_args: list[str] | None = None) -> None:
        self.directory = tempfile.mkdtemp(prefix="qmq-bench-")
        self.servers: list[Server] = []
        try:
            self.meta = self._add(start_server("metaserver", [
                "metaserver", "--db",
                f"sqlite+aiosqlite:///{os.path.join(self.directory, 'meta.db')}",
                "--host", "127.0.0.1", "--port", "0",
            ]))
            broker_cmd = os.environ.get(BROKER_CMD_ENV)
            self.broker = self._add(start_server("realtime", [
                "realtime", "--meta", self.meta_url,
                "--data-dir", os.path.join(self.directory, "realtime"),
                "--host", "127.0.0.1", "--port", "0", "--flush", flush, *(broker_args or []),
            ], shlex.split(broker_cmd) if broker_cmd else None))
        except BaseException:
            self.close()
            raise

    def _add(self, server: Server) -> Server:
        self.servers.append(server)
        return server

    @property
    def meta_url(self) -> str:
        return f"http://{self.meta.address}"

    def close(self) -> None:
        """Stop the servers (broker first, so it can deregister) and remove the temp dir."""
        for server in reversed(self.servers):
            server.stop()
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


async def paced(count: int, rate_per_s: float,
                start: Callable[[int], Awaitable[None]]) -> tuple[float, float]:
    """Start ``start(0)`` .. ``start(count - 1)`` as tasks on a fixed schedule of ``rate_per_s``
    (a slow one does not hold back the next), then wait for them all. Returns the monotonic
    times the schedule began and the last one was started (how well the rate was kept)."""
    tasks: set[asyncio.Task[None]] = set()
    began = time.monotonic()
    started = 0
    while started < count:
        due = min(count, int((time.monotonic() - began) * rate_per_s) + 1)
        while started < due:
            task = asyncio.ensure_future(start(started))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            started += 1
        await asyncio.sleep(max(0.0, began + started / rate_per_s - time.monotonic()))
    last_started = time.monotonic()
    await asyncio.gather(*tasks)
    return began, last_started


def percentile(sorted_values: list[float], fraction: float) -> float:
    """The nearest-rank percentile of already sorted values (``fraction`` in 0..1)."""
    if not sorted_values:
        return float("nan")
    rank = max(0, min(len(sorted_values) - 1, round(fraction * len(sorted_values)) - 1))
    return sorted_values[rank]


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds the process ``pid`` has used so far (0.0 if unknown)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    # After the ")" that ends the command name: state is field 3, utime 14, stime 15 (man proc).
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_s(pid: int) -> dict[str, float]:
    """User + system CPU seconds so far of the threads of process ``pid``, summed by OS thread
    name (/proc/<pid>/task/<tid>/comm: a server's I/O threads name themselves,
    ``serverkit.io_thread.name_os_thread``); the main thread (tid == pid) as "main". {} if
    unknown."""
    totals: dict[str, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return totals
    tick = os.sysconf("SC_CLK_TCK")
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", encoding="ascii", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/task/{tid}/comm", encoding="utf-8", errors="replace") as f:
                name = "main" if tid == str(pid) else f.read().strip()
        except (OSError, IndexError):
            continue  # the thread ended meanwhile
        totals[name] = totals.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return totals


def thread_switches(pid: int) -> dict[str, tuple[int, int]]:
    """(voluntary, involuntary) context switches so far of the threads of process ``pid``,
    summed by OS thread name as ``thread_cpu_s`` names them. A thread that waits for the GIL
    sleeps on a futex: a voluntary switch, as each wait for a system call that blocks is."""
    totals: dict[str, tuple[int, int]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return totals
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/status", encoding="utf-8") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            with open(f"/proc/{pid}/task/{tid}/comm", encoding="utf-8", errors="replace") as f:
                name = "main" if tid == str(pid) else f.read().strip()
            voluntary = int(fields["voluntary_ctxt_switches"])
            involuntary = int(fields["nonvoluntary_ctxt_switches"])
        except (OSError, KeyError, ValueError):
            continue  # the thread ended meanwhile
        before = totals.get(name, (0, 0))
        totals[name] = (before[0] + voluntary, before[1] + involuntary)
    return totals


def cpu_pressure_us() -> int | None:
    """Microseconds some task has waited for a CPU since boot (Linux PSI), None if unknown.
    Over an interval, the increase / the interval's length is the share of time the machine
    was short of CPU: how much other work shared it with the benchmark."""
    try:
        with open("/proc/pressure/cpu", encoding="ascii") as f:
            some = f.readline().split()
    except OSError:
        return None
    for field_text in some:
        if field_text.startswith("total="):
            return int(field_text[len("total="):])
    return None


def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo, or "unknown"."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"
