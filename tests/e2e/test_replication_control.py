"""The control plane with real processes: a planned switchover driven by ``qmq admin
switchover``, the admin views, and a replicated master that shuts down handing its group over
(docs/REPLICATION.md 9, 11). The data plane is the stand-in of ``tests/replication_stub.py``."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from serverkit import server_id
from tests.harness import Cluster, ServerProcess, admin, run_qmq, spawn, wait_for
from tests.rawclient import RawClient
from wire.message import Message, encode_message

FIRST, SECOND = "0000000000000c01", "0000000000000d02"
_LISTEN = re.compile(r"listening on (?:http://)?(\S+?)[ /]")


def start_stub(cluster: Cluster, meta_url: str, name: str, me: str, peer: str) -> ServerProcess:
    data: Path = cluster.root / name
    data.mkdir(exist_ok=True)
    if not (data / "server.id").exists():
        server_id.write(str(data), bytes.fromhex(me))
    return cluster.keep(spawn(f"stub {name}", [
        sys.executable, "-m", "tests.replication_stub", "--meta", meta_url, "--data-dir",
        str(data), "--group", "rt1", "--insync", peer], _LISTEN))


def server_row(url: str, server: str) -> dict[str, Any]:
    return next(r for r in admin(url, "brokers") if r["server_id"] == server)


def group_row(url: str) -> dict[str, Any]:
    return next(r for r in admin(url, "replication") if r["group"] == "rt1")


async def send(port: int, n: int) -> dict[str, Any]:
    client = await RawClient.connect(port)
    try:
        payload = encode_message(Message.create("orders", b"x", now_ms=time.time_ns() // 10**6,
                                                id=f"s-{n}"))
        answer = await client.request({"op": "send", "messages": [payload]})
    finally:
        await client.close()
    return answer.get("error") or answer["results"][0]


@pytest.mark.timeout(180)
async def test_a_switchover_moves_the_master_and_a_shutdown_hands_it_back(cluster: Cluster):
    meta = cluster.keep(spawn("metaserver", [
        sys.executable, "-m", "qmq", "--log-level", "warning", "metaserver", "--db",
        f"sqlite+aiosqlite:///{cluster.root / 'meta.db'}", "--port", "0", "--lease-ms", "2000"],
        _LISTEN))
    url = meta.url
    first = start_stub(cluster, url, "first", FIRST, SECOND)
    second = start_stub(cluster, url, "second", SECOND, FIRST)
    await wait_for(lambda: group_row(url)["insync"] == [SECOND], 30, "the slave in sync",
                   in_thread=True)
    assert (await send(first.port, 1))["status"] == "stored"
    assert (await send(second.port, 2))["code"] == "not_master"

    await wait_for(lambda: server_row(url, SECOND)["lag_bytes"] == 0, 30,
                   "the slave's lag reported", in_thread=True)
    listing = await asyncio.to_thread(run_qmq, "admin", "brokers", "--meta", url)
    assert listing.returncode == 0, listing.stderr
    header = listing.stdout.splitlines()[0].split()
    assert header == ["group", "kind", "address", "server_id", "role", "epoch", "state",
                      "in_sync", "lag_bytes", "lag_ms", "heartbeat_age_ms"]
    # A master reports no lag of its own ("-"); the stand-in slave reports 0 bytes and 0 ms.
    assert re.search(rf"{FIRST}\s+master\s+1\s+rw\s+yes\s+-\s+-\s", listing.stdout), \
        listing.stdout
    assert re.search(rf"{SECOND}\s+slave\s+1\s+rw\s+yes\s+0\s+0\s", listing.stdout), \
        listing.stdout

    switched = await asyncio.to_thread(run_qmq, "admin", "switchover", "rt1", "--meta", url)
    assert switched.returncode == 0, switched.stdout + switched.stderr
    assert f"switched group rt1 from {FIRST} to {SECOND} at epoch 2" in switched.stdout
    await wait_for(_stored(second.port, 3), 30, "the new master to serve")
    refused = await send(first.port, 4)
    assert refused["code"] == "not_master" and "slave at epoch 2" in refused["message"]

    shown = await asyncio.to_thread(run_qmq, "admin", "replication", "--meta", url, "--json")
    assert shown.returncode == 0, shown.stderr
    [row] = json.loads(shown.stdout)
    assert (row["master_id"], row["epoch"], row["insync"]) == (SECOND, 2, [FIRST])

    # The master stops (SIGTERM): it refuses writes, drains, deregisters, and the MetaServer
    # hands the group to its in-sync slave at once.
    assert await asyncio.to_thread(second.terminate) == 0
    row = group_row(url)
    assert (row["master_id"], row["epoch"]) == (FIRST, 3)
    await wait_for(_stored(first.port, 5), 30, "the old master to serve again")


def _stored(port: int, n: int):
    """An async condition: a fresh send to ``port`` is stored (each try has its own id)."""
    tries = itertools.count()

    async def check() -> bool:
        return (await send(port, n * 1000 + next(tries))).get("status") == "stored"

    return check
