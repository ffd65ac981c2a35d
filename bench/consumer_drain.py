"""A lone consumer draining a backlog that is visible at once (W2's floor on the consumer side:
the hot slot's messages already stored, as a hand-off ahead of the due time would leave them).

N realtime messages are sent to a fresh ``qmq up`` first; then one SDK ``Consumer`` in this
process (``async for`` and ``await msg.ack()``, as an application) drains them. It prints the
time from the first to the last receipt, how many pull requests it took (counted on the
consumer's connection pool), the sizes the first pulls asked for, and the CPU of ``qmq up`` and
of this process meanwhile. ``--fixed`` runs the same with ``pull_batch_max=pull_batch`` (pulls
fixed at 256, the behaviour before pulls adapted), alternating with the default run by run.

    .venv/bin/python -m bench.consumer_drain --runs 3
    .venv/bin/python -m bench.consumer_drain --runs 3 --fixed   # default and fixed, alternating

A benchmark, not a test: it asserts nothing. Every wait is bounded in time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from typing import Any

from bench._cluster import process_cpu_s
from bench.peers import servers
from sdk.connection import Connection
from sdk.consumer import PULL_BATCH_DEFAULT, Consumer
from sdk.producer import Producer

SUBJECT = "drain.s"
BODY_BYTES = 200
SEND_BATCH = 256
DRAIN_TIMEOUT_S = 120.0


async def _drain(url: str, server_pid: int, count: int, fixed: bool) -> dict[str, Any]:
    async with Producer(url) as producer:
        body = b"x" * BODY_BYTES
        for start in range(0, count, SEND_BATCH):
            await producer.send_many(SUBJECT, [body] * min(SEND_BATCH, count - start))
    options: dict[str, Any] = {"pull_batch_max": PULL_BATCH_DEFAULT} if fixed else {}
    consumer = Consumer(url, group="drain", start="earliest", **options)
    asked: list[tuple[int, int]] = []
    request_nowait = Connection.request_nowait

    def counted(conn: Connection, op: dict[str, Any], timeout_ms: int | None,
                on_answer: Any, on_error: Any) -> int:
        def noted(answer: dict[str, Any]) -> None:
            if op.get("op") == "pull" and op.get("subject") == SUBJECT:
                asked.append((op["max_count"], len(answer.get("payloads") or ())))
            on_answer(answer)
        return request_nowait(conn, op, timeout_ms, noted, on_error)

    Connection.request_nowait = counted  # type: ignore[method-assign]
    server_cpu_s, own_cpu_s = process_cpu_s(server_pid), time.process_time()
    received, first, last = 0, 0.0, 0.0
    try:
        async with consumer:
            async with asyncio.timeout(DRAIN_TIMEOUT_S):
                async for msg in consumer.subscribe(SUBJECT):
                    last = time.monotonic()
                    first = first or last
                    await msg.ack()
                    received += 1
                    if received == count:
                        break
    finally:
        Connection.request_nowait = request_nowait  # type: ignore[method-assign]
    return {"drain_ms": round((last - first) * 1000), "pulls": len(asked),
            "first_pulls": asked[:5], "received": received,
            "server_cpu_s": process_cpu_s(server_pid) - server_cpu_s,
            "consumer_cpu_s": time.process_time() - own_cpu_s}


def one_run(count: int, fixed: bool) -> dict[str, Any]:
    """One drain of ``count`` messages against a fresh ``qmq up``."""
    running = servers.start(servers.SETTINGS_BY_KEY["pyqmq"], None)
    try:
        return asyncio.run(_drain(running.url, running.pids[0], count, fixed))
    finally:
        running.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.consumer_drain",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--fixed", action="store_true",
                        help="alternate with pulls fixed at pull_batch (before they adapted)")
    args = parser.parse_args(argv)
    kinds = ("adaptive", "fixed") if args.fixed else ("adaptive",)
    figures: dict[str, list[dict[str, Any]]] = {kind: [] for kind in kinds}
    for run in range(1, args.runs + 1):
        for kind in kinds:
            result = one_run(args.messages, kind == "fixed")
            figures[kind].append(result)
            print(f"run {run} {kind}: drained {result['received']:,} in {result['drain_ms']} ms, "
                  f"{result['pulls']} pulls (first {result['first_pulls']}); qmq up "
                  f"{result['server_cpu_s']:.2f} CPU-s, consumer {result['consumer_cpu_s']:.2f} "
                  f"CPU-s; load average {os.getloadavg()[0]:.2f}", flush=True)
    for kind, results in figures.items():
        print(f"median of {len(results)} {kind}: "
              f"{statistics.median(r['drain_ms'] for r in results):.0f} ms, "
              f"{statistics.median(r['pulls'] for r in results):.0f} pulls, qmq up "
              f"{statistics.median(r['server_cpu_s'] for r in results):.2f} CPU-s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
