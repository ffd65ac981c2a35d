"""Fail closed with real processes (issue 13 item 7; docs/SECURITY.md): a broker that starts while
no MetaServer can be reached does not know whether auth is on, so it refuses every client with
the retriable ``unavailable``, even though it has an admin token of its own. Once a MetaServer
with auth on answers its registration, a client without a token is refused as unauthorized and
one with a valid token is served: the broker never opened up meanwhile."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.harness import Cluster, free_port, start_server, wait_for
from tests.rawclient import RawClient
from wire.errors import error_from_wire
from wire.message import Message, encode_message

ADMIN = "qmq_fail_closed_admin_secret_0123"


async def hello_and_send(port: int, token: str | None, n: int) -> dict[str, Any]:
    """Hello (with ``token`` if given), then one send; the first error, or the send's result."""
    client = await RawClient.connect(port, hello=False)
    try:
        hello: dict[str, Any] = {"op": "hello", "client_id": "t", "app": "tests", "protocol": 1}
        if token is not None:
            hello["token"] = token
        answer = await client.request(hello)
        if "error" in answer:
            return answer["error"]
        payload = encode_message(Message.create("orders", b"x", now_ms=time.time_ns() // 10**6,
                                                id=f"fc-{n}"))
        answer = await client.request({"op": "send", "messages": [payload]})
        return answer.get("error") or answer["results"][0]
    finally:
        await client.close()


@pytest.mark.timeout(120)
async def test_a_broker_that_never_reached_a_metaserver_refuses_clients_until_it_knows_auth(
        cluster: Cluster) -> None:
    meta_url = f"http://127.0.0.1:{free_port()}"  # nothing listens there yet
    broker = cluster.keep(start_server("realtime rt1", [
        "realtime", "--meta", meta_url, "--data-dir", str(cluster.root / "rt1"), "--group",
        "rt1", "--port", "0", "--no-metrics", "--token", ADMIN]))

    for token in (None, "qmq_some_app_token_never_seen_000"):
        refused = await hello_and_send(broker.port, token, 0)
        assert refused["code"] == "unavailable", refused
        assert "does not know whether auth is on" in refused["message"]
        assert error_from_wire(refused["code"], refused["message"]).retriable

    port = int(meta_url.rsplit(":", 1)[1])
    cluster.keep(start_server("metaserver", [
        "metaserver", "--db", f"sqlite+aiosqlite:///{cluster.root / 'meta.db'}", "--port",
        str(port), "--admin-token", ADMIN]))

    async def served() -> bool:
        return (await hello_and_send(broker.port, ADMIN, 1)).get("status") == "stored"

    await wait_for(served, 30, "the broker to register and serve a valid token")
    refused = await hello_and_send(broker.port, None, 2)
    assert refused["code"] == "unauthorized", refused
