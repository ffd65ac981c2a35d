"""The MetaServer's /metrics on its own HTTP port, after real API traffic (SQLite)."""

from __future__ import annotations

from typing import Any, AsyncIterator

import pytest

from metaserver import sqlite_url
from tests.integration.test_metaserver import EXPIRY_MS, Api, FakeClock, serve
from tests.metricsclient import scrape


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def api(tmp_path: Any, clock: FakeClock) -> AsyncIterator[Api]:
    async with serve(sqlite_url(tmp_path / "meta.db"), clock) as client:
        yield client


async def test_brokers_subjects_and_groups_are_counted_from_the_database(
        api: Api, clock: FakeClock) -> None:
    await api.register("rt1", "127.0.0.1:1001")
    await api.register("rt2", "127.0.0.1:1002")
    await api.register("d1", "127.0.0.1:2001", kind="delay")
    await api.ok("POST", "/api/admin/brokers/readonly", {"group": "rt2", "readonly": True})
    assert (await api.route("orders"))[0] == 200
    assert (await api.route("refunds"))[0] == 200
    await api.ok("POST", "/api/clients/heartbeat",
                 {"client_id": "c1", "app": "billing", "group": "billing",
                  "subjects": ["orders", "refunds"], "role": "consumer"})

    scraped = await scrape(api.server.url + "/metrics")
    brokers = "qmq_meta_brokers"
    assert scraped[brokers, {"kind": "realtime", "state": "rw"}] == 1
    assert scraped[brokers, {"kind": "realtime", "state": "readonly"}] == 1
    assert scraped[brokers, {"kind": "delay", "state": "rw"}] == 1
    assert scraped[brokers, {"kind": "delay", "state": "offline"}] == 0
    assert scraped["qmq_meta_subjects"] == 2
    assert scraped["qmq_meta_consumer_groups"] == 1

    clock.advance(EXPIRY_MS + 1)
    await api.expire()
    expired = await scrape(api.server.url + "/metrics")
    assert expired[brokers, {"kind": "realtime", "state": "offline"}] == 2
    assert expired[brokers, {"kind": "delay", "state": "offline"}] == 1
    assert expired[brokers, {"kind": "realtime", "state": "rw"}] == 0


async def test_requests_are_counted_by_route_pattern_and_errors_by_code(api: Api) -> None:
    before = await scrape(api.server.url + "/metrics")
    await api.register("rt1", "127.0.0.1:1001")
    await api.register("rt1", "127.0.0.1:1002")
    assert (await api.get("/no/such/path"))[0] == 404
    assert (await api.get("/no/other/path"))[0] == 404
    assert (await api.post("/api/brokers/register", raw=b"not json"))[0] == 400
    assert (await api.heartbeat("ghost", "127.0.0.1:9"))[0] == 404

    scraped = await scrape(api.server.url + "/metrics")
    requests = "qmq_meta_http_requests_total"
    register = {"route": "/api/brokers/register", "method": "POST"}
    assert scraped[requests, {**register, "status": "200"}] == 2
    assert scraped[requests, {**register, "status": "400"}] == 1
    assert scraped[requests, {"route": "unmatched", "method": "GET", "status": "404"}] == 2
    assert scraped[requests, {"route": "/api/brokers/heartbeat", "method": "POST",
                              "status": "404"}] == 1
    # The scrape before this test's requests is itself counted, once.
    assert scraped[requests, {"route": "/metrics", "method": "GET", "status": "200"}] == 1
    assert before.get(requests, {**register, "status": "200"}) is None
    assert scraped["qmq_meta_errors_total", {"code": "not_found"}] == 3
    assert scraped["qmq_meta_errors_total", {"code": "bad_request"}] == 1
