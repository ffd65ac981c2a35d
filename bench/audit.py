"""Audit benchmark: time ``qmq audit`` over synthetic traces on ``local[2]``, with the goals.

Generates a realistic trace with ``tracelog.events.TraceWriter`` (one realtime and one delay
server per generator process, the writer clock following the simulated time so files rotate
hourly over about 3 hours), then runs ``qmq audit`` in a fresh process, as a user would, and
times it, JVM start included. Each size runs ``--runs`` times; the median is compared with the
goal, and the load average is printed beside it (the machine is shared: say so with a figure).

Mix per message: produced, stored, pulled, acked (one group per subject, 16 subjects, each
subscribed at the start); 5% are delayed (+ scheduled, dispatched, lateness 0-50 ms); 2% are
nacked once and succeed on a retry copy 5 s later (+ nacked, retried, scheduled, dispatched,
stored, pulled, acked); 0.1% are nacked twice and dead-lettered. On the first subject, every
other message is tagged ``vip`` and a second group subscribed with the filter ``vip`` takes
those (so the subscription rules run). The audit must find 0 lost, 0 overdue, 0 early and
exactly the dead ones.

    python -m bench.audit                    # 10k events (3 runs), then 10M (1 run)
    python -m bench.audit --sizes 10000 --runs 5
    python -m bench.audit --sizes 1000000 --keep /tmp/trace
    python -m bench.audit --sizes 10000 --class-archive-dir off   # without the JVM archive

Before the timed runs, when the driver JVM's class-data-sharing archive
(``spark_audit.class_archive``) or its top layer is not built yet, an untimed audit records the
class list (then another the top layer) and the benchmark waits for the detached builder,
printing both times: the timed runs are then those of every audit after the first two on the
machine.

Goals (issue 14): 10k events in <= 15 s and 10M events in <= 120 s on local[2].
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tracelog.events import subscription_event, trace_event
from tracelog.writer import TraceWriter  # noqa: E402

START_MS = 1_767_225_600_000  # 2026-01-01T00:00:00Z
SPAN_MS = 3 * 3_600_000  # simulated time the trace covers
SUBJECTS = [f"bench.subject.{i}" for i in range(16)]
DELAYED_SHARE, RETRIED_SHARE, DEAD_SHARE = 0.05, 0.02, 0.001
EVENTS_PER_MESSAGE = 4 + 2 * DELAYED_SHARE + 7 * RETRIED_SHARE + 9 * DEAD_SHARE
RETRY_DELAY_MS = 5_000
DEADLINE_MS = 300_000
SEED = 20260101
GOALS_S = {10_000: 15, 10_000_000: 120}  # events -> wall-time goal of one audit, seconds
DEFAULT_RUNS = {10_000: 3, 10_000_000: 1}
VIP_SUBJECT = SUBJECTS[0]


class SimClock:
    """The writers' clock: the simulated time of the latest event."""

    def __init__(self) -> None:
        self.now_ms = START_MS

    def __call__(self) -> int:
        return self.now_ms


def _subscriptions(worker: int) -> list[tuple[str, dict]]:
    """Every group subscribes at the start; the vip group with its tag filter."""
    out = [("r", subscription_event("subscribed", ts_ms=START_MS, subject=s, group=s + ".g",
                                    consumer=f"c1-{worker}")) for s in SUBJECTS]
    out.append(("r", subscription_event("subscribed", ts_ms=START_MS, subject=VIP_SUBJECT,
                                        group=VIP_SUBJECT + ".vip", consumer=f"v1-{worker}",
                                        tags=["vip"])))
    return out


def _vip_events(msg_id: str, t: int) -> list[tuple[str, dict]]:
    """The vip group's pull and ack of a vip message stored at ``t``."""
    common = dict(subject=VIP_SUBJECT, group=VIP_SUBJECT + ".vip", consumer="v1",
                  created_at_ms=t)
    return [("r", trace_event("pulled", ts_ms=t + 3, msg_id=msg_id, **common)),
            ("r", trace_event("acked", ts_ms=t + 4, msg_id=msg_id, **common))]


def _message_events(rng: random.Random, msg_id: str, subject: str, t: int) -> list[dict]:
    """One message's events (realtime and delay server mixed), in time order."""
    group, root = subject + ".g", msg_id
    roll = rng.random()
    deliver_at = t + rng.randint(1_000, 60_000) if roll < DELAYED_SHARE else None
    ready = t if deliver_at is None else deliver_at + rng.randint(0, 50)
    common = dict(subject=subject, created_at_ms=t, deliver_at_ms=deliver_at)
    vip = subject == VIP_SUBJECT and deliver_at is None and rng.random() < 0.5
    tags = ["vip"] if vip else None
    out = [("d" if deliver_at else "r", trace_event("produced", ts_ms=t, msg_id=msg_id,
                                                    tags=tags, **common))]
    if vip:
        out += _vip_events(msg_id, t)
    if deliver_at is not None:
        out.append(("d", trace_event("scheduled", ts_ms=t + 1, msg_id=msg_id, **common)))
        out.append(("d", trace_event("dispatched", ts_ms=ready, msg_id=msg_id, **common)))
    out.append(("r", trace_event("stored", ts_ms=ready + 1, msg_id=msg_id, **common)))
    pulled = ready + 1 + rng.randint(0, 20)
    out.append(("r", trace_event("pulled", ts_ms=pulled, msg_id=msg_id, group=group,
                                 consumer="c1", **common)))
    dead = roll > 1 - DEAD_SHARE
    if roll > 1 - RETRIED_SHARE - DEAD_SHARE:  # retried once; the dead ones fail again
        copy_id, copy_at = msg_id + ".r1", pulled + 5 + RETRY_DELAY_MS
        copy = dict(subject=subject, origin_id=msg_id, group=group, created_at_ms=pulled + 5,
                    deliver_at_ms=copy_at, retries=1)
        out += [("r", trace_event("nacked", ts_ms=pulled + 5, msg_id=msg_id, group=group,
                                  consumer="c1", **common)),
                ("r", trace_event("retried", ts_ms=pulled + 6, msg_id=copy_id, **copy)),
                ("d", trace_event("scheduled", ts_ms=pulled + 7, msg_id=copy_id, **copy)),
                ("d", trace_event("dispatched", ts_ms=copy_at + 3, msg_id=copy_id, **copy)),
                ("r", trace_event("stored", ts_ms=copy_at + 4, msg_id=copy_id, **copy)),
                ("r", trace_event("pulled", ts_ms=copy_at + 6, msg_id=copy_id, consumer="c2",
                                  **copy))]
        msg_id, pulled, common = copy_id, copy_at + 6, {**copy}
        common.pop("group")
        if dead:
            out += [("r", trace_event("nacked", ts_ms=pulled + 1, msg_id=msg_id, group=group,
                                      consumer="c2", **common)),
                    ("r", trace_event("dead", ts_ms=pulled + 2, msg_id=root + ".r2",
                                      group=group, **{**common, "retries": 2}))]
            return out
    out.append(("r", trace_event("acked", ts_ms=pulled + 2, msg_id=msg_id, group=group,
                                 consumer="c2" if ".r" in msg_id else "c1", **common)))
    return out


def generate(worker: int, workers: int, events_target: int, directory: str) -> tuple[int, float]:
    """Write about events_target / workers events; returns (events, seconds)."""
    rng = random.Random(SEED + worker)
    clock = SimClock()
    writers = {kind: TraceWriter(directory, f"{name}-{worker}", clock_ms=clock, background=False)
               for kind, name in (("r", "realtime:rt"), ("d", "delay:d"))}
    messages = max(1, int(events_target / workers / EVENTS_PER_MESSAGE))
    step_ms = SPAN_MS / messages
    written = 0
    started = time.perf_counter()
    for kind, event in _subscriptions(worker):
        writers[kind].emit(event)
        written += 1
    for i in range(messages):
        t = START_MS + int(i * step_ms)
        clock.now_ms = t
        for kind, event in _message_events(rng, f"w{worker}-{i}", SUBJECTS[i % len(SUBJECTS)], t):
            writers[kind].emit(event)
            written += 1
        if i % 2_000 == 0:
            for writer in writers.values():
                writer.flush()
    for writer in writers.values():
        writer.close()
    return written, time.perf_counter() - started


def _generate_star(args: tuple[int, int, int, str]) -> tuple[int, float]:
    return generate(*args)


def disk_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path)
               for f in files)


def write_trace(events_target: int, workers: int, trace: str) -> int:
    """Generate the trace; returns its event count (and prints what it wrote)."""
    started = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        results = pool.map(_generate_star, [(w, workers, events_target, trace)
                                            for w in range(workers)])
    events = sum(n for n, _ in results)
    size = disk_bytes(trace)
    per_process = sum(n / s for n, s in results) / len(results)
    print(f"trace: {events:,} events, {size / 1e6:,.1f} MB ({size / events:.0f} B/event), "
          f"written in {time.perf_counter() - started:.1f} s; TraceWriter {per_process:,.0f} "
          f"events/s per process")
    return events


CPU_SAMPLE_S = 0.25  # how often the audit's process tree is sampled for its CPU time


# Where the audit's CPU goes, by thread name (/proc/<pid>/task/<tid>/comm, at most 15
# characters): the first prefix that matches names the kind. The JVM's compilers and the Spark
# tasks are the usual suspects; "driver" is the py4j threads that plan the queries.
THREAD_KINDS = (
    ("JIT C2", ("C2 CompilerThre",)),
    ("JIT C1", ("C1 CompilerThre",)),
    ("tasks", ("Executor task",)),  # "Executor task launch worker..." as the JVM shortens it
    ("driver (py4j)", ("Thread-",)),
    ("GC", ("GC Thread", "G1 ", "VM Thread")),
    ("python", ("python",)),
    ("JVM main", ("java",)),
)


def thread_kind(name: str) -> str:
    """The THREAD_KINDS kind of a thread named ``name``, else "other"."""
    for kind, prefixes in THREAD_KINDS:
        if name.startswith(prefixes):
            return kind
    return "other"


def _stat_fields(path: str) -> tuple[str, list[str]] | None:
    """(name, the fields after it) of a /proc stat file, or None if it is gone."""
    try:
        with open(path) as file:
            text = file.read()
    except OSError:
        return None
    return text[text.index("(") + 1:text.rindex(")")], text.rsplit(")", 1)[1].split()


def _tree_cpu_ticks(root: int, seen: dict[int, int],
                    threads: dict[tuple[int, int], tuple[str, int]] | None = None) -> None:
    """Record in ``seen`` the CPU ticks (user + system) of ``root`` and its descendants (the
    JVM is a child of the qmq process, reparented when it exits, so rusage misses it), and in
    ``threads`` (if given) each of their threads' name and ticks."""
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        stat = _stat_fields(f"/proc/{name}/stat")
        if stat is None:
            continue
        parents[int(name)] = int(stat[1][1])
        ticks[int(name)] = int(stat[1][11]) + int(stat[1][12])
    tree = {root}
    for _ in range(4):  # qmq -> java, and any helper of either
        tree |= {pid for pid, parent in parents.items() if parent in tree}
    for pid in tree & ticks.keys():
        seen[pid] = max(seen.get(pid, 0), ticks[pid])
        if threads is not None:
            _thread_ticks(pid, threads)


def _thread_ticks(pid: int, threads: dict[tuple[int, int], tuple[str, int]]) -> None:
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return
    for tid in tids:
        stat = _stat_fields(f"/proc/{pid}/task/{tid}/stat")
        if stat is not None:
            name, fields = stat
            used = int(fields[11]) + int(fields[12])
            threads[(pid, int(tid))] = (name, max(threads.get((pid, int(tid)), ("", 0))[1], used))


def cpu_by_kind(threads: dict[tuple[int, int], tuple[str, int]]) -> dict[str, float]:
    """CPU seconds per ``thread_kind``, largest first."""
    kinds: dict[str, float] = {}
    for name, used in threads.values():
        kind = thread_kind(name)
        kinds[kind] = kinds.get(kind, 0.0) + used / os.sysconf("SC_CLK_TCK")
    return dict(sorted(kinds.items(), key=lambda item: -item[1]))


def audit_once(trace: str, out: str, args: argparse.Namespace) -> tuple[float, float, str]:
    """One ``qmq audit`` in a fresh process: (wall seconds, CPU seconds of the process and its
    JVM, its verdict line). CPU time varies far less with the machine's load than wall time.
    Prints the CPU by kind of thread (``cpu_by_kind``)."""
    command = [sys.executable, "-m", "qmq", "--log-level", "warning", "audit",
               "--trace-dir", trace, "--out", out, "--master", args.master,
               "--driver-memory", args.driver_memory, "--deadline-ms", str(DEADLINE_MS),
               "--class-archive-dir", args.class_archive_dir]
    for setting in args.conf:
        command += ["--conf", setting]
    seen: dict[int, int] = {}
    threads: dict[tuple[int, int], tuple[str, int]] = {}
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out_file, tempfile.TemporaryFile("w+") as err_file:
        proc = subprocess.Popen(command, stdout=out_file, stderr=err_file, text=True)
        while proc.poll() is None:  # bounded by the audit's own run
            _tree_cpu_ticks(proc.pid, seen, threads)
            time.sleep(CPU_SAMPLE_S)
        seconds = time.perf_counter() - started
        out_file.seek(0)
        err_file.seek(0)
        stdout, stderr = out_file.read(), err_file.read()
    # Sampled: the last CPU_SAMPLE_S of each process (its shutdown) is not counted.
    cpu_s = sum(seen.values()) / os.sysconf("SC_CLK_TCK")
    print("    CPU by thread: " + ", ".join(f"{kind} {seconds:.1f} s"
                                           for kind, seconds in cpu_by_kind(threads).items()))
    if args.verbose:
        print("\n".join(line for line in stderr.splitlines() if line.startswith("[")))
    verdict = stdout.splitlines()[0] if stdout else stderr[-3000:]
    if proc.returncode != 0:
        raise SystemExit(f"qmq audit exited {proc.returncode}: {verdict}")
    return seconds, cpu_s, verdict


ARCHIVE_BUILD_WAIT_S = 1_800  # the dump took ~4 min of wall time on a loaded 2-core machine


def _archive_settled(archive) -> bool:
    """Whether the class archive and its top layer are built (or failed for good)."""
    if os.path.exists(archive.failed_path):
        return True
    return archive.ready() and (os.path.isfile(archive.top_path)
                                or os.path.exists(archive.top_failed_path))


def warm_up(trace: str, out: str, args: argparse.Namespace) -> None:
    """Until the class archive and its top layer are built: one audit (it records the class
    list, or the top layer once the archive is there, and starts the builder), then wait for
    the builder; each printed, none counted."""
    from spark_audit.class_archive import plan  # lazily: imports pyspark

    archive = plan(args.class_archive_dir)
    for _ in range(2):  # the class list, then the top layer
        if archive is None or _archive_settled(archive):
            return
        top = archive.ready()
        what, path = (("top layer", archive.top_path) if top
                      else ("JVM's class list", archive.archive_path))
        seconds, cpu_s, _ = audit_once(trace, out, args)
        print(f"  warm-up audit (records the {what}): {seconds:.1f} s, CPU {cpu_s:.1f} s")
        started = time.perf_counter()
        failed = archive.top_failed_path if top else archive.failed_path
        while not (os.path.isfile(path) or os.path.exists(failed)):
            if time.perf_counter() - started > ARCHIVE_BUILD_WAIT_S:
                print(f"  class archive ({what}): not built in time; timed runs go without it")
                return
            time.sleep(1)
        state = "built" if os.path.isfile(path) else f"FAILED (see {failed})"
        print(f"  class archive ({what}) {state} in {time.perf_counter() - started:.0f} s "
              f"after the warm-up: {path}")


def bench_size(events_target: int, runs: int, args: argparse.Namespace, base: str) -> bool:
    """Generate a trace of about ``events_target`` events and audit it ``runs`` times; print
    every time, the median and the goal. True if the goal (if any) is met."""
    trace, out = os.path.join(base, f"trace-{events_target}"), os.path.join(base, "out")
    shutil.rmtree(trace, ignore_errors=True)  # a kept directory would be appended to
    events = write_trace(events_target, args.workers, trace)
    warm_up(trace, out, args)
    times, cpu_times = [], []
    for run in range(runs):
        load = os.getloadavg()[0]
        seconds, cpu_s, verdict = audit_once(trace, out, args)
        times.append(seconds)
        cpu_times.append(cpu_s)
        print(f"  run {run + 1}/{runs}: {seconds:.1f} s ({events / seconds:,.0f} events/s), "
              f"CPU {cpu_s:.1f} s, "
              f"load average {load:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} "
              f"CPUs; {verdict}")
    median = statistics.median(times)
    goal = GOALS_S.get(events_target)
    verdict = "" if goal is None else (f"   goal: <= {goal} s: "
                                       f"{'met' if median <= goal else 'NOT met'}")
    print(f"qmq audit ({args.master}, driver {args.driver_memory}) of {events:,} events: "
          f"median {median:.1f} s of {runs} (min {min(times):.1f}, max {max(times):.1f}), "
          f"CPU median {statistics.median(cpu_times):.1f} s{verdict}")
    return goal is None or median <= goal


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(GOALS_S),
                        help="trace sizes in events (default: the goals' 10k and 10M)")
    parser.add_argument("--runs", type=int, default=None,
                        help="audits per size (default 3 for 10k, 1 for 10M, else 1)")
    parser.add_argument("--workers", type=int, default=2, help="generator processes")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--driver-memory", default="6g")
    parser.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE",
                        help="a Spark setting passed to qmq audit (repeatable; for experiments)")
    parser.add_argument("--class-archive-dir", default=None, metavar="DIR",
                        help="qmq audit's --class-archive-dir (default: its own default; "
                             "'off': no JVM class archive)")
    parser.add_argument("--keep", default=None, help="write the traces here and keep them")
    parser.add_argument("--verbose", action="store_true", help="print the audit's progress")
    args = parser.parse_args()
    if args.class_archive_dir is None:
        from spark_audit.class_archive import default_directory  # lazily: imports pyspark

        args.class_archive_dir = default_directory()
    base = args.keep or tempfile.mkdtemp(prefix="qmq-bench-audit-")
    try:
        met = [bench_size(size, args.runs or DEFAULT_RUNS.get(size, 1), args, base)
               for size in args.sizes]
        return 0 if all(met) else 1
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
