"""Servers and their roles, in one process with a real MetaServer: who serves, when a new master
starts serving, failing closed, failing over between MetaServers, and a delay server that lost
its mastership not dispatching (docs/REPLICATION.md 3-5, 12). The data plane is a stand-in
(``StubReplication``) that copies nothing, so these tests see the control plane alone; the real
data plane is tested by ``test_replication_data.py`` and the e2e replication tests."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest

from delayserver.config import DelayConfig
from delayserver.server import DelayServer
from metaserver import MetaConfig, sqlite_url, start_metaserver
from realtime.config import RealtimeConfig
from realtime.server import RealtimeServer
from serverkit import server_id
from serverkit.replication import ReplicaReport
from serverkit.role import RoleView, ServerRole
from tests.harness import free_port, wait_for
from tests.rawclient import RawClient
from wire.message import Message, encode_message

FIRST, SECOND = "00000000000000e1", "00000000000000f2"
LEASE_MS = 2_000


class StubReplication:
    """A data plane that copies nothing: as master it proposes fixed peers as in sync (so the
    MetaServer can promote them) and reports a switchover's target as ready at once."""

    def __init__(self, peers: list[str]) -> None:
        self.peers = tuple(peers)
        self.role: ServerRole | None = None
        self.views: list[RoleView] = []

    def report(self) -> ReplicaReport:
        """The peers as in sync (master), and the switchover target as ready."""
        if self.role is None:  # not bound to its server yet
            return ReplicaReport()
        view = self.role.view()
        if view.role != "master":
            return ReplicaReport(position=0, lag_bytes=0, lag_ms=0)
        return ReplicaReport(position=0, insync=self.peers, handover_ready=view.switchover_to)

    async def on_role(self, view: RoleView) -> None:
        """Nothing to seal or truncate; remember what was told."""
        self.views.append(view)

    def last_epoch(self) -> int:
        """No epoch history."""
        return 0

    async def drain(self, timeout_ms: int) -> None:
        """Nothing copied, nothing to wait for."""


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def realtime(tmp_path: Any, meta_url: str, me: str, peer: str,
             stub: StubReplication | None = None) -> RealtimeServer:
    data = tmp_path / me
    data.mkdir(exist_ok=True)
    server_id.write(str(data), bytes.fromhex(me))
    stub = stub or StubReplication([peer])
    server = RealtimeServer(RealtimeConfig(data_dir=str(data), meta_url=meta_url, group="rt1",
                                           port=0, trace=False), replication=stub)
    stub.role = server.role
    return server


async def send(port: int, n: int) -> dict[str, Any]:
    client = await RawClient.connect(port)
    try:
        payload = encode_message(Message.create("orders", b"x", now_ms=now_ms(), id=f"r-{n}"))
        answer = await client.request({"op": "send", "messages": [payload]})
    finally:
        await client.close()
    return answer.get("error") or answer["results"][0]


async def admin(url: str, method: str, path: str, body: Any = None) -> Any:
    async with aiohttp.ClientSession() as session:
        async with session.request(method, url + path, json=body) as response:
            return await response.json()


async def test_a_second_server_of_a_group_is_a_slave_that_answers_only_hello(tmp_path):
    config = MetaConfig(db_url=sqlite_url(tmp_path / "m.db"), port=0, lease_ms=LEASE_MS)
    async with start_metaserver(config) as meta:
        first = realtime(tmp_path, meta.url, FIRST, SECOND)
        second = realtime(tmp_path, meta.url, SECOND, FIRST)
        await first.start()
        await second.start()
        try:
            assert (first.role.role, second.role.role) == ("master", "slave")
            assert (await send(first.port, 1))["status"] == "stored"
            client = await RawClient.connect(second.port)
            try:
                hello = await client.request({"op": "hello", "client_id": "c", "app": "a",
                                              "protocol": 1})
                assert hello["server"]["role"] == "slave" and hello["server"]["epoch"] == 1
                pull = await client.pull("orders", "g", "c")
                assert pull["error"]["code"] == "not_master"
                assert f"the master is {FIRST} at {first.address}" in pull["error"]["message"]
            finally:
                await client.close()
        finally:
            await second.stop()
            await first.stop()


class BlockingStub(StubReplication):
    """A stand-in whose ``on_role`` for a master waits until the test lets it go."""

    def __init__(self, peers: list[str]) -> None:
        super().__init__(peers)
        self.release = asyncio.Event()
        self.entered = asyncio.Event()

    async def on_role(self, view: RoleView) -> None:
        await super().on_role(view)
        if view.role == "master" and view.epoch > 1:
            self.entered.set()
            await self.release.wait()


async def test_a_promoted_slave_serves_only_once_its_data_plane_has_sealed_its_logs(tmp_path):
    config = MetaConfig(db_url=sqlite_url(tmp_path / "m.db"), port=0, lease_ms=LEASE_MS)
    async with start_metaserver(config) as meta:
        first = realtime(tmp_path, meta.url, FIRST, SECOND)
        stub = BlockingStub([FIRST])
        second = realtime(tmp_path, meta.url, SECOND, FIRST, stub)
        await first.start()
        await second.start()
        try:
            await wait_for(lambda: second.role.insync == (SECOND,) or
                           second.role.lease_required, 20, "the slave in sync")
            started = await admin(meta.url, "POST", "/api/admin/switchover",
                                  {"group": "rt1", "to": SECOND})
            assert started["state"] == "requested", started
            async with asyncio.timeout(30):
                await stub.entered.wait()
            assert second.role.role == "master" and not second.role.active
            refused = await send(second.port, 2)
            assert refused["code"] == "not_master" and "sealing its logs" in refused["message"]
            stub.release.set()
            await wait_for(lambda: second.role.active, 10, "activation")
            assert (await send(second.port, 3))["status"] == "stored"
            assert [v.role for v in stub.views][-1] == "master"
        finally:
            stub.release.set()
            await second.stop()
            await first.stop()


async def test_a_server_that_never_reached_a_metaserver_refuses_clients(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    server = realtime(tmp_path, dead, FIRST, SECOND)
    await server.start()
    try:
        client = await RawClient.connect(server.port, hello=False)
        try:
            answer = await client.request({"op": "hello", "client_id": "c", "app": "a",
                                           "protocol": 1})
            assert answer["error"]["code"] == "unavailable", answer
            assert "does not know whether auth is on" in answer["error"]["message"]
        finally:
            await client.close()
    finally:
        await server.stop()


async def test_registration_and_token_checks_move_to_the_next_metaserver_of_the_list(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    config = MetaConfig(db_url=sqlite_url(tmp_path / "m.db"), port=0, lease_ms=LEASE_MS)
    async with start_metaserver(config) as meta:
        server = realtime(tmp_path, f"{dead},{meta.url}", FIRST, SECOND)
        await server.start()
        try:
            assert server.role.role == "master" and server.role.active
            assert server.registration is not None
            assert server.registration.meta.url == meta.url
            assert (await send(server.port, 1))["status"] == "stored"
        finally:
            await server.stop()


async def test_a_delay_server_that_lost_its_mastership_does_not_dispatch(tmp_path):
    config = MetaConfig(db_url=sqlite_url(tmp_path / "m.db"), port=0, lease_ms=LEASE_MS)
    dispatched: list[RoleView] = []  # the first server's role at each dispatch it made
    holder: list[DelayServer] = []

    async def dispatch(subject: str, payloads: list[bytes]) -> tuple[str, list[dict[str, Any]]]:
        dispatched.append(holder[0].role.view())
        return "rt1", [{"status": "stored"} for _ in payloads]

    async with start_metaserver(config) as meta:
        servers = []
        for me, peer in ((FIRST, SECOND), (SECOND, FIRST)):
            data = tmp_path / me
            data.mkdir()
            server_id.write(str(data), bytes.fromhex(me))
            stub = StubReplication([peer])
            server = DelayServer(DelayConfig(data_dir=str(data), meta_url=meta.url, group="d1",
                                             port=0, bucket_ms=1000, trace=False),
                                 dispatch=dispatch, replication=stub)
            stub.role = server.role
            servers.append(server)
        first, second = servers
        holder.append(first)
        await first.start()
        await second.start()
        try:
            await wait_for(lambda: first.role.lease_required, 20, "the slave in sync")
            client = await RawClient.connect(first.port)
            await client.send(Message.create("later", b"x", now_ms=now_ms(),
                                             deliver_at_ms=now_ms() + 4000))
            await client.close()
            await admin(meta.url, "POST", "/api/admin/switchover", {"group": "d1", "to": SECOND})
            await wait_for(lambda: first.role.role == "slave", 30, "the handover")
            # Once due, its scheduler tries, is refused, and retries with backoff: never sent.
            await wait_for(lambda: first.metrics.dispatch_failures.get("not_master", 0) >= 1,
                           30, "the refused dispatch")
            assert all(view.role == "master" for view in dispatched), dispatched
        finally:
            await second.stop()
            await first.stop()


async def _no_dispatch(subject: str, payloads: list[bytes]) -> tuple[str, list[dict[str, Any]]]:
    raise AssertionError(f"nothing is due in this test ({subject})")


def delay(tmp_path: Any, meta_url: str, me: str, peer: str) -> DelayServer:
    """A delay server of group d1 as ``me`` whose stand-in data plane proposes ``peer``."""
    data = tmp_path / me
    data.mkdir(exist_ok=True)
    server_id.write(str(data), bytes.fromhex(me))
    stub = StubReplication([peer])
    server = DelayServer(DelayConfig(data_dir=str(data), meta_url=meta_url, group="d1", port=0,
                                     bucket_ms=1000, trace=False),
                         dispatch=_no_dispatch, replication=stub)
    stub.role = server.role
    return server


@pytest.mark.parametrize("kind", ["realtime", "delay"])
async def test_a_master_that_stalled_past_its_lease_stores_the_next_send_after_renewing_at_once(
        tmp_path, kind):
    # A process stalled longer than its lease (SIGSTOP, swap, a loaded machine) used to refuse
    # sends with not_master until its next heartbeat interval's answer (~1 s with the defaults,
    # review s18 slave): a producer's 4 attempts could all fail on a master that still is one.
    # Now the send waits for a renewal asked at once. The MetaServer's margin is long so the
    # stall cannot end in a failover: this is the master that stays master.
    config = MetaConfig(db_url=sqlite_url(tmp_path / "m.db"), port=0, lease_ms=LEASE_MS,
                        lease_margin_ms=600_000)
    make = realtime if kind == "realtime" else delay
    async with start_metaserver(config) as meta:
        first = make(tmp_path, meta.url, FIRST, SECOND)
        second = make(tmp_path, meta.url, SECOND, FIRST)
        await first.start()
        await second.start()
        client = await RawClient.connect(first.port)
        try:
            await wait_for(lambda: first.role.lease_required and not first.role.solo, 20,
                           "a master that needs a lease (a slave in sync)")
            renewals = first.role.lease_until_ms
            time.sleep(LEASE_MS / 1000)  # the whole process stalls (the loop too) past the lease
            assert not first.role.writable_now(), "the stall must outlast the lease"
            later = now_ms() + 3_600_000 if kind == "delay" else None  # a delay server's own
            payload = encode_message(Message.create("orders", b"x", now_ms=now_ms(), id="r-1",
                                                    deliver_at_ms=later))
            answer = await client.request({"op": "send", "messages": [payload]})
            assert "error" not in answer, answer
            assert answer["results"][0]["status"] == "stored"
            assert first.role.lease_until_ms > renewals  # stored under a renewed lease
        finally:
            await client.close()
            await second.stop()
            await first.stop()
