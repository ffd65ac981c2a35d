"""How long a one-shot ``qmq`` client command takes, start to exit (issue 17: under 0.3 s for
the import and start-up of ``qmq send``).

    python -m bench.cli_start [--runs 5] [--phases]

Starts one ``qmq up`` (every port 0, a temp data dir), then runs each command ``--runs`` times
as a fresh ``python -m qmq`` process and prints the median and the spread of the wall time,
with the load average beside them (the machine may be shared). ``python -c pass`` is the floor:
the interpreter alone.

Each command is timed twice: with bytecode caches (``.pyc`` files, kept under a temporary
``PYTHONPYCACHEPREFIX`` and filled by a first run: what an installed package has, pip compiles
them), and ``from source``: ``PYTHONDONTWRITEBYTECODE=1`` with no ``__pycache__`` in the source
tree, as in a development checkout on this machine, where every module of ours that a command
imports is compiled on every run. ``--phases`` also times one in-process ``send`` step by step:
importing the CLI's commands, the route lookup, connecting, the send, the close.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench._cluster import start_process

_UP_READY = re.compile(r"^(Ctrl-C) stops everything")
_UP_META = re.compile(r"^\s+metaserver\s+(http://\S+)\s")
_ROOT = Path(__file__).resolve().parents[1]


def _wall_s(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + system) of one process run to its exit (which must
    be 0). The CPU time is what the machine's other load changes least."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    elapsed = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"{argv} exited {done.returncode}: {done.stderr[-1000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return elapsed, cpu


def _row(name: str, argv: list[str], runs: int, env: dict[str, str]) -> str:
    samples = [_wall_s(argv, env) for _ in range(runs)]
    walls = sorted(wall for wall, _ in samples)
    cpu = statistics.median(cpu for _, cpu in samples)
    load = os.getloadavg()[0]
    return (f"{name:<40} median {statistics.median(walls):.3f} s, cpu {cpu:.3f} s  "
            f"(min {walls[0]:.3f}, max {walls[-1]:.3f}, {runs} runs; load {load:.2f})")


async def _phases(meta_url: str) -> list[tuple[str, float]]:
    """One send in this process, with a timestamp after each step."""
    marks = [("start", time.perf_counter())]
    from qmq import commands  # noqa: F401  (what `qmq send` imports)
    from sdk.producer import Producer

    marks.append(("import qmq.commands + Producer", time.perf_counter()))
    producer = Producer(meta_url)
    await producer._routes.get("bench.cli", "producer")
    marks.append(("route lookup", time.perf_counter()))
    await producer.send("bench.cli", b"warm")  # connects to the broker, then sends
    marks.append(("connect + first send", time.perf_counter()))
    await producer.send("bench.cli", b"again")
    marks.append(("second send", time.perf_counter()))
    await producer.close()
    marks.append(("close", time.perf_counter()))
    return [(name, at - before) for (name, at), (_, before) in zip(marks[1:], marks)]


def _commands(meta_url: str) -> list[tuple[str, list[str]]]:
    qmq = [sys.executable, "-m", "qmq"]
    meta = ["--meta", meta_url]
    return [
        ("qmq send --help", [*qmq, "send", "--help"]),
        ("qmq send bench.cli hi", [*qmq, "send", "bench.cli", "hi", *meta]),
        ("qmq send --delay-ms 60000", [*qmq, "send", "bench.cli", "later", "--delay-ms",
                                       "60000", *meta]),
        ("qmq admin brokers", [*qmq, "admin", "brokers", *meta]),
        ("qmq consume --count 1", [*qmq, "consume", "bench.cli", "--group", "g", "--start",
                                   "earliest", "--count", "1", *meta]),
    ]


def main() -> None:
    """Run the benchmark and print one line per command and mode."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--phases", action="store_true", help="also time one send step by step")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="qmq-bench-cli-") as root:
        cached = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        cached["PYTHONPYCACHEPREFIX"] = os.path.join(root, "pycache")
        source = {k: v for k, v in os.environ.items() if k != "PYTHONPYCACHEPREFIX"}
        source["PYTHONDONTWRITEBYTECODE"] = "1"
        if any(_ROOT.glob("*/__pycache__/*.pyc")):
            print("note: the source tree has __pycache__ files, so 'from source' reads some")
        up = start_process("qmq up", [sys.executable, "-m", "qmq", "up", "--data-dir",
                                      os.path.join(root, "up"), "--meta-port", "0",
                                      "--realtime-port", "0", "--delay-port", "0", "--no-trace"],
                           ready=_UP_READY)
        try:
            meta_url = next(m.group(1) for m in map(_UP_META.search, list(up.lines)) if m)
            commands = _commands(meta_url)
            for _, argv in commands:  # routes made, bytecode cached
                _wall_s(argv, cached)
            print(_row("python -c pass", [sys.executable, "-c", "pass"], args.runs, cached))
            for name, argv in commands:
                print(_row(f"{name} (cached)", argv, args.runs, cached))
                print(_row(f"{name} (from source)", argv, args.runs, source))
            if args.phases:
                for name, seconds in asyncio.run(_phases(meta_url)):
                    print(f"  {name:<32} {seconds * 1000:8.1f} ms")
        finally:
            up.stop()


if __name__ == "__main__":
    main()
