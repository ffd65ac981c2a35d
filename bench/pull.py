"""The realtime broker's pull + ack path, in-process: CPU microseconds per message consumed.

Run: ``.venv/bin/python -m bench.pull`` (6,000 messages a round, 5 rounds, pulls of 256).

A ``Broker`` (sync flush, tracing on, a temporary data dir) is given ``--messages`` messages of
256-byte bodies in sends of 256; then ``--consumers`` consumers of one group pull them
(``--pull-batch`` a pull, the answer encoded as the frame the server would write) and ack each
pull as one range, until every message is consumed. Only that consume phase is timed, with
``process_time`` (every thread of this process: the event loop, both storage threads and the
trace writer), so the figure is what pulls and acks cost the broker per message, without the
sockets and request parsing around them. ``--messages`` below the tracer's memory of recently
stored messages (32,768 per subject) is the case of consumers that keep up; above it, pulls
decode payloads to trace them.

Each run of ``--rounds`` rounds is repeated ``--runs`` times (default 3) and the median printed.
This is a benchmark, not a test: it asserts nothing.
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
from realtime.tracing import BrokerTracer
from wire.message import Message, encode_message
from wire.protocol import Ack, Pull, encode_frame, pull_response
from tracelog.writer import TraceWriter

BODY_BYTES = 256
SEND_BATCH = 256
SUBJECT, GROUP = "bench.pull", "g"


async def consume(broker: Broker, count: int, consumers: int, pull_batch: int) -> None:
    """``consumers`` consumers pull and ack until ``count`` messages were handed out."""
    state = {"got": 0}

    async def consumer(consumer_id: str) -> None:
        pull = Pull(1, SUBJECT, GROUP, consumer_id, pull_batch, 0, [], "earliest", False)
        while state["got"] < count:
            pulled = await broker.pull(pull)
            encode_frame({"rid": 1, **pull_response(*pulled)})
            if not pulled.pull_seqs:
                await asyncio.sleep(0)
                continue
            state["got"] += len(pulled.pull_seqs)
            ranges = [(pulled.pull_seqs[0], pulled.pull_seqs[-1])]
            await broker.ack(Ack(2, SUBJECT, GROUP, consumer_id, ranges))

    await asyncio.gather(*(consumer(f"c{n}") for n in range(consumers)))


async def run_once(count: int, rounds: int, consumers: int, pull_batch: int) -> float:
    """CPU seconds per message of the consume phases of ``rounds`` rounds."""
    with tempfile.TemporaryDirectory(prefix="qmq-bench-pull-") as directory:
        config = RealtimeConfig(data_dir=directory, port=0)
        writer = TraceWriter(config.trace_directory, "realtime:bench")
        broker = await Broker.open(config, tracer=BrokerTracer(writer))
        cpu_s = 0.0
        try:
            for _ in range(rounds):
                payloads = [encode_message(Message.create(SUBJECT, os.urandom(BODY_BYTES),
                                                          now_ms=broker.clock()))
                            for _ in range(count)]
                await asyncio.gather(*(broker.send(payloads[i:i + SEND_BATCH])
                                       for i in range(0, count, SEND_BATCH)))
                start_s = time.process_time()
                await consume(broker, count, consumers, pull_batch)
                cpu_s += time.process_time() - start_s
        finally:
            await broker.stop()
            writer.close()
        return cpu_s / (count * rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=6_000, help="messages per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--consumers", type=int, default=4)
    parser.add_argument("--pull-batch", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    per_message_us = [asyncio.run(run_once(args.messages, args.rounds, args.consumers,
                                           args.pull_batch)) * 1e6
                      for _ in range(args.runs)]
    print(f"{args.messages:,} messages x {args.rounds} rounds, {args.consumers} consumers, "
          f"pulls of {args.pull_batch}, tracing on: pull + ack cost the broker "
          f"{statistics.median(per_message_us):.2f} CPU-us per message (median; runs "
          f"{', '.join(f'{us:.2f}' for us in per_message_us)})")


if __name__ == "__main__":
    main()
