"""NATS JetStream's driver for the peers benchmark (nats-py, file storage, one replica).

- Two streams: ``PEERS_RT`` over ``rt.>`` for the realtime workloads, and ``PEERS_DL`` over
  ``dl.>`` and ``sched.>`` with ``allow_msg_schedules`` for the delayed ones (a separate stream,
  so the realtime figures carry no cost of the schedule feature).
- send: ``js.publish`` (waits for the PubAck); batch: ``js.publish_async`` for every body, then
  awaiting every PubAck future.
- delayed: JetStream message schedules (ADR-51, server 2.12+): ``js.publish`` to a subject of
  its own, ``sched.<subject>.<seq>`` (a schedule subject holds one schedule), with headers
  ``Nats-Schedule: @at <RFC 3339 UTC, ms>`` and ``Nats-Schedule-Target: <subject>``; at that
  time the server publishes the body to the target subject and removes the schedule.
- consume: a durable push consumer (``js.subscribe`` with ``manual_ack``, deliver all, explicit
  acks) filtered on the subject; ``await msg.ack()`` for each message.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone
from typing import Any, Callable

from bench.peers.workloads import read_body

REALTIME_STREAM = "PEERS_RT"
DELAYED_STREAM = "PEERS_DL"
SCHEDULE_PREFIX = "sched"
PUBLISH_TIMEOUT_S = 30.0  # a PubAck later than this fails the send (fsync-always under load)


def at_header(due_ms: int) -> str:
    """The ``Nats-Schedule`` value for a one-shot schedule at ``due_ms`` (epoch ms)."""
    moment = datetime.fromtimestamp(due_ms / 1000, timezone.utc)
    return "@at " + moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class NatsDriver:
    """See the module docstring; ``url`` is ``nats://host:port``."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._nc: Any = None
        self._js: Any = None

    async def open(self) -> None:
        import nats

        self._nc = await nats.connect(self.url)
        self._js = self._nc.jetstream(timeout=PUBLISH_TIMEOUT_S)

    async def close(self) -> None:
        await self._nc.drain()

    async def _ensure_streams(self) -> None:
        from nats.js.api import StorageType, StreamConfig
        from nats.js.errors import NotFoundError

        for config in (
            StreamConfig(name=REALTIME_STREAM, subjects=["rt.>"], storage=StorageType.FILE),
            StreamConfig(name=DELAYED_STREAM, subjects=["dl.>", f"{SCHEDULE_PREFIX}.>"],
                         storage=StorageType.FILE, allow_msg_schedules=True),
        ):
            try:
                await self._js.stream_info(config.name)
            except NotFoundError:
                await self._js.add_stream(config)

    async def prepare_consumer(self, subject: str, delayed: bool) -> None:
        await self._ensure_streams()

    async def consume(self, subject: str, on_message: Callable[[bytes], None],
                      stop: asyncio.Event) -> None:
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        async def handle(msg: Any) -> None:
            on_message(msg.data)
            await msg.ack()

        stream = DELAYED_STREAM if subject.startswith("dl.") else REALTIME_STREAM
        subscription = await self._js.subscribe(
            subject, durable="peers-" + subject.replace(".", "-"), stream=stream, cb=handle,
            manual_ack=True, config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL,
                                                   ack_policy=AckPolicy.EXPLICIT))
        try:
            await stop.wait()
        finally:
            await subscription.unsubscribe()

    async def send(self, subject: str, body: bytes) -> None:
        await self._js.publish(subject, body)

    async def send_many(self, subject: str, bodies: list[bytes]) -> None:
        futures = [await self._js.publish_async(subject, body) for body in bodies]
        await asyncio.gather(*futures)

    async def send_at(self, subject: str, body: bytes, due_ms: int) -> None:
        seq = read_body(body)[0]
        await self._js.publish(f"{SCHEDULE_PREFIX}.{subject}.{seq}", body, headers={
            "Nats-Schedule": at_header(due_ms), "Nats-Schedule-Target": subject})
