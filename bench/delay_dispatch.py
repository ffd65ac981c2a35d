"""In-process benchmark of the delay server's dispatch path: a hot second, no sockets.

A ``Scheduler`` with a fake clock, tracing on, and a fake broker that does the client's share
of a real dispatch (packs the ``send`` request, unpacks a prepared answer of one ``{id,
status}`` map per message) stores N messages due at random times within one second, then the
clock jumps past that second and the benchmark takes the process CPU time until every message
is confirmed and recorded. It prints the delay server's CPU microseconds per dispatched message
(the W2 figure of ``bench.delay`` without the broker, the consumer and the network), which is
far steadier than end-to-end timings on a shared machine.

``--one-instant`` makes it W2's hot slot: every message due at the same instant, and the clock
first stops ``--lead-ms`` before it (the timer reads payloads ahead there, uncounted), then
moves to the instant; the figure is the CPU from the due instant to the last record, and the
wall ms it took are printed beside it.

    .venv/bin/python -m bench.delay_dispatch            # 100,000 messages
    .venv/bin/python -m bench.delay_dispatch --messages 20000 --runs 3
    .venv/bin/python -m bench.delay_dispatch --messages 20000 --runs 5 --one-instant

A benchmark, not a test: it asserts nothing. Every wait is bounded in time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import tempfile
import time

import msgpack

from delayserver.config import DelayConfig
from delayserver.scheduler import Scheduler
from delayserver.tracing import DelayTracer
from wire.message import Message, encode_message
from tracelog.writer import TraceWriter

BODY_BYTES = 256
SEND_CHUNK = 256  # messages per schedule() call while storing
BROKER_ANSWER_DELAY_S = 0.001  # the fake broker answers after this (a loopback round trip)
DISPATCH_TIMEOUT_S = 300.0
START_MS = 1_700_000_000_000


class FakeClock:
    """The scheduler's clock, moved by hand (ms)."""

    def __init__(self) -> None:
        self.now_ms = START_MS

    def __call__(self) -> int:
        return self.now_ms


LEAD_SETTLE_S = 1.0  # real time the clock rests at --lead-ms before the due instant


async def one_run(messages: int, one_instant: bool = False, lead_ms: int = 0
                  ) -> tuple[float, float]:
    """Store ``messages`` due within one second (or at one instant), dispatch them; CPU-us
    per message and the wall ms from the due time to the last record."""
    directory = tempfile.mkdtemp(prefix="qmq-bench-dispatch-")
    clock = FakeClock()
    confirmed = 0
    all_confirmed = asyncio.Event()
    answers: dict[int, bytes] = {}

    async def dispatch(subject: str, payloads: list[bytes]):
        nonlocal confirmed
        msgpack.packb({"op": "send", "messages": payloads, "rid": 1}, use_bin_type=True)
        answer = answers.get(len(payloads))
        if answer is None:
            answer = answers[len(payloads)] = msgpack.packb(
                {"rid": 1, "results": [{"id": "m-0123456789abcdef0123", "status": "stored"}]
                 * len(payloads)})
        await asyncio.sleep(BROKER_ANSWER_DELAY_S)
        confirmed += len(payloads)
        if confirmed >= messages:
            all_confirmed.set()
        return "rt-bench", msgpack.unpackb(answer)["results"]

    trace = TraceWriter(os.path.join(directory, "trace"), "delay:bench", clock_ms=clock)
    scheduler = await Scheduler.open(DelayConfig(data_dir=directory, port=0), clock, dispatch,
                                     tracer=DelayTracer(trace))
    try:
        await scheduler.start()
        second_ms = clock.now_ms - clock.now_ms % 60_000 + 30_000
        rng = random.Random(2)
        body = os.urandom(BODY_BYTES)
        payloads = [encode_message(Message.create("bench.w2", body, now_ms=clock.now_ms,
                                                  deliver_at_ms=second_ms + (
                                                      0 if one_instant else rng.randrange(1000))))
                    for _ in range(messages)]
        for start in range(0, messages, 4 * SEND_CHUNK):
            await asyncio.gather(*(scheduler.schedule(payloads[at:at + SEND_CHUNK])
                                   for at in range(start, min(messages, start + 4 * SEND_CHUNK),
                                                   SEND_CHUNK)))
        if lead_ms:
            clock.now_ms = second_ms - lead_ms
            scheduler.poke()
            await asyncio.sleep(LEAD_SETTLE_S)
        clock.now_ms = second_ms + (0 if one_instant else 1_000)
        cpu_s, wall_s = time.process_time(), time.monotonic()
        scheduler.poke()
        await asyncio.wait_for(all_confirmed.wait(), DISPATCH_TIMEOUT_S)
        deadline = time.monotonic() + DISPATCH_TIMEOUT_S
        while scheduler.dispatcher.tasks and time.monotonic() < deadline:  # the last records
            await asyncio.sleep(0.001)
        return ((time.process_time() - cpu_s) / messages * 1e6,
                (time.monotonic() - wall_s) * 1000)
    finally:
        await scheduler.stop()
        trace.close()
        shutil.rmtree(directory, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.delay_dispatch",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--one-instant", action="store_true",
                        help="every message due at the same instant (W2)")
    parser.add_argument("--lead-ms", type=int, default=300,
                        help="with --one-instant: the clock rests this far before the instant")
    args = parser.parse_args(argv)
    lead_ms = args.lead_ms if args.one_instant else 0
    figures, walls = [], []
    for run in range(args.runs):
        cpu_us, wall_ms = asyncio.run(one_run(args.messages, args.one_instant, lead_ms))
        figures.append(cpu_us)
        walls.append(wall_ms)
        print(f"run {run + 1}: {cpu_us:.1f} CPU-us per dispatched message, {wall_ms:.0f} ms "
              f"to the last record; load average {os.getloadavg()[0]:.2f}", flush=True)
    shape = (f"due at one instant, {lead_ms} ms of lead" if args.one_instant
             else "due in one second")
    print(f"median of {args.runs}: {statistics.median(figures):.1f} CPU-us per dispatched "
          f"message, {statistics.median(walls):.0f} ms to the last record ({args.messages:,} "
          f"{shape}, tracing on)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
