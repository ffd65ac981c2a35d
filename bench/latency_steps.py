"""Where one message's latency goes at a fixed rate, step by step (issue 18, "latency at 2,000
msg/s"): send -> batch sent -> read by the broker -> handled -> commit begun -> commit ended ->
published (visible) -> pulled -> pull answer written -> read by the consumer -> received.

    python -m bench.latency_steps                   # 2,000 msg/s for 8 s, data dir in /tmp
    python -m bench.latency_steps --tmpfs           # data dir in /dev/shm: fsync costs ~nothing
    python -m bench.latency_steps --runs 3 --seconds 20
    python -m bench.latency_steps --no-trace        # qmq up --no-trace: what trace events cost
    python -m bench.latency_steps --count-loop      # + the server's loop iterations, callbacks
    python -m bench.latency_steps --long            # the loop's long callbacks and gc passes
    python -m bench.latency_steps --replicas 2      # one sync slave (same process), in sync first
    python -m bench.latency_steps --event-loop asyncio --config up.toml   # passed to qmq up

One fresh ``qmq up`` (flush sync) and the peers harness's consumer and fixed-rate producer
(``bench.peers.worker``), each started through ``bench._step_probe``, which notes when each
message passes each step (CLOCK_MONOTONIC, one clock for every process) and writes it down at
exit. Printed per run: p50 / p90 / p99 of each step's share, in ms; the server's CPU per
message by thread (event loop "main", the store thread, the pull-log thread, the rest); the
group commits with their messages each; the store thread's context switches per group commit
(each wait for the GIL is a voluntary one, as is each blocking system call); and where the
slowest 1% lost their time: how many 10 ms windows of send time they fall in, the busiest ones,
and the step that was longest for each (a few windows a second apart is a periodic stall of
the whole server, not a tail).
The commit step is split too (store thread): Python before the message log's sync, the sync,
and after it; where the write and fsync are one call (``OsFile.append_and_sync``, or the usual
commit's ``commit_run.write_run``, whose "sync" also holds the records' encoding in C) the sync
splits again into the kernel's write + fsync and the wait to take the GIL back after it. For
the slowest 1%, the median of each part of their commit.
A step's share is measured per message, so shares of consecutive steps add up to the whole only at the same message, not percentile by percentile.
The probes add a few us per request: the totals are a little above an unprobed run's
(bench.commit_cycle). Wall clock: state the load.
``--replicas 2`` adds one sync slave per group in the same process (its threads count in the
server's CPU, the slave's store thread with the master's); a send is then confirmed once the
slave has it, while the consumer may receive it before: the slave reaches send -> received
through the producer's linger (a batch waits, up to linger_ms, for the answer of the one on
the wire). ``--event-loop`` and ``--config`` are passed to ``qmq up``.
``--long`` runs the server without its step probes (their events are allocations and calls of
their own on the loop; the gc untracks them at its first pass, so they no longer pile up in the
older generations) and notes instead each event-loop callback and each loop-thread garbage
collection of at least 1 ms, wall or CPU, by name (a task by its coroutine): per name, how many
ran during the traffic and their wall / CPU ms; and for each of the slowest 1% the one of most CPU
that ran while it was in flight. Under load, wall times are mostly waits for a core: count the
callbacks long in CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from typing import Any

from bench._cluster import (
    percentile, process_cpu_s, start_process, thread_cpu_s, thread_switches,
)
from bench._step_probe import LONG_ENV, LONG_MS, LOOP_ENV, OUT_ENV
from bench.commit_cycle import _free_port, _histogram
from bench.delay import wait_registered
from bench.peers.servers import _QMQ_UP_READY, REPO_ROOT, wait_in_sync

SUBJECT = "rt.steps"
CONSUMER_READY = re.compile(r"^ready$")
WORKER_SLACK_S = 60.0
# (from, to, what happens in between), in the order a message lives them.
STEPS = (
    ("send", "batch_sent", "the producer's batching (linger)"),
    ("batch_sent", "arrived", "to the broker (wire, its read)"),
    ("arrived", "handled", "until the broker's handler runs"),
    ("handled", "commit_begun", "waiting for the group commit"),
    ("commit_begun", "commit_ended", "the commit on the store thread (fsync)"),
    ("commit_ended", "published", "back to the event loop"),
    ("published", "confirmed", "the answer to the producer"),
    ("published", "pulled", "the long poll wakes and records the pull"),
    ("pulled", "pull_written", "the pull answer built and written"),
    ("pull_written", "pull_read", "to the consumer (wire, its read)"),
    ("pull_read", "received", "the consumer hands it over"),
    ("send", "confirmed", "send -> confirmed (total)"),
    ("send", "received", "send -> received (total)"),
)
# The commit step split (store thread): before the message log's sync, the sync (the write
# and fsync in the kernel, then the wait to take the GIL back: apart only where they are one
# call, logstore.fileio.OsFile.append_and_sync), and after it.
COMMIT_STEPS = (
    ("commit_begun", "sync_begun", "commit: Python before the sync"),
    ("sync_begun", "synced", "commit: the sync (write, fsync, GIL back)"),
    ("sync_begun", "fsync_returned", "commit: write + fsync in the kernel"),
    ("fsync_returned", "synced", "commit: the GIL back after the fsync"),
    ("synced", "commit_ended", "commit: after the sync (index, dedup)"),
)
PROBED = ("server", "consumer", "producer")


def _probe_argv(role: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "bench._step_probe", role, *args]


def _worker_args(url: str, role: str, params: dict[str, Any], out: str) -> list[str]:
    return ["pyqmq", url, role, json.dumps(params), out]


def _steps(directory: str, count: int) -> dict[int, dict[str, int]]:
    """Each message's first time at each step, by its sequence number."""
    seen: dict[int, dict[str, int]] = {}
    for name in PROBED:
        with open(os.path.join(directory, f"{name}.steps"), "rb") as f:
            for step, ns, seqs in pickle.load(f):
                for seq in seqs:
                    if seq < count:  # the producer's warm-up message is ``count``
                        seen.setdefault(seq, {}).setdefault(step, ns)
    return seen


def _slowest(seen: dict[int, dict[str, int]], share: float = 0.01) -> dict[str, Any]:
    """Where the slowest ``share`` of the messages (send -> received) lost their time: how many
    10 ms windows of send time they fall in (few windows: stalls of the whole path, not a
    scattered tail), the start of the busiest windows in s from the first send, and for each
    step how many of those messages spent their longest step there."""
    timed = sorted((times["received"] - times["send"], times["send"], times)
                   for times in seen.values() if "send" in times and "received" in times)
    if not timed:
        return {"count": 0, "windows": 0, "busiest_s": [], "blamed": {}}
    first_ns = min(sent for _, sent, _ in timed)
    slow = timed[len(timed) - max(1, int(len(timed) * share)):]
    windows: dict[int, int] = {}
    blamed: dict[str, int] = {}
    for _, sent, times in slow:
        window = (sent - first_ns) // 10_000_000
        windows[window] = windows.get(window, 0) + 1
        longest = max(((times[then] - times[first], what) for first, then, what in STEPS[:11]
                       if first in times and then in times and then != "confirmed"),
                      default=(0, "?"))
        blamed[longest[1]] = blamed.get(longest[1], 0) + 1
    busiest = sorted(windows.items(), key=lambda item: -item[1])[:6]
    commit_split = {}
    for first, then, what in COMMIT_STEPS:
        shares = sorted((times[then] - times[first]) / 1e6 for _, _, times in slow
                        if first in times and then in times)
        if shares:
            commit_split[what] = percentile(shares, 0.5)
    return {"count": len(slow), "windows": len(windows),
            "busiest_s": sorted(window / 100 for window, _ in busiest),
            "blamed": dict(sorted(blamed.items(), key=lambda item: -item[1])),
            "commit_split_p50": commit_split}


def one_run(rate: int, seconds: float, tmpfs: bool, up_args: tuple[str, ...] = (),
            count_loop: bool = False, long: bool = False, replicas: int = 1) -> dict[str, Any]:
    """One fresh probed ``qmq up`` at ``rate`` msg/s for ``seconds`` (``up_args`` added to its
    command line; ``replicas`` > 1: its sync slaves, in the same process, in sync before the
    first send): the module doc's figures."""
    count = int(rate * seconds)
    metrics_port = _free_port()
    directory = tempfile.mkdtemp(prefix="qmq-steps-", dir="/dev/shm" if tmpfs else None)
    out = {name: os.path.join(directory, f"{name}.steps") for name in PROBED}
    timeout_s = seconds * 4 + WORKER_SLACK_S
    env = dict(os.environ)
    try:
        os.environ[OUT_ENV] = out["server"]  # start_process passes our environment on
        if count_loop:
            os.environ[LOOP_ENV] = "1"
        if long:
            os.environ[LONG_ENV] = "1"
        server = start_process("qmq up", _probe_argv("server", [
            "--log-level", "warning", "up", "--data-dir", os.path.join(directory, "qmq"),
            "--host", "127.0.0.1", "--meta-port", "0", "--realtime-port", "0",
            "--delay-port", "0", "--flush", "sync", "--replicas", str(replicas), *up_args,
            "--realtime-metrics-port", str(metrics_port)]), _QMQ_UP_READY, cwd=REPO_ROOT)
        try:
            url = f"http://{server.address}"
            wait_registered(url)
            if replicas > 1:
                wait_in_sync(url)
            os.environ[OUT_ENV] = out["consumer"]
            os.environ.pop(LOOP_ENV, None)
            os.environ.pop(LONG_ENV, None)
            consumer = start_process("consumer", _probe_argv("client", _worker_args(
                url, "consume", {"subject": SUBJECT, "count": count, "timeout_s": timeout_s,
                                 "delayed": False}, os.path.join(directory, "c.json"))),
                CONSUMER_READY, address="-", cwd=REPO_ROOT)
            try:
                threads_before = thread_cpu_s(server.pid)
                switches_before = thread_switches(server.pid)
                consumer_before_s = process_cpu_s(consumer.pid)
                produced = subprocess.run(_probe_argv("client", _worker_args(
                    url, "produce_rate", {"subject": SUBJECT, "count": count, "rate_per_s": rate,
                                          "cpu_pids": [server.pid]},
                    os.path.join(directory, "p.json"))), cwd=REPO_ROOT, capture_output=True,
                    text=True, timeout=timeout_s, check=False,
                    env={**env, OUT_ENV: out["producer"]})
                if produced.returncode != 0:
                    raise RuntimeError(f"producer failed: {produced.stdout[-2000:]}"
                                       f"{produced.stderr[-2000:]}")
                reaped = os.times()  # the producer's CPU is in it, the consumer's not yet
                consumer.process.wait(timeout=timeout_s)
                threads = thread_cpu_s(server.pid)
                switches = thread_switches(server.pid)
                # Its whole life, once reaped, less what it had used before the first send.
                times = os.times()
                consumer_cpu_s = (times.children_user + times.children_system
                                  - reaped.children_user - reaped.children_system
                                  - consumer_before_s)
            finally:
                consumer.stop()
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                        timeout=10) as response:
                metrics = response.read().decode()
        finally:
            server.stop()  # SIGTERM: the probe writes its file at exit
        with open(os.path.join(directory, "c.json"), encoding="utf-8") as f:
            received = json.load(f)["received"]
        seen = _steps(directory, count)
        loop_counts: dict[str, int] = {}
        if count_loop:
            with open(out["server"] + ".loop", "rb") as f:
                loop_counts = pickle.load(f)
        long_noted: dict[str, Any] = {}
        if long:
            with open(out["server"] + ".long", "rb") as f:
                long_noted = pickle.load(f)
    finally:
        os.environ.clear()
        os.environ.update(env)
        shutil.rmtree(directory, ignore_errors=True)
    _, fsync_s, commits = _histogram(metrics, "qmq_realtime_fsync_seconds")
    by_thread: dict[str, float] = {}
    for name, cpu_s in threads.items():
        key = name if name == "main" or name.startswith("realtime-") else "other"
        by_thread[key] = by_thread.get(key, 0.0) + (cpu_s - threads_before.get(name, 0.0))
    # The store thread's context switches per commit: each wait for the GIL is one.
    store_switches = [0, 0]
    for name, counts in switches.items():
        if name.startswith("realtime-store"):
            before = switches_before.get(name, (0, 0))
            store_switches = [store_switches[0] + counts[0] - before[0],
                              store_switches[1] + counts[1] - before[1]]
    steps = {}
    for first, then, what in STEPS + COMMIT_STEPS:
        shares = sorted((times[then] - times[first]) / 1e6 for times in seen.values()
                        if first in times and then in times)
        if not shares and "fsync_returned" in (first, then):
            continue  # no mark of the fsync's return: a tree before it, or no C twin
        steps[what] = (len(shares), *(percentile(shares, f) for f in (0.5, 0.9, 0.99)))
    requests = {op: float(n) for op, n in re.findall(
        r'qmq_realtime_requests_total\{op="([a-z_]+)"\} ([0-9.e+]+)', metrics)}
    return {"steps": steps, "received": received, "count": count,
            "requests_per_msg": {op: n / count for op, n in requests.items()},
            "consumer_cpu_us": consumer_cpu_s / count * 1e6,
            "cpu_us_by_thread": {k: v / count * 1e6 for k, v in by_thread.items()},
            "commits": commits, "fsync_mean_ms": fsync_s / max(1.0, commits) * 1e3,
            "store_switches_per_commit": [n / max(1.0, commits) for n in store_switches],
            "slowest": _slowest(seen), "load_1min": os.getloadavg()[0],
            "loop_per_msg": {what: n / count for what, n in loop_counts.items()},
            "long": _long_callbacks(long_noted, seen) if long else {}}


def _long_callbacks(long_noted: dict[str, Any], seen: dict[int, dict[str, int]]
                    ) -> dict[str, Any]:
    """The loop's long callbacks and collections noted while messages were in flight (first
    send to last receipt), by name: how many, how many of them long in CPU, and their wall /
    CPU ms (median, max); and for each of the slowest 1% the noted one of most CPU that ran
    between its send and its receipt (the stall it waited behind, if any)."""
    begun = min(times["send"] for times in seen.values() if "send" in times)
    ended = max(times["received"] for times in seen.values() if "received" in times)
    spans = [(at, at + wall_ns, wall_ns / 1e6, cpu_ns / 1e6, name)
             for name, at, wall_ns, cpu_ns in long_noted["noted"] if begun <= at <= ended]
    by_name: dict[str, list[tuple[float, float]]] = {}
    for _, _, wall_ms, cpu_ms, name in spans:
        by_name.setdefault(name, []).append((wall_ms, cpu_ms))
    timed = sorted((times["received"] - times["send"], times["send"], times["received"])
                   for times in seen.values() if "send" in times and "received" in times)
    behind: dict[str, int] = {}
    for _, sent, received in timed[len(timed) - max(1, len(timed) // 100):]:
        overlapping = [(cpu_ms, name) for start, end, _, cpu_ms, name in spans
                       if start < received and end > sent]
        name = max(overlapping)[1] if overlapping else "none"
        behind[name] = behind.get(name, 0) + 1
    summary = {}
    for name, rows in by_name.items():
        walls, cpus = sorted(w for w, _ in rows), sorted(c for _, c in rows)
        summary[name] = (len(rows), sum(c >= LONG_MS for c in cpus), percentile(walls, 0.5),
                         walls[-1], percentile(cpus, 0.5), cpus[-1])
    return {"seconds": (ended - begun) / 1e9, "callbacks": long_noted["callbacks"],
            "slowest_behind": dict(sorted(behind.items(), key=lambda item: -item[1])),
            "by_name": summary}


def _lines(f: dict[str, Any]) -> list[str]:
    lines = [f"received {f['received']:,} of {f['count']:,}; {f['commits']:,.0f} commits of "
             f"{f['count'] / max(1.0, f['commits']):.2f} msg, fsync mean "
             f"{f['fsync_mean_ms']:.2f} ms; load {f['load_1min']:.2f}",
             "server CPU us/msg by thread: " + ", ".join(
                 f"{name} {us:.0f}" for name, us in sorted(f["cpu_us_by_thread"].items(),
                                                         key=lambda item: -item[1])),
             "store thread context switches per commit: voluntary {:.2f}, involuntary "
             "{:.2f}".format(*f["store_switches_per_commit"]),
             f"consumer process CPU {f['consumer_cpu_us']:.0f} us/msg; requests per message: "
             + ", ".join(f"{op} {n:.3f}" for op, n in sorted(f["requests_per_msg"].items()))]
    for what, (seen, p50, p90, p99) in f["steps"].items():
        lines.append(f"{what:<44} p50 {p50:7.3f}  p90 {p90:7.3f}  p99 {p99:8.3f} ms"
                     f"  ({seen:,} msgs)")
    slow = f["slowest"]
    lines.append(f"slowest 1% ({slow['count']} msgs): sent in {slow['windows']} windows of 10 ms; "
                 "busiest at " + ", ".join(f"{s:.2f}" for s in slow["busiest_s"])
                 + " s; longest step: " + ", ".join(f"{what} {n}"
                                                   for what, n in slow["blamed"].items()))
    if slow.get("commit_split_p50"):
        lines.append("  their commit, p50 of each part: " + ", ".join(
            f"{what[len('commit: '):]} {ms:.3f} ms"
            for what, ms in slow["commit_split_p50"].items()))
    if f["loop_per_msg"]:  # the server's whole life (start, warm-up, stop): a little high
        lines.append("event loop per message: " + ", ".join(
            f"{what} {n:.2f}" for what, n in sorted(f["loop_per_msg"].items(),
                                                     key=lambda item: -item[1]) if n >= 0.01))
    if f["long"]:
        long = f["long"]
        lines.append(f"loop callbacks or loop-thread gc of >= {LONG_MS:g} ms (wall or CPU) in "
                     f"the {long['seconds']:.1f} s of traffic ({long['callbacks']:,} callbacks "
                     "in the server's life): count, of them long in CPU, wall p50 / max, CPU "
                     "p50 / max ms:")
        lines.append("  the slowest 1% each behind (the noted one of most CPU during its "
                     "send -> received): " + ", ".join(
                         f"{name} {n}" for name, n in long["slowest_behind"].items()))
        for name, (n, n_cpu, w50, wmax, c50, cmax) in sorted(
                long["by_name"].items(), key=lambda item: (-item[1][1], -item[1][0])):
            lines.append(f"  {n:5d} {n_cpu:5d}  {w50:6.2f} {wmax:6.2f}  {c50:6.2f} {cmax:6.2f}  "
                         + name)
    return lines


def main(argv: list[str] | None = None) -> int:
    """Run the measurement; prints each run's table."""
    parser = argparse.ArgumentParser(prog="python -m bench.latency_steps", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=int, default=2_000, help="msg/s")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--tmpfs", action="store_true", help="data dir in /dev/shm")
    parser.add_argument("--no-trace", action="store_true",
                        help="qmq up --no-trace: what the trace events cost the path")
    parser.add_argument("--count-loop", action="store_true",
                        help="count the server's event-loop iterations, callbacks, tasks and "
                             "futures per message (slows the loop: its CPU figures not quoted)")
    parser.add_argument("--long", action="store_true",
                        help=f"note the server's loop callbacks and gc passes of >= {LONG_MS:g} "
                             "ms, by name (slows the loop a little: CPU figures not quoted)")
    parser.add_argument("--replicas", type=int, default=1,
                        help="qmq up --replicas: 2 adds one sync slave per group (same process)")
    parser.add_argument("--event-loop", choices=("auto", "uvloop", "asyncio"),
                        help="qmq up --event-loop (default: qmq up's own)")
    parser.add_argument("--config", help="qmq up --config FILE (e.g. preallocate_step_bytes)")
    args = parser.parse_args(argv)
    if args.event_loop == "uvloop" and (args.long or args.count_loop):
        parser.error("--long and --count-loop probe asyncio's own loop classes: not with "
                     "--event-loop uvloop")
    up_args = [*(("--no-trace",) if args.no_trace else ()),
               *(("--event-loop", args.event_loop) if args.event_loop else ()),
               *(("--config", os.path.abspath(args.config)) if args.config else ())]
    print(f"qmq up ({'tmpfs' if args.tmpfs else 'disk'} data dir, flush sync, replicas "
          f"{args.replicas}{' ' + ' '.join(up_args) if up_args else ''}), probed, "
          f"{args.rate:,} msg/s for {args.seconds:g} s:", flush=True)
    for number in range(args.runs):
        figures = one_run(args.rate, args.seconds, args.tmpfs, tuple(up_args), args.count_loop,
                          args.long, args.replicas)
        print(f"  run {number + 1}: " + "\n    ".join(_lines(figures)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
