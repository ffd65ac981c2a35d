"""A planned switchover with real ``qmq realtime`` processes and real copies (``sync``
replication), driven by ``qmq admin switchover`` under a steady producer and two consumers, then
a replicated master that shuts down handing its group back (docs/REPLICATION.md 9, 11).

What a user notices: every receipt is consumed, none twice. A planned switchover stops the
master's writes before the target is promoted, and the target has every byte by then, so a send
refused during the handover and resent with its id is a ``duplicate`` receipt on the new master
(de-duplication), and an ack refused during the handover is sent again to the new master, which
holds the same pull-log state. REPLICATION.md 9 allows duplicates only for what was in flight;
this test asserts none, because the SDK resends both with their ids.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest

import qmq
from tests.e2e import replication_support as replication
from tests.e2e.replication_support import Load, start_leased_meta
from tests.harness import Cluster, ServerProcess, admin, run_qmq, wait_for

FIRST, SECOND = "0000000000000c01", "0000000000000d02"
BROKER_FLAGS = ("--flush", "sync", "--replication", "sync", "--ack-timeout-ms", "5000",
                "--consumer-expiry-ms", "5000")


def start_member(cluster: Cluster, name: str, me: str) -> ServerProcess:
    """A realtime server of group rt1 with server id ``me`` on data dir ``root/<name>``."""
    return replication.start_member(cluster, "realtime", "rt1", name, *BROKER_FLAGS, me=me)


def server_row(url: str, server: str) -> dict[str, Any]:
    return next(r for r in admin(url, "brokers") if r["server_id"] == server)


def group_row(url: str) -> dict[str, Any]:
    return replication.group_row(url, "rt1")


@pytest.mark.timeout(180)
async def test_a_switchover_under_load_loses_and_duplicates_nothing_and_a_shutdown_hands_back(
        cluster: Cluster):
    url = start_leased_meta(cluster).url
    first = start_member(cluster, "first", FIRST)
    second = start_member(cluster, "second", SECOND)
    await wait_for(lambda: group_row(url)["insync"] == [SECOND], 60, "the slave in sync",
                   in_thread=True)
    await wait_for(lambda: server_row(url, SECOND)["lag_bytes"] == 0, 30,
                   "the slave's lag reported", in_thread=True)
    listing = await asyncio.to_thread(run_qmq, "admin", "brokers", "--meta", url)
    assert listing.returncode == 0, listing.stderr
    header = listing.stdout.splitlines()[0].split()
    assert header == ["group", "kind", "address", "server_id", "role", "epoch", "state",
                      "in_sync", "lag_bytes", "lag_ms", "undecodable", "heartbeat_age_ms"]
    # A master is never behind (0); a caught-up slave lacks 0 bytes; neither copy is stopped.
    assert re.search(rf"{FIRST}\s+master\s+1\s+rw\s+yes\s+0\s+0\s+-\s", listing.stdout), \
        listing.stdout
    assert re.search(rf"{SECOND}\s+slave\s+1\s+rw\s+yes\s+0\s+\d+\s+-\s",
                     listing.stdout), listing.stdout

    subject = "orders.switch"
    # Patient sends: writes pause from the moment the master hands over until the target has
    # heard of its promotion (its next heartbeat) and sealed its logs, which on a loaded machine
    # outlasts the SDK's default 3 quick resends.
    load = await Load.start(url, subject, send_timeout_ms=10_000, retries_max=12)
    run, live = load.run, load.live
    try:
        await wait_for(lambda: len(run.acknowledged) >= 300, 60, "300 receipts")
        switched = await asyncio.to_thread(run_qmq, "admin", "switchover", "rt1", "--meta", url)
        assert switched.returncode == 0, switched.stdout + switched.stderr
        assert f"switched group rt1 from {FIRST} to {SECOND} at epoch 2" in switched.stdout
        at_switch = len(run.acknowledged)
        await wait_for(lambda: len(run.acknowledged) >= at_switch + 300, 60,
                       "300 receipts from the new master")
        everything = await load.drain(60)
    finally:
        await load.close()
    print(f"{len(everything)} receipts ({at_switch} before the switchover; "
          f"{dict(run.statuses)}), {len(run.failures)} failed sends, "
          f"{len(live.duplicates())} ids delivered twice")
    assert run.failures == []
    assert everything - live.ids == set()
    assert live.duplicates() == {}

    shown = await asyncio.to_thread(run_qmq, "admin", "replication", "--meta", url, "--json")
    assert shown.returncode == 0, shown.stderr
    [row] = json.loads(shown.stdout)
    assert (row["master_id"], row["epoch"]) == (SECOND, 2)
    await wait_for(lambda: group_row(url)["insync"] == [FIRST], 30,
                   "the old master in sync as a slave", in_thread=True)

    # The new master stops (SIGTERM): it refuses writes, drains, deregisters, and the
    # MetaServer hands the group to its in-sync slave at once.
    assert await asyncio.to_thread(second.terminate) == 0
    row = group_row(url)
    assert (row["master_id"], row["epoch"]) == (FIRST, 3)
    async with qmq.Producer(url, send_timeout_ms=30_000) as again:
        receipt = await again.send(subject, b"after", message_id="after")
    assert receipt.status == "stored"
    assert first.running
