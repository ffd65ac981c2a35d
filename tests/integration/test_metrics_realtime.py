"""A live realtime broker's /metrics, scraped over HTTP after real traffic on its data port."""

from __future__ import annotations

import asyncio

import pytest

from realtime import metrics as realtime_metrics
from realtime.config import RealtimeConfig
from realtime.server import RealtimeServer
from wire.message import encode_message
from tests.metricsclient import scrape
from tests.rawclient import FakeClock, RawClient, message

WAIT_TIMEOUT_S = 30


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def server(tmp_path, clock):
    config = RealtimeConfig(data_dir=str(tmp_path / "rt"), port=0, metrics_port=0,
                            expiry_check_interval_ms=3_600_000)
    server = RealtimeServer(config, clock)
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def client(server):
    client = await RawClient.connect(server.port)
    yield client
    await client.close()


async def wait_waiting_pulls(server: RealtimeServer, count: int) -> None:
    """Until ``count`` long polls wait on the broker (bounded)."""
    async with asyncio.timeout(WAIT_TIMEOUT_S):
        while server.broker.waiting_pulls != count:
            await asyncio.sleep(0.01)


async def test_metrics_listen_on_their_own_port_only_when_asked(tmp_path, clock, server):
    assert server.metrics_url == f"http://127.0.0.1:{server.config.metrics_port}/metrics"
    assert server.config.metrics_port not in (0, server.port)
    quiet = RealtimeServer(RealtimeConfig(data_dir=str(tmp_path / "quiet"), port=0), clock)
    await quiet.start()
    try:
        assert quiet.metrics_url is None
    finally:
        await quiet.stop()


async def test_sends_pulls_and_acks_move_the_counters_by_exactly_what_happened(
        server, client, clock):
    before = await scrape(server.metrics_url)
    sent = [message("orders", b"one", clock), message("orders", b"two!", clock),
            message("orders", b"three", clock)]
    await client.send(*sent)
    await client.send(sent[0])  # the same id again: a duplicate, not stored
    pulled = await client.pull("orders", "billing", "c1", start="earliest")
    assert len(pulled["payloads"]) == 3
    assert (await client.ack("orders", "billing", "c1", [[0, 1]]))["acked"] == 2

    after = await scrape(server.metrics_url)
    orders = {"subject": "orders"}
    assert after["qmq_realtime_messages_sent_total", orders] == 3
    assert after["qmq_realtime_sent_bytes_total", orders] == sum(
        len(encode_message(m)) for m in sent)
    assert after["qmq_realtime_duplicates_total"] == 1
    assert after["qmq_realtime_messages_pulled_total"] == 3
    assert after["qmq_realtime_messages_acked_total"] == 2
    assert after["qmq_realtime_messages_redelivered_total"] == 0
    for op, count in (("send", 2), ("pull", 1), ("ack", 1)):
        labels = {"op": op}
        assert after["qmq_realtime_requests_total", labels] - before[
            "qmq_realtime_requests_total", labels] == count
    # Two group commits (one per send request), four messages appended in all.
    assert after["qmq_realtime_commit_batch_messages_count"] == 2
    assert after["qmq_realtime_commit_batch_messages_sum"] == 4
    # flush=sync: the commit that stored three fsynced; the one of a duplicate wrote nothing.
    assert after["qmq_realtime_fsync_seconds_count"] == 1


async def test_the_backlog_gauge_of_a_group_is_what_it_has_not_acked(server, client, clock):
    await client.send(*[message("orders", b"m%d" % i, clock) for i in range(5)])
    await client.pull("orders", "billing", "c1", start="earliest", max_count=2)
    await client.ack("orders", "billing", "c1", [[0, 0]])
    await client.pull("orders", "audit", "c9", start="earliest", max_count=5)
    await client.ack("orders", "audit", "c9", [[0, 4]])

    scraped = await scrape(server.metrics_url)
    # billing: 3 never pulled + 1 pulled and not acked; audit consumed everything.
    assert scraped["qmq_realtime_backlog_messages", {"subject": "orders", "group": "billing"}] == 4
    assert scraped["qmq_realtime_backlog_messages", {"subject": "orders", "group": "audit"}] == 0
    assert scraped["qmq_realtime_consumers", {"subject": "orders", "group": "billing"}] == 1

    await client.pull("orders", "billing", "c1", max_count=10)
    await client.ack("orders", "billing", "c1", [[1, 4]])
    rescraped = await scrape(server.metrics_url)
    assert rescraped["qmq_realtime_backlog_messages",
                     {"subject": "orders", "group": "billing"}] == 0


async def test_errors_are_counted_by_code_per_request_and_per_message(server, client, clock):
    await client.ack("orders", "nobody", "c1", [[0, 0]])  # not_found: the whole request
    await client.request({"op": "cancel", "ids": ["x"], "deliver_at_ms": [clock()]})
    delayed = message("orders", b"later", clock, deliver_at_ms=clock() + 60_000)
    await client.send(delayed, message("orders", b"now", clock))  # one of two refused

    scraped = await scrape(server.metrics_url)
    errors = "qmq_realtime_errors_total"
    assert scraped[errors, {"code": "not_found", "scope": "request"}] == 1
    assert scraped[errors, {"code": "not_supported", "scope": "request"}] == 1
    assert scraped[errors, {"code": "bad_request", "scope": "message"}] == 1
    assert scraped[errors, {"code": "bad_request", "scope": "request"}] == 0
    assert scraped["qmq_realtime_messages_sent_total", {"subject": "orders"}] == 1


async def test_a_frame_that_is_not_msgpack_counts_as_a_bad_request(server, clock):
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"\x00\x00\x00\x02\xc1\xc1")  # a frame whose body is not msgpack
    await writer.drain()
    async with asyncio.timeout(WAIT_TIMEOUT_S):
        await reader.read()  # answered, then closed
    writer.close()
    scraped = await scrape(server.metrics_url)
    assert scraped["qmq_realtime_errors_total", {"code": "bad_request", "scope": "request"}] == 1


async def test_a_waiting_long_poll_shows_in_the_gauge_until_a_message_wakes_it(
        server, client, clock):
    consumer = await RawClient.connect(server.port)
    await consumer.pull("orders", "g", "c1")  # creates the group at "latest"
    waiting = asyncio.create_task(consumer.pull("orders", "g", "c1", wait_ms=60_000))
    await wait_waiting_pulls(server, 1)
    assert (await scrape(server.metrics_url))["qmq_realtime_long_polls_waiting"] == 1
    await client.send(message("orders", b"wake", clock))
    async with asyncio.timeout(WAIT_TIMEOUT_S):
        assert len((await waiting)["payloads"]) == 1
    await wait_waiting_pulls(server, 0)
    assert (await scrape(server.metrics_url))["qmq_realtime_long_polls_waiting"] == 0
    await consumer.close()


async def test_subjects_past_the_label_cap_are_summed_under_other(
        server, client, clock, monkeypatch):
    monkeypatch.setattr(realtime_metrics, "SUBJECT_LABELS_MAX", 2)
    for subject in ("a", "b", "c", "d"):
        await client.send(message(subject, b"x", clock))
    scraped = await scrape(server.metrics_url)
    by_subject = {dict(labels)["subject"]: value for labels, value in
                  scraped.labelled("qmq_realtime_messages_sent_total").items()}
    assert by_subject == {"a": 1, "b": 1, realtime_metrics.OTHER_SUBJECTS: 2}
