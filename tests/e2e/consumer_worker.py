"""A consumer in its own process, for tests that kill it: ``python -m tests.e2e.consumer_worker``.

Prints one JSON line per message it gets (``{"id", "redelivered", "broker_group"}``) and acks it
unless ``--hold`` is given (then it keeps every message unacked for as long as it lives). Prints
``{"ready": true}`` once subscribed. Runs until SIGTERM or SIGKILL.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys

import qmq


async def run(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    consumer = qmq.Consumer(args.meta, group=args.group, consumer_id=args.consumer_id,
                            start=args.start, pull_batch=args.pull_batch, wait_ms=args.wait_ms,
                            heartbeat_interval_ms=args.heartbeat_interval_ms)
    async with consumer:
        subscription = consumer.subscribe(args.subject)
        print(json.dumps({"ready": True}), flush=True)

        async def consume() -> None:
            async for msg in subscription:
                print(json.dumps({"id": msg.id, "redelivered": msg.redelivered,
                                  "broker_group": msg.broker_group}), flush=True)
                if not args.hold:
                    await msg.ack()

        task = asyncio.create_task(consume())
        await stop.wait()
    await task


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--meta", required=True)
    parser.add_argument("--group", required=True)
    parser.add_argument("--subject", required=True)
    parser.add_argument("--consumer-id", required=True)
    parser.add_argument("--start", default="earliest", choices=["earliest", "latest"])
    parser.add_argument("--pull-batch", type=int, default=32)
    parser.add_argument("--wait-ms", type=int, default=500)
    parser.add_argument("--heartbeat-interval-ms", type=int, default=300)
    parser.add_argument("--hold", action="store_true", help="never ack")
    asyncio.run(run(parser.parse_args()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
