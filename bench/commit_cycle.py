"""Where a message's latency goes at a fixed rate: the group commit's cycle against its fsync
(issue 18, "latency at 2,000 msg/s").

    python -m bench.commit_cycle                   # 2,000 msg/s for 8 s, data dir in /tmp
    python -m bench.commit_cycle --tmpfs           # data dir in /dev/shm: fsync costs ~nothing
    python -m bench.commit_cycle --runs 3 --seconds 20

One fresh ``qmq up`` (flush sync), the peers harness's consumer and fixed-rate producer
(``bench.peers.worker``: one send per task on a fixed schedule, one Consumer acking each), then
the realtime broker's own histograms from its /metrics. Printed per run: latency (send ->
consumer) and send -> confirmation p50 / p99, the server's CPU per message, how many group
commits ran and how many messages each carried, and the fsync's mean and bucket p50 / p99. A
commit every ``1 / (rate / messages per commit)`` ms against an fsync of a fraction of that
says the cycle is the event loop's turn (answers, pulls, the store thread's hand-back), not
the disk; wall-clock figures measure the machine's load as much as the code: state the load.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import urllib.request
from typing import Any

from bench._cluster import start_process
from bench.path_cpu import qmq_up
from bench.peers.servers import REPO_ROOT

SUBJECT = "rt.cycle"
CONSUMER_READY = re.compile(r"^ready$")
WORKER_SLACK_S = 60.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _histogram(text: str, name: str) -> tuple[list[tuple[float, float]], float, float]:
    """Buckets (le, cumulative count), sum and count of one Prometheus histogram."""
    buckets = [(float(le), float(value)) for le, value in
               re.findall(name + r'_bucket\{le="([^"]+)"\} ([0-9.e+-]+)', text)]
    total = re.search(name + r"_sum ([0-9.e+-]+)", text)
    count = re.search(name + r"_count ([0-9.e+-]+)", text)
    return buckets, float(total.group(1)) if total else 0.0, float(count.group(1)) if count else 0.0


def _bucket_at(buckets: list[tuple[float, float]], count: float, fraction: float) -> float:
    """The upper bound of the first bucket holding ``fraction`` of the observations."""
    return next((le for le, value in buckets if value >= fraction * count), float("nan"))


def _worker(url: str, role: str, params: dict[str, Any], out: str) -> list[str]:
    return [sys.executable, "-m", "bench.peers.worker", "pyqmq", url, role, json.dumps(params),
            out]


def one_run(rate: int, seconds: float, tmpfs: bool) -> dict[str, Any]:
    """One fresh ``qmq up``: ``rate`` msg/s for ``seconds``; the figures of the module doc."""
    count = int(rate * seconds)
    port = _free_port()
    metrics_port = _free_port()
    with qmq_up("qmq-cycle-", "sync", ["--realtime-port", str(port), "--realtime-metrics-port",
                                       str(metrics_port)], tmpfs) as server, \
            tempfile.TemporaryDirectory(prefix="qmq-cycle-out-") as outs:
        url = f"http://{server.address}"
        timeout_s = seconds * 4 + WORKER_SLACK_S
        consumer = start_process("consumer", _worker(url, "consume", {
            "subject": SUBJECT, "count": count, "timeout_s": timeout_s, "delayed": False},
            os.path.join(outs, "c.json")), CONSUMER_READY, address="-", cwd=REPO_ROOT)
        try:
            produced = subprocess.run(_worker(url, "produce_rate", {
                "subject": SUBJECT, "count": count, "rate_per_s": rate,
                "cpu_pids": [server.process.pid]}, os.path.join(outs, "p.json")),
                cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout_s, check=False)
            if produced.returncode != 0:
                raise RuntimeError(f"producer failed: {produced.stdout[-2000:]}"
                                   f"{produced.stderr[-2000:]}")
            consumer.process.wait(timeout=timeout_s)
        finally:
            consumer.stop()
        with open(os.path.join(outs, "p.json"), encoding="utf-8") as f:
            p = json.load(f)
        with open(os.path.join(outs, "c.json"), encoding="utf-8") as f:
            c = json.load(f)
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                    timeout=10) as response:
            metrics = response.read().decode()
    fsync, fsync_s, commits = _histogram(metrics, "qmq_realtime_fsync_seconds")
    _, messages, batches = _histogram(metrics, "qmq_realtime_commit_batch_messages")
    return {
        "latency_p50_ms": c["latency_p50_ms"], "latency_p99_ms": c["latency_p99_ms"],
        "confirm_p50_ms": p["confirm_p50_ms"], "confirm_p99_ms": p["confirm_p99_ms"],
        "server_cpu_us": p["server_cpu_s"] / count * 1e6, "commits": commits,
        "messages_per_commit": messages / max(1.0, batches),
        "fsync_mean_ms": fsync_s / max(1.0, commits) * 1e3,
        "fsync_p50_ms": _bucket_at(fsync, commits, 0.5) * 1e3,
        "fsync_p99_ms": _bucket_at(fsync, commits, 0.99) * 1e3,
        "failed": p["failed"], "load_1min": os.getloadavg()[0],
    }


def _line(f: dict[str, Any], rate: int) -> str:
    cycle_ms = 1000 / (rate / max(1e-9, f["messages_per_commit"]))
    return (f"latency p50 {f['latency_p50_ms']:.2f} / p99 {f['latency_p99_ms']:.2f} ms, "
            f"confirm p50 {f['confirm_p50_ms']:.2f} / p99 {f['confirm_p99_ms']:.2f} ms, server "
            f"{f['server_cpu_us']:.0f} us/msg, {f['commits']:.0f} commits of "
            f"{f['messages_per_commit']:.2f} msg (one every {cycle_ms:.2f} ms), fsync mean "
            f"{f['fsync_mean_ms']:.2f} ms (bucket p50 <= {f['fsync_p50_ms']:g}, p99 <= "
            f"{f['fsync_p99_ms']:g} ms), failed {f['failed']}; load {f['load_1min']:.2f}")


def main(argv: list[str] | None = None) -> int:
    """Run the measurement; prints one line per run."""
    parser = argparse.ArgumentParser(prog="python -m bench.commit_cycle", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=int, default=2_000, help="msg/s")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--tmpfs", action="store_true", help="data dir in /dev/shm")
    args = parser.parse_args(argv)
    print(f"qmq up ({'tmpfs' if args.tmpfs else 'disk'} data dir, flush sync), "
          f"{args.rate:,} msg/s for {args.seconds:g} s:", flush=True)
    for number in range(args.runs):
        print(f"  run {number + 1}: {_line(one_run(args.rate, args.seconds, args.tmpfs), args.rate)}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
