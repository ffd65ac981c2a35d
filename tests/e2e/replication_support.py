"""What the replication end-to-end tests share (``test_replication_control``, ``_failover``,
``_delay``, ``_delay_rejoin``): a MetaServer with a short lease, group members on data dirs of
their own (with a fixed server id when the test names servers), the group's replication row,
and a steady load (one producer, consumers recording into one ledger) that ends by waiting
until the consumers hold every acknowledged id."""

from __future__ import annotations

import asyncio
from typing import Any

import qmq
from serverkit import server_id
from tests.e2e.support import Ledger, Producing, RunningConsumer, close_all
from tests.harness import Cluster, ServerProcess, admin, start_delay, start_realtime, \
    start_server, wait_for

LEASE_MS = 2_000  # a lost master is replaced within a few seconds


def start_leased_meta(cluster: Cluster, lease_ms: int = LEASE_MS) -> ServerProcess:
    """The cluster's MetaServer on ``root/meta.db`` with a ``lease_ms`` master lease."""
    cluster.meta = cluster.keep(start_server("metaserver", [
        "metaserver", "--db", f"sqlite+aiosqlite:///{cluster.root / 'meta.db'}", "--port", "0",
        "--lease-ms", str(lease_ms)]))
    return cluster.meta


def start_member(cluster: Cluster, kind: str, group: str, name: str, *flags: str,
                 me: str | None = None) -> ServerProcess:
    """A ``realtime`` or ``delay`` server of ``group`` on data dir ``root/<name>`` (the same on
    a restart), with server id ``me`` (16 hex digits) when given."""
    data = cluster.root / name
    data.mkdir(exist_ok=True)
    if me is not None and not (data / "server.id").exists():
        server_id.write(str(data), bytes.fromhex(me))
    start = {"realtime": start_realtime, "delay": start_delay}[kind]
    return cluster.keep(start(cluster.meta_url, str(data), group, *flags))


def group_row(url: str, group: str) -> dict[str, Any]:
    """``group``'s row of ``GET /api/admin/replication``."""
    return next(r for r in admin(url, "replication") if r["group"] == group)


class Load:
    """One producer sending steadily (``Producing``) and ``consumers`` consumers of group
    ``billing`` on one subject, every delivery in ``live``."""

    def __init__(self, producer: qmq.Producer, consumers: list[RunningConsumer],
                 live: Ledger, subject: str) -> None:
        self.producer = producer
        self.consumers = consumers
        self.live = live
        self.stop = asyncio.Event()
        self.run = Producing(producer, subject, self.stop)

    @classmethod
    async def start(cls, url: str, subject: str, consumers: int = 2,
                    **producer_options: Any) -> Load:
        """Consumers first (from the earliest message), then the producer."""
        live = Ledger()
        running = [await RunningConsumer(url, "billing", subject, live, name=f"c{n}",
                                         start="earliest", reconnect_backoff_max_ms=500).start()
                   for n in range(consumers)]
        producer = qmq.Producer(url, **producer_options)
        await producer.__aenter__()
        return cls(producer, running, live, subject)

    @property
    def acknowledged(self) -> set[str]:
        """Ids the producer holds a receipt for."""
        return self.run.acknowledged

    async def drain(self, timeout_s: float) -> set[str]:
        """Stop the producer, then wait (up to ``timeout_s``) until the consumers hold every
        acknowledged id; returns those ids."""
        self.stop.set()
        await self.run.task
        everything = set(self.run.acknowledged)
        await wait_for(lambda: self.live.ids >= everything, timeout_s,
                       "the consumers to get every acknowledged message", interval_s=0.2)
        return everything

    async def close(self) -> None:
        """Stop sending and close the consumers and the producer (safe after ``drain``)."""
        self.stop.set()
        try:
            await close_all(self.consumers)
        finally:
            await self.producer.close()
