"""The MetaServer can restart: clients run on cached routes meanwhile, brokers come back to it."""

from __future__ import annotations

import asyncio
import time

import pytest

import qmq
from sdk.routes import RouteCache
from tests.e2e.support import Ledger, RunningConsumer, close_all, send_all
from tests.harness import admin, admin_or_none, free_port, run_qmq, wait_for

# Short route lifetimes so the clients' cached routes go stale while the MetaServer is down.
ROUTE_TTL_MS = 300


@pytest.mark.timeout(120)
async def test_clients_keep_working_while_the_metaserver_is_down_and_brokers_return_to_it(cluster):
    # Clients must find the new MetaServer at the same URL, so the port is chosen here.
    port = free_port()
    meta = cluster.start_meta(port=port)
    url = meta.url
    cluster.start_broker("rt1", "--ack-timeout-ms", "3000", "--consumer-expiry-ms", "3000")
    await wait_for(lambda: admin(url, "brokers"), 20, "the broker to register", in_thread=True)
    subject, group = "orders.placed", "shipping"
    before, during, after = ([f"{phase}-{i:03d}" for i in range(100)]
                             for phase in ("before", "during", "after"))
    ledger = Ledger()
    consumer = await RunningConsumer(
        url, group, subject, ledger, name="shipper", start="earliest", route_refresh_ms=300,
        routes=RouteCache(url, ttl_ms=ROUTE_TTL_MS, stale_retry_ms=ROUTE_TTL_MS),
    ).start()
    try:
        async with qmq.Producer(url, routes=RouteCache(url, ttl_ms=ROUTE_TTL_MS,
                                                       stale_retry_ms=ROUTE_TTL_MS)) as producer:
            await send_all(producer, subject, before, chunk=20)
            await wait_for(lambda: ledger.ids >= set(before), 30, "the first messages")

            assert await asyncio.to_thread(meta.terminate) == 0
            down_at = time.monotonic()
            # Sends spread over several route lifetimes: the stale cached routes must serve.
            receipts = []
            for first in range(0, len(during), 10):
                receipts += await send_all(producer, subject, during[first:first + 10])
                await asyncio.sleep(ROUTE_TTL_MS / 2000)
            await wait_for(lambda: ledger.ids >= set(during), 30,
                           "messages sent while the MetaServer is down")
            assert time.monotonic() - down_at > 3 * ROUTE_TTL_MS / 1000
            assert admin_or_none(url, "brokers") is None, "the MetaServer must really be down"

            back_ms = time.time_ns() // 1_000_000
            await asyncio.to_thread(cluster.start_meta, port)

            def broker_heartbeating() -> bool:
                rows = admin_or_none(url, "brokers") or []
                return any(r["group"] == "rt1" and r["state"] == "rw"
                           and r["last_heartbeat_ms"] >= back_ms for r in rows)

            await wait_for(broker_heartbeating, 20, "the broker to heartbeat the new MetaServer",
                           interval_s=0.2, in_thread=True)
            receipts += await send_all(producer, subject, after, chunk=20)
            await wait_for(lambda: ledger.ids >= set(after), 30, "messages sent after it is back")
    finally:
        await close_all([consumer])

    assert {r.broker_group for r in receipts} == {"rt1"}
    assert ledger.ids == set(before + during + after)
    listing = await asyncio.to_thread(run_qmq, "admin", "brokers", "--meta", url)
    assert listing.returncode == 0, listing.stderr
    assert "rt1" in listing.stdout and "rw" in listing.stdout
