"""kill -9 of a realtime master's slave and then of the master, after the slave copied the
master's last records, then a power loss of those records on the master (simulated: its
message log is cut back to before them while it is down): the master comes back as master of
the same epoch and writes on; the slave, restarted, cuts the tail its master lost and ends
holding the master's bytes; every message sent before the lost ones and after the restart is
there, in order (docs/REPLICATION.md 8.3, the fence of a master's run)."""

from __future__ import annotations

import asyncio
import glob
import os

import pytest

from tests.e2e import replication_support as replication
from tests.e2e.replication_support import start_leased_meta
from tests.e2e.support import same_bytes
from tests.harness import Cluster, ServerProcess, epoch_ms, wait_for
from tests.rawclient import RawClient
from tests.segment_files import segment_data_bytes
from wire.message import Message, decode_message, encode_message


def start_member(cluster: Cluster, name: str) -> ServerProcess:
    """A realtime server of group rt1 on its own data dir ``root/<name>``."""
    return replication.start_member(cluster, "realtime", "rt1", name, "--flush", "sync")


def in_sync(url: str) -> bool:
    return bool(replication.group_row(url, "rt1")["insync"])


async def send(port: int, ids: list[str], body: bytes) -> None:
    client = await RawClient.connect(port)
    try:
        payloads = [encode_message(Message.create("orders", body, now_ms=epoch_ms(), id=i))
                    for i in ids]
        answer = await client.request({"op": "send", "messages": payloads})
    finally:
        await client.close()
    assert [r["status"] for r in answer.get("results", ())] == ["stored"] * len(ids), answer


async def pulled_ids(port: int) -> list[str]:
    client = await RawClient.connect(port)
    try:
        pulled = await client.pull("orders", "g", "c1", max_count=200, start="earliest")
    finally:
        await client.close()
    return [decode_message(p).id for p in pulled["payloads"]]


def last_segment(data_dir: os.PathLike[str]) -> str:
    return sorted(glob.glob(os.path.join(data_dir, "messagelog", "*.log")))[-1]


@pytest.mark.timeout(240)
async def test_a_slave_cuts_the_tail_its_master_lost_after_a_kill_9_and_a_power_loss(
        cluster: Cluster):
    meta = start_leased_meta(cluster)
    master = start_member(cluster, "a")
    slave = start_member(cluster, "b")
    await wait_for(lambda: in_sync(meta.url), 60, "the slave in sync", in_thread=True)
    await send(master.port, [f"kept-{n}" for n in range(30)], b"k" * 100)
    kept_bytes = segment_data_bytes(last_segment(cluster.root / "a"))
    await send(master.port, [f"lost-{n}" for n in range(10)], b"l" * 100)
    await wait_for(lambda: same_bytes(cluster.root / "a", cluster.root / "b"), 60,
                   "the slave holding every record", in_thread=True)
    epoch = replication.group_row(meta.url, "rt1")["epoch"]
    await asyncio.to_thread(slave.kill9)
    # Out of the in-sync set first, so the master's own outage promotes nobody.
    await wait_for(lambda: not in_sync(meta.url), 60, "the slave out of the in-sync set",
                   in_thread=True)
    await asyncio.to_thread(master.kill9)
    # The power loss: the master's last ten records never reached its disk.
    with open(last_segment(cluster.root / "a"), "r+b") as segment:
        segment.truncate(kept_bytes)
    master = start_member(cluster, "a")
    # More than the slave holds past the cut, before it fetches again: its next fetch's offset
    # lies inside what the master wrote since (without the fence: a read there fails its
    # check on every fetch, or at a record boundary the copy carries on with other records).
    await send(master.port, [f"new-{n}" for n in range(40)], b"n" * 100)
    assert replication.group_row(meta.url, "rt1")["epoch"] == epoch  # no promotion
    slave = start_member(cluster, "b")
    await wait_for(lambda: same_bytes(cluster.root / "a", cluster.root / "b"), 60,
                   "the slave holding the master's bytes, and no more", in_thread=True)
    assert "lost before their fsync" in master.text(), master.text()[-3000:]
    assert "diverged" in slave.text(), slave.text()[-3000:]
    assert await pulled_ids(master.port) == (
        [f"kept-{n}" for n in range(30)] + [f"new-{n}" for n in range(40)])
