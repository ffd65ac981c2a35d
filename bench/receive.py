"""The consumer SDK's receive path, in-process: CPU microseconds per message received and acked.

Run: ``.venv/bin/python -m bench.receive`` (pull answers of 256 messages, 400 of them a run).

One pull answer (``--pull-batch`` messages of 256-byte bodies, as a broker sends it) is decoded
from its frame again and again and goes the way a pulled batch goes in ``sdk.consumer``: the
answer's columns are read, every payload checked and turned into a ``ReceivedMessage``, the
batch put in the subscription's prefetch buffer, each message taken by the iterator, its body
read and ``await msg.ack()`` recorded in the ack batcher (which sends nothing here). No socket
and no broker: the figure is the SDK's own cost per message, which the end-to-end benchmark's
consumer figure contains together with the sockets, the event loop and the benchmark's own
bookkeeping.

Each run is repeated ``--runs`` times (default 3) and the median printed. This is a benchmark,
not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from types import SimpleNamespace
from typing import Any

from sdk.acks import AckBatcher
from sdk.consumer import Consumer, Subscription
from sdk.received import PullSize, _PulledBatch
from wire.message import Message, encode_message
from wire.protocol import decode_frame_payload, encode_frame, pull_response

BODY_BYTES = 256
SUBJECT = "bench.receive"


def answer_frame(count: int) -> bytes:
    """The payload of a pull answer frame carrying ``count`` fresh messages."""
    payloads = [encode_message(Message.create(SUBJECT, os.urandom(BODY_BYTES),
                                              now_ms=1_767_225_600_000)) for _ in range(count)]
    frame = encode_frame({"rid": 1, **pull_response(list(range(count)), payloads,
                                                    [0] * count)})
    return frame[4:]  # without the length header, as the connection hands it on


async def run_once(frame: bytes, answers: int) -> float:
    """CPU seconds per message to receive, iterate and ack ``answers`` pull answers."""

    async def send_nothing(address: str, op: dict[str, Any]) -> dict[str, Any]:
        return {"acked": 0}

    acks = AckBatcher(send_nothing, interval_ms=20, pending_max=1 << 62)
    consumer: Any = SimpleNamespace(_acks=acks)  # what ReceivedMessage.ack reaches for
    sub = Subscription(SUBJECT, [], PullSize(1, 1, 1 << 30))  # a buffer that never fills
    received = 0
    start_s = time.process_time()
    for _ in range(answers):
        answer = decode_frame_payload(frame)
        batch = _PulledBatch(consumer, "group-a", "127.0.0.1:1",
                             ("127.0.0.1:1", "group-a", SUBJECT))
        messages = Consumer._received(answer, sub, batch)
        sub._prefetch.put_fitting(messages)  # as Consumer._hand_over does
        for _ in range(len(messages)):
            msg = await sub.__anext__()
            msg.body
            await msg.ack()
        received += len(messages)
        acks._pending.clear()  # what a flush would send: nothing goes anywhere here
        acks._count = 0
    return (time.process_time() - start_s) / received


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pull-batch", type=int, default=256, help="messages per pull answer")
    parser.add_argument("--answers", type=int, default=400, help="pull answers per run")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    frame = answer_frame(args.pull_batch)
    per_message_us = [asyncio.run(run_once(frame, args.answers)) * 1e6 for _ in range(args.runs)]
    print(f"{args.answers} pull answers of {args.pull_batch} messages: receive + iterate + ack "
          f"cost the consumer {statistics.median(per_message_us):.2f} CPU-us per message "
          f"(median; runs {', '.join(f'{us:.2f}' for us in per_message_us)})")


if __name__ == "__main__":
    main()
