"""Starting real pyqmq processes for end-to-end tests: port 0, loopback only, always stopped.

Each server prints a "listening on" line once ready; the harness reads it to learn the port.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

_READY_TIMEOUT_S = 30
_LISTEN = re.compile(r"listening on (?:http://)?(\S+?)[ /]")


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

    def kill9(self) -> None:
        """SIGKILL: no flush, no checkpoint, no deregistration."""
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


def start_server(name: str, args: list[str], env: dict[str, str] | None = None) -> ServerProcess:
    """Run ``qmq <args>`` and wait for its "listening on" line."""
    cmd = [sys.executable, "-m", "qmq", "--log-level", "warning", *args]
    process = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **(env or {})},
    )
    output: list[str] = []
    ready = threading.Event()
    found: dict[str, str] = {}

    def pump() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            output.append(line)
            match = _LISTEN.search(line + " ")
            if match and not ready.is_set():
                found["address"] = match.group(1)
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    if not ready.wait(_READY_TIMEOUT_S) or "address" not in found:
        process.kill()
        raise RuntimeError(f"{name} did not start: {''.join(output)[-2000:]}")
    return ServerProcess(name, args, process, found["address"], output)


def start_metaserver(db_path: str) -> ServerProcess:
    """A MetaServer subprocess on a SQLite file."""
    return start_server("metaserver", ["metaserver", "--db", f"sqlite+aiosqlite:///{db_path}",
                                       "--port", "0"])


def start_realtime(meta_url: str, data_dir: str, group: str, *extra: str) -> ServerProcess:
    """A realtime broker subprocess registered with ``meta_url``."""
    return start_server(f"realtime {group}", ["realtime", "--meta", meta_url, "--data-dir",
                                               data_dir, "--group", group, "--port", "0", *extra])


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
