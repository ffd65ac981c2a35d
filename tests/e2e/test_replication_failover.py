"""The data plane of a realtime group with real ``qmq realtime`` processes (docs/REPLICATION.md
7, 8, 10): a second server of a group copies the master; kill -9 of a ``sync`` master under a
steady producer loses no receipt (and ``qmq audit`` over every server's trace finds nothing
lost); ``--min-insync 1`` refuses sends while the slave is down and
carries on once it is back; a byte flipped in the slave's copy is found and fetched again."""

from __future__ import annotations

import asyncio
import glob
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest

import qmq
from tests.e2e import replication_support as replication
from tests.e2e.replication_support import Load, start_leased_meta
from tests.e2e.support import same_bytes
from tests.harness import Cluster, ServerProcess, admin, epoch_ms, run_qmq, wait_for
from tests.rawclient import RawClient
from tests.segment_files import segment_data_bytes
from wire.message import Message

AUDIT_TIMEOUT_S = 600  # a fresh JVM and a few dozen Spark jobs on a loaded 2-core machine
BROKER_FLAGS = ("--flush", "sync", "--ack-timeout-ms", "3000", "--consumer-expiry-ms", "3000")


def start_meta(cluster: Cluster) -> ServerProcess:
    return start_leased_meta(cluster)


def start_member(cluster: Cluster, name: str, *extra: str) -> ServerProcess:
    """A realtime server of group rt1 on its own data dir ``root/<name>``."""
    return replication.start_member(cluster, "realtime", "rt1", name, *BROKER_FLAGS, *extra)


def group_row(url: str) -> dict[str, Any]:
    return replication.group_row(url, "rt1")


def in_sync(url: str) -> bool:
    return bool(group_row(url)["insync"])


@pytest.mark.timeout(240 + AUDIT_TIMEOUT_S)  # the test, then one qmq audit (a JVM)
async def test_a_kill_9_of_a_sync_master_under_load_loses_no_receipt(cluster: Cluster):
    meta = start_meta(cluster)
    master = start_member(cluster, "a")
    start_member(cluster, "b")
    await wait_for(lambda: in_sync(meta.url), 60, "the slave in sync", in_thread=True)
    subject = "orders.paid"
    load = await Load.start(meta.url, subject, send_timeout_ms=3_000)
    run, live = load.run, load.live
    try:
        await wait_for(lambda: len(run.acknowledged) >= 300, 60, "300 receipts")
        epoch = group_row(meta.url)["epoch"]
        await asyncio.to_thread(master.kill9)
        at_kill = len(run.acknowledged)
        await wait_for(lambda: group_row(meta.url)["epoch"] > epoch, 60, "the promotion",
                       in_thread=True)
        await wait_for(lambda: len(run.acknowledged) >= at_kill + 300, 60,
                       "300 receipts from the new master")
        everything = await load.drain(90)
    finally:
        await load.close()
    assert everything - live.ids == set()
    print(f"{len(everything)} receipts ({at_kill} before the kill), {len(run.failures)} failed "
          f"sends, {len(live.duplicates())} ids delivered twice (at-least-once)")
    # The old master comes back as a slave: it cuts whatever tail the new master lacks (its
    # unreplicated last commits) and copies the new master's log byte for byte.
    old = start_member(cluster, "a")
    await wait_for(lambda: same_bytes(cluster.root / "b", cluster.root / "a"), 60,
                   "the old master to hold the new master's bytes", in_thread=True)
    await wait_for(lambda: len(group_row(meta.url)["insync"]) == 1, 60,
                   "the old master in sync as a slave", in_thread=True)
    print("the old master cut a diverging tail" if "diverged" in old.text() else
          "the old master had no tail to cut")
    # The audit over every server's trace (found under the test's root by --data-dir) finds
    # nothing lost: what the old master traced before its death and the new master after.
    cluster.stop_all()
    started = time.monotonic()
    result = await asyncio.to_thread(
        run_qmq, "audit", "--data-dir", str(cluster.root), "--out", str(cluster.root / "audit"),
        "--master", "local[2]", "--driver-memory", "1g", timeout_s=AUDIT_TIMEOUT_S)
    print(f"qmq audit took {time.monotonic() - started:.1f} s: {result.stdout.splitlines()[:1]}")
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr[-4000:]}"
    assert result.stdout.startswith("PASS: 0 lost"), result.stdout
    # The new master's trace is always read; the killed master's too when it wrote a trace
    # file before its death (one run of three under heavy load found none there: see the report).
    assert str(cluster.root / "b" / "trace") in result.stderr, result.stderr[-2000:]
    print(result.stderr.splitlines()[0])


def flip_a_byte(data_dir: Path) -> str:
    """Flip one byte in the middle of the oldest message-log segment; its path."""
    segment = sorted(glob.glob(str(data_dir / "messagelog" / "*.log")))[0]
    size = segment_data_bytes(segment)
    assert size > 4096, size
    with open(segment, "r+b") as f:
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0x40]))
    return segment


@pytest.mark.timeout(240)
async def test_min_insync_refuses_sends_without_the_slave_and_a_flipped_byte_is_fetched_again(
        cluster: Cluster):
    meta = start_meta(cluster)
    master = start_member(cluster, "a", "--min-insync", "1")
    slave = start_member(cluster, "b")
    await wait_for(lambda: in_sync(meta.url), 60, "the slave in sync", in_thread=True)
    producer = qmq.Producer(meta.url, send_timeout_ms=2_000)
    try:
        await producer.__aenter__()
        for first in range(0, 600, 200):
            await asyncio.gather(*(producer.send("orders", b"x" * 200, message_id=f"m-{n}")
                                   for n in range(first, first + 200)))
        await wait_for(lambda: same_bytes(cluster.root / "a", cluster.root / "b"), 30,
                       "the slave to hold the master's bytes", in_thread=True)
        await asyncio.to_thread(slave.kill9)
        flip_a_byte(cluster.root / "b")

        async def refused() -> bool:
            client = await RawClient.connect(master.port)
            try:
                answer = await client.send(Message.create("orders", b"y", now_ms=epoch_ms(),
                                                          id="refused"))
            finally:
                await client.close()
            return answer.get("error", {}).get("code") == "not_enough_replicas"

        await wait_for(refused, 60, "sends refused without a slave in sync")
        # The MetaServer also routes producers away from the group (writable: false).
        with pytest.raises((qmq.NoRoute, qmq.NotEnoughReplicas)):
            await producer.send("orders", b"y", message_id="refused")
        slave = start_member(cluster, "b")
        await wait_for(lambda: same_bytes(cluster.root / "a", cluster.root / "b"), 60,
                       "the rotten record fetched again", in_thread=True)
        # Found by the restart's recovery scan (past the checkpoint) or by the scrub (below).
        assert re.search(r"crc mismatch|rotten record", slave.text()), slave.text()[-3000:]

        async def accepted() -> bool:
            try:
                await producer.send("orders", b"z", message_id="after")
            except qmq.QmqError:
                return False
            return True

        await wait_for(accepted, 60, "sends accepted with the slave back in sync")
    finally:
        await producer.close()


@pytest.mark.timeout(120)
async def test_qmq_up_with_two_replicas_runs_each_group_with_a_slave_in_sync(cluster: Cluster):
    up = cluster.start_up("--replicas", "2")
    assert re.search(r"realtime\s+\S+\s+slave of group realtime-1", up.text()), up.text()
    assert re.search(r"delay\s+\S+\s+slave of group delay-1", up.text()), up.text()

    def both_in_sync() -> bool:
        rows = {r["group"]: r for r in admin(up.meta_url, "replication")}
        return all(len(rows.get(g, {}).get("insync") or []) == 1
                   for g in ("realtime-1", "delay-1"))

    await wait_for(both_in_sync, 60, "a slave in sync in each group", in_thread=True)
    async with qmq.Producer(up.meta_url) as producer:
        receipt = await producer.send("demo", b"hello")
    assert receipt.status == "stored"
    assert up.terminate() == 0
    assert "Traceback" not in up.text()
