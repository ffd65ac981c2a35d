"""Where a ``sync`` commit waits for its slave, step by step (issue 18, "measure every figure
with and without a slave"): for each commit of the realtime broker's message log and of the
delay server's delay log, the time from the master's commit (its fsync done, on the store
thread) to the waiting senders resuming, split in the steps of docs/REPLICATION.md 8.3.

    python -m bench.replication_wait                      # 2,000 sends/s, then W1-like delays
    python -m bench.replication_wait --seconds 10 --rate 2000 --delayed 20000

One fresh ``qmq up --replicas 2`` (flush sync; each group a master and one ``sync`` slave in
the same process), started through this module (``server``), which wraps the replication steps
by name (``ReplicaSource.fetch``/``_answer``/``_answer_now``/``advanced``/``wait_replicated``/
``park_replicated``,
a parked fetch's ``ParkedFetch.answer``,
``Follower._request``, the slave's ``apply_position_io``, the two
commits' store calls) and notes when each happens (CLOCK_MONOTONIC, one process) per (log,
offset). At exit it writes them to ``QMQ_REPL_PROBE_OUT``. The driver runs the peers harness's
fixed-rate producer on a realtime subject, then its 32-in-flight delayed producer (W1's shape),
stops the server and matches, per commit end E: the first fetch answer that ships E, the
slave's apply of it, the slave's next fetch (at or past E), the master's receipt of it, and the
first waiting sender's resumption.

Steps printed (p50 / p90 / p99 / mean in ms, over the commits that waited):
  (master commit) the master's store call (append, fsync): before the wait, not in the total
  commit->loop    the store call's end to the event loop's ``advanced`` (the commit published)
  wake            ``advanced`` to the parked fetch reading (or ``-`` when no fetch was parked)
  read            the fetch's answer made (``_answer_now``, ``_answer``): from memory (a parked
                  fetch: inside ``advanced``), or queued for the master's store thread and read
                  there
  answer->slave   the answer returned by ``fetch`` to the slave's ``_request`` returning
                  (encode, socket, the slave's read and decode)
  slave->thread   the answer in hand to the slave's store thread starting the append
  write+fsync     the append and fsync on the slave's store thread
  ->next fetch    back to the slave's loop and its next fetch sent
  fetch->master   that fetch to the master's ``fetch`` (wire)
  ->resumed       the master's ack to the first waiting sender resuming
  total           the commit's end to that sender resuming
  ->next commit   that sender resumed to the next commit's store call beginning (the answers
                  written, the producer's next sends read and checked; ``-`` for the last)
  (round)         the commit's store call beginning to the next one's: with all of W1's 32
                  sends in one commit, a round of the producer (not in the total)

Also printed: W1's sends/s and the ``qmq up`` process's CPU per send in each phase (the probes
add a few us per step to it). A benchmark's instrument, not an API: it fails at start when a
probed name moved. Wall clock on a shared machine: state the load.
"""

from __future__ import annotations

import argparse
import atexit
import bisect
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

OUT_ENV = "QMQ_REPL_PROBE_OUT"
LOGS = ("message", "delay")  # the logs whose commits senders wait for (the realtime, the delay)
SUBJECT = "rt.replwait"
WORKER_SLACK_S = 60.0
_EVENTS: list[tuple[Any, ...]] = []  # (step, log, a, b, ns): list.append holds the GIL
_now = time.monotonic_ns


def _wrap(owner: Any, name: str, make: Callable[[Any], Any]) -> None:
    original = getattr(owner, name)  # AttributeError at start when a probed name moved
    setattr(owner, name, make(original))


def install() -> None:
    """Wrap the steps of the module doc (the server process)."""
    import serverkit.follower as follower
    import serverkit.parked_fetch as parked_fetch
    import serverkit.replica_source as source
    from delayserver.scheduler import Scheduler
    from realtime.sends import Sends

    add = _EVENTS.append

    def commit_rt(original: Any) -> Any:
        def probed(self: Any, batch: Any, now_ms: int) -> Any:
            begun = _now()
            result = original(self, batch, now_ms)
            add(("commit", "message", result[1], begun, _now()))
            return result
        return probed

    def commit_delay(original: Any) -> Any:
        def probed(self: Any, batch: Any) -> Any:
            begun = _now()
            result = original(self, batch)
            add(("commit", "delay", result[1], begun, _now()))
            return result
        return probed

    def advanced(original: Any) -> Any:
        def probed(self: Any, name: str, end: int) -> None:
            if end > self.ends.get(name, 0):
                add(("advanced", name, end, 0, _now()))
            original(self, name, end)
        return probed

    def wait_replicated(original: Any) -> Any:
        async def probed(self: Any, name: str, end: int) -> None:
            await original(self, name, end)
            add(("resumed", name, end, 0, _now()))
        return probed

    def park_replicated(original: Any) -> Any:
        def probed(self: Any, name: str, end: int, done: Any) -> None:
            def resumed(error: Any) -> None:  # the parked sender answered (a realtime send)
                add(("resumed", name, end, 0, _now()))
                done(error)
            original(self, name, end, resumed)
        return probed

    def fetch(original: Any) -> Any:
        async def probed(self: Any, request: Any) -> Any:
            add(("fetch_in", request.log, request.offset, 0, _now()))
            answer = await original(self, request)
            if type(answer) is dict:  # else parked: noted when answered (parked_answer)
                add(("fetch_out", request.log, request.offset, answer.get("next_offset", 0),
                     _now()))
            return answer
        return probed

    def parked_answer(original: Any) -> Any:
        def probed(self: Any, outcome: Any) -> None:
            if type(outcome) is dict:
                add(("fetch_out", self.request.log, self.request.offset,
                     outcome.get("next_offset", 0), _now()))
            original(self, outcome)
        return probed

    # The answer ``_answer_now`` gave last: ``_answer`` calls it first, and notes only an
    # answer read from the store (one "read" per answer).
    given_now: list[Any] = [None]

    def answer_now(original: Any) -> Any:
        def probed(self: Any, log_: Any, request: Any) -> Any:
            begun = _now()
            result = given_now[0] = original(self, log_, request)
            if result is not None:
                add(("read", log_.name, request.offset, result.next_offset, begun, _now()))
            return result
        return probed

    def answer(original: Any) -> Any:
        async def probed(self: Any, log_: Any, request: Any) -> Any:
            begun = _now()
            result = await original(self, log_, request)
            if result is not given_now[0]:
                add(("read", log_.name, request.offset, result.next_offset, begun, _now()))
            return result
        return probed

    def request(original: Any) -> Any:
        async def probed(self: Any, op: dict, timeout_ms: int) -> dict:
            if op.get("op") == "fetch":
                add(("req_out", op["log"], op["offset"], 0, _now()))
            raw = await original(self, op, timeout_ms)
            if op.get("op") == "fetch":
                add(("ans_in", op["log"], op["offset"], raw.get("next_offset", 0), _now()))
            return raw
        return probed

    def apply(original: Any) -> Any:
        def probed(log_: Any, offset: int, data: bytes, epochs: Any) -> Any:
            begun = _now()
            result = original(log_, offset, data, epochs)
            add(("apply", log_.name, offset, result[0], begun, _now()))
            return result
        return probed

    _wrap(Sends, "_append_and_commit_io", commit_rt)
    _wrap(Scheduler, "_append_and_commit", commit_delay)
    _wrap(source.ReplicaSource, "advanced", advanced)
    _wrap(source.ReplicaSource, "wait_replicated", wait_replicated)
    _wrap(source.ReplicaSource, "park_replicated", park_replicated)
    _wrap(source.ReplicaSource, "fetch", fetch)
    _wrap(source.ReplicaSource, "_answer", answer)
    _wrap(source.ReplicaSource, "_answer_now", answer_now)
    _wrap(parked_fetch.ParkedFetch, "answer", parked_answer)
    _wrap(follower.Follower, "_request", request)
    _wrap(follower, "apply_position_io", apply)
    atexit.register(_dump)


def _dump() -> None:
    with open(os.environ[OUT_ENV], "wb") as f:
        pickle.dump(_EVENTS, f)


# ---------------------------------------------------------------------- the analysis

STEPS = ("(master commit)", "commit->loop", "wake", "read", "answer->slave", "slave->thread",
         "write+fsync", "->next fetch", "fetch->master", "->resumed", "total", "->next commit",
         "(round)")


class _Index:
    """Events of one step and log, by time, for "the first at or after t with a condition"."""

    def __init__(self, rows: list[tuple[Any, ...]]) -> None:
        self.rows = sorted(rows, key=lambda row: row[-1])
        self.times = [row[-1] for row in self.rows]

    def first(self, after_ns: int, test: Callable[[tuple[Any, ...]], bool]
              ) -> tuple[Any, ...] | None:
        for row in self.rows[bisect.bisect_left(self.times, after_ns):]:
            if test(row):
                return row
        return None


def split(events: list[tuple[Any, ...]], name: str) -> dict[str, list[float]]:
    """Per commit end of log ``name`` that a sender waited for: each step's ms (module doc)."""
    by: dict[str, list[tuple[Any, ...]]] = {}
    for row in events:
        if row[1] == name:
            by.setdefault(row[0], []).append(row)
    idx = {step: _Index(rows) for step, rows in by.items()}
    empty = _Index([])
    get = lambda step: idx.get(step, empty)  # noqa: E731
    out: dict[str, list[float]] = {step: [] for step in STEPS}
    waited = {row[2] for row in by.get("resumed", [])}
    for commit in by.get("commit", []):
        end, t0 = commit[2], commit[-1]
        if end not in waited:
            continue
        adv = get("advanced").first(t0, lambda r: r[2] >= end)
        # The read that shipped the end: began after the commit ended, from below it.
        read = get("read").first(t0, lambda r: r[2] < end <= r[3])
        if adv is None or read is None:
            continue
        out_ = get("fetch_out").first(read[-1], lambda r: r[2] == read[2] and r[3] == read[3])
        ans_in = get("ans_in").first(read[-1], lambda r: r[2] == read[2] and r[3] == read[3])
        apply = get("apply").first(ans_in[-1] if ans_in else t0, lambda r: r[2] <= end <= r[3])
        if out_ is None or ans_in is None or apply is None:
            continue
        req = get("req_out").first(apply[-1], lambda r: r[2] >= end)
        fin = get("fetch_in").first(apply[-1], lambda r: r[2] >= end)
        res = get("resumed").first(t0, lambda r: r[2] == end)
        if req is None or fin is None or res is None:
            continue
        woken = read[4] if read[4] >= adv[-1] else None
        ms = lambda a, b: (b - a) / 1e6  # noqa: E731
        out["(master commit)"].append(ms(commit[3], t0))
        out["commit->loop"].append(ms(t0, adv[-1]))
        out["wake"].append(ms(adv[-1], woken) if woken is not None else float("nan"))
        out["read"].append(ms(woken if woken is not None else adv[-1], read[-1]))
        out["answer->slave"].append(ms(out_[-1], ans_in[-1]))
        out["slave->thread"].append(ms(ans_in[-1], apply[4]))
        out["write+fsync"].append(ms(apply[4], apply[-1]))
        out["->next fetch"].append(ms(apply[-1], req[-1]))
        out["fetch->master"].append(ms(req[-1], fin[-1]))
        out["->resumed"].append(ms(fin[-1], res[-1]))
        out["total"].append(ms(t0, res[-1]))
        # The rest of the round: the next commit that began after the sender resumed (the
        # answers, the producer's next sends, their checks), and commit start to commit start.
        nxt = get("commit").first(res[-1], lambda r: r[3] >= res[-1])
        out["->next commit"].append(ms(res[-1], nxt[3]) if nxt else float("nan"))
        out["(round)"].append(ms(commit[3], nxt[3]) if nxt else float("nan"))
    return out


def _pct(values: list[float], fraction: float) -> float:
    values = sorted(v for v in values if v == v)
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(fraction * len(values)))]


def report(events: list[tuple[Any, ...]]) -> str:
    """The table of the module doc, per log."""
    lines = []
    for name in LOGS:
        steps = split(events, name)
        count = len(steps["total"])
        parked = sum(1 for v in steps["wake"] if v == v)
        lines.append(f"{name} log: {count} waited commits matched, {parked} with a parked "
                     f"fetch woken (ms: p50 / p90 / p99 / mean)")
        for step in STEPS:
            values = [v for v in steps[step] if v == v]
            mean = sum(values) / len(values) if values else float("nan")
            lines.append(f"  {step:<16} {_pct(values, .5):7.3f} {_pct(values, .9):7.3f} "
                         f"{_pct(values, .99):7.3f} {mean:7.3f}")
    return "\n".join(lines)


# ---------------------------------------------------------------------- the driver


def _worker(url: str, role: str, params: dict[str, Any], out: str) -> list[str]:
    return [sys.executable, "-m", "bench.peers.worker", "pyqmq", url, role, json.dumps(params),
            out]


def one_run(rate: int, seconds: float, delayed: int) -> str:
    """One fresh ``qmq up --replicas 2``, probed: the fixed-rate sends, then the delayed ones."""
    from bench._cluster import process_cpu_s, start_process
    from bench.delay import wait_registered
    from bench.peers.servers import _QMQ_UP_READY, REPO_ROOT, wait_in_sync

    directory = tempfile.mkdtemp(prefix="qmq-replwait-")
    out = os.path.join(directory, "events.pickle")
    os.environ[OUT_ENV] = out  # the server inherits it
    rates: list[str] = []
    try:
        server = start_process("qmq up", [
            sys.executable, "-m", "bench.replication_wait", "server", "--log-level", "warning",
            "up", "--data-dir", os.path.join(directory, "qmq"), "--host", "127.0.0.1",
            "--meta-port", "0", "--realtime-port", "0", "--delay-port", "0", "--replicas", "2",
        ], _QMQ_UP_READY, cwd=REPO_ROOT)
        try:
            url = f"http://{server.address}"
            wait_registered(url)
            wait_in_sync(url)
            timeout_s = seconds * 4 + WORKER_SLACK_S
            if rate:
                count = int(rate * seconds)
                cpu_s = process_cpu_s(server.pid)
                subprocess.run(_worker(url, "produce_rate", {
                    "subject": SUBJECT, "count": count, "rate_per_s": rate,
                    "cpu_pids": []}, os.path.join(directory, "p.json")),
                    cwd=REPO_ROOT, check=True, timeout=timeout_s)
                cpu_s = process_cpu_s(server.pid) - cpu_s
                rates.append(f"{count} sends at {rate}/s: the qmq up process "
                             f"{cpu_s * 1e6 / count:,.0f} CPU-us/send")
            if delayed:
                cpu_s = process_cpu_s(server.pid)
                subprocess.run(_worker(url, "produce_delayed", {
                    "subject": SUBJECT + ".d", "count": delayed, "delay_low_ms": 600_000,
                    "delay_high_ms": 900_000}, os.path.join(directory, "d.json")),
                    cwd=REPO_ROOT, check=True, timeout=timeout_s)
                cpu_s = process_cpu_s(server.pid) - cpu_s
                with open(os.path.join(directory, "d.json"), encoding="utf-8") as f:
                    done = json.load(f)
                rates.append(f"{delayed} delayed sends 32 in flight: "
                             f"{delayed / ((done['end_ns'] - done['start_ns']) / 1e9):,.0f}/s, "
                             f"the qmq up process {cpu_s * 1e6 / delayed:,.0f} CPU-us/send")
        finally:
            server.stop()
        with open(out, "rb") as f:
            return "\n".join([*rates, report(pickle.load(f))])
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """``server ...``: the probed ``qmq`` CLI; else the measurement (module doc)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["server"]:
        install()
        from qmq.cli import main as qmq_main
        return qmq_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m bench.replication_wait", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=int, default=2_000, help="realtime sends/s (0: none)")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--delayed", type=int, default=20_000, help="W1-like delayed sends")
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args(argv)
    for run in range(args.runs):
        load = os.getloadavg()
        print(f"run {run + 1}: load {load[0]:.2f}; {args.rate}/s for {args.seconds:g} s, then "
              f"{args.delayed} delayed sends 32 in flight", flush=True)
        print(one_run(args.rate, args.seconds, args.delayed), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
