"""The delay server down: delayed sends fail with a clear retriable error and nacks are refused
(the message comes back by ack timeout) while realtime sends and consumption go on; once it is
back, delayed sends and retries resume."""

from __future__ import annotations

import asyncio
import time

import pytest

import qmq
from wire.message import retry_subject
from tests.harness import Arrivals, epoch_ms, start_delay_cluster, wait_registered

ACK_TIMEOUT_MS = 2_000
REALTIME_FLAGS = ("--ack-timeout-ms", str(ACK_TIMEOUT_MS), "--retry-backoff-ms", "300",
                  "--retries-max", "3")
CONSUMER_OPTIONS = {"wait_ms": 500, "heartbeat_interval_ms": 500, "reconnect_backoff_max_ms": 500,
                    "start": "earliest"}


async def next_message(subscription: qmq.Subscription, arrivals: Arrivals,
                       timeout_s: float = 15) -> qmq.ReceivedMessage:
    async with asyncio.timeout(timeout_s):
        msg = await subscription.__anext__()
    arrivals.record(msg)
    return msg


@pytest.mark.timeout(90)
@pytest.mark.parametrize("stop", ["sigterm", "kill9"])
async def test_with_the_delay_server_down_realtime_goes_on_and_delayed_sends_and_nacks_fail_clearly(
        cluster, stop):
    _realtime, delay = await asyncio.to_thread(start_delay_cluster, cluster,
                                               realtime_flags=REALTIME_FLAGS)
    subject, group = "orders.placed", "fulfilment"
    arrivals = Arrivals()
    async with qmq.Consumer(cluster.meta_url, group=group, **CONSUMER_OPTIONS) as consumer, \
            qmq.Producer(cluster.meta_url) as producer:
        subscription = consumer.subscribe(subject)
        assert (await producer.send(subject, b"warm-up", delay=100)).delayed
        warm_up = await next_message(subscription, arrivals)
        assert warm_up.body == b"warm-up"
        await warm_up.ack()
        if stop == "sigterm":  # it deregisters: producers find no delay route
            assert await asyncio.to_thread(delay.terminate) == 0
        else:  # still routed until its heartbeat expires: connections are refused
            await asyncio.to_thread(delay.kill9)

        started = time.monotonic()
        with pytest.raises((qmq.NoRoute, qmq.ConnectionLost)) as refused:
            await producer.send(subject, b"later", delay=1_000)
        failed_after_s = time.monotonic() - started
        assert refused.value.retriable
        assert "delay" in refused.value.message, "the error must say the delay server is missing"
        assert failed_after_s < 15, f"a delayed send took {failed_after_s:.1f} s to fail"

        # The realtime path does not need the delay server.
        stuck = await producer.send(subject, b"retry me")
        assert not stuck.delayed
        msg = await next_message(subscription, arrivals)
        assert msg.id == stuck.message_id and msg.redelivered == 0
        with pytest.raises(qmq.Overloaded) as nack_refused:
            await msg.nack()
        assert nack_refused.value.retriable
        assert not msg.settled
        nack_failed = time.monotonic()
        plain = await producer.send(subject, b"plain")
        got = await next_message(subscription, arrivals)
        assert got.id == plain.message_id
        await got.ack()
        # Unacked after the failed nack: the ack timeout hands it out again.
        again = await next_message(subscription, arrivals, timeout_s=ACK_TIMEOUT_MS / 1000 + 10)
        assert again.id == stuck.message_id and again.redelivered >= 1
        assert time.monotonic() - nack_failed >= ACK_TIMEOUT_MS / 1000 - 0.2

        await asyncio.to_thread(cluster.start_delay, "d1")
        await asyncio.to_thread(wait_registered, cluster.meta_url, {("delay", "d1"): "rw"})
        resumed = await producer.send(subject, b"delayed again", delay=500)
        assert resumed.delayed and resumed.broker_group == "d1"
        nacked_at = time.monotonic()
        await again.nack()
        assert again.settled
        # The original may come round once more by ack timeout while the delay server restarts
        # (a loaded machine can take longer than ACK_TIMEOUT_MS), and then the nack above found
        # it no longer held: the handler fails on it again, as a real one would.
        by_body = {}
        for _ in range(10):
            got = await next_message(subscription, arrivals)
            if got.body == b"retry me" and not got.retries:
                await got.nack()
                continue
            await got.ack()
            by_body[got.body] = got
            if len(by_body) == 2:
                break
        retry = by_body[b"retry me"]
        assert retry.retries == 1 and retry.wire_subject == retry_subject(subject, group)
        assert time.monotonic() - nacked_at >= 0.3
        assert by_body[b"delayed again"].id == resumed.message_id
        assert epoch_ms() >= resumed.deliver_at_ms

    print(f"delayed send with the delay server down ({stop}) failed after "
          f"{failed_after_s:.2f} s: {type(refused.value).__name__}: {refused.value.message}")
    assert arrivals.early() == []
