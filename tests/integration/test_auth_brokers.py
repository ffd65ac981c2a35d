"""Token auth on the data plane: a real MetaServer with auth on, a realtime broker and a delay
server in-process on port 0, and the SDK's Producer and Consumer."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgpack
import pytest

import qmq
from delayserver.config import DelayConfig
from delayserver.server import DelayServer
from metaserver.app import start_metaserver
from metaserver.config import MetaConfig, sqlite_url
from realtime.config import RealtimeConfig
from realtime.server import RealtimeServer
from serverkit.access import AccessCache, Grant
from wire.errors import Forbidden, Internal, Unauthorized, Unavailable
from wire.message import Message, encode_message
from tests.rawclient import RawClient

ADMIN = "cluster-admin-secret-0123456789"
RECEIVE_TIMEOUT_S = 30


@dataclass
class Cluster:
    """The servers of one test and the secret of an app token limited to ``order.*``."""

    meta_url: str
    realtime: RealtimeServer
    delay: DelayServer
    session: aiohttp.ClientSession
    orders_token: str
    orders_token_id: int

    async def admin(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """Call the admin API with the admin token."""
        async with self.session.request(method, self.meta_url + path, json=body,
                                        headers={"Authorization": f"Bearer {ADMIN}"}) as resp:
            return resp.status, await resp.json()


@pytest.fixture
async def cluster(tmp_path: Any) -> AsyncIterator[Cluster]:
    """Auth on (a configured admin token); both brokers hold it; one ``order.*`` app token."""
    meta_config = MetaConfig(db_url=sqlite_url(tmp_path / "meta.db"), port=0, admin_token=ADMIN)
    async with start_metaserver(meta_config) as meta, aiohttp.ClientSession() as session:
        realtime = RealtimeServer(RealtimeConfig(
            data_dir=str(tmp_path / "rt"), meta_url=meta.url, group="rt-1", port=0,
            heartbeat_interval_ms=200, token=ADMIN, retry_backoff_ms=(100,)))
        await realtime.start()
        delay = DelayServer(DelayConfig(
            data_dir=str(tmp_path / "delay"), meta_url=meta.url, group="delay-1", port=0,
            bucket_ms=1000, heartbeat_interval_ms=200, token=ADMIN))
        await delay.start()
        cluster = Cluster(meta.url, realtime, delay, session, "", 0)
        status, made = await cluster.admin("POST", "/api/admin/tokens",
                                           {"app": "shop", "produce": ["order.*"],
                                            "consume": ["order.*"]})
        assert status == 200, made
        cluster.orders_token, cluster.orders_token_id = made["token"], made["id"]
        try:
            yield cluster
        finally:
            await delay.stop()
            await realtime.stop()


async def next_message(subscription: Any) -> qmq.ReceivedMessage:
    """The next message of a subscription, within RECEIVE_TIMEOUT_S."""
    async with asyncio.timeout(RECEIVE_TIMEOUT_S):
        return await subscription.__anext__()


async def test_a_token_limited_to_order_subjects_cannot_produce_or_consume_payment_x(
        cluster: Cluster) -> None:
    token = cluster.orders_token
    async with qmq.Producer(cluster.meta_url, app="shop", token=token) as producer, \
            qmq.Consumer(cluster.meta_url, group="billing", app="shop", token=token,
                         start="earliest", wait_ms=200) as consumer:
        receipt = await producer.send("order.created", b"42")
        assert receipt.status == "stored"
        got = await next_message(consumer.subscribe("order.created"))
        assert (got.id, got.body) == (receipt.message_id, b"42")
        await got.ack()

        with pytest.raises(Forbidden) as refused:
            await producer.send("payment.x", b"no")
        assert "app 'shop' may not produce to subject 'payment.x'" in refused.value.message
        with pytest.raises(Forbidden) as refused:
            await producer.send("payment.x", b"no", delay=60_000)  # the delay server checks too
        assert "'payment.x'" in refused.value.message

        with pytest.raises(Forbidden) as refused:
            await next_message(consumer.subscribe("payment.x"))
        # The subject or its retry subject (%retry%payment.x%billing), whichever pull ran first.
        assert re.search(r"app 'shop' may not consume subject '(%retry%)?payment\.x",
                         refused.value.message), refused.value.message


async def test_a_delayed_message_is_dispatched_and_a_nack_retried_through_servers_holding_tokens(
        cluster: Cluster) -> None:
    token = cluster.orders_token
    async with qmq.Producer(cluster.meta_url, app="shop", token=token) as producer, \
            qmq.Consumer(cluster.meta_url, group="billing", app="shop", token=token,
                         start="earliest", wait_ms=200) as consumer:
        receipt = await producer.send("order.timeout", b"late", delay=50)
        assert receipt.delayed
        subscription = consumer.subscribe("order.timeout")
        first = await next_message(subscription)
        assert first.id == receipt.message_id
        # Nacked: the copy goes realtime -> delay server -> realtime as %retry%order.timeout%billing,
        # which the consumer may pull because it counts as order.timeout.
        await first.nack(retry_after=0)
        again = await next_message(subscription)
        assert again.body == b"late" and again.retries == 1
        await again.ack()


async def test_missing_and_unknown_tokens_get_unauthorized_from_both_brokers(
        cluster: Cluster) -> None:
    for port in (cluster.realtime.port, cluster.delay.port):
        assert port is not None
        client = await RawClient.connect(port, hello=False)
        try:
            for token in (None, "qmq_unknown"):
                answer = await client.request({"op": "hello", "client_id": "c", "app": "shop",
                                               "token": token, "protocol": 1})
                assert answer["error"]["code"] == "unauthorized", answer
                assert "(app 'shop')" in answer["error"]["message"]
        finally:
            await client.close()
    # The SDK surfaces the MetaServer's refusal as the same error.
    async with qmq.Producer(cluster.meta_url, app="shop", token="qmq_unknown") as producer:
        with pytest.raises(Unauthorized):
            await producer.send("order.created", b"x")


async def test_a_revoked_token_is_refused_by_a_broker_once_its_cached_answer_expires(
        cluster: Cluster) -> None:
    clock = FakeMonotonic()
    cache = AccessCache(cluster.meta_url, token=ADMIN, ttl_ms=10_000, clock_ms=clock)
    try:
        grant = await cache.grant(cluster.orders_token, "shop")
        assert grant == Grant(app="shop", produce=("order.*",), consume=("order.*",))
        status, _ = await cluster.admin("POST", "/api/admin/tokens/revoke",
                                        {"id": cluster.orders_token_id})
        assert status == 200
        clock.advance(9_999)  # still within the TTL: the cached grant holds
        assert await cache.grant(cluster.orders_token, "shop") == grant
        clock.advance(1)
        with pytest.raises(Unauthorized, match="unknown or revoked"):
            await cache.grant(cluster.orders_token, "shop")
    finally:
        await cache.close()


async def test_a_broker_with_a_short_ttl_refuses_a_revoked_token_on_an_open_connection(
        cluster: Cluster, tmp_path: Any) -> None:
    realtime = RealtimeServer(RealtimeConfig(
        data_dir=str(tmp_path / "rt2"), meta_url=cluster.meta_url, group="rt-2", port=0,
        token=ADMIN, auth_ttl_ms=1))
    await realtime.start()
    try:
        assert realtime.port is not None
        client = await RawClient.connect(realtime.port, hello=False)
        hello = {"op": "hello", "client_id": "c", "app": "shop", "token": cluster.orders_token,
                 "protocol": 1}
        assert (await client.request(hello)).get("ok")
        pull = {"op": "pull", "subject": "order.created", "group": "g", "consumer_id": "c",
                "max_count": 1, "wait_ms": 0}
        assert "payloads" in await client.request(pull)
        assert (await client.request({**pull, "subject": "payment.x"}))["error"]["code"] == \
            "forbidden"
        await cluster.admin("POST", "/api/admin/tokens/revoke", {"id": cluster.orders_token_id})
        answer = await client.request(pull)
        assert answer["error"]["code"] == "unauthorized", answer
        await client.close()
    finally:
        await realtime.stop()


async def test_cached_grants_outlive_a_metaserver_outage_but_an_unseen_token_is_retriable(
        tmp_path: Any) -> None:
    clock = FakeMonotonic()
    config = MetaConfig(db_url=sqlite_url(tmp_path / "m.db"), port=0, admin_token=ADMIN)
    async with start_metaserver(config) as meta:
        cache = AccessCache(meta.url, token=ADMIN, ttl_ms=10_000, clock_ms=clock)
        assert (await cache.grant(ADMIN, "ops")).admin
    # The MetaServer is gone now.
    try:
        clock.advance(60_000)
        assert (await cache.grant(ADMIN, "ops")).admin
        with pytest.raises(Internal) as failed:
            await cache.grant("qmq_never_seen", "shop")
        assert failed.value.retriable and "unreachable" in failed.value.message
    finally:
        await cache.close()


async def test_a_broker_that_never_reached_a_metaserver_fails_closed_with_or_without_a_token(
        tmp_path: Any) -> None:
    for own_token in (None, ADMIN):
        cache = AccessCache("http://127.0.0.1:9", token=own_token, clock_ms=FakeMonotonic())
        try:
            with pytest.raises(Unavailable, match="does not know whether auth is on") as failed:
                await cache.grant(None, "shop")
            assert failed.value.retriable
        finally:
            await cache.close()


async def test_a_broker_told_by_its_registration_that_auth_is_off_lets_clients_in_meanwhile(
        tmp_path: Any) -> None:
    cache = AccessCache("http://127.0.0.1:9", token=None, clock_ms=FakeMonotonic())
    try:
        cache.note_auth(False)  # said by a register or heartbeat answer
        assert (await cache.grant(None, "shop")).admin  # the open grant of an auth-off cluster
        cache.note_auth(True)
        with pytest.raises(Internal, match="unreachable"):
            await cache.grant(None, "shop")
    finally:
        await cache.close()


async def test_token_checks_fail_over_to_the_next_metaserver_of_the_list(tmp_path: Any) -> None:
    config = MetaConfig(db_url=sqlite_url(tmp_path / "m.db"), port=0, admin_token=ADMIN)
    async with start_metaserver(config) as meta:
        cache = AccessCache(f"http://127.0.0.1:9,{meta.url}", token=ADMIN,
                            clock_ms=FakeMonotonic())
        try:
            assert (await cache.grant(ADMIN, "ops")).admin
            assert cache.meta.url == meta.url, "the one that answered is asked first from now on"
        finally:
            await cache.close()


async def test_the_admin_api_reaches_brokers_with_the_callers_admin_token(
        cluster: Cluster) -> None:
    status, answer = await cluster.admin("GET", "/api/admin/dead")
    assert status == 200, answer
    assert answer.get("errors", []) == []


async def test_broker_admin_ops_need_an_admin_token(cluster: Cluster) -> None:
    assert cluster.realtime.port is not None
    client = await RawClient.connect(cluster.realtime.port, hello=False)
    try:
        await client.request({"op": "hello", "client_id": "c", "app": "shop",
                              "token": cluster.orders_token, "protocol": 1})
        answer = await client.request({"op": "subjects", "prefix": "%dead%"})
        assert answer["error"]["code"] == "forbidden"
        assert "admin op subjects" in answer["error"]["message"]
    finally:
        await client.close()


class FakeMonotonic:
    """A monotonic clock in ms that moves only when told."""

    def __init__(self) -> None:
        self.now_ms = 1_000_000

    def __call__(self) -> int:
        return self.now_ms

    def advance(self, ms: int) -> None:
        """Move the clock forward by ``ms``."""
        self.now_ms += ms


async def test_a_delayed_batch_with_one_subject_outside_the_token_is_refused_whole_storing_nothing(
        cluster: Cluster) -> None:
    client = await RawClient.connect(cluster.delay.port, hello=False)
    try:
        hello = await client.request({"op": "hello", "client_id": "c", "app": "shop",
                                      "token": cluster.orders_token, "protocol": 1})
        assert hello.get("ok"), hello
        now_ms = int(time.time() * 1000)
        due_ms = now_ms + 600_000
        allowed = Message.create("order.a", b"a", now_ms=now_ms, deliver_at_ms=due_ms)
        # A key the quick check does not know leaves this payload to the full check: its
        # subject is read for the grant all the same.
        unknown_key = msgpack.packb({"i": "odd-1", "s": "payment.x", "b": b"x", "c": now_ms,
                                     "d": due_ms, "zz": 1}, use_bin_type=True)
        for refused in (encode_message(Message.create("payment.x", b"p", now_ms=now_ms,
                                                      deliver_at_ms=due_ms)), unknown_key):
            answer = await client.request({"op": "send",
                                           "messages": [encode_message(allowed), refused]})
            assert answer["error"]["code"] == "forbidden", answer
            assert "subject 'payment.x'" in answer["error"]["message"]
        assert (await cluster.delay.scheduler.report())["pending_total"] == 0
        answer = await client.request({"op": "send", "messages": [encode_message(allowed)]})
        assert answer["results"][0]["status"] == "stored", answer
        assert (await cluster.delay.scheduler.report())["pending_total"] == 1
    finally:
        await client.close()
