"""Realtime benchmark: produce throughput, end-to-end throughput and end-to-end latency.

Run: ``.venv/bin/python -m bench.realtime`` (full, a few minutes) or ``--quick`` (under a minute).
``--flush async`` runs the broker with ``flush=async`` (default ``sync``: a send is answered
only after fsync, with group commit).

It starts a MetaServer (SQLite) and one realtime broker as ``python -m qmq`` subprocesses on
127.0.0.1 port 0, in a temp dir removed at the end. The clients run in their own processes
(``multiprocessing`` spawn), so the broker, the producer and the consumers each have an event
loop of their own, as they would in production. Every message has a 256-byte body whose first
16 bytes are its sequence number and the producer's ``time.monotonic_ns()`` when it was sent
(system-wide on Linux, so comparable across processes).

Figures, each run 3 times (a fresh subject per run) and printed as the median:

- **produce**: one Producer sends N messages (default 200,000; quick 20,000) as fast as it can,
  batched (``send_many``, or ``--api send``: concurrent ``send()`` calls); messages/s from the
  first send to the last receipt.
- **end to end**: 4 consumers of one group (in one process, ``start="earliest"``) consume while
  one producer sends N messages; produced/s as above, consumed/s = N / (last message received
  - first send). Every message must be received; missing and duplicate counts are printed.
- **latency**: one producer sends at a fixed 2,000 msg/s for 20 s (quick 5 s) with ``send()``,
  the 4 consumers receive; latency = the consumer's receive time (when the iterator hands the
  message out) - the send time in the body. p50 and p99 over every message.

Each run also prints what explains its figures on a shared machine: the CPU microseconds per
message each process used (broker from /proc, clients from ``time.process_time()``: a cost that
does not depend on how busy the machine is), and for the latency run the send -> receipt
latency (the producer's share) and the consumer process's event-loop lag (a 1 ms sleep's
overshoot: CPU starvation and pauses that every latency figure includes).

Goals (DESIGN.md 14): >= 50,000 msg/s produced and consumed end to end with sync flush; p99
end-to-end latency < 10 ms at 2,000 msg/s. This is a benchmark, not a test: it asserts nothing
and exits 0 whether the goals are met or not. Every wait is bounded in time.

Profiling: ``QMQ_BENCH_PROFILE_DIR=DIR`` runs each client under cProfile (stats in DIR);
``QMQ_BENCH_BROKER_CMD`` replaces ``python -m qmq`` for the broker (see bench/_cluster.py);
or attach ``py-spy record --gil -p PID`` to the broker pid printed at the start.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import functools
import multiprocessing
import os
import platform
import statistics
import struct
import sys
import time
from dataclasses import dataclass
from typing import Any

from bench._cluster import (
    Cluster, cpu_model, cpu_pressure_us, paced, percentile, process_cpu_s,
)

RUNS = 3
BODY_BYTES = 256
MESSAGES_DEFAULT = 200_000
MESSAGES_QUICK = 20_000
CONSUMERS = 4
GROUP = "bench"
LATENCY_RATE_PER_S = 2_000
LATENCY_SECONDS = 20.0
LATENCY_SECONDS_QUICK = 5.0
GOAL_E2E_PER_S = 50_000
GOAL_P99_MS = 10.0
SEND_WINDOW = 4_096  # concurrent send() calls with --api send
SEND_MANY_CHUNK = 1_024  # bodies per send_many call
SEND_MANY_CONCURRENCY = 4  # send_many calls in flight at once
PROFILE_DIR_ENV = "QMQ_BENCH_PROFILE_DIR"
WORKER_SLACK_S = 60.0
LAG_PROBE_INTERVAL_S = 0.001  # a worker gives up this long after its expected end
_HEADER = struct.Struct(">QQ")  # sequence number, send time (monotonic ns)
_PAD = b"\x00" * (BODY_BYTES - _HEADER.size)


def body(seq: int) -> bytes:
    """A 256-byte body carrying ``seq`` and the send time."""
    return _HEADER.pack(seq, time.monotonic_ns()) + _PAD


# --------------------------------------------------------------------------- client processes


async def _produce(meta_url: str, subject: str, count: int, api: str,
                   options: dict[str, Any]) -> dict[str, Any]:
    from sdk import Producer

    async with Producer(meta_url, **options) as producer:
        await producer.send(subject, body(count))  # warm-up: route + connection; not counted
        start_ns, cpu_start_s = time.monotonic_ns(), time.process_time()
        if api == "send_many":
            slots = asyncio.Semaphore(SEND_MANY_CONCURRENCY)

            async def chunk(first: int, last: int) -> None:
                try:
                    await producer.send_many(subject, [body(s) for s in range(first, last)])
                finally:
                    slots.release()

            async with asyncio.TaskGroup() as group:
                for first in range(0, count, SEND_MANY_CHUNK):
                    await slots.acquire()  # at most SEND_MANY_CONCURRENCY calls in flight
                    group.create_task(chunk(first, min(count, first + SEND_MANY_CHUNK)))
        else:
            slots = asyncio.Semaphore(SEND_WINDOW)
            tasks = set()
            for seq in range(count):
                await slots.acquire()
                task = asyncio.create_task(producer.send(subject, body(seq)))
                task.add_done_callback(lambda t: slots.release())
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.gather(*tasks)
        end_ns, cpu_s = time.monotonic_ns(), time.process_time() - cpu_start_s
    return {"start_ns": start_ns, "end_ns": end_ns, "cpu_s": cpu_s}


async def _produce_at_rate(meta_url: str, subject: str, count: int, rate: int,
                           options: dict[str, Any]) -> dict[str, Any]:
    from sdk import Producer

    acks_ns: list[int] = []

    async def send_one(seq: int) -> None:
        sent_ns = time.monotonic_ns()
        await producer.send(subject, _HEADER.pack(seq, sent_ns) + _PAD)
        acks_ns.append(time.monotonic_ns() - sent_ns)

    async with Producer(meta_url, **options) as producer:
        await producer.send(subject, body(count))  # warm-up, not counted
        start, _ = await paced(count, rate, send_one)
        return {"start_ns": int(start * 1e9), "end_ns": time.monotonic_ns(), "cpu_s": 0.0,
                "acks_ns": acks_ns}


async def _loop_lag_probe(lags_ns: list[int]) -> None:
    """Sleep 1 ms again and again, recording how late each wake-up is: the process's own
    scheduling delay (CPU contention, GC pauses), which every latency figure includes."""
    while True:
        before_ns = time.monotonic_ns()
        await asyncio.sleep(LAG_PROBE_INTERVAL_S)
        lags_ns.append(time.monotonic_ns() - before_ns - int(LAG_PROBE_INTERVAL_S * 1e9))


async def _consume(meta_url: str, subject: str, count: int, timeout_s: float,
                   options: dict[str, Any], ready: Any) -> dict[str, Any]:
    from sdk import Consumer
    from sdk.routes import RouteCache

    routes = RouteCache(meta_url)
    await routes.get(subject, "producer")  # the subject's route exists before consumers ask
    await routes.close()
    seen = bytearray(count + 1)
    state = {"received": 0, "duplicates": 0, "last_ns": 0}
    latencies_ns: list[int] = []
    done = asyncio.Event()
    consumers = [Consumer(meta_url, group=GROUP, start="earliest", **options)
                 for _ in range(CONSUMERS)]

    async def drain(consumer: Any) -> None:
        async for msg in consumer.subscribe(subject):
            now_ns = time.monotonic_ns()
            seq, sent_ns = _HEADER.unpack_from(msg.body)
            await msg.ack()
            if seq >= count:  # the producer's warm-up message
                continue
            if seen[seq]:
                state["duplicates"] += 1
                continue
            seen[seq] = 1
            latencies_ns.append(now_ns - sent_ns)
            state["received"] += 1
            state["last_ns"] = now_ns
            if state["received"] == count:
                done.set()

    tasks = [asyncio.create_task(drain(c)) for c in consumers]
    lags_ns: list[int] = []
    tasks.append(asyncio.create_task(_loop_lag_probe(lags_ns)))
    await asyncio.sleep(0.3)  # let the first long polls reach the broker
    lags_ns.clear()
    ready.set()
    cpu_start_s = time.process_time()
    try:
        await asyncio.wait_for(done.wait(), timeout_s)
    except asyncio.TimeoutError:
        pass
    cpu_s = time.process_time() - cpu_start_s
    tasks[-1].cancel()
    await asyncio.gather(*(c.close() for c in consumers))
    await asyncio.gather(*tasks, return_exceptions=True)
    return {"received": state["received"], "duplicates": state["duplicates"],
            "last_ns": state["last_ns"], "latencies_ns": latencies_ns, "cpu_s": cpu_s,
            "lags_ns": lags_ns}


def _worker(kind: str, args: tuple[Any, ...], results: Any, ready: Any) -> None:
    """Entry point of a client process; puts ``(kind, result or error text)`` on ``results``.

    With ``QMQ_BENCH_PROFILE_DIR`` set, the client runs under cProfile and its stats are written
    to ``<dir>/<kind>-<pid>.prof`` (read them with ``python -m pstats``)."""
    if kind == "produce":
        work = functools.partial(_produce, *args)
    elif kind == "produce_rate":
        work = functools.partial(_produce_at_rate, *args)
    else:
        work = functools.partial(_consume, *args, ready)
    profile_dir = os.environ.get(PROFILE_DIR_ENV)
    profiler = cProfile.Profile() if profile_dir else None
    try:
        if profiler is not None:
            profiler.enable()
        result = asyncio.run(work())
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(os.path.join(profile_dir, f"{kind}-{os.getpid()}.prof"))
        results.put((kind, result))
    except BaseException as exc:  # report, never hang the orchestrator
        results.put((kind, f"{type(exc).__name__}: {exc}"))


# --------------------------------------------------------------------------- orchestration


@dataclass
class RunResult:
    values: dict[str, float]
    notes: str = ""


def _collect(ctx: Any, workers: list[tuple[str, tuple[Any, ...]]], ready: Any,
             wait_ready: bool, timeout_s: float) -> dict[str, Any]:
    """Start the worker processes (consumers first when ``wait_ready``), return their results."""
    results = ctx.Queue()
    processes = []
    for kind, args in workers:
        process = ctx.Process(target=_worker, args=(kind, args, results, ready), daemon=True)
        process.start()
        processes.append(process)
        if wait_ready and kind == "consume" and not ready.wait(30):
            raise RuntimeError("consumers did not start within 30 s")
    out: dict[str, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < len(workers):
            kind, result = results.get(timeout=max(0.1, deadline - time.monotonic()))
            if isinstance(result, str):
                raise RuntimeError(f"{kind} worker failed: {result}")
            out[kind] = result
    finally:
        for process in processes:
            process.join(5)
            if process.is_alive():
                process.kill()
                process.join(5)
    return out


@dataclass(frozen=True)
class Clients:
    """How the client processes are set up (bench options)."""

    api: str  # "send_many" or "send": how the throughput producer sends
    producer: dict[str, Any]  # Producer options beyond the defaults
    consumer: dict[str, Any]  # Consumer options beyond the defaults


def _cpu_values(count: int, broker_cpu_s: float, clients: dict[str, float]) -> dict[str, float]:
    """CPU microseconds per message of each process: the cost, whatever the machine's load."""
    values = {"broker_us": broker_cpu_s / count * 1e6}
    values.update({f"{name}_us": cpu_s / count * 1e6 for name, cpu_s in clients.items()})
    return values


def _cpu_note(values: dict[str, float]) -> str:
    return "cpu us/msg: " + ", ".join(
        f"{key[:-3]} {value:.0f}" for key, value in values.items() if key.endswith("_us"))


def run_produce(ctx: Any, cluster: Cluster, subject: str, count: int,
                clients: Clients) -> RunResult:
    broker_cpu_s = process_cpu_s(cluster.broker.pid)
    out = _collect(ctx, [("produce", (cluster.meta_url, subject, count, clients.api,
                                      clients.producer))],
                   ctx.Event(), False, count / 1_000 + WORKER_SLACK_S)
    broker_cpu_s = process_cpu_s(cluster.broker.pid) - broker_cpu_s
    p = out["produce"]
    values = {"produced_per_s": count / ((p["end_ns"] - p["start_ns"]) / 1e9)}
    values.update(_cpu_values(count, broker_cpu_s, {"producer": p["cpu_s"]}))
    return RunResult(values, _cpu_note(values))


def run_e2e(ctx: Any, cluster: Cluster, subject: str, count: int, clients: Clients) -> RunResult:
    timeout_s = count / 1_000 + WORKER_SLACK_S
    broker_cpu_s = process_cpu_s(cluster.broker.pid)
    out = _collect(ctx, [
        ("consume", (cluster.meta_url, subject, count, timeout_s, clients.consumer)),
        ("produce", (cluster.meta_url, subject, count, clients.api, clients.producer)),
    ], ctx.Event(), True, timeout_s + 30)
    broker_cpu_s = process_cpu_s(cluster.broker.pid) - broker_cpu_s
    p, c = out["produce"], out["consume"]
    values = {
        "produced_per_s": count / ((p["end_ns"] - p["start_ns"]) / 1e9),
        "consumed_per_s": (c["received"] / ((c["last_ns"] - p["start_ns"]) / 1e9)
                           if c["received"] else 0.0),
        "missing": count - c["received"],
    }
    values.update(_cpu_values(count, broker_cpu_s,
                              {"producer": p["cpu_s"], "consumers": c["cpu_s"]}))
    notes = f"missing {count - c['received']}, duplicates {c['duplicates']}; {_cpu_note(values)}"
    return RunResult(values, notes)


def run_latency(ctx: Any, cluster: Cluster, subject: str, seconds: float, rate: int,
                clients: Clients) -> RunResult:
    count = int(seconds * rate)
    timeout_s = seconds + WORKER_SLACK_S
    out = _collect(ctx, [
        ("consume", (cluster.meta_url, subject, count, timeout_s, clients.consumer)),
        ("produce_rate", (cluster.meta_url, subject, count, rate, clients.producer)),
    ], ctx.Event(), True, timeout_s + 30)
    p, c = out["produce_rate"], out["consume"]
    latencies_ms = sorted(ns / 1e6 for ns in c["latencies_ns"])
    acks_ms = sorted(ns / 1e6 for ns in p["acks_ns"])
    lags_ms = sorted(ns / 1e6 for ns in c["lags_ns"])
    offered = count / ((p["end_ns"] - p["start_ns"]) / 1e9)
    values = {"p50_ms": percentile(latencies_ms, 0.50), "p99_ms": percentile(latencies_ms, 0.99),
              "p999_ms": percentile(latencies_ms, 0.999), "missing": count - c["received"],
              "send_p50_ms": percentile(acks_ms, 0.5), "send_p99_ms": percentile(acks_ms, 0.99)}
    notes = (f"missing {count - c['received']}, duplicates {c['duplicates']}, "
             f"offered {offered:,.0f} msg/s, max {latencies_ms[-1] if latencies_ms else 0:.1f} "
             f"ms; send->receipt p50 {values['send_p50_ms']:.2f} p99 {values['send_p99_ms']:.2f}"
             f" ms; consumer loop lag p99 {percentile(lags_ms, 0.99):.2f} "
             f"max {lags_ms[-1] if lags_ms else 0:.1f} ms")
    return RunResult(values, notes)


def _median_row(name: str, runs: list[RunResult], key: str, fmt: str, goal: str,
                met: bool | None) -> str:
    values = [r.values[key] for r in runs]
    median = statistics.median(values)
    all_runs = ", ".join(fmt.format(v) for v in values)
    verdict = "" if met is None else ("yes" if met else "NO")
    return f"  {name:<34} {fmt.format(median):>10}   runs [{all_runs}]   goal {goal} {verdict}"


def _cpu_row(runs: list[RunResult]) -> str:
    keys = [key for key in runs[0].values if key.endswith("_us")]
    medians = ", ".join(f"{key[:-3]} {statistics.median(r.values[key] for r in runs):.0f}"
                        for key in keys)
    return f"  {'  cpu us/msg (medians)':<34} {medians}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.realtime", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="short smoke run")
    parser.add_argument("--flush", choices=["sync", "async"], default="sync")
    parser.add_argument("--messages", type=int, default=None, help="messages per throughput run")
    parser.add_argument("--latency-seconds", type=float, default=None)
    parser.add_argument("--rate", type=int, default=LATENCY_RATE_PER_S,
                        help="messages/s of the latency run (the goal is set at 2,000)")
    parser.add_argument("--runs", type=int, default=RUNS)
    parser.add_argument("--only", default="produce,e2e,latency",
                        help="comma-separated subset of produce,e2e,latency")
    parser.add_argument("--broker-arg", action="append", default=[],
                        help="extra argument for `qmq realtime` (repeatable), e.g. --no-trace")
    parser.add_argument("--api", choices=["send_many", "send"], default=None,
                        help="how the throughput producer sends (default: send_many if the SDK "
                             "has it, else send)")
    parser.add_argument("--linger-ms", type=int, default=None, help="Producer linger_ms")
    parser.add_argument("--pull-batch", type=int, default=None, help="Consumer pull_batch")
    parser.add_argument("--ack-pending-max", type=int, default=None,
                        help="Consumer ack_pending_max")
    args = parser.parse_args(argv)
    count = args.messages or (MESSAGES_QUICK if args.quick else MESSAGES_DEFAULT)
    seconds = args.latency_seconds or (LATENCY_SECONDS_QUICK if args.quick else LATENCY_SECONDS)
    only = set(args.only.split(","))
    from sdk import Producer

    clients = Clients(
        api=args.api or ("send_many" if hasattr(Producer, "send_many") else "send"),
        producer={} if args.linger_ms is None else {"linger_ms": args.linger_ms},
        consumer={name: value for name, value in (("pull_batch", args.pull_batch),
                                                  ("ack_pending_max", args.ack_pending_max))
                  if value is not None},
    )
    ctx = multiprocessing.get_context("spawn")
    print(f"bench.realtime: flush={args.flush}, {count:,} messages of {BODY_BYTES} B per "
          f"throughput run, latency {args.rate:,} msg/s for {seconds:g} s, {args.runs} runs, "
          f"producer api {clients.api}, options {clients.producer or ''}{clients.consumer or ''}"
          f"{' broker ' + ' '.join(args.broker_arg) if args.broker_arg else ''}")
    print(f"machine: {multiprocessing.cpu_count()} cores, {cpu_model()}, "
          f"Python {platform.python_version()}")
    produce: list[RunResult] = []
    e2e: list[RunResult] = []
    latency: list[RunResult] = []
    pressure_start_us, wall_start_s = cpu_pressure_us(), time.monotonic()
    with Cluster(args.flush, args.broker_arg) as cluster:
        print(f"cluster: metaserver {cluster.meta_url}, broker {cluster.broker.address} "
              f"(pid {cluster.broker.pid})", flush=True)
        for run in range(args.runs):
            if "produce" in only:
                produce.append(run_produce(ctx, cluster, f"bench.produce.{run}", count, clients))
                print(f"run {run + 1} produce: {produce[-1].values['produced_per_s']:,.0f} msg/s "
                      f"({produce[-1].notes})", flush=True)
            if "e2e" in only:
                e2e.append(run_e2e(ctx, cluster, f"bench.e2e.{run}", count, clients))
                v = e2e[-1].values
                print(f"run {run + 1} end to end: produced {v['produced_per_s']:,.0f} msg/s, "
                      f"consumed {v['consumed_per_s']:,.0f} msg/s ({e2e[-1].notes})", flush=True)
            if "latency" in only:
                latency.append(run_latency(ctx, cluster, f"bench.latency.{run}", seconds,
                                           args.rate, clients))
                v = latency[-1].values
                print(f"run {run + 1} latency: p50 {v['p50_ms']:.2f} ms, p99 {v['p99_ms']:.2f} ms, "
                      f"p99.9 {v['p999_ms']:.2f} ms ({latency[-1].notes})", flush=True)

    pressure_end_us, wall_s = cpu_pressure_us(), time.monotonic() - wall_start_s
    if pressure_start_us is not None and pressure_end_us is not None:
        share = (pressure_end_us - pressure_start_us) / 1e6 / wall_s
        print(f"\nmachine short of CPU {share:.0%} of the time "
              "(PSI 'cpu some': the benchmark's processes and any other work)")
    print(f"\nmedians of {args.runs} runs (flush={args.flush}):")
    if produce:
        print(_median_row("produce, msg/s", produce, "produced_per_s", "{:,.0f}", "none", None))
        print(_cpu_row(produce))
    if e2e:
        for key, name in (("produced_per_s", "end to end produced, msg/s"),
                          ("consumed_per_s", "end to end consumed, msg/s")):
            value = statistics.median(r.values[key] for r in e2e)
            print(_median_row(name, e2e, key, "{:,.0f}", f">= {GOAL_E2E_PER_S:,}",
                              value >= GOAL_E2E_PER_S))
        print(_cpu_row(e2e))
        missing = sum(r.values["missing"] for r in e2e)
        print(f"  every message received: {'yes' if missing == 0 else f'NO, {missing} missing'}")
    if latency:
        print(_median_row(f"latency p50 at {args.rate:,}/s, ms", latency, "p50_ms", "{:.2f}",
                          "none", None))
        value = statistics.median(r.values["p99_ms"] for r in latency)
        print(_median_row(f"latency p99 at {args.rate:,}/s, ms", latency, "p99_ms", "{:.2f}",
                          f"< {GOAL_P99_MS:g}", value < GOAL_P99_MS))
        print(_median_row("  send -> receipt p99, ms", latency, "send_p99_ms", "{:.2f}",
                          "none", None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
