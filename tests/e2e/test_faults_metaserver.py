"""A MetaServer that comes back with an empty database (lost, or replaced by a fresh one): the
realtime and delay servers register themselves again on their next heartbeat, running clients
never stop, and new clients route through it, delayed sends included.

``test_metaserver_restart.py`` covers a restart on the same database.
"""

from __future__ import annotations

import asyncio

import pytest

import qmq
from tests.e2e.support import Ledger, RunningConsumer, close_all, send_all
from tests.harness import (
    admin_or_none, free_port, run_qmq, start_metaserver, wait_for, wait_registered,
)

BROKER_FLAGS = ("--ack-timeout-ms", "3000", "--consumer-expiry-ms", "3000")
REREGISTER_BOUND_S = 30  # a few heartbeat intervals (3 s), on a loaded machine


@pytest.mark.timeout(180)
async def test_brokers_register_again_into_a_metaserver_that_lost_its_database(cluster, tmp_path):
    port = free_port()  # clients and brokers know the MetaServer by this URL only
    meta = cluster.keep(start_metaserver(str(tmp_path / "first.db"), port))
    cluster.meta = meta
    url = meta.url
    cluster.start_broker("rt1", *BROKER_FLAGS)
    cluster.start_delay("d1")
    await asyncio.to_thread(wait_registered, url, {("realtime", "rt1"): "rw",
                                                   ("delay", "d1"): "rw"})
    subject = "orders.created"
    ledger = Ledger()
    running = await RunningConsumer(url, "fulfil", subject, ledger, name="fulfiller",
                                    start="earliest").start()
    consumers = [running]
    try:
        async with qmq.Producer(url) as producer:
            await send_all(producer, subject, [f"before-{n:03d}" for n in range(50)])
            await wait_for(lambda: len(ledger.ids) >= 50, 30, "messages before the outage")

            assert await asyncio.to_thread(meta.terminate) == 0
            fresh = cluster.keep(await asyncio.to_thread(
                start_metaserver, str(tmp_path / "fresh.db"), port))
            cluster.meta = fresh
            assert await asyncio.to_thread(admin_or_none, url, "brokers") == [], \
                "the new MetaServer must start empty"
            await asyncio.to_thread(wait_registered, url, {("realtime", "rt1"): "rw",
                                                           ("delay", "d1"): "rw"},
                                    REREGISTER_BOUND_S)

            # The running clients carry on.
            await send_all(producer, subject, [f"during-{n:03d}" for n in range(50)])
            await wait_for(lambda: len(ledger.ids) >= 100, 30, "the running consumer to go on")

        # New clients know nothing but the URL: they route through the fresh MetaServer.
        newcomer = Ledger()
        consumers.append(await RunningConsumer(url, "audit", subject, newcomer,
                                               name="newcomer", start="earliest").start())
        async with qmq.Producer(url) as producer:
            now = await producer.send(subject, b"now", message_id="fresh-now")
            later = await producer.send(subject, b"later", message_id="fresh-later", delay=500)
        assert (now.broker_group, later.broker_group) == ("rt1", "d1")
        await wait_for(lambda: {"fresh-now", "fresh-later"} <= newcomer.ids, 30,
                       "a new consumer to get a new producer's messages, delayed one included")
        await wait_for(lambda: {"fresh-now", "fresh-later"} <= ledger.ids, 30,
                       "the running consumer to get them too")
    finally:
        await close_all(consumers)

    listing = await asyncio.to_thread(run_qmq, "admin", "brokers", "--meta", url)
    assert listing.returncode == 0, listing.stderr
    assert "rt1" in listing.stdout and "d1" in listing.stdout
    assert ledger.duplicates() == {}
