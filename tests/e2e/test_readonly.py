"""A broker group made readonly by the admin: producers go elsewhere, consumers drain it."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest

import qmq
from tests.e2e.support import Ledger, RunningConsumer, close_all, send_in_batches, start_cluster
from tests.harness import admin, run_qmq, wait_for

BROKER_FLAGS = ("--ack-timeout-ms", "3000", "--consumer-expiry-ms", "3000")


async def two_groups(cluster) -> str:
    return await start_cluster(cluster, "rt1", "rt2", broker_flags=BROKER_FLAGS)


def set_readonly(meta_url: str, group: str, readonly: bool) -> None:
    """What ``qmq admin readonly GROUP on|off`` does, without a process start-up."""
    request = urllib.request.Request(
        f"{meta_url}/api/admin/brokers/readonly", method="POST",
        data=json.dumps({"group": group, "readonly": readonly}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        assert json.loads(response.read())["ok"]


def broker_row(meta_url: str, group: str) -> dict:
    [row] = [r for r in admin(meta_url, "brokers") if r["group"] == group]
    return row


@pytest.mark.timeout(90)
async def test_a_readonly_group_takes_no_more_sends_and_its_messages_are_still_consumed(cluster):
    url = await two_groups(cluster)
    subject, group = "orders.drain", "billing"
    before = [f"before-{i:03d}" for i in range(100)]
    ledger = Ledger()
    consumer = await RunningConsumer(url, group, subject, ledger, name="c0",
                                     start="earliest").start()
    try:
        async with qmq.Producer(url) as producer:
            receipts = await send_in_batches(producer, subject, before, per_batch=10)
            assert {r.broker_group for r in receipts} == {"rt1", "rt2"}
            switched = await asyncio.to_thread(run_qmq, "admin", "readonly", "rt1", "on",
                                               "--meta", url)
            assert switched.returncode == 0, switched.stderr
            # This producer cached a route with rt1 in it: rt1 answers readonly once its
            # heartbeat tells it, and the producer goes to rt2 from then on.
            rounds = 0
            after: list[str] = []

            async def only_rt2() -> bool:
                nonlocal rounds
                rounds += 1
                batch = [f"after-{rounds:03d}-{i}" for i in range(10)]
                after.extend(batch)
                got = await send_in_batches(producer, subject, batch, per_batch=5)
                return {r.broker_group for r in got} == {"rt2"}

            await wait_for(only_rt2, 20, "sends to stop landing on the readonly group",
                           interval_s=0.1)
            final = [f"final-{i:03d}" for i in range(100)]
            final_receipts = await send_in_batches(producer, subject, final, per_batch=10)
        everything = set(before + after + final)
        await wait_for(lambda: ledger.ids >= everything, 30, "every message, rt1's included")
    finally:
        await close_all([consumer])

    assert {r.broker_group for r in final_receipts} == {"rt2"}
    assert ledger.ids == everything
    rows = {r["group"]: r["state"] for r in admin(url, "brokers")}
    assert rows == {"rt1": "readonly", "rt2": "rw"}


@pytest.mark.timeout(60)
async def test_a_group_switched_back_to_rw_accepts_sends_as_soon_as_producers_are_routed_to_it(
    cluster,
):
    url = await start_cluster(cluster, "rt1", broker_flags=BROKER_FLAGS)
    subject = "orders.reopened"
    await asyncio.to_thread(set_readonly, url, "rt1", True)
    # The broker has applied readonly once it reports it (one heartbeat after it was told).
    await wait_for(lambda: broker_row(url, "rt1")["reported_state"] == "readonly", 20,
                   "the broker to report readonly", interval_s=0.1, in_thread=True)
    # Right after a heartbeat the next one is a whole interval (3 s) away.
    seen = broker_row(url, "rt1")["last_heartbeat_ms"]
    await wait_for(lambda: broker_row(url, "rt1")["last_heartbeat_ms"] > seen, 10,
                   "the next broker heartbeat", interval_s=0.05, in_thread=True)
    await asyncio.to_thread(set_readonly, url, "rt1", False)
    async with qmq.Producer(url) as producer:
        receipt = await producer.send(subject, b"open again")
    assert receipt.broker_group == "rt1" and receipt.status == "stored"
