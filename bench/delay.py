"""Delay benchmark: delayed sends/s, lateness of delivery, a hot second, delay-server memory, and
retry gaps, against real processes on loopback.

Run: ``.venv/bin/python -m bench.delay`` (100,000 messages per workload, a few minutes) or
``--quick`` (10,000, about a minute). ``--runs 3`` repeats the whole set on a fresh cluster each
time and prints the medians.

Processes, all ``python -m qmq`` on 127.0.0.1 port 0 in a temp dir removed at the end: a
MetaServer (SQLite), a realtime broker (``--flush sync``, ``--retry-backoff-ms 1000,2000,4000``)
and a delay server (``--flush sync``, default 1-minute buckets). The producer is one SDK
``qmq.Producer`` in this process (``in_flight_max`` 32, so up to 32 batches on the wire): by
default each message is one concurrent ``send(delay=...)`` or ``send(deliver_at=...)`` call, at
most ``--window`` of them pending; ``--api send_many`` sends with ``send_many`` calls of 1,024
messages, each with its own ``delay``/``deliver_at``, 4 calls in flight. The consumer of W1 and W2
is one SDK ``qmq.Consumer`` in a child process of its own (``pull_batch`` 256), so the producer's
work does not delay its clock readings. Bodies are 256 bytes.

- **W1 steady**: N messages with delays uniform over 1-60 s (quick: 1-10 s). Delayed sends/s =
  N / (first send to last receipt). Lateness = the consumer's receive wall time minus the
  message's ``deliver_at_ms``: p50 / p99 / max, and the count of early deliveries (must be 0).
  Also the delay server's own view (confirmed dispatch minus deliver_at, from its stats).
- **W2 hot slot**: N messages all due within the same wall-clock second (sent beforehand);
  the time from the end of that second until the last message is received, and the lateness
  max.
- **W3 capacity**: the delay server's RSS (/proc/PID/status VmRSS, and VmHWM its peak) after
  W1/W2; ``--w3-pending 1000000`` also fills a delay server with that many messages due in
  30-40 days and reports its RSS. The store at 1M/10M pending is measured by
  ``bench/delay_capacity.py``.
- **W4 retries**: a handler that fails 3 times then succeeds (50 messages; quick 20), with the
  broker's backoff 1 s, 2 s, 4 s: observed gaps between handler calls vs configured.

Goals (DESIGN.md 14): >= 40,000 delayed sends/s from one client; W1 p99 lateness <= 50 ms with
zero early; W2 last message <= 2 s after its time (DESIGN: 0.3 s for 20k); W3 <= 256 MB RSS at
10M pending. A benchmark, not a test: it asserts nothing, exits 0 either way, and every wait is
bounded in time.

Profiling: ``QMQ_BENCH_DELAY_CMD="py-spy record -o delay.svg -- python -m qmq"`` runs the
delay server under a profiler (likewise ``QMQ_BENCH_BROKER_CMD`` for the realtime broker).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from bench._cluster import (
    Server, cpu_model, cpu_pressure_us, percentile, process_cpu_s, start_server,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BODY_BYTES = 256
RUNS = 1
SEND_WINDOW = 4_096  # send() calls pending at once (the producer keeps 32 batches on the wire)
SEND_MANY_CHUNK = 1_024  # --api send_many: messages per send_many call
SEND_MANY_IN_FLIGHT = 4  # --api send_many: calls in flight at once
W4_BACKOFF_MS = (1_000, 2_000, 4_000)
W4_FAILURES = 3
GOAL_SENDS_PER_S = 40_000
GOAL_W1_P99_MS = 50
GOAL_W2_LAST_S = 2.0
DESIGN_W2_LAST_S = 0.3
GOAL_RSS_MB = 256
CONSUMER_PULL_BATCH = 256
BROKER_CMD_ENV = "QMQ_BENCH_BROKER_CMD"
DELAY_CMD_ENV = "QMQ_BENCH_DELAY_CMD"
CONSUMER_READY_TIMEOUT_S = 30.0
DRAIN_SLACK_S = 60.0  # longest wait for deliveries after the last due time


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


def _command(env_name: str) -> list[str] | None:
    value = os.environ.get(env_name)
    return shlex.split(value) if value else None


def admin_get(meta_url: str, what: str) -> Any:
    """GET ``/api/admin/<what>`` of the MetaServer at ``meta_url``, decoded from JSON."""
    with urllib.request.urlopen(f"{meta_url}/api/admin/{what}", timeout=10) as response:
        return json.loads(response.read())


def wait_registered(meta_url: str, timeout_s: float = 30) -> None:
    """Wait until a realtime and a delay server are registered read-write with the
    MetaServer at ``meta_url`` (clients can route to both)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = admin_get(meta_url, "brokers")["brokers"]
        if {(r["kind"], r["state"]) for r in rows} >= {("realtime", "rw"), ("delay", "rw")}:
            return
        time.sleep(0.1)
    raise RuntimeError("the realtime and delay servers did not register in time")


class DelayCluster:
    """MetaServer + realtime broker + delay server in a fresh temp dir; ``close()`` stops them."""

    def __init__(self, trace: bool = True) -> None:
        self.directory = tempfile.mkdtemp(prefix="qmq-bench-delay-")
        no_trace = [] if trace else ["--no-trace"]
        self.servers: list[Server] = []
        try:
            self.meta = self._add(start_server("metaserver", [
                "metaserver", "--db",
                f"sqlite+aiosqlite:///{os.path.join(self.directory, 'meta.db')}",
                "--host", "127.0.0.1", "--port", "0",
            ]))
            self.realtime = self._add(start_server("realtime", [
                "realtime", "--meta", self.meta_url, "--group", "rt1",
                "--data-dir", os.path.join(self.directory, "realtime"),
                "--host", "127.0.0.1", "--port", "0", "--flush", "sync",
                "--retry-backoff-ms", ",".join(map(str, W4_BACKOFF_MS)), "--retries-max", "16",
                *no_trace,
            ], _command(BROKER_CMD_ENV)))
            self.delay = self._add(start_server("delay", [
                "delay", "--meta", self.meta_url, "--group", "d1",
                "--data-dir", os.path.join(self.directory, "delay"),
                "--host", "127.0.0.1", "--port", "0", "--flush", "sync", *no_trace,
            ], _command(DELAY_CMD_ENV)))
            self._wait_registered()
        except BaseException:
            self.close()
            raise

    def _add(self, server: Server) -> Server:
        self.servers.append(server)
        return server

    @property
    def meta_url(self) -> str:
        return f"http://{self.meta.address}"

    def admin(self, what: str) -> Any:
        return admin_get(self.meta_url, what)

    def _wait_registered(self) -> None:
        wait_registered(self.meta_url)

    def close(self) -> None:
        for server in reversed(self.servers):
            server.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


def rss_mb(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of ``pid`` in MB (MiB), from /proc/PID/status; (nan, nan) if unknown."""
    values = {"VmRSS:": float("nan"), "VmHWM:": float("nan")}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                parts = line.split()
                if parts and parts[0] in values:
                    values[parts[0]] = int(parts[1]) / 1024
    except OSError:
        pass
    return values["VmRSS:"], values["VmHWM:"]


class Pressure:
    """The share of wall time some task on the machine waited for a CPU (Linux PSI) since this
    was made: how much the benchmark competed with other work. NaN where PSI is missing."""

    def __init__(self) -> None:
        self._start = (cpu_pressure_us(), time.monotonic())

    def share(self) -> float:
        waited_us, began = self._start
        now_us = cpu_pressure_us()
        if waited_us is None or now_us is None:
            return float("nan")
        return (now_us - waited_us) / 1e6 / max(1e-9, time.monotonic() - began)


# ---------------------------------------------------------------------------- consumer child


async def _consume(args: argparse.Namespace) -> None:
    """The child process: receive ``expect`` messages, then write lateness figures to ``out``."""
    import qmq

    lateness: list[int] = []
    due: list[int] = []
    seen: set[str] = set()
    duplicates = 0
    first_at_ms = last_at_ms = 0
    last_arrival = time.monotonic()
    async with qmq.Consumer(args.meta, group=args.group, start="earliest", wait_ms=1_000,
                            pull_batch=CONSUMER_PULL_BATCH) as consumer:
        subscription = consumer.subscribe(args.subject)
        print("ready", flush=True)

        async def receive() -> None:
            nonlocal duplicates, first_at_ms, last_at_ms, last_arrival
            async for msg in subscription:
                at_ms = time.time_ns() // 1_000_000
                last_arrival = time.monotonic()
                if msg.id in seen:
                    duplicates += 1
                else:
                    seen.add(msg.id)
                    lateness.append(at_ms - msg.message.deliver_at_ms)
                    due.append(msg.message.deliver_at_ms)
                    first_at_ms = first_at_ms or at_ms
                    last_at_ms = at_ms
                await msg.ack()
                if len(seen) >= args.expect:
                    return

        task = asyncio.create_task(receive())
        deadline = time.monotonic() + args.timeout_s
        while not task.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if not task.done():
            task.cancel()
        await asyncio.sleep(0.2)  # let the last acks go out with the close
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"lateness_ms": lateness, "due_ms": due, "duplicates": duplicates,
                   "received": len(seen),
                   "first_at_ms": first_at_ms, "last_at_ms": last_at_ms}, f)


class ConsumerChild:
    """A consumer process for one subject; ``result()`` waits for its figures."""

    def __init__(self, meta_url: str, subject: str, group: str, expect: int, timeout_s: float,
                 directory: str) -> None:
        self.out = os.path.join(directory, f"consumer-{subject}.json")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "bench.delay", "--consumer", "--meta", meta_url,
             "--subject", subject, "--group", group, "--expect", str(expect),
             "--timeout-s", str(timeout_s), "--out", self.out],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO_ROOT,
        )
        self.timeout_s = timeout_s
        assert self.process.stdout is not None
        deadline = time.monotonic() + CONSUMER_READY_TIMEOUT_S
        line = self.process.stdout.readline()
        if line.strip() != "ready" or time.monotonic() > deadline:
            self.process.kill()
            raise RuntimeError(f"consumer child did not start: {line}{self.process.stdout.read()}")

    def result(self) -> dict[str, Any]:
        try:
            self.process.wait(self.timeout_s + 30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)
        if not os.path.exists(self.out):
            assert self.process.stdout is not None
            output = self.process.stdout.read()[-2000:]
            raise RuntimeError(f"consumer child wrote nothing: {output}")
        with open(self.out, encoding="utf-8") as f:
            return json.load(f)


# ---------------------------------------------------------------------------- workloads


async def send_delayed(producer: Any, subject: str, count: int, when: Any,
                       window: int, api: str = "send") -> tuple[float, int]:
    """``count`` concurrent ``send`` calls, at most ``window`` pending: gathered in chunks of
    ``window // 2``, two chunks at a time, so the harness adds only gather's task per call.
    ``when(i)`` gives the keyword (``delay=`` or ``deliver_at=``). Returns (seconds from the
    first send to the last receipt, failed sends). ``api="send_many"``: ``send_many`` calls of
    SEND_MANY_CHUNK messages with a due time per message, SEND_MANY_IN_FLIGHT calls at a time."""
    if api == "send_many":
        return await send_delayed_many(producer, subject, count, when)
    body = os.urandom(BODY_BYTES)
    chunk = max(1, window // 2)
    send = producer.send
    began = time.perf_counter()
    pending: list[asyncio.Future[list[Any]]] = []
    results: list[Any] = []
    for start in range(0, count, chunk):
        if len(pending) == 2:
            results += await pending.pop(0)
        pending.append(asyncio.gather(
            *(send(subject, body, **when(i)) for i in range(start, min(count, start + chunk))),
            return_exceptions=True))
    for future in pending:
        results += await future
    elapsed_s = time.perf_counter() - began
    return elapsed_s, sum(1 for r in results if isinstance(r, BaseException))


async def send_delayed_many(producer: Any, subject: str, count: int,
                            when: Any) -> tuple[float, int]:
    """``send_delayed`` through ``send_many`` (the batch path for delayed messages)."""
    body = os.urandom(BODY_BYTES)
    [keyword] = when(0)
    slots = asyncio.Semaphore(SEND_MANY_IN_FLIGHT)
    failed = 0

    async def one_call(start: int) -> None:
        nonlocal failed
        stop = min(count, start + SEND_MANY_CHUNK)
        async with slots:
            results = await producer.send_many(
                subject, [body] * (stop - start),
                **{keyword: [when(i)[keyword] for i in range(start, stop)]},
                return_exceptions=True)
        failed += sum(1 for r in results if isinstance(r, BaseException))

    began = time.perf_counter()
    await asyncio.gather(*(one_call(start) for start in range(0, count, SEND_MANY_CHUNK)))
    return time.perf_counter() - began, failed


def _lateness_figures(data: dict[str, Any]) -> dict[str, float]:
    values = sorted(data["lateness_ms"])
    return {
        "received": data["received"],
        "duplicates": data["duplicates"],
        "early": sum(1 for v in values if v < 0),
        "p50_ms": percentile(values, 0.5),
        "p99_ms": percentile(values, 0.99),
        "max_ms": values[-1] if values else float("nan"),
    }


async def w1_steady(cluster: DelayCluster, count: int, spread_s: tuple[int, int],
                    window: int, api: str = "send") -> dict[str, float]:
    import qmq

    low_ms, high_ms = spread_s[0] * 1000, spread_s[1] * 1000
    rng = random.Random(1)
    delays = [rng.randint(low_ms, high_ms) for _ in range(count)]
    child = ConsumerChild(cluster.meta_url, "bench.w1", "w1", count,
                          spread_s[1] + DRAIN_SLACK_S + count / 2_000, cluster.directory)
    delay_cpu_s = process_cpu_s(cluster.delay.pid)
    client_cpu_s = time.process_time()
    pressure = Pressure()
    async with qmq.Producer(cluster.meta_url) as producer:
        elapsed_s, failed = await send_delayed(producer, "bench.w1", count,
                                               lambda i: {"delay": delays[i]}, window, api)
    sent_ms = wall_ms()
    client_cpu_s = time.process_time() - client_cpu_s
    delay_send_cpu_s = process_cpu_s(cluster.delay.pid) - delay_cpu_s
    data = child.result()
    figures = _lateness_figures(data)
    figures["cpu_short"] = pressure.share()
    # Messages due while the producer was still sending compete with the sends for the delay
    # server; the rest show the steady state.
    after = sorted(late for late, due_ms in zip(data["lateness_ms"], data["due_ms"])
                   if due_ms > sent_ms + 1000)
    during = sorted(late for late, due_ms in zip(data["lateness_ms"], data["due_ms"])
                    if due_ms <= sent_ms)
    # The done watermark moves once a minute: messages due in the 5 s after a wall-clock minute
    # against the rest show whether that move stalls dispatching.
    boundary = sorted(late for late, due_ms in zip(data["lateness_ms"], data["due_ms"])
                      if due_ms % 60_000 < 5_000)
    rest = sorted(late for late, due_ms in zip(data["lateness_ms"], data["due_ms"])
                  if due_ms % 60_000 >= 5_000)
    figures.update(boundary_p99_ms=percentile(boundary, 0.99),
                   rest_p99_ms=percentile(rest, 0.99))
    figures.update(
        during_count=len(during), during_p99_ms=percentile(during, 0.99),
        after_count=len(after), after_p50_ms=percentile(after, 0.5),
        after_p99_ms=percentile(after, 0.99), after_max_ms=after[-1] if after else float("nan"))
    figures.update(sends_per_s=count / elapsed_s, send_s=elapsed_s, failed=failed,
                   client_us_per_send=client_cpu_s / count * 1e6,
                   delay_us_per_send=delay_send_cpu_s / count * 1e6,
                   delay_cpu_s=process_cpu_s(cluster.delay.pid) - delay_cpu_s)
    time.sleep(3.5)  # one delay-server heartbeat carries its stats to the MetaServer
    stats = next(iter(cluster.admin("delay")["delay"]), {}).get("stats") or {}
    figures.update(server_p50_le=stats.get("lateness_ms_p50_le"),
                   server_p99_le=stats.get("lateness_ms_p99_le"),
                   server_max_ms=stats.get("lateness_ms_max"),
                   server_early=stats.get("early"))
    return figures


async def w2_hot_second(cluster: DelayCluster, count: int, window: int,
                        sends_per_s_estimate: float, api: str = "send") -> dict[str, float]:
    import qmq

    # Far enough ahead that every message is stored before its second begins.
    lead_s = 3 + 2 * count / max(1_000.0, sends_per_s_estimate)
    second_ms = (wall_ms() + int(lead_s * 1000)) // 1000 * 1000 + 1000
    rng = random.Random(2)
    due = [second_ms + rng.randrange(1000) for _ in range(count)]
    child = ConsumerChild(cluster.meta_url, "bench.w2", "w2", count,
                          lead_s + 2 + DRAIN_SLACK_S, cluster.directory)
    async with qmq.Producer(cluster.meta_url) as producer:
        elapsed_s, failed = await send_delayed(producer, "bench.w2", count,
                                               lambda i: {"deliver_at": due[i]}, window, api)
    stored_before_ms = second_ms - wall_ms()
    print(f"  W2: {count:,} messages stored, due in the second starting at epoch ms {second_ms} "
          f"(in {stored_before_ms / 1000:.1f} s)", flush=True)
    await asyncio.sleep(max(0, second_ms - wall_ms()) / 1000)
    pressure = Pressure()
    delay_cpu_s = process_cpu_s(cluster.delay.pid)
    broker_cpu_s = process_cpu_s(cluster.realtime.pid)
    data = await asyncio.to_thread(child.result)
    delay_cpu_s = process_cpu_s(cluster.delay.pid) - delay_cpu_s
    broker_cpu_s = process_cpu_s(cluster.realtime.pid) - broker_cpu_s
    figures = _lateness_figures(data)
    figures["cpu_short"] = pressure.share()
    figures.update(
        last_after_second_s=(data["last_at_ms"] - (second_ms + 1000)) / 1000,
        stored_margin_s=stored_before_ms / 1000, failed=failed, send_s=elapsed_s,
        delay_us_per_message=delay_cpu_s / count * 1e6,
        broker_us_per_message=broker_cpu_s / count * 1e6,
    )
    # The delay server's own view tells its share from the broker's and the consumer's: its
    # largest dispatch lateness (confirmed by the broker) since it started (W1 included).
    await asyncio.sleep(3.5)  # one heartbeat carries the stats to the MetaServer
    stats = next(iter(cluster.admin("delay")["delay"]), {}).get("stats") or {}
    figures["server_max_ms"] = stats.get("lateness_ms_max")
    return figures


async def w3_pending(cluster: DelayCluster, pending: int, window: int,
                     api: str = "send") -> dict[str, float]:
    import qmq

    rng = random.Random(3)
    now_ms = wall_ms()
    spread_ms = 10 * 86_400_000
    due = [now_ms + 30 * 86_400_000 + rng.randrange(spread_ms) for _ in range(pending)]
    delay_cpu_s = process_cpu_s(cluster.delay.pid)
    client_cpu_s = time.process_time()
    async with qmq.Producer(cluster.meta_url) as producer:
        elapsed_s, failed = await send_delayed(
            producer, "bench.w3", pending,
            lambda i: {"deliver_at": due[i]}, window, api)
    client_cpu_s = time.process_time() - client_cpu_s
    delay_cpu_s = process_cpu_s(cluster.delay.pid) - delay_cpu_s
    rss, hwm = rss_mb(cluster.delay.pid)
    return {"pending": pending, "rss_mb": rss, "hwm_mb": hwm, "sends_per_s": pending / elapsed_s,
            "failed": failed, "client_us_per_send": client_cpu_s / pending * 1e6,
            "delay_us_per_send": delay_cpu_s / pending * 1e6}


async def w4_retries(cluster: DelayCluster, count: int) -> dict[str, Any]:
    import qmq

    calls: dict[str, list[float]] = {}
    finished: set[str] = set()
    consumer = qmq.Consumer(cluster.meta_url, group="w4", start="earliest", wait_ms=1_000)

    @consumer.handler("bench.w4", concurrency=64)
    async def flaky(msg: qmq.ReceivedMessage) -> None:
        origin = msg.properties.get("qmq-origin-id", msg.id)
        calls.setdefault(origin, []).append(time.monotonic())
        if msg.retries < W4_FAILURES:
            raise RuntimeError("bench: failing on purpose")
        finished.add(origin)

    import logging
    logging.getLogger("sdk.consumer").setLevel(logging.CRITICAL)  # one traceback per failure
    async with consumer:
        async with qmq.Producer(cluster.meta_url) as producer:
            await asyncio.gather(*(producer.send("bench.w4", b"x" * BODY_BYTES)
                                   for _ in range(count)))
        deadline = time.monotonic() + sum(W4_BACKOFF_MS) / 1000 + 30
        while len(finished) < count and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
    gaps: list[list[float]] = [[] for _ in W4_BACKOFF_MS]
    for times in calls.values():
        for step, (earlier, later) in enumerate(zip(times, times[1:])):
            if step < len(gaps):
                gaps[step].append((later - earlier) * 1000)
    return {"finished": len(finished), "count": count,
            "extra_calls": sum(max(0, len(t) - W4_FAILURES - 1) for t in calls.values()),
            "gaps_ms": [sorted(g) for g in gaps]}


# ---------------------------------------------------------------------------- running


@dataclass
class RunResult:
    w1: dict[str, float] = field(default_factory=dict)
    w2: dict[str, float] = field(default_factory=dict)
    w3: dict[str, float] = field(default_factory=dict)
    w4: dict[str, Any] = field(default_factory=dict)
    rss_after_mb: tuple[float, float] = (float("nan"), float("nan"))


async def one_run(args: argparse.Namespace, spread_s: tuple[int, int]) -> RunResult:
    cluster = await asyncio.to_thread(DelayCluster, not args.no_trace)
    result = RunResult()
    try:
        print(f"  cluster: meta pid {cluster.meta.pid}, realtime pid {cluster.realtime.pid}, "
              f"delay pid {cluster.delay.pid}", flush=True)
        if "w1" in args.only:
            result.w1 = await w1_steady(cluster, args.messages, spread_s, args.window,
                                        args.api)
            print(f"  W1: {_w1_line(result.w1)}", flush=True)
        if "w2" in args.only:
            estimate = result.w1.get("sends_per_s", 5_000.0)
            result.w2 = await w2_hot_second(cluster, args.hot, args.window, estimate,
                                            args.api)
            print(f"  W2: {_w2_line(result.w2)}", flush=True)
        result.rss_after_mb = rss_mb(cluster.delay.pid)
        if "w4" in args.only:
            result.w4 = await w4_retries(cluster, args.retry_messages)
            print(f"  W4: {_w4_line(result.w4)}", flush=True)
        if args.w3_pending:
            result.w3 = await w3_pending(cluster, args.w3_pending, args.window, args.api)
            w3 = result.w3
            print(f"  W3: {w3['pending']:,} far-future messages at {w3['sends_per_s']:,.0f} "
                  f"sends/s (CPU per send: client {w3['client_us_per_send']:.0f} us, delay server "
                  f"{w3['delay_us_per_send']:.0f} us); delay server RSS {w3['rss_mb']:.0f} MB, "
                  f"peak {w3['hwm_mb']:.0f} MB; failed {w3['failed']}", flush=True)
    finally:
        await asyncio.to_thread(cluster.close)
    return result


def _w1_line(w: dict[str, float]) -> str:
    return (f"{w['sends_per_s']:,.0f} delayed sends/s; lateness p50 {w['p50_ms']:.0f} ms, "
            f"p99 {w['p99_ms']:.0f} ms, max {w['max_ms']:.0f} ms; early {w['early']}; received "
            f"{w['received']}, duplicates {w['duplicates']}, failed sends {w['failed']}; "
            f"delay server: dispatch lateness p50 <= {w['server_p50_le']} ms, p99 <= "
            f"{w['server_p99_le']} ms, max {w['server_max_ms']} ms; CPU per delayed send: client "
            f"{w['client_us_per_send']:.0f} us, delay server {w['delay_us_per_send']:.0f} us "
            f"(delay server CPU in all {w['delay_cpu_s']:.1f} s); {w['during_count']} due while "
            f"sending: p99 {w['during_p99_ms']:.0f} ms; {w['after_count']} due 1 s after the "
            f"sends: p50 {w['after_p50_ms']:.0f} / p99 {w['after_p99_ms']:.0f} / max "
            f"{w['after_max_ms']:.0f} ms; due in the 5 s after a minute: p99 "
            f"{w['boundary_p99_ms']:.0f} ms, due in the other 55 s: p99 {w['rest_p99_ms']:.0f} ms; "
            f"machine short of CPU {100 * w['cpu_short']:.0f}% of the time")


def _w2_line(w: dict[str, float]) -> str:
    return (f"last received {w['last_after_second_s']:.2f} s after the hot second ended; "
            f"lateness p50 {w['p50_ms']:.0f} ms, p99 {w['p99_ms']:.0f} ms, max "
            f"{w['max_ms']:.0f} ms; early {w['early']}; received {w['received']}, duplicates "
            f"{w['duplicates']}; all stored {w['stored_margin_s']:.1f} s before the second; "
            f"delay server: largest dispatch lateness {w.get('server_max_ms')} ms; CPU per "
            f"message from the second to the last receipt: delay server "
            f"{w['delay_us_per_message']:.0f} us, broker {w['broker_us_per_message']:.0f} us; "
            f"machine short of CPU {100 * w['cpu_short']:.0f}% of the time")


def _w4_line(w: dict[str, Any]) -> str:
    parts = []
    for step_ms, gaps in zip(W4_BACKOFF_MS, w["gaps_ms"]):
        if gaps:
            parts.append(f"{step_ms} ms -> min {gaps[0]:.0f} / p50 {percentile(gaps, 0.5):.0f} / "
                         f"max {gaps[-1]:.0f} ms")
    return (f"{w['finished']}/{w['count']} finished after {W4_FAILURES} failures, "
            f"{w['extra_calls']} extra calls; gaps " + "; ".join(parts))


def _median(values: list[float]) -> float:
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")


def _verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def report(results: list[RunResult], args: argparse.Namespace, spread_s: tuple[int, int]) -> None:
    runs = len(results)
    print(f"\nMedians of {runs} run(s); {args.messages:,} messages (W1, delays "
          f"{spread_s[0]}-{spread_s[1]} s), {args.hot:,} (W2), {BODY_BYTES}-byte bodies")
    if results[0].w1:
        w1 = {k: _median([r.w1[k] for r in results]) for k in
              ("sends_per_s", "p50_ms", "p99_ms", "max_ms", "early", "duplicates")}
        print(f"  delayed sends/s          {w1['sends_per_s']:>10,.0f}   goal >= "
              f"{GOAL_SENDS_PER_S:,}   {_verdict(w1['sends_per_s'] >= GOAL_SENDS_PER_S)}")
        print(f"  W1 lateness p50          {w1['p50_ms']:>10.0f} ms")
        print(f"  W1 lateness p99          {w1['p99_ms']:>10.0f} ms  goal <= {GOAL_W1_P99_MS} ms"
              f"   {_verdict(w1['p99_ms'] <= GOAL_W1_P99_MS)}")
        print(f"  W1 lateness max          {w1['max_ms']:>10.0f} ms")
        steady = _median([r.w1["after_p99_ms"] for r in results])
        print(f"  W1 p99 of those due 1 s after the last send {steady:.0f} ms  goal <= "
              f"{GOAL_W1_P99_MS} ms   {_verdict(steady <= GOAL_W1_P99_MS)}; due while sending: "
              f"p99 {_median([r.w1['during_p99_ms'] for r in results]):.0f} ms")
        print(f"  CPU per delayed send     client "
              f"{_median([r.w1['client_us_per_send'] for r in results]):.0f} us, delay server "
              f"{_median([r.w1['delay_us_per_send'] for r in results]):.0f} us; machine short of "
              f"CPU {100 * _median([r.w1['cpu_short'] for r in results]):.0f}% of W1")
        early = max(r.w1["early"] for r in results)
        print(f"  W1 early (worst run)     {early:>10.0f}      goal 0   {_verdict(early == 0)}")
        print(f"  W1 duplicates (worst)    {max(r.w1['duplicates'] for r in results):>10.0f}")
    if results[0].w2:
        last = _median([r.w2["last_after_second_s"] for r in results])
        print(f"  W2 last after its second {last:>10.2f} s   goal <= {GOAL_W2_LAST_S} s   "
              f"{_verdict(last <= GOAL_W2_LAST_S)}  (DESIGN asks {DESIGN_W2_LAST_S} s for 20k; "
              f"{_verdict(last <= DESIGN_W2_LAST_S)} at {args.hot:,})")
        print(f"  W2 lateness max          {_median([r.w2['max_ms'] for r in results]):>10.0f} ms"
              f"; early (worst run) {max(r.w2['early'] for r in results):.0f}")
    rss = _median([r.rss_after_mb[0] for r in results])
    hwm = _median([r.rss_after_mb[1] for r in results])
    when = "after W1+W2" if results[0].w1 or results[0].w2 else "idle"
    print(f"  W3 delay server RSS {when}: {rss:.0f} MB (peak {hwm:.0f} MB); goal <= "
          f"{GOAL_RSS_MB} MB at 10M pending: see bench/delay_capacity.py")
    if results[0].w3:
        w3 = results[0].w3
        print(f"  W3 with {w3['pending']:,} pending: RSS {w3['rss_mb']:.0f} MB (peak "
              f"{w3['hwm_mb']:.0f} MB)   {_verdict(w3['rss_mb'] <= GOAL_RSS_MB)} at this size")
    if results[0].w4:
        for step, step_ms in enumerate(W4_BACKOFF_MS):
            gaps = sorted(g for r in results for g in r.w4["gaps_ms"][step])
            if gaps:
                print(f"  W4 retry {step + 1}: configured {step_ms} ms, observed min "
                      f"{gaps[0]:.0f} / p50 {percentile(gaps, 0.5):.0f} / max {gaps[-1]:.0f} ms"
                      f"   {_verdict(gaps[0] >= step_ms)} (never early)")


async def run(args: argparse.Namespace) -> None:
    spread_s = (1, 10) if args.quick else (1, 60)
    print(f"bench.delay {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; {cpu_model()}, "
          f"{os.cpu_count()} CPUs; Python {platform.python_version()}; load average "
          f"{os.getloadavg()[0]:.2f}; servers {'without' if args.no_trace else 'with'} trace "
          f"events", flush=True)
    results = []
    for n in range(args.runs):
        print(f"run {n + 1} of {args.runs}", flush=True)
        results.append(await one_run(args, spread_s))
    report(results, args, spread_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.delay", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="10,000 messages, delays 1-10 s")
    parser.add_argument("--messages", type=int, default=None, help="W1 messages")
    parser.add_argument("--hot", type=int, default=None, help="W2 messages")
    parser.add_argument("--retry-messages", type=int, default=None, help="W4 messages")
    parser.add_argument("--w3-pending", type=int, default=0,
                        help="also fill the delay server with this many far-future messages "
                             "and report its RSS")
    parser.add_argument("--window", type=int, default=SEND_WINDOW,
                        help="send() calls pending at once")
    parser.add_argument("--api", choices=("send", "send_many"), default="send",
                        help="concurrent send(delay=...) calls, or send_many calls of "
                             f"{SEND_MANY_CHUNK} with a due time per message")
    parser.add_argument("--runs", type=int, default=RUNS)
    parser.add_argument("--no-trace", action="store_true",
                        help="run the servers with --no-trace (default: they write trace events)")
    parser.add_argument("--only", default="w1,w2,w4", help="comma-separated: w1,w2,w4")
    # The consumer child's arguments.
    parser.add_argument("--consumer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--meta", help=argparse.SUPPRESS)
    parser.add_argument("--subject", help=argparse.SUPPRESS)
    parser.add_argument("--group", help=argparse.SUPPRESS)
    parser.add_argument("--expect", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--timeout-s", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.consumer:
        asyncio.run(_consume(args))
        return 0
    size = 10_000 if args.quick else 100_000
    args.messages = args.messages or size
    args.hot = args.hot or size
    args.retry_messages = args.retry_messages or (20 if args.quick else 50)
    args.only = set(args.only.split(","))
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
