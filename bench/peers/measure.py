"""One measurement of one workload against one started system: which client processes run,
in which order, and the figures taken from what they report.

By default every workload gets a freshly started server (bench/peers/servers.py), so no figure
depends on what an earlier workload left behind. The consumer (and the Redis mover) is started
first and says when it is receiving; then the producer runs; then the consumer's figures are
read.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from dataclasses import dataclass
from typing import Any

from bench._cluster import Server, start_process
from bench.peers.servers import REPO_ROOT, Running, Setting

_READY = re.compile(r"^ready$")
WORKER_SLACK_S = 60.0  # beyond a workload's expected length, before a client is given up on
SLOWEST_PER_S = 200.0  # the slowest rate waited for (fsync-always peers on a slow disk)
W2_LEAD_MIN_S = 1.0  # W2's due time is at least this far ahead of the first send, plus
W2_LEAD_FACTOR = 2.0  # this many times as long as sending them takes at W1's rate
W2_SENDS_PER_S_GUESS = 5_000.0  # the rate assumed when W1 has not run
W2_SENDS_PER_S_FLOOR = 200.0  # a slower W1 rate is taken as this (bounds the lead)


@dataclass(frozen=True)
class Sizes:
    """How big each workload is."""

    w1_messages: int
    w1_delay_ms: tuple[int, int]  # low, high (uniform)
    w2_messages: int
    e2e_messages: int
    latency_seconds: float
    rate_per_s: int


# How often ``Clients.results`` looks whether a client ended, in s.
RESULTS_POLL_S = 0.1

FULL = Sizes(20_000, (1_000, 20_000), 20_000, 200_000, 20.0, 2_000)
QUICK = Sizes(2_000, (1_000, 5_000), 2_000, 20_000, 5.0, 2_000)


class Clients:
    """Starts the worker processes of one measurement and collects what they wrote."""

    def __init__(self, setting: Setting, running: Running, python: str) -> None:
        self.setting = setting
        self.running = running
        self.python = python
        self._started: list[tuple[str, subprocess.Popen[str] | Server, str]] = []

    def _argv(self, role: str, params: dict[str, Any], out: str) -> list[str]:
        return [self.python, "-m", "bench.peers.worker", self.setting.system, self.running.url,
                role, json.dumps(params), out]

    def _out(self, role: str) -> str:
        return os.path.join(self.running.directory, f"{role}-{len(self._started)}.json")

    def start_ready(self, role: str, params: dict[str, Any]) -> str:
        """Start a consumer or mover and wait until it prints ``ready``; returns its out file."""
        out = self._out(role)
        server = start_process(role, self._argv(role, params, out), _READY, address="-",
                               timeout_s=WORKER_SLACK_S, cwd=REPO_ROOT)
        self._started.append((role, server, out))
        return out

    def start(self, role: str, params: dict[str, Any]) -> str:
        """Start a producer; returns its out file. What it prints goes to ``<out>.log`` (a
        pipe nobody reads could fill and stall it)."""
        out = self._out(role)
        with open(out + ".log", "w", encoding="utf-8") as log:
            process = subprocess.Popen(self._argv(role, params, out), cwd=REPO_ROOT,
                                       stdout=log, stderr=subprocess.STDOUT, text=True)
        self._started.append((role, process, out))
        return out

    def pid(self, role: str) -> int:
        """The process id of the first client started as ``role``."""
        for started_role, child, _path in self._started:
            if started_role == role:
                return child.process.pid if isinstance(child, Server) else child.pid
        raise KeyError(f"no client {role!r} was started")

    def results(self, timeout_s: float) -> dict[str, dict[str, Any]]:
        """Wait for every started client and read its figures (in start order). The first
        client that fails or writes nothing fails the measurement at once with what it
        printed, the others still running (``kill`` stops them): a producer that gave up would
        otherwise leave its consumer waiting for the rest of its timeout (~1,000 s end to end)
        for messages that never come."""
        deadline = time.monotonic() + timeout_s
        out: dict[str, dict[str, Any]] = {}
        waiting = list(self._started)
        while waiting:
            for started in list(waiting):
                role, child, path = started
                process = child.process if isinstance(child, Server) else child
                if process.poll() is None:
                    if time.monotonic() < deadline:
                        continue
                    process.kill()
                    process.wait(10)
                waiting.remove(started)
                out[role] = self._result(role, child, path)
            if waiting:
                time.sleep(RESULTS_POLL_S)
        return {role: out[role] for role, _child, _path in self._started}

    def _result(self, role: str, child: subprocess.Popen[str] | Server,
                path: str) -> dict[str, Any]:
        """The figures an ended client wrote; RuntimeError with what it printed when none."""
        result = _read(path)
        if result is None or "error" in result:
            printed = ("\n".join(child.lines[-20:]) if isinstance(child, Server)
                       else _tail(path + ".log"))
            raise RuntimeError(f"{self.setting.key} {role} failed: "
                               f"{(result or {}).get('error', 'no result')}\n{printed}")
        return result

    def kill(self) -> None:
        """Stop every client still running (after a failure), and write what each consumer or
        mover printed to ``<out>.log`` beside its figures (a producer writes its own)."""
        for _role, child, path in self._started:
            process = child.process if isinstance(child, Server) else child
            if process.poll() is None:
                process.kill()
                process.wait(10)
            if isinstance(child, Server):
                with open(path + ".log", "w", encoding="utf-8") as log:
                    log.write("\n".join(child.lines) + "\n")


def _tail(path: str, chars: int = 3_000) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return ""


def _read(path: str) -> dict[str, Any] | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _delivery_checks(consumed: dict[str, Any]) -> dict[str, float]:
    return {"missing": consumed["missing"], "duplicates": consumed["duplicates"]}


def _run_delayed(clients: Clients, subject: str, count: int, timeout_s: float,
                 when: dict[str, int]) -> dict[str, dict[str, Any]]:
    """The clients of a delayed workload: (for Redis, the mover), the consumer, then the
    producer of ``count`` delayed messages due as ``when`` says; their figures."""
    if clients.setting.system == "redis":
        clients.start_ready("mover", {"subject": subject, "count": count, "timeout_s": timeout_s})
    clients.start_ready("consume", {"subject": subject, "count": count, "timeout_s": timeout_s,
                                    "delayed": True})
    clients.start("produce_delayed", {"subject": subject, "count": count,
                                      "cpu_pids": clients.running.pids, **when})
    return clients.results(timeout_s + WORKER_SLACK_S)


def measure_w1(clients: Clients, sizes: Sizes) -> dict[str, float]:
    """W1: delayed sends with 32 in flight, delays uniform over the range; lateness."""
    count, (low_ms, high_ms) = sizes.w1_messages, sizes.w1_delay_ms
    timeout_s = high_ms / 1000 + count / SLOWEST_PER_S + WORKER_SLACK_S
    out = _run_delayed(clients, "dl.w1", count, timeout_s,
                       {"delay_low_ms": low_ms, "delay_high_ms": high_ms})
    produced, consumed = out["produce_delayed"], out["consume"]
    figures = {
        "sends_per_s": count / ((produced["end_ns"] - produced["start_ns"]) / 1e9),
        "lateness_p50_ms": consumed["lateness_p50_ms"],
        "lateness_p99_ms": consumed["lateness_p99_ms"],
        "lateness_max_ms": consumed["lateness_max_ms"],
        "early": consumed["early"], "failed_sends": produced["failed"],
        "producer_cpu_us": produced["cpu_s"] / count * 1e6,
        "server_cpu_us": produced["server_cpu_s"] / count * 1e6,
        **_delivery_checks(consumed),
    }
    if "mover" in out:
        figures["mover_cpu_us"] = out["mover"]["cpu_s"] / count * 1e6
    return figures


def measure_w2(clients: Clients, sizes: Sizes, sends_per_s: float | None) -> dict[str, float]:
    """W2: every message due at the same instant (a whole second, far enough ahead for the
    producer to store them all first at W1's rate); how long after that instant the last one
    is received."""
    count = sizes.w2_messages
    rate = max(W2_SENDS_PER_S_FLOOR, sends_per_s or W2_SENDS_PER_S_GUESS)
    lead_s = W2_LEAD_MIN_S + W2_LEAD_FACTOR * count / rate
    timeout_s = lead_s + count / SLOWEST_PER_S + WORKER_SLACK_S
    out = _run_delayed(clients, "dl.w2", count, timeout_s, {"lead_ms": int(lead_s * 1000)})
    produced, consumed = out["produce_delayed"], out["consume"]
    due_at_ms = produced["due_at_ms"]
    return {
        "last_after_due_s": (consumed["last_wall_ms"] - due_at_ms) / 1000,
        "first_after_due_s": (consumed["first_wall_ms"] - due_at_ms) / 1000,
        "lateness_p50_ms": consumed["lateness_p50_ms"],
        "early": consumed["early"], "failed_sends": produced["failed"],
        # Must be > 0: every message was stored before the instant they are all due.
        "stored_before_due_s": (due_at_ms - produced["end_wall_ms"]) / 1000,
        **_delivery_checks(consumed),
    }


def measure_e2e(clients: Clients, sizes: Sizes) -> dict[str, float]:
    """Realtime end to end: one producer sending batches, one consumer acking each message."""
    count = sizes.e2e_messages
    timeout_s = count / SLOWEST_PER_S + WORKER_SLACK_S
    clients.start_ready("consume", {"subject": "rt.e2e", "count": count, "timeout_s": timeout_s,
                                    "delayed": False})
    clients.start("produce_batched", {"subject": "rt.e2e", "count": count,
                                      "cpu_pids": clients.running.pids})
    out = clients.results(timeout_s + WORKER_SLACK_S)
    produced, consumed = out["produce_batched"], out["consume"]
    return {
        "consumed_per_s": consumed["received"] / ((consumed["last_ns"] - produced["start_ns"])
                                                  / 1e9) if consumed["received"] else 0.0,
        "produced_per_s": count / ((produced["end_ns"] - produced["start_ns"]) / 1e9),
        "server_cpu_us": produced["server_cpu_s"] / count * 1e6,
        "producer_cpu_us": produced["cpu_s"] / count * 1e6,
        "consumer_cpu_us": consumed["cpu_s"] / count * 1e6,
        **_delivery_checks(consumed),
    }


def measure_latency(clients: Clients, sizes: Sizes) -> dict[str, float]:
    """Latency at a fixed rate (send -> the consumer's loop), and the server processes' CPU
    per message over the producer's sending window."""
    count = int(sizes.latency_seconds * sizes.rate_per_s)
    timeout_s = sizes.latency_seconds + count / SLOWEST_PER_S + WORKER_SLACK_S
    clients.start_ready("consume", {"subject": "rt.lat", "count": count, "timeout_s": timeout_s,
                                    "delayed": False})
    clients.start("produce_rate", {"subject": "rt.lat", "count": count,
                                   "rate_per_s": sizes.rate_per_s,
                                   "cpu_pids": clients.running.pids})
    out = clients.results(timeout_s + WORKER_SLACK_S)
    produced, consumed = out["produce_rate"], out["consume"]
    return {
        "p50_ms": consumed["latency_p50_ms"], "p99_ms": consumed["latency_p99_ms"],
        "max_ms": consumed["latency_max_ms"],
        "server_cpu_us": produced["server_cpu_s"] / count * 1e6,
        "rate_per_s": sizes.rate_per_s, "offered_per_s": produced["offered_per_s"],
        "confirmed_per_s": produced["confirmed_per_s"],
        "confirm_p50_ms": produced["confirm_p50_ms"],
        "confirm_p99_ms": produced["confirm_p99_ms"], "failed_sends": produced["failed"],
        **_delivery_checks(consumed),
    }
