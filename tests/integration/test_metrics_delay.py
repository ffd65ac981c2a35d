"""A live delay server's /metrics, scraped over HTTP, with a fake clock and a recording dispatch
function standing in for the realtime brokers."""

from __future__ import annotations

import asyncio

import pytest

from delayserver import metrics as delay_metrics
from delayserver.config import DelayConfig
from delayserver.server import DelayServer
from tests.integration.test_delay_server import Realtime, settle
from tests.metricsclient import scrape
from tests.rawclient import FakeClock, RawClient, message

HOUR_MS = 3_600_000
# 2023-11-14T22:00:00Z: a whole hour, so the expected hour labels are easy to read.
START_MS = 1_699_999_200_000
WAIT_TIMEOUT_S = 30


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(START_MS)


@pytest.fixture
def realtime(clock) -> Realtime:
    return Realtime(clock)


@pytest.fixture
async def server(tmp_path, clock, realtime):
    config = DelayConfig(data_dir=str(tmp_path / "delay"), port=0, metrics_port=0,
                         bucket_ms=1000)
    server = DelayServer(config, clock=clock, dispatch=realtime.dispatch)
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def client(server):
    client = await RawClient.connect(server.port)
    yield client
    await client.close()


def test_pending_hours_fall_into_the_first_horizon_their_start_is_within():
    now_ms = START_MS + 30 * 60_000  # half past: the current hour started before now
    per_hour = {START_MS: 1, START_MS + HOUR_MS: 2, START_MS + 6 * HOUR_MS: 3,
                START_MS + 400 * 24 * HOUR_MS: 4}
    assert delay_metrics.pending_by_horizon(per_hour, now_ms) == {
        "1h": 3, "6h": 3, "1d": 0, "7d": 0, "30d": 0, "365d": 0, "later": 4}


def pending(scraped) -> dict[str, float]:
    """The pending gauge's horizons that hold messages."""
    return {dict(labels)["due_in"]: value
            for labels, value in scraped.labelled("qmq_delay_pending_messages").items() if value}


async def test_pending_messages_are_counted_by_how_far_ahead_they_are_due(server, client, clock):
    due = [START_MS + 2 * HOUR_MS + 5, START_MS + 2 * HOUR_MS + 59 * 60_000,
           START_MS + 30 * HOUR_MS + 1, START_MS + 2 * 365 * 24 * HOUR_MS - HOUR_MS]
    sent = await client.send(*[message("orders", b"m%d" % i, clock, deliver_at_ms=at)
                               for i, at in enumerate(due)])
    assert [r["status"] for r in sent["results"]] == ["stored"] * 4

    scraped = await scrape(server.metrics_url)
    assert pending(scraped) == {"6h": 2, "7d": 1, "later": 1}
    # Every horizon is always there: a fixed set of series, whatever is pending.
    assert len(scraped.labelled("qmq_delay_pending_messages")) == 7
    assert scraped["qmq_delay_messages_scheduled_total"] == 4
    assert scraped["qmq_delay_requests_total", {"op": "send"}] == 1


async def test_the_process_and_platform_collectors_are_scraped(server):
    scraped = await scrape(server.metrics_url)
    assert scraped["process_resident_memory_bytes"] > 0
    assert scraped["process_open_fds"] > 0
    assert len(scraped.labelled("python_info")) == 1


async def test_dispatches_fill_the_lateness_histogram_with_how_late_they_went(
        server, client, clock, realtime):
    await client.send(message("orders", b"a", clock, deliver_at_ms=START_MS + 1_000),
                      message("orders", b"b", clock, deliver_at_ms=START_MS + 1_500))
    clock.advance(2_000)  # both are due: 1000 ms and 500 ms late when dispatched
    await realtime.wait_for(2, server, timeout_s=WAIT_TIMEOUT_S)
    await settle(server)

    scraped = await scrape(server.metrics_url)
    assert scraped["qmq_delay_messages_dispatched_total"] == 2
    assert scraped["qmq_delay_early_dispatches_total"] == 0
    lateness = "qmq_delay_dispatch_lateness_seconds"
    assert scraped[f"{lateness}_count"] == 2
    assert scraped[f"{lateness}_sum"] == 1.5
    assert scraped[f"{lateness}_bucket", {"le": "0.2"}] == 0
    assert scraped[f"{lateness}_bucket", {"le": "0.5"}] == 1
    assert scraped[f"{lateness}_bucket", {"le": "1.0"}] == 2
    assert scraped[f"{lateness}_bucket", {"le": "+Inf"}] == 2
    assert pending(scraped) == {}  # nothing left to send
    assert scraped["qmq_delay_fsync_seconds_count"] >= 1


async def test_a_dispatch_the_realtime_side_refuses_is_counted_by_code_and_retried(
        server, client, clock, realtime):
    realtime.fail_next = 1
    await client.send(message("orders", b"x", clock, deliver_at_ms=START_MS + 1_000))
    clock.advance(1_000)
    async with asyncio.timeout(WAIT_TIMEOUT_S):
        while not realtime.received:  # first attempt fails; the retry waits its backoff
            await settle(server)
            clock.advance(1_000)
    scraped = await scrape(server.metrics_url)
    assert scraped["qmq_delay_dispatch_failures_total", {"code": "overloaded"}] == 1
    assert scraped["qmq_delay_messages_dispatched_total"] == 1


async def test_cancels_and_errors_are_counted_by_outcome_and_code(server, client, clock):
    doomed = message("orders", b"doomed", clock, deliver_at_ms=START_MS + HOUR_MS)
    too_far = message("orders", b"far", clock, deliver_at_ms=START_MS + 3 * 365 * 24 * HOUR_MS)
    sent = await client.send(doomed, too_far)
    assert sent["results"][1]["error"]["code"] == "delay_out_of_range"
    for _ in range(2):
        await client.request({"op": "cancel", "ids": [doomed.id],
                              "deliver_at_ms": [doomed.deliver_at_ms]})
    await client.pull("orders", "g", "c1")  # pulls go to realtime brokers: not_supported
    await server.scheduler.advance_done()  # the watermark reaches the bucket of now
    await client.request({"op": "cancel", "ids": ["long-gone"],
                          "deliver_at_ms": [START_MS - 2 * HOUR_MS]})

    scraped = await scrape(server.metrics_url)
    assert scraped["qmq_delay_cancels_total", {"outcome": "cancelled"}] == 1
    assert scraped["qmq_delay_cancels_total", {"outcome": "already_cancelled"}] == 1
    assert scraped["qmq_delay_cancels_total", {"outcome": "already_past"}] == 1
    errors = "qmq_delay_errors_total"
    assert scraped[errors, {"code": "delay_out_of_range", "scope": "message"}] == 1
    assert scraped[errors, {"code": "not_supported", "scope": "request"}] == 1
    assert scraped["qmq_delay_messages_scheduled_total"] == 1
    assert pending(scraped) == {}


async def test_a_bug_publishing_a_commit_answers_its_sends_internal_counts_it_and_goes_on(
        server, client, clock, monkeypatch):
    commits = server.scheduler._commits
    publish = commits._committed
    calls = []

    def publish_raising_once(batch, committed):
        calls.append(batch)
        if len(calls) == 1:
            raise KeyError("injected publish bug")
        publish(batch, committed)

    monkeypatch.setattr(commits, "_committed", publish_raising_once)
    async with asyncio.timeout(WAIT_TIMEOUT_S):  # before the fix: never answered
        first = await client.send(message("orders", b"a", clock,
                                          deliver_at_ms=START_MS + HOUR_MS))
    assert [r["error"]["code"] for r in first["results"]] == ["internal"]
    async with asyncio.timeout(WAIT_TIMEOUT_S):
        second = await client.send(message("orders", b"b", clock,
                                           deliver_at_ms=START_MS + HOUR_MS))
    assert "error" not in second["results"][0], second
    scraped = await scrape(server.metrics_url)
    assert scraped["qmq_delay_commit_publish_failures_total"] == 1
