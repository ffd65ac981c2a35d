"""A partition, rehearsed across machines: the MetaServer, a master and its slave each run in
their own network namespace (``tests/netns.py``), and the master is cut off from the MetaServer
and from the slave while the test process still reaches it. The master must stop accepting
writes within its lease, the slave must be promoted, and no write may be acknowledged by the
old master after the promotion (docs/REPLICATION.md 5, 6, 10).

The servers are real ``qmq realtime`` processes with ``sync`` replication: the slave holds a
real copy, so after the failover every send the old master acknowledged is consumed from the
new master, once (the test never resends, so there is nothing to de-duplicate; REPLICATION.md
10 names resends as the only duplicates of a partition). Healed, the old master rejoins as a
slave and cuts the tail it wrote alone (sends it refused for want of a lease): its message log
ends up byte for byte the new master's.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from serverkit import server_id
from tests import netns
from tests.e2e.support import same_bytes
from tests.harness import wait_for
from tests.rawclient import RawClient
from wire.message import Message, decode_message, encode_message

pytestmark = pytest.mark.skipif(netns.available() is not None,
                                reason=f"network namespaces: {netns.available()}")

LEASE_MS, MARGIN_MS, EXPIRY_MS = 2_000, 1_000, 6_000
MASTER_ID, SLAVE_ID = "0000000000000a01", "0000000000000b02"
_LISTEN = re.compile(r"listening on (?:http://)?(\S+?)[ /]")


@dataclass
class Outcome:
    """One send to the old master: when its answer came (wall ms) and what it said."""

    at_ms: int
    stored: bool
    code: str | None
    message: str
    message_id: str


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


def admin(url: str, what: str) -> Any:
    with urllib.request.urlopen(f"{url}/api/admin/{what}", timeout=5) as response:
        return json.loads(response.read())[what]


def replication_row(url: str) -> dict[str, Any] | None:
    try:
        return next((r for r in admin(url, "replication") if r["group"] == "rt1"), None)
    except OSError:
        return None


def start(net: netns.Network, tmp: Path) -> tuple[str, Any, Any]:
    """The MetaServer, then the master, then the slave; returns (meta URL, master, slave)."""
    meta = net.run("meta", "metaserver", [
        sys.executable, "-m", "qmq", "--log-level", "warning", "metaserver",
        "--db", f"sqlite+aiosqlite:///{tmp / 'meta.db'}", "--host", net.address("meta"),
        "--port", "8090", "--lease-ms", str(LEASE_MS), "--lease-margin-ms", str(MARGIN_MS),
        "--broker-expiry-ms", str(EXPIRY_MS)], _LISTEN)
    url = f"http://{meta.address}"
    servers = []
    for node, me in (("m", MASTER_ID), ("s", SLAVE_ID)):
        data = tmp / node
        data.mkdir()
        server_id.write(str(data), bytes.fromhex(me))
        servers.append(net.run(node, f"realtime {node}", [
            sys.executable, "-m", "qmq", "--log-level", "warning", "realtime", "--meta", url,
            "--data-dir", str(data), "--group", "rt1", "--host", net.address(node), "--port",
            "20881", "--no-metrics", "--flush", "sync", "--replication", "sync"], _LISTEN))
    return url, servers[0], servers[1]


async def send_one(client: RawClient, n: int) -> dict[str, Any]:
    payload = encode_message(Message.create("orders", f"m{n}".encode(), now_ms=wall_ms(),
                                            id=f"p-{n}"))
    return await client.request({"op": "send", "messages": [payload]}, timeout_s=30)


def outcome(answer: dict[str, Any], n: int) -> Outcome:
    if "error" in answer:
        return Outcome(wall_ms(), False, answer["error"]["code"], answer["error"]["message"],
                       f"p-{n}")
    result = answer["results"][0]
    return Outcome(wall_ms(), "status" in result, (result.get("error") or {}).get("code"),
                   str(result), f"p-{n}")


async def drain(client: RawClient) -> list[str]:
    """Every message of ``orders`` for a fresh consumer group, in order, acking as it goes."""
    ids: list[str] = []
    for _ in range(100):
        pulled = await client.pull("orders", "audit", "c1", max_count=100, start="earliest")
        if not pulled["pull_seqs"]:
            return ids
        ids += [decode_message(p).id for p in pulled["payloads"]]
        seqs = pulled["pull_seqs"]
        await client.ack("orders", "audit", "c1", [[seqs[0], seqs[-1]]])
    raise AssertionError(f"more than 10000 messages: {len(ids)}")


@pytest.mark.timeout(180)
async def test_a_master_cut_off_stops_within_its_lease_and_the_slave_takes_over(tmp_path):
    net = netns.Network(["meta", "m", "s"])
    with net:
        url, master, slave = await asyncio.to_thread(start, net, tmp_path)
        # The slave catches up and the master proposes it in sync: the group is replicated.
        await wait_for(lambda: (replication_row(url) or {}).get("insync") == [SLAVE_ID], 30,
                       "the slave in sync", in_thread=True)
        old = await RawClient.connect(master.port, host=net.address("m"))
        new = await RawClient.connect(slave.port, host=net.address("s"))
        results: list[Outcome] = [outcome(await send_one(old, 0), 0)]
        assert results[0].stored
        refused = outcome(await send_one(new, 1), 1)
        assert refused.code == "not_master" and "slave at epoch 1" in refused.message

        net.cut("m", "meta")
        net.cut("m", "s")
        cut_ms = wall_ms()
        n = 2
        # Keep writing to the old master (the test still reaches it) until the slave is
        # promoted and has served a write, and for a while after.
        promoted_row: dict[str, Any] | None = None
        served_by_new: list[str] = []
        after_promotion = 0
        for _ in range(2000):
            results.append(outcome(await send_one(old, n), n))
            n += 1
            row = await asyncio.to_thread(replication_row, url)
            if row is not None and row["epoch"] == 2:
                promoted_row = row
                if not served_by_new:
                    if outcome(await send_one(new, n), n).stored:
                        served_by_new.append(f"p-{n}")
                    n += 1
                after_promotion += 1
            if served_by_new and after_promotion >= 20:
                break
            await asyncio.sleep(0.05)
        assert promoted_row is not None, "the slave was never promoted"
        assert promoted_row["master_id"] == SLAVE_ID
        assert served_by_new, "the promoted slave never accepted a send"
        promoted_ms = promoted_row["epoch_started_at_ms"]

        acked = [r for r in results if r.stored]
        refusals = [r for r in results if not r.stored]
        print(f"cut at {cut_ms}, promoted at {promoted_ms} (+{promoted_ms - cut_ms} ms); old "
              f"master acked {len(acked) - 1} after the cut, last "
              f"+{acked[-1].at_ms - cut_ms} ms, first refusal +{refusals[0].at_ms - cut_ms} ms")
        # No write is acknowledged by the old master after the promotion ...
        assert all(r.at_ms < promoted_ms for r in acked), [r for r in acked
                                                           if r.at_ms >= promoted_ms]
        # ... because it stopped on its own: it refuses with not_master for want of a lease
        # (a send waiting for the cut-off slave is refused too), and from its first refusal on
        # it never accepts again.
        first = results.index(refusals[0])
        assert all(not r.stored for r in results[first:])
        assert all(r.code == "not_master" for r in refusals), {r.code for r in refusals}
        assert any("lease ran out" in r.message for r in refusals)

        # Healed, the old master learns the new epoch and is a slave: it still refuses.
        net.heal("m", "meta")
        net.heal("m", "s")

        def old_master_is_a_slave() -> bool:
            rows = admin(url, "brokers")
            return any(r["server_id"] == MASTER_ID and r["role"] == "slave"
                       and r["reported_epoch"] == 2 and r["state"] != "offline" for r in rows)

        await wait_for(old_master_is_a_slave, 60, "the old master to rejoin as a slave",
                       in_thread=True)
        rejoined = outcome(await send_one(old, n), n)
        assert rejoined.code == "not_master" and "slave at epoch 2" in rejoined.message
        last = outcome(await send_one(new, n + 1), n + 1)
        assert last.stored
        # What a user notices: every send either master acknowledged is consumed from the new
        # master, each once (nothing was resent, so there is nothing to de-duplicate).
        consumed = await drain(new)
        acknowledged = {r.message_id for r in acked} | set(served_by_new) | {last.message_id}
        assert acknowledged - set(consumed) == set()
        assert len(consumed) == len(set(consumed)), sorted(consumed)
        # The old master cut the tail it wrote alone and holds the new master's bytes.
        await wait_for(lambda: same_bytes(tmp_path / "s", tmp_path / "m"), 60,
                       "the old master to hold the new master's bytes", in_thread=True)
        print(f"{len(acknowledged)} acknowledged, {len(consumed)} consumed; the old master "
              + ("cut a diverging tail" if "diverged" in master.text() else "had no tail to cut"))
        await old.close()
        await new.close()
    # Everything the network made is gone: namespaces (with their veths) and processes.
    left = netns.ip("netns", "list").stdout
    assert net.namespace("") not in left, left
    assert all(s.process.poll() is not None for s in net.processes)
