"""Where a hot slot's time goes: the peers benchmark's W2 against pyqmq (``qmq up``), with a
timeline per stage read from the trace events and the CPU each process used.

N delayed messages all due at one instant, stored well before it (bench/peers/workloads.py's
``produce_delayed``, 32 sends in flight), one consumer process acking each (the SDK as an
application uses it). After the run, the trace events of the subject give, for every message,
when the delay server recorded its dispatch (``dispatched``: after the broker confirmed it),
when the broker stored it, when it was pulled and when it was acked; each stage is printed as
ms after the due instant (first, p10, p50, p90, last). The consumer's own first and last
receipt, and the CPU seconds of the ``qmq up`` process from just before the due instant to the
last receipt (and the consumer's), say which side is the bound.

    .venv/bin/python -m bench.hot_slot                     # 20,000 messages, 3 runs
    .venv/bin/python -m bench.hot_slot --runs 1 --spy DIR  # py-spy --gil of both processes
    .venv/bin/python -m bench.hot_slot --visible           # the consumer's drain alone
    .venv/bin/python -m bench.hot_slot --handoff-lead-ms 3000  # with the hand-off on
    .venv/bin/python -m bench.hot_slot --due-after-ms 2500     # bench.peers' W2 lead

``--due-after-ms`` (default 12,000) places the due instant: the first whole second this long or
more after the first send. bench.peers' W2 uses 1,000 ms plus twice the time the sends take at
W1's rate (~2,500 ms): the slot is then stored inside the delay server's 3,000 ms hand-off
lead, each commit handed off as it comes, where the default stores it all before the lead.

``--visible`` measures W2's floor on the consumer side: the N messages are sent as realtime
messages first (visible at once), then the consumer process starts and drains them; it prints
the first-to-last receipt and the ``qmq up`` CPU from just before the consumer started.

Each run says how much of the slot was handed off ahead of the due instant (``hand-off:``,
from the delay server's ``handed`` lines: when each hold was confirmed, in ms after the due
instant) and how much was sent at the due time instead. The dispatcher decides per batch of
256, as the batch's turn comes: a batch whose turn comes after its due time is sent, not held.
A hand-off slower than the lead (the holds of 20,000 messages take ~1 s at load 6-9) sends its
tail at the due time; with ``--handoff-lead-ms 1000`` that is seen in most runs.

``--spy DIR`` writes ``DIR/<run>-server.txt`` and ``DIR/<run>-consumer.txt`` (py-spy's raw
format, only the thread holding the GIL, from 0.3 s before the due instant for
``--spy-seconds``) with the py-spy of ``--py-spy`` (default: /work/tools-venv/bin/py-spy).
A benchmark, not a test: it asserts nothing. Every wait is bounded in time.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from typing import Any

from bench._cluster import percentile, process_cpu_s, thread_cpu_s
from bench.peers import servers
from bench.peers.measure import Clients

SUBJECT = "dl.w2"
LEAD_MS = 12_000  # the due instant is this far ahead of the first send (stored well before)
CLIENT_TIMEOUT_S = 120.0
TRACE_FLUSH_WAIT_S = 1.5  # the trace writer flushes at least once a second
STAGES = ("handed", "dispatched", "stored", "pulled", "acked")
PY_SPY_DEFAULT = "/work/tools-venv/bin/py-spy"
ROUNDS_SHOWN = 24  # distinct "stored" times printed per run


def _stage_times(directory: str, due_ms: int) -> dict[str, list[int]]:
    """Each stage's event times for SUBJECT, in ms after ``due_ms``, from every trace file
    under ``directory``."""
    times: dict[str, list[int]] = {stage: [] for stage in STAGES}
    for path in glob.glob(os.path.join(directory, "**", "trace", "**", "*.jsonl"),
                          recursive=True):
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue  # a line cut by the writer's last flush
                if event.get("subject") == SUBJECT and event.get("event") in times:
                    times[event["event"]].append(event["ts_ms"] - due_ms)
    return times


def _due_instant(produced_at: str, lead_ms: int = LEAD_MS) -> int:
    """The due instant (epoch ms) the producer chose, read from its figures once it finished
    sending (before that instant); if it has not within ``lead_ms``, the next whole second, a
    guess only for when to start measuring (``one_run`` takes the producer's own afterwards)."""
    deadline = time.monotonic() + lead_ms / 1000
    while time.monotonic() < deadline:
        try:
            with open(produced_at, encoding="utf-8") as f:
                return int(json.load(f)["due_at_ms"])
        except (OSError, ValueError, KeyError):
            time.sleep(0.05)
    return -(-(time.time_ns() // 1_000_000) // 1000) * 1000


def _spy(py_spy: str, pid: int, out: str, seconds: float) -> subprocess.Popen[bytes]:
    return subprocess.Popen([py_spy, "record", "-f", "raw", "-r", "500", "--gil", "--nonblocking",
                             "-d", str(max(1, round(seconds))), "-o", out, "-p", str(pid)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def one_run(count: int, spy_dir: str | None, py_spy: str, spy_seconds: float,
            run: int, handoff_lead_ms: int | None = None, lead_ms: int = LEAD_MS
            ) -> dict[str, Any]:
    """One W2 of ``count`` messages due at the first whole second ``lead_ms`` or more after
    the first send, against a fresh ``qmq up`` (its delay server's ``handoff_lead_ms`` set
    when given); its figures."""
    setting = servers.with_handoff_lead(servers.SETTINGS_BY_KEY["pyqmq"], handoff_lead_ms)
    running = servers.start(setting, None)
    clients = Clients(setting, running, sys.executable)
    spies: list[subprocess.Popen[bytes]] = []
    try:
        clients.start_ready("consume", {"subject": SUBJECT, "count": count,
                                        "timeout_s": CLIENT_TIMEOUT_S, "delayed": True})
        consumer_pid = clients.pid("consume")
        produced_at = clients.start("produce_delayed", {
            "subject": SUBJECT, "count": count, "cpu_pids": running.pids, "lead_ms": lead_ms})
        due_ms = _due_instant(produced_at, lead_ms)
        time.sleep(max(0.0, due_ms / 1000 - 0.3 - time.time()))
        server_cpu_s = process_cpu_s(running.pids[0])
        threads_before = thread_cpu_s(running.pids[0])
        if spy_dir:
            spies = [_spy(py_spy, pid, os.path.join(spy_dir, f"{run}-{name}.txt"), spy_seconds)
                     for name, pid in (("server", running.pids[0]), ("consumer", consumer_pid))]
        out = clients.results(CLIENT_TIMEOUT_S)
        server_cpu_s = process_cpu_s(running.pids[0]) - server_cpu_s
        threads = thread_cpu_s(running.pids[0])
        threads = {name: threads[name] - threads_before.get(name, 0.0) for name in threads}
        produced, consumed = out["produce_delayed"], out["consume"]
        # The producer's own due instant: _due_instant's fallback (the sends not done within
        # lead_ms, a loaded machine) is the next whole second, which may be a second early.
        due_ms = produced.get("due_at_ms") or due_ms
        time.sleep(TRACE_FLUSH_WAIT_S)
        return {"due_ms": due_ms, "stored_before_ms": due_ms - produced["end_wall_ms"],
                "first_ms": consumed["first_wall_ms"] - due_ms,
                "last_ms": consumed["last_wall_ms"] - due_ms, "early": consumed["early"],
                "missing": consumed["missing"], "server_cpu_s": server_cpu_s,
                "consumer_cpu_s": consumed["cpu_s"], "threads_cpu_s": threads,
                "stages": _stage_times(running.directory, due_ms)}
    finally:
        for spy in spies:
            try:
                spy.wait(spy_seconds + 30)
            except subprocess.TimeoutExpired:
                spy.kill()
        clients.kill()
        running.close()


def one_drain(count: int) -> dict[str, Any]:
    """``count`` realtime messages stored first, then one consumer process drains them; its
    first-to-last receipt (ms) and the ``qmq up`` CPU seconds meanwhile."""
    setting = servers.SETTINGS_BY_KEY["pyqmq"]
    running = servers.start(setting, None)
    producing = Clients(setting, running, sys.executable)
    consuming = Clients(setting, running, sys.executable)
    try:
        producing.start("produce_batched", {"subject": SUBJECT, "count": count,
                                            "cpu_pids": running.pids})
        producing.results(CLIENT_TIMEOUT_S)
        server_cpu_s = process_cpu_s(running.pids[0])
        consuming.start_ready("consume", {"subject": SUBJECT, "count": count,
                                          "timeout_s": CLIENT_TIMEOUT_S, "delayed": False})
        consumed = consuming.results(CLIENT_TIMEOUT_S)["consume"]
        return {"drain_ms": consumed["last_wall_ms"] - consumed["first_wall_ms"],
                "server_cpu_s": process_cpu_s(running.pids[0]) - server_cpu_s,
                "consumer_cpu_s": consumed["cpu_s"], "missing": consumed["missing"]}
    finally:
        producing.kill()
        consuming.kill()
        running.close()


def _print_hand_off(figures: dict[str, Any]) -> None:
    """How much of the slot the delay server handed off ahead of the due instant (its
    ``handed`` lines, stamped as each hold is confirmed), and how much it sent at the due
    time instead: a batch whose turn comes after its due time is sent, not held, so a
    hand-off slower than the lead leaves its tail to 256-message sends (bench.hot_slot's
    docstring)."""
    handed, dispatched = figures["stages"]["handed"], figures["stages"]["dispatched"]
    if not handed:
        print(f"  hand-off: none of {len(dispatched)} handed off; all sent at the due time",
              flush=True)
        return
    whole = "whole" if len(handed) >= len(dispatched) else \
        f"PART: {len(dispatched) - len(handed)} sent at the due time"
    print(f"  hand-off: {len(handed)} of {len(dispatched)} handed ({whole}); holds confirmed "
          f"from {min(handed)} to {max(handed)} ms, {max(handed) - min(handed)} ms",
          flush=True)


def _print_run(run: int, figures: dict[str, Any]) -> None:
    if figures["stored_before_ms"] <= 0:
        print(f"run {run}: the sends ended {-figures['stored_before_ms']} ms after the due "
              f"instant (a loaded machine): not a hot slot", flush=True)
    print(f"run {run}: stored {figures['stored_before_ms']} ms before the due instant; "
          f"consumer first {figures['first_ms']} ms, last {figures['last_ms']} ms after it; "
          f"early {figures['early']}, missing {figures['missing']}; CPU from the due instant "
          f"to the last receipt: qmq up {figures['server_cpu_s']:.2f} s, consumer (whole run) "
          f"{figures['consumer_cpu_s']:.2f} s", flush=True)
    _print_hand_off(figures)
    busy = sorted(((s, name) for name, s in figures["threads_cpu_s"].items() if s >= 0.005),
                  reverse=True)
    print("  qmq up threads (CPU-ms): "
          + ", ".join(f"{name} {1000 * s:.0f}" for s, name in busy), flush=True)
    for stage in STAGES:
        values = sorted(figures["stages"][stage])
        if values:
            marks = " ".join(f"{name} {percentile(values, q):.0f}" for name, q in
                             (("p10", 0.1), ("p50", 0.5), ("p90", 0.9)))
            print(f"  {stage:<10} n={len(values):<6} first {values[0]} {marks} "
                  f"last {values[-1]} ms", flush=True)
    # A store call stamps each of its messages with one time: the distinct times of "stored"
    # are the store calls (visibility rounds, or dispatch batches with the hand-off off), and
    # those of "pulled" the pulls (two pulls in the same ms count as one).
    for stage in ("stored", "pulled"):
        rounds = Counter(figures["stages"][stage])
        if rounds:
            print(f"  {stage} by time (ms: messages): "
                  + ", ".join(f"{ms}: {n}" for ms, n in sorted(rounds.items())[:ROUNDS_SHOWN])
                  + (" ..." if len(rounds) > ROUNDS_SHOWN else ""), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.hot_slot", description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--spy", default=None, metavar="DIR",
                        help="py-spy both processes over the hot window into DIR")
    parser.add_argument("--py-spy", default=PY_SPY_DEFAULT)
    parser.add_argument("--spy-seconds", type=float, default=2.0)
    parser.add_argument("--visible", action="store_true",
                        help="the consumer's drain of messages already visible, alone")
    parser.add_argument("--handoff-lead-ms", type=int, default=None, metavar="MS",
                        help="the delay server hands the slot to the broker this long ahead of "
                             "the due instant (handoff_lead_ms; default: the config's)")
    parser.add_argument("--due-after-ms", type=int, default=LEAD_MS, metavar="MS",
                        help="the due instant is the first whole second this long or more "
                             "after the first send (bench.peers' W2: 1,000 + twice the time "
                             "the sends take at W1's rate, ~2,500 ms)")
    args = parser.parse_args(argv)
    if args.visible:
        drains = []
        for run in range(1, args.runs + 1):
            drains.append(one_drain(args.messages))
            print(f"run {run}: drained {args.messages:,} in {drains[-1]['drain_ms']} ms; qmq up "
                  f"{drains[-1]['server_cpu_s']:.2f} CPU-s, consumer "
                  f"{drains[-1]['consumer_cpu_s']:.2f} CPU-s; missing {drains[-1]['missing']}; "
                  f"load average {os.getloadavg()[0]:.2f}", flush=True)
        print(f"median of {len(drains)}: drained in "
              f"{statistics.median(d['drain_ms'] for d in drains):.0f} ms", flush=True)
        return 0
    if args.spy:
        os.makedirs(args.spy, exist_ok=True)
    lead = ("" if args.handoff_lead_ms is None
            else f"; handoff_lead_ms {args.handoff_lead_ms}")
    if args.due_after_ms != LEAD_MS:
        lead += f"; due {args.due_after_ms} ms or more after the first send"
    print(f"bench.hot_slot: {args.messages:,} messages due at one instant, {args.runs} run(s)"
          f"{lead}; load average {os.getloadavg()[0]:.2f}", flush=True)
    runs = []
    for run in range(1, args.runs + 1):
        runs.append(one_run(args.messages, args.spy, args.py_spy, args.spy_seconds, run,
                            args.handoff_lead_ms, args.due_after_ms))
        _print_run(run, runs[-1])
    print(f"median of {len(runs)}: last received "
          f"{statistics.median(r['last_ms'] for r in runs):.0f} ms after the due instant; "
          f"qmq up CPU {statistics.median(r['server_cpu_s'] for r in runs):.2f} s; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
