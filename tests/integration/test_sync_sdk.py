"""``qmq.sync`` and plain-function handlers against real servers in-process on port 0.

The servers run on the test's event loop; every blocking call runs in a worker thread
(``asyncio.to_thread``), as it would in a Django or Flask request thread.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from datetime import timedelta

import pytest

import qmq
from delayserver.config import DelayConfig
from delayserver.server import DelayServer
from metaserver import MetaConfig, sqlite_url, start_metaserver
from realtime.config import RealtimeConfig
from realtime.server import RealtimeServer
from sdk.threaded import BlockingMessage, run_on_loop
from tests.harness import wait_for


@pytest.fixture
async def meta_url(tmp_path) -> AsyncIterator[str]:
    config = MetaConfig(db_url=sqlite_url(tmp_path / "meta.db"), port=0)
    async with start_metaserver(config) as meta:
        realtime = RealtimeServer(RealtimeConfig(
            data_dir=str(tmp_path / "rt"), meta_url=meta.url, group="rt-1", port=0,
            retry_backoff_ms=(100,), heartbeat_interval_ms=200))
        await realtime.start()
        delay = DelayServer(DelayConfig(data_dir=str(tmp_path / "delay"), meta_url=meta.url,
                                        group="delay-1", port=0, bucket_ms=1000,
                                        heartbeat_interval_ms=200))
        await delay.start()
        try:
            yield meta.url
        finally:
            await delay.stop()
            await realtime.stop()


async def test_a_sync_producer_sends_and_cancels_and_a_sync_iterator_receives(meta_url) -> None:
    def work() -> tuple[list[str], str, list[tuple[str, bytes]]]:
        with qmq.sync.Producer(meta_url) as producer:
            sent = [producer.send("sync.orders", b"one", tags=["vip"]).message_id,
                    *(r.message_id for r in producer.send_many("sync.orders", [b"two", b"3"]))]
            later = producer.send("sync.orders", b"never", delay=timedelta(minutes=5))
            status = producer.cancel(later)
        with qmq.sync.Consumer(meta_url, group="g", start="earliest") as consumer:
            got = []
            for msg in consumer.subscribe("sync.orders"):
                got.append((msg.id, msg.body))
                msg.ack()
                if len(got) == 3:
                    break
        return sent, status, got

    sent, status, got = await asyncio.to_thread(work)
    assert status == "cancelled"
    assert [body for _, body in got] == [b"one", b"two", b"3"]
    assert [message_id for message_id, _ in got] == sent


async def test_threads_of_a_web_process_share_one_sync_producer(meta_url) -> None:
    producer = await asyncio.to_thread(qmq.sync.Producer, meta_url)
    receipts: list[qmq.Receipt] = []
    lock = threading.Lock()

    def request_thread(n: int) -> None:
        for i in range(25):
            receipt = producer.send("sync.shared", f"{n}-{i}".encode())
            with lock:
                receipts.append(receipt)

    threads = [threading.Thread(target=request_thread, args=(n,)) for n in range(8)]
    await asyncio.to_thread(lambda: [t.start() for t in threads] and [t.join(60) for t in threads])
    await asyncio.to_thread(producer.close)
    assert len(receipts) == 200 and {r.status for r in receipts} == {"stored"}
    assert len({r.message_id for r in receipts}) == 200
    with pytest.raises(RuntimeError, match="closed"):
        producer.send("sync.shared", b"late")


async def test_a_plain_function_handler_runs_in_bounded_worker_threads(meta_url) -> None:
    async with qmq.Producer(meta_url) as producer:
        await producer.send_many("sync.slow", [b"%d" % i for i in range(12)])
    running, peak, done = [0], [0], []
    lock = threading.Lock()
    consumer = qmq.Consumer(meta_url, group="g", start="earliest")

    @consumer.handler("sync.slow", concurrency=3)
    def slow(msg: BlockingMessage) -> None:  # a plain def: runs in a worker thread
        assert threading.current_thread().name.startswith("qmq-handler")
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1
            done.append(msg.body)

    async with consumer:
        await wait_for(lambda: len(done) == 12, 30, "12 messages handled")
    assert sorted(done) == sorted(b"%d" % i for i in range(12))
    assert 1 < peak[0] <= 3


async def test_a_plain_handler_that_raises_is_nacked_and_can_nack_itself(meta_url) -> None:
    calls: list[tuple[bytes, int]] = []

    def run() -> None:
        with qmq.sync.Producer(meta_url) as producer:
            producer.send("sync.fail", b"raise")
            producer.send("sync.fail", b"later")
        consumer = qmq.sync.Consumer(meta_url, group="g", start="earliest")

        @consumer.handler("sync.fail")
        def handle(msg: BlockingMessage) -> None:
            calls.append((msg.body, msg.retries))
            if msg.retries == 0 and msg.body == b"raise":
                raise ValueError("first try fails")
            if msg.retries == 0:
                msg.nack(retry_after=timedelta(milliseconds=200))

        consumer.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(calls) < 4:
            time.sleep(0.05)
        consumer.close()

    await asyncio.to_thread(run)
    assert sorted(calls) == [(b"later", 0), (b"later", 1), (b"raise", 0), (b"raise", 1)]


async def test_a_blocking_call_on_the_loop_thread_is_refused_instead_of_deadlocking() -> None:
    async def nothing() -> None:
        return None

    coro = nothing()
    with pytest.raises(RuntimeError, match="event loop's own thread"):
        run_on_loop(asyncio.get_running_loop(), coro)


def test_a_handler_must_be_callable() -> None:
    consumer = qmq.Consumer("http://127.0.0.1:1", group="g")
    with pytest.raises(TypeError, match="must be a function"):
        consumer.handler("s")("not a function")  # type: ignore[arg-type]
