"""Gateway benchmark: sends through the HTTP gateway against the SDK on the binary protocol, in
one sitting, to the same broker.

Run: ``.venv/bin/python -m bench.gateway`` (``--messages`` 20,000 per throughput run,
``--in-flight`` 32, ``--rate`` 500 msg/s and ``--latency-messages`` 5,000 for the latency runs;
``--quick`` for a tenth of it).

A MetaServer and a realtime broker (``--flush sync``, tracing on) run as ``python -m qmq``
subprocesses on 127.0.0.1 port 0; this process is the client. Messages have 256-byte bodies.
Runs, one after the other on the same cluster:

* **throughput**: ``--messages`` as fast as the client goes, ``--in-flight`` requests at a time:
  the SDK (``Producer.send``, one message per call, batched by the SDK), the gateway with one
  message per HTTP request, and the gateway with ``--batch`` (64) messages per request;
* **latency** at a fixed ``--rate``: each message's time from the call to its stored answer, the
  SDK against the gateway with one message per request.

Printed beside the figures: the MetaServer's and the broker's CPU seconds per run, and the load
average, since the machine may be shared; a latency run whose schedule fell behind, or which
finished below 90% of its rate (its latency is then queueing), says so. A
benchmark, not a test: it asserts nothing, and every wait is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp

import qmq
from bench._cluster import Cluster, cpu_model, paced, percentile, process_cpu_s

BODY = "x" * 256
SUBJECT = "bench.gateway"
# Longest a throughput or latency run may take before it is abandoned, in seconds.
RUN_TIMEOUT_S = 600.0
# A paced run that finished below this share of its asked rate did not keep up with it.
KEPT_UP_SHARE = 0.9


@dataclass
class Result:
    """One run's figures."""

    name: str
    messages: int
    seconds: float
    latencies_ms: list[float]
    meta_cpu_s: float
    broker_cpu_s: float
    behind_s: float = 0.0  # a paced run: how late its last start was
    rate: float | None = None  # a paced run: the rate asked for, messages per second

    def line(self) -> str:
        rate = self.messages / self.seconds if self.seconds else float("nan")
        lat = sorted(self.latencies_ms)
        behind = f"  (schedule {self.behind_s:.1f} s behind)" if self.behind_s > 0.5 else ""
        if self.rate is not None and rate < KEPT_UP_SHARE * self.rate:
            # Calls start on schedule whether or not earlier ones have answered (open loop),
            # so a server that cannot keep up shows as queueing: latency grows with the run.
            behind += f"  (did not keep up with {self.rate:.0f}/s: latency is queueing)"
        return (f"{self.name:34} {self.messages:>7,} {rate:>10,.0f} {percentile(lat, 0.5):>8.1f} "
                f"{percentile(lat, 0.99):>8.1f} {self.meta_cpu_s:>8.1f} {self.broker_cpu_s:>8.1f}"
                f"{behind}")


class Bench:
    """The cluster, an SDK producer and an HTTP session, and the runs over them."""

    def __init__(self, cluster: Cluster, producer: qmq.Producer,
                 http: aiohttp.ClientSession) -> None:
        self.cluster = cluster
        self.producer = producer
        self.http = http
        self.url = cluster.meta_url + "/api/send"

    async def sdk_send(self) -> None:
        await self.producer.send(SUBJECT, BODY.encode())

    async def http_send(self, count: int = 1) -> None:
        body = {"messages": [{"subject": SUBJECT, "body": BODY}] * count}
        async with self.http.post(self.url, json=body) as resp:
            answer = await resp.json()
        if resp.status != 200 or any("error" in r for r in answer["results"]):
            raise RuntimeError(f"gateway send failed: HTTP {resp.status} {answer}")

    async def measured(self, name: str, messages: int,
                       body: Callable[[list[float]], Awaitable[float]],
                       rate: float | None = None) -> Result:
        meta, broker = self.cluster.meta.pid, self.cluster.broker.pid
        meta_cpu, broker_cpu = process_cpu_s(meta), process_cpu_s(broker)
        latencies: list[float] = []
        started = time.perf_counter()
        behind = await asyncio.wait_for(body(latencies), RUN_TIMEOUT_S)
        seconds = time.perf_counter() - started
        return Result(name, messages, seconds, latencies, process_cpu_s(meta) - meta_cpu,
                      process_cpu_s(broker) - broker_cpu, behind, rate)

    async def throughput(self, name: str, messages: int, in_flight: int,
                         send: Callable[[], Awaitable[None]], per_call: int = 1) -> Result:
        calls = messages // per_call

        async def body(latencies: list[float]) -> float:
            next_call = iter(range(calls))

            async def worker() -> None:
                for _ in next_call:
                    start = time.perf_counter()
                    await send()
                    latencies.append((time.perf_counter() - start) * 1000)

            await asyncio.gather(*(worker() for _ in range(in_flight)))
            return 0.0

        return await self.measured(name, calls * per_call, body)

    async def latency(self, name: str, messages: int, rate: float,
                      send: Callable[[], Awaitable[None]]) -> Result:
        async def body(latencies: list[float]) -> float:
            async def one(_: int) -> None:
                start = time.perf_counter()
                await send()
                latencies.append((time.perf_counter() - start) * 1000)

            began, last = await paced(messages, rate, one)
            return max(0.0, last - began - messages / rate)

        return await self.measured(name, messages, body, rate)


async def run(args: argparse.Namespace) -> None:
    scale = 10 if args.quick else 1
    messages, latency_messages = args.messages // scale, args.latency_messages // scale
    load_before = os.getloadavg()
    with Cluster(flush="sync") as cluster:
        async with qmq.Producer(cluster.meta_url, in_flight_max=args.in_flight) as producer, \
                aiohttp.ClientSession() as http:
            bench = Bench(cluster, producer, http)
            await bench.sdk_send()  # routes cached, connections open, before any timing
            await bench.http_send()
            results = [
                await bench.throughput("SDK, binary protocol", messages, args.in_flight,
                                       bench.sdk_send),
                await bench.throughput("gateway, 1 message/request", messages, args.in_flight,
                                       bench.http_send),
                await bench.throughput(f"gateway, {args.batch} messages/request", messages,
                                       max(1, args.in_flight // 8),
                                       lambda: bench.http_send(args.batch), args.batch),
                await bench.latency(f"SDK at {args.rate:.0f}/s", latency_messages, args.rate,
                                    bench.sdk_send),
                await bench.latency(f"gateway at {args.rate:.0f}/s", latency_messages,
                                    args.rate, bench.http_send),
            ]
    load_after = os.getloadavg()
    print(f"{'run':34} {'msgs':>7} {'msg/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'meta s':>8} "
          f"{'broker s':>8}")
    for result in results:
        print(result.line())
    print(f"256-byte bodies, flush sync, {args.in_flight} requests in flight (batched: "
          f"{max(1, args.in_flight // 8)}); latency is per call (a batched request's for all its "
          f"messages); CPU seconds of the MetaServer and the broker per run; {cpu_model()}, "
          f"{os.cpu_count()} cores; load average {load_before[0]:.1f} before, "
          f"{load_after[0]:.1f} after")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--in-flight", type=int, default=32)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rate", type=float, default=500.0)
    parser.add_argument("--latency-messages", type=int, default=5_000)
    parser.add_argument("--quick", action="store_true", help="a tenth of the messages")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
