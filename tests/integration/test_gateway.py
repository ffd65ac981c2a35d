"""The HTTP gateway end to end in one process: a MetaServer, realtime brokers and a delay server
on port 0, driven with plain HTTP as a client in any language would."""

from __future__ import annotations

import asyncio
import base64
import time
from datetime import datetime, timezone
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from delayserver.config import DelayConfig
from delayserver.server import DelayServer
from metaserver import MetaConfig, sqlite_url, start_metaserver
from metaserver.app import RunningMetaServer
from metaserver.gateway_codec import GATEWAY_REQUEST_BYTES_MAX, make_receipt
from realtime.config import RealtimeConfig
from realtime.server import RealtimeServer
from wire.limits import MAX_BODY_BYTES, MAX_SEND_BATCH_MESSAGES

ADMIN = "gateway-admin-secret-0123456789"


@dataclass
class Gateway:
    meta: RunningMetaServer
    http: aiohttp.ClientSession
    realtime: list[RealtimeServer] = field(default_factory=list)
    token: str | None = None

    async def call(self, path: str, body: Any, token: str | None = None,
                   raw: bytes | None = None) -> tuple[int, Any]:
        token = token if token is not None else self.token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with self.http.post(self.meta.url + path, json=None if raw else body, data=raw,
                                  headers=headers) as resp:
            return resp.status, await resp.json()

    async def ok(self, path: str, body: Any, token: str | None = None) -> Any:
        status, answer = await self.call(path, body, token)
        assert status == 200, answer
        return answer

    async def send(self, *messages: dict[str, Any]) -> list[dict[str, Any]]:
        return (await self.ok("/api/send", {"messages": list(messages)}))["results"]

    async def pull(self, **fields: Any) -> list[dict[str, Any]]:
        body = {"subject": "orders", "group": "billing", "consumer_id": "c1",
                "start": "earliest", **fields}
        return (await self.ok("/api/pull", body))["messages"]


@asynccontextmanager
async def gateway(tmp_path: Any, groups: int = 1, **meta: Any) -> AsyncIterator[Gateway]:
    config = MetaConfig(db_url=sqlite_url(tmp_path / "meta.db"), port=0, **meta)
    token = meta.get("admin_token")
    async with start_metaserver(config) as server:
        started: list[Any] = []
        try:
            for i in range(groups):
                rt = RealtimeServer(RealtimeConfig(
                    data_dir=str(tmp_path / f"rt{i}"), meta_url=server.url, group=f"rt{i}",
                    port=0, heartbeat_interval_ms=200, trace=False, token=token,
                    metrics_port=None, retry_backoff_ms=(100,), retries_max=1))
                await rt.start()
                started.append(rt)
            delay = DelayServer(DelayConfig(
                data_dir=str(tmp_path / "delay"), meta_url=server.url, group="delay-1", port=0,
                bucket_ms=1000, heartbeat_interval_ms=200, trace=False, token=token,
                metrics_port=None))
            await delay.start()
            started.append(delay)
            async with aiohttp.ClientSession() as http:
                yield Gateway(server, http, started[:groups])
        finally:
            for s in reversed(started):
                await s.stop()


async def test_a_message_sent_over_http_is_pulled_with_its_fields_and_acked_once(tmp_path):
    async with gateway(tmp_path) as gw:
        (sent,) = await gw.send({"subject": "orders", "body": "aGk=", "encoding": "base64",
                                 "tags": ["vip"], "properties": {"k": "v"}, "id": "o-1"})
        assert (sent["id"], sent["status"], sent["broker_group"]) == ("o-1", "stored", "rt0")
        (again,) = await gw.send({"subject": "orders", "body": "hi", "id": "o-1"})
        assert again["status"] == "duplicate"
        (message,) = await gw.pull(wait_ms=2000)
        assert (message["id"], message["body"], message["encoding"], message["tags"],
                message["properties"], message["retries"], message["redelivered"]) == (
            "o-1", "hi", "utf-8", ["vip"], {"k": "v"}, 0, 0)
        assert (await gw.ok("/api/ack", {"receipts": [message["receipt"]]}))["acked"] == 1
        assert (await gw.ok("/api/ack", {"receipts": [message["receipt"]]}))["acked"] == 0
        assert await gw.pull() == []


async def test_a_binary_body_comes_back_as_base64(tmp_path):
    async with gateway(tmp_path) as gw:
        body = bytes(range(256))
        await gw.send({"subject": "orders", "body": base64.b64encode(body).decode(),
                       "encoding": "base64"})
        (message,) = await gw.pull(wait_ms=2000)
        assert message["encoding"] == "base64"
        assert base64.b64decode(message["body"]) == body


async def test_a_long_poll_waits_for_a_message_sent_while_it_waits(tmp_path):
    async with gateway(tmp_path, groups=2) as gw:
        await gw.pull()  # the group starts here (start latest) on both brokers
        waiting = asyncio.create_task(gw.pull(wait_ms=10_000, start="latest"))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        await gw.send({"subject": "orders", "body": "now"})
        async with asyncio.timeout(10):
            (message,) = await waiting
        assert message["body"] == "now"


async def test_a_delayed_message_arrives_at_its_time_and_another_is_cancelled(tmp_path):
    async with gateway(tmp_path) as gw:
        start = time.time()
        tomorrow = datetime.fromtimestamp(int(start) + 86_400, timezone.utc)
        soon, later = await gw.send(
            {"subject": "orders", "body": "soon", "delay_ms": 500},
            {"subject": "orders", "body": "later",
             "deliver_at": tomorrow.isoformat().replace("+00:00", "Z")})
        assert soon["broker_group"] == later["broker_group"] == "delay-1"
        assert later["deliver_at_ms"] == (int(start) + 86_400) * 1000
        cancel = {"subject": "orders", "id": later["id"], "broker_group": "delay-1",
                  "deliver_at_ms": later["deliver_at_ms"]}
        (result,) = (await gw.ok("/api/cancel", {"messages": [cancel]}))["results"]
        assert result == {"id": later["id"], "status": "cancelled"}
        (result,) = (await gw.ok("/api/cancel", {"messages": [cancel]}))["results"]
        assert result["status"] == "already_cancelled"
        messages = await gw.pull(wait_ms=10_000)
        assert [m["body"] for m in messages] == ["soon"]
        assert time.time() - start >= 0.5


async def test_a_nacked_message_comes_back_as_a_retry_then_goes_dead(tmp_path):
    async with gateway(tmp_path) as gw:
        await gw.send({"subject": "orders", "body": "fails", "id": "f-1"})
        (first,) = await gw.pull(wait_ms=2000)
        nacked = await gw.ok("/api/nack", {"receipts": [first["receipt"]], "retry_after_ms": 0})
        assert nacked == {"nacked": 1}
        deadline = time.monotonic() + 20
        retried: list[dict[str, Any]] = []
        while not retried and time.monotonic() < deadline:
            retried = await gw.pull(wait_ms=1000)
        (retry,) = retried
        assert (retry["subject"], retry["retries"], retry["origin_id"]) == ("orders", 1, "f-1")
        assert (await gw.ok("/api/nack", {"receipts": [retry["receipt"]]}))["nacked"] == 1
        status, dead = 0, {"dead": []}
        while not dead["dead"] and time.monotonic() < deadline:
            async with gw.http.get(gw.meta.url + "/api/admin/dead") as resp:
                status, dead = resp.status, await resp.json()
        assert [d["origin_id"] for d in dead["dead"]] == ["f-1"]


async def test_the_binary_protocols_limits_hold_with_its_codes(tmp_path):
    async with gateway(tmp_path) as gw:
        status, answer = await gw.call("/api/send", {"messages": [
            {"subject": "orders", "body": "x"}] * (MAX_SEND_BATCH_MESSAGES + 1)})
        assert (status, answer["error"]["code"]) == (413, "too_large")
        assert "exceeds MAX_SEND_BATCH_MESSAGES 256" in answer["error"]["message"]
        big = {"subject": "orders", "body": "x" * (MAX_BODY_BYTES + 1)}
        fine = {"subject": "orders", "body": "x" * MAX_BODY_BYTES}
        results = await gw.send(big, fine, {"subject": "orders", "body": "x",
                                            "delay_ms": 63_072_000_001},
                                {"subject": "%dead%a%b", "body": "x"},
                                {"subject": "orders", "body": "x", "tags": ["t"] * 11})
        assert [r.get("error", {}).get("code") for r in results] == [
            "too_large", None, "delay_out_of_range", "bad_request", "bad_request"]
        assert "exceeds MAX_BODY_BYTES 4194304" in results[0]["error"]["message"]
        status, answer = await gw.call("/api/send", None,
                                       raw=b" " * (GATEWAY_REQUEST_BYTES_MAX + 1))
        assert (status, answer["error"]["code"]) == (413, "too_large")
        status, answer = await gw.call("/api/pull", {"subject": "orders", "group": "g",
                                                     "consumer_id": "c", "max_count": 1025})
        assert status == 400 and "MAX_PULL_BATCH_MESSAGES 1024" in answer["error"]["message"]
        status, answer = await gw.call("/api/send", {"messages": [{"subject": "orders"}]})
        assert status == 400 and "body" in answer["error"]["message"]


async def test_tokens_and_their_patterns_are_checked_as_on_the_binary_protocol(tmp_path):
    async with gateway(tmp_path, admin_token=ADMIN) as gw:
        async with gw.http.post(gw.meta.url + "/api/admin/tokens", json={
                "app": "shop", "produce": ["order.*"], "consume": ["order.*"]},
                headers={"Authorization": f"Bearer {ADMIN}"}) as resp:
            shop = (await resp.json())["token"]
        status, answer = await gw.call("/api/send", {"messages": [
            {"subject": "order.a", "body": "x"}]})
        assert (status, answer["error"]["code"]) == (401, "unauthorized")
        status, answer = await gw.call("/api/send", {"messages": [
            {"subject": "order.a", "body": "x"}, {"subject": "payment.x", "body": "y"}]}, shop)
        assert (status, answer["error"]["code"]) == (403, "forbidden")
        assert "may not produce to subject 'payment.x'" in answer["error"]["message"]
        (sent,) = (await gw.ok("/api/send", {"messages": [{"subject": "order.a", "body": "x"}]},
                               shop))["results"]
        assert sent["status"] == "stored"
        status, answer = await gw.call("/api/pull", {"subject": "payment.x", "group": "g",
                                                     "consumer_id": "c"}, shop)
        assert (status, answer["error"]["code"]) == (403, "forbidden")
        pulled = await gw.ok("/api/pull", {"subject": "order.a", "group": "g",
                                           "consumer_id": "c", "start": "earliest",
                                           "wait_ms": 2000}, shop)
        assert [m["body"] for m in pulled["messages"]] == ["x"]


async def test_a_receipt_naming_no_broker_of_the_subject_is_refused(tmp_path):
    async with gateway(tmp_path) as gw:
        await gw.send({"subject": "orders", "body": "x"})
        receipt = make_receipt("127.0.0.1:1", "orders", "billing", "c1", 0)
        status, answer = await gw.call("/api/ack", {"receipts": [receipt]})
        assert (status, answer["error"]["code"]) == (404, "not_found")
        status, answer = await gw.call("/api/ack", {"receipts": ["not-a-receipt"]})
        assert (status, answer["error"]["code"]) == (400, "bad_request")


async def test_the_openapi_document_is_open_even_with_auth_on(tmp_path):
    async with gateway(tmp_path, admin_token=ADMIN) as gw:
        async with gw.http.get(gw.meta.url + "/api/openapi.json") as resp:
            document = await resp.json()
        assert resp.status == 200
        assert set(document["paths"]) == {"/api/send", "/api/cancel", "/api/pull", "/api/ack",
                                          "/api/nack"}


async def test_an_http_consumer_counts_as_online_in_the_group_listing(tmp_path):
    async with gateway(tmp_path, groups=2) as gw:
        await gw.pull()
        async with gw.http.get(gw.meta.url + "/api/admin/groups") as resp:
            listing = (await resp.json())["groups"]
        billing = [g for g in listing if (g["group"], g["subject"]) == ("billing", "orders")]
        assert billing and billing[0]["online_clients"] == 1
