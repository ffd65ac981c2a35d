"""The realtime broker's send path, in-process: CPU microseconds per message stored.

Run: ``.venv/bin/python -m bench.send`` (100,000 messages in sends of 256, 8 in flight).

A ``Broker`` (sync flush, tracing on, a temporary data dir) is given ``--messages`` messages of
256-byte bodies, already encoded as a producer encodes them, in ``Broker.send`` calls of
``--batch`` messages with ``--in-flight`` calls at a time, so group commits take several
requests as they do under load. ``--delayed`` stamps every message with a ``deliver_at_ms`` in
the past, as a delay server's dispatch does (W2 of bench/delay.py sends about 100 a request).
Only the sends are timed, with ``process_time`` (every thread of this process: the event loop,
the store thread and the trace writer), so the figure is what the check, the group commit, the
tail and the trace events cost the broker per message, without the sockets and frames around
them (bench/realtime.py has those).

Each run is repeated ``--runs`` times (default 3) and the median printed. This is a benchmark,
not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time

from realtime.broker import Broker
from realtime.config import RealtimeConfig
from serverkit.server import tune_gc
from realtime.tracing import BrokerTracer
from wire.message import Message, encode_message
from tracelog.writer import TraceWriter

BODY_BYTES = 256
SUBJECT = "bench.send"
CREATED_AT_MS = 1_767_225_600_000


def payloads(count: int, batch: int, delayed: bool) -> list[list[bytes]]:
    """``count`` encoded messages in lists of ``batch``, with ids unique across runs."""
    prefix = os.urandom(8).hex()
    encoded = [encode_message(Message(
        id=f"{prefix}{n:016x}", subject=SUBJECT, body=b"x" * BODY_BYTES,
        created_at_ms=CREATED_AT_MS + n // 64,
        deliver_at_ms=CREATED_AT_MS + n // 64 if delayed else None)) for n in range(count)]
    return [encoded[n:n + batch] for n in range(0, count, batch)]


async def run_once(count: int, batch: int, in_flight: int, delayed: bool) -> float:
    """CPU microseconds per message of sending ``count`` messages."""
    with tempfile.TemporaryDirectory() as data_dir:
        writer = TraceWriter(os.path.join(data_dir, "trace"), "realtime:bench")
        broker = await Broker.open(RealtimeConfig(data_dir=data_dir, port=0),
                                   tracer=BrokerTracer(writer))
        tune_gc()
        requests = payloads(count, batch, delayed)
        slots = asyncio.Semaphore(in_flight)

        async def send(request: list[bytes]) -> None:
            async with slots:
                await broker.send(request)

        started_s = time.process_time()
        await asyncio.gather(*(send(request) for request in requests))
        cpu_s = time.process_time() - started_s
        await broker.stop()
        writer.close()
        return cpu_s / count * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=256, help="messages per send (max 256)")
    parser.add_argument("--in-flight", type=int, default=8, help="sends at a time")
    parser.add_argument("--delayed", action="store_true",
                        help="messages carry a past deliver_at_ms, as a delay server's do")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    runs = [asyncio.run(run_once(args.messages, args.batch, args.in_flight, args.delayed))
            for _ in range(args.runs)]
    print(f"bench.send: {args.messages:,} messages of {BODY_BYTES} B, sends of {args.batch}, "
          f"{args.in_flight} in flight, {'delayed' if args.delayed else 'not delayed'}, "
          f"tracing on, sync flush")
    print(f"  broker CPU-us per message stored: median {statistics.median(runs):.2f} "
          f"(runs {', '.join(f'{r:.2f}' for r in runs)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
