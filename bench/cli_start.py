"""How long a one-shot ``qmq`` client command takes, start to exit (issue 17: under 0.3 s for
the import and start-up of ``qmq send``).

    python -m bench.cli_start [--runs 5]

Starts one ``qmq up`` (every port 0, a temp data dir), then runs each command ``--runs`` times
as a fresh ``python -m qmq`` process and prints the median and the spread of the wall time,
with the load average beside them (the machine may be shared). ``python -c pass`` is the floor:
the interpreter alone. ``--phases`` also times one in-process ``send`` step by step: importing
the CLI's commands, the route lookup, connecting, the send, the close.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench._cluster import start_process

_UP_READY_PATTERN = r"^(Ctrl-C) stops everything"


def _wall_s(argv: list[str]) -> float:
    """Wall seconds of one process run to its exit (which must be 0)."""
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{argv} exited {done.returncode}: {done.stderr[-1000:]}")
    return elapsed


def _row(name: str, argv: list[str], runs: int) -> str:
    times = sorted(_wall_s(argv) for _ in range(runs))
    load = os.getloadavg()[0]
    return (f"{name:<28} median {statistics.median(times):.3f} s  "
            f"(min {times[0]:.3f}, max {times[-1]:.3f}, {runs} runs; load {load:.2f})")


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


def main() -> None:
    """Run the benchmark and print one line per command."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--phases", action="store_true", help="also time one send step by step")
    args = parser.parse_args()
    import re

    with tempfile.TemporaryDirectory(prefix="qmq-bench-cli-") as root:
        up = start_process("qmq up", [sys.executable, "-m", "qmq", "up", "--data-dir", root,
                                      "--meta-port", "0", "--realtime-port", "0",
                                      "--delay-port", "0", "--no-trace"],
                           ready=re.compile(_UP_READY_PATTERN))
        try:
            meta_url = next(m.group(1) for m in map(
                re.compile(r"^\s+metaserver\s+(http://\S+)\s").search, list(up.lines)) if m)
            qmq = [sys.executable, "-m", "qmq"]
            meta = ["--meta", meta_url]
            _wall_s([*qmq, "send", "bench.cli", "warm-up", *meta])  # route made, caches warm
            print(_row("python -c pass", [sys.executable, "-c", "pass"], args.runs))
            print(_row("qmq send --help", [*qmq, "send", "--help"], args.runs))
            print(_row("qmq send bench.cli hi", [*qmq, "send", "bench.cli", "hi", *meta],
                       args.runs))
            print(_row("qmq send --delay-ms 60000", [*qmq, "send", "bench.cli", "later",
                                                      "--delay-ms", "60000", *meta], args.runs))
            print(_row("qmq admin brokers", [*qmq, "admin", "brokers", *meta], args.runs))
            print(_row("qmq consume --count 1", [*qmq, "consume", "bench.cli", "--group", "g",
                                                  "--start", "earliest", "--count", "1", *meta],
                       args.runs))
            if args.phases:
                for name, seconds in asyncio.run(_phases(meta_url)):
                    print(f"  {name:<32} {seconds * 1000:8.1f} ms")
        finally:
            up.stop()


if __name__ == "__main__":
    main()
