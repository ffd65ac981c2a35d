"""Two MetaServers over one PostgreSQL, one of them killed: every server and client was given
both URLs, so the broker's heartbeats and the clients' routes move to the other one. No broker
goes offline, and sends and consumes carry on (issue 13 item 5; docs/REPLICATION.md 10).

Before MetaServer lists this failed: the broker heartbeated only to the killed MetaServer, the
other one expired it, and every send got no_route.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

import qmq
from tests.e2e.support import FAST, Ledger, RunningConsumer, close_all, send_all
from tests.harness import Cluster, admin_or_none, start_server, wait_for, wait_registered
from tests.pg import PgCluster, create_database

EXPIRY_MS = 3_000


@pytest.mark.postgres
@pytest.mark.timeout(180)
async def test_killing_one_of_two_metaservers_takes_no_broker_offline(cluster: Cluster,
                                                                     pg_cluster: PgCluster):
    name = f"t_{uuid.uuid4().hex[:16]}"
    await create_database(pg_cluster.url_of("postgres"), name)
    metas = [cluster.keep(start_server(f"metaserver {i}", [
        "metaserver", "--db", pg_cluster.url_of(name), "--port", "0",
        "--broker-expiry-ms", str(EXPIRY_MS)])) for i in (1, 2)]
    first, second = (m.url for m in metas)
    both = f"{first},{second}"
    cluster.keep(start_server("realtime rt1", [
        "realtime", "--meta", both, "--data-dir", str(cluster.root / "rt1"), "--group", "rt1",
        "--port", "0", "--metrics-port", "0", "--ack-timeout-ms", "3000",
        "--consumer-expiry-ms", "3000"]))
    await asyncio.to_thread(wait_registered, second, {("realtime", "rt1"): "rw"})

    subject, ledger = "orders.paid", Ledger()
    consumer = await RunningConsumer([first, second], "billing", subject, ledger,
                                     name="biller", start="earliest", route_refresh_ms=300,
                                     **FAST).start()
    try:
        async with qmq.Producer([first, second]) as producer:
            await send_all(producer, subject, [f"before-{i:03d}" for i in range(30)])
            await wait_for(lambda: len(ledger.ids) >= 30, 30, "the first messages")

            metas[0].kill9()
            states: list[str] = []
            # Carry on for three expiry periods, watching the broker from the survivor.
            loop = asyncio.get_running_loop()
            until = loop.time() + 3 * EXPIRY_MS / 1000
            sent = 0
            while loop.time() < until:
                await send_all(producer, subject, [f"during-{sent + i:04d}" for i in range(5)])
                sent += 5
                rows = await asyncio.to_thread(admin_or_none, second, "brokers") or []
                states += [r["state"] for r in rows if r["group"] == "rt1"]
                await asyncio.sleep(0.2)
            assert states and set(states) == {"rw"}, f"the broker went {set(states)}"
            during = {f"during-{i:04d}" for i in range(sent)}
            await wait_for(lambda: during <= ledger.ids, 30, "every message sent meanwhile")
    finally:
        await close_all([consumer])
    assert ledger.duplicates() == {}
