"""SDK-side helpers of the end-to-end tests: consumers that record every delivery in a ledger.

Consumers here poll and heartbeat well inside the short consumer expiry the tests give brokers
(``FAST``), so a live consumer is never taken for a dead one.
"""

from __future__ import annotations

import asyncio
import glob
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import qmq
from tests.segment_files import read_segment_data

# Consumer options for brokers run with --consumer-expiry-ms of a few seconds: a long poll and a
# heartbeat each well under that, so a consumer waiting for messages stays online.
FAST: dict[str, Any] = {"wait_ms": 500, "heartbeat_interval_ms": 300}
SEND_WINDOW = 20  # sends in flight of a ``Producing``
SENDS_MAX = 100_000  # bound on a ``Producing`` loop


@dataclass(frozen=True)
class Delivery:
    """One message handed to the application."""

    id: str
    body: bytes
    tags: tuple[str, ...]
    redelivered: int
    broker_group: str
    consumer: str
    at: float  # time.monotonic() when the application got it


@dataclass
class Ledger:
    """Every delivery seen by a set of consumers."""

    deliveries: list[Delivery] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)

    def record(self, msg: qmq.ReceivedMessage, consumer: str) -> Delivery:
        delivery = Delivery(msg.id, msg.body, tuple(msg.tags), msg.redelivered, msg.broker_group,
                            consumer, time.monotonic())
        self.deliveries.append(delivery)
        self.counts[msg.id] += 1
        return delivery

    @property
    def ids(self) -> set[str]:
        return set(self.counts)

    def duplicates(self) -> dict[str, int]:
        """Ids delivered more than once, with their delivery counts."""
        return {i: n for i, n in self.counts.items() if n > 1}

    def of(self, message_id: str) -> list[Delivery]:
        return [d for d in self.deliveries if d.id == message_id]


AckPolicy = Callable[[qmq.ReceivedMessage], bool]


def always(_: qmq.ReceivedMessage) -> bool:
    return True


class RunningConsumer:
    """A ``qmq.Consumer`` subscribed to one subject, recording into ``ledger`` and acking the
    messages ``should_ack`` approves. ``close()`` is the SDK's graceful close."""

    def __init__(self, meta_url: str, group: str, subject: str, ledger: Ledger, *,
                 name: str, should_ack: AckPolicy = always, tags: list[str] | None = None,
                 **options: Any) -> None:
        self.name = name
        self.subject = subject
        self.ledger = ledger
        self.should_ack = should_ack
        self.tags = tags
        self.consumer = qmq.Consumer(meta_url, group=group, consumer_id=name,
                                     **{**FAST, **options})
        self.received = 0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> RunningConsumer:
        await self.consumer.__aenter__()
        subscription = self.consumer.subscribe(self.subject, tags=self.tags)
        self._task = asyncio.create_task(self._run(subscription), name=f"e2e {self.name}")
        return self

    async def _run(self, subscription: qmq.Subscription) -> None:
        async for msg in subscription:
            self.ledger.record(msg, self.name)
            self.received += 1
            if self.should_ack(msg):
                await msg.ack()

    async def close(self) -> None:
        await self.consumer.close()
        if self._task is not None:
            async with asyncio.timeout(30):
                await self._task


async def close_all(consumers: list[RunningConsumer]) -> None:
    """Close every consumer, even when some fail to close."""
    results = await asyncio.gather(*(c.close() for c in consumers), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise errors[0]


async def send_all(producer: qmq.Producer, subject: str, ids: list[str], *,
                   chunk: int = 500, **kwargs: Any) -> list[qmq.Receipt]:
    """Send one message per id (body = the id), ``chunk`` sends in flight at a time."""
    receipts: list[qmq.Receipt] = []
    for start in range(0, len(ids), chunk):
        receipts += await asyncio.gather(*(
            producer.send(subject, i.encode(), message_id=i, **kwargs)
            for i in ids[start:start + chunk]
        ))
    return receipts


async def send_in_batches(producer: qmq.Producer, subject: str, ids: list[str],
                          per_batch: int) -> list[qmq.Receipt]:
    """One send request per ``per_batch`` ids (the producer spreads requests over broker
    groups, not single messages)."""
    receipts: list[qmq.Receipt] = []
    for first in range(0, len(ids), per_batch):
        receipts += await send_all(producer, subject, ids[first:first + per_batch])
    return receipts


async def start_cluster(cluster: Any, *groups: str, broker_flags: tuple[str, ...] = (),
                        meta_port: int = 0) -> str:
    """A MetaServer and one realtime broker per group, all registered rw; returns the URL."""
    from tests.harness import admin, wait_for

    cluster.start_meta(port=meta_port)
    for group in groups:
        cluster.start_broker(group, *broker_flags)

    def all_rw() -> bool:
        rows = admin(cluster.meta_url, "brokers")
        return {r["group"] for r in rows if r["kind"] == "realtime" and r["state"] == "rw"} \
            == set(groups)

    await wait_for(all_rw, 20, f"broker groups {groups} to register", in_thread=True)
    return cluster.meta_url


def same_bytes(master_dir: Path, slave_dir: Path, log_dir: str = "messagelog") -> bool:
    """The slave's copy of a log (``log_dir``: ``messagelog``, or ``delaylog`` and
    ``donelog`` of a delay server) holds the master's bytes, every segment."""
    for path in sorted(glob.glob(str(master_dir / log_dir / "*.log"))):
        twin = slave_dir / log_dir / os.path.basename(path)
        if not twin.exists():
            return False
        try:
            mine, theirs = read_segment_data(path), read_segment_data(twin)
        except FileNotFoundError:
            return False  # deleted meanwhile (a copy thrown away, retention): not yet the same
        if theirs != mine[:len(theirs)] or len(theirs) < len(mine):
            return False
    return True


class Producing:
    """One producer sending ``SEND_WINDOW`` at a time (ids ``p-000000`` on, body = the id)
    until ``stop`` is set; records every receipt's id and every failure."""

    def __init__(self, producer: qmq.Producer, subject: str, stop: asyncio.Event) -> None:
        self.acknowledged: set[str] = set()
        self.statuses: Counter[str] = Counter()
        self.failures: list[qmq.QmqError] = []
        self.task = asyncio.create_task(self._run(producer, subject, stop))

    async def _run(self, producer: qmq.Producer, subject: str, stop: asyncio.Event) -> None:
        for first in range(0, SENDS_MAX, SEND_WINDOW):
            if stop.is_set():
                return
            ids = [f"p-{n:06d}" for n in range(first, first + SEND_WINDOW)]
            results = await asyncio.gather(
                *(producer.send(subject, i.encode(), message_id=i) for i in ids),
                return_exceptions=True)
            for message_id, result in zip(ids, results):
                if isinstance(result, qmq.Receipt):
                    self.acknowledged.add(message_id)
                    self.statuses[result.status] += 1
                elif isinstance(result, qmq.QmqError):
                    self.failures.append(result)
                    await asyncio.sleep(0.01)
                else:
                    raise result
