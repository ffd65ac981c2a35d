"""A realtime broker killed with kill -9 mid-send and restarted on its data dir loses nothing
it acknowledged, and its consumers carry on."""

from __future__ import annotations

import asyncio

import pytest

import qmq
from tests.e2e.support import Ledger, RunningConsumer, close_all
from tests.harness import admin, free_port, wait_for

BROKER_FLAGS = ("--flush", "sync", "--ack-timeout-ms", "3000", "--consumer-expiry-ms", "3000")
SEND_WINDOW = 100  # sends in flight at once
SENDS_MAX = 200_000  # bound on the producing loop


@pytest.mark.timeout(150)
async def test_every_send_acknowledged_as_stored_survives_a_kill_9_of_the_broker(cluster):
    cluster.start_meta()
    # The broker comes back on the same address, as a supervised broker with a fixed port does.
    port = free_port()
    broker = cluster.start_broker("rt1", *BROKER_FLAGS, port=port)
    await wait_for(lambda: admin(cluster.meta_url, "brokers"), 20, "the broker to register",
                   in_thread=True)
    subject = "payments.captured"
    ledger = Ledger()
    steady = await RunningConsumer(cluster.meta_url, "ledger", subject, ledger, name="steady",
                                   start="earliest").start()
    acknowledged: set[str] = set()
    attempted: set[str] = set()
    failures: list[BaseException] = []
    stop = asyncio.Event()
    consumers = [steady]
    try:
        async with qmq.Producer(cluster.meta_url, send_timeout_ms=2_000) as producer:
            async def produce() -> None:
                for first in range(0, SENDS_MAX, SEND_WINDOW):
                    if stop.is_set():
                        return
                    ids = [f"pay-{n:06d}" for n in range(first, first + SEND_WINDOW)]
                    attempted.update(ids)
                    results = await asyncio.gather(
                        *(producer.send(subject, i.encode(), message_id=i) for i in ids),
                        return_exceptions=True,
                    )
                    for message_id, result in zip(ids, results):
                        if isinstance(result, qmq.Receipt):
                            assert result.status in ("stored", "duplicate")
                            acknowledged.add(message_id)
                        elif isinstance(result, qmq.QmqError):
                            failures.append(result)
                        else:
                            raise result

            producing = asyncio.create_task(produce())
            await wait_for(lambda: len(acknowledged) >= 3_000 or producing.done(), 30,
                           "3000 stored receipts")
            await asyncio.to_thread(broker.kill9)
            acknowledged_at_kill = len(acknowledged)
            await wait_for(lambda: failures or producing.done(), 30,
                           "sends to fail while the broker is down")
            await asyncio.to_thread(cluster.start_broker, "rt1", *BROKER_FLAGS, port=port)
            await wait_for(lambda: len(acknowledged) >= acknowledged_at_kill + 3_000
                           or producing.done(), 60, "3000 more stored receipts after the restart")
            stop.set()
            await producing
        acknowledged_after_restart = len(acknowledged) - acknowledged_at_kill
        await wait_for(lambda: ledger.ids >= acknowledged, 60,
                       "the running consumer to get every acknowledged message", interval_s=0.2)
        # A group that never read anything replays the recovered log from the start.
        audit = Ledger()
        consumers.append(await RunningConsumer(cluster.meta_url, "audit", subject, audit,
                                               name="auditor", start="earliest").start())
        await wait_for(lambda: audit.ids >= acknowledged, 60,
                       "a new group to read every acknowledged message", interval_s=0.2)
    finally:
        await close_all(consumers)

    assert failures, "the broker must have been killed while sends were in flight"
    assert acknowledged - ledger.ids == set()
    assert acknowledged - audit.ids == set()
    assert ledger.ids <= attempted and audit.ids <= attempted
    # The consumer connected before the crash also got the 3000+ messages sent after it.
    assert acknowledged_after_restart >= 3_000
    print(f"{len(acknowledged)} acknowledged, {len(failures)} failed sends, "
          f"{len(ledger.duplicates())} ids redelivered to the running consumer")
