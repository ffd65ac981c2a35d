"""sdk.consumer's prefetch buffer: bounded by the prefetch option, in order, shared fairly by
readers, refilled in sizeable pulls; the pull size grows while pulls come back full and falls
back when they do not (PullSize)."""

from __future__ import annotations

import asyncio

from sdk.consumer import Consumer
from sdk.received import PullSize, _Prefetch
from tests.unit.test_sdk_fakes import broker_a, meta  # noqa: F401  (fixtures)

NEVER_MS = 3_600_000


async def test_put_all_waits_while_the_buffer_is_full_and_keeps_the_order():
    buffer = _Prefetch(capacity=3)
    putting = asyncio.create_task(buffer.put_all(list(range(7))))
    await asyncio.sleep(0)
    assert list(buffer.items) == [0, 1, 2] and not putting.done()
    got = [await buffer.get() for _ in range(7)]
    async with asyncio.timeout(5):
        await putting
    assert got == list(range(7))


async def test_waiting_readers_each_get_a_different_item():
    buffer = _Prefetch(capacity=10)
    readers = [asyncio.create_task(buffer.get()) for _ in range(3)]
    await asyncio.sleep(0)
    await buffer.put_all(["a", "b", "c"])
    async with asyncio.timeout(5):
        assert sorted(await asyncio.gather(*readers)) == ["a", "b", "c"]


async def test_a_slow_application_is_never_handed_more_than_its_prefetch_ahead(meta, broker_a):
    meta.set_route("orders", [broker_a])
    broker_a.publish("orders", *(b"%d" % i for i in range(20)))
    consumer = Consumer(meta.url, group="billing", consumer_id="c1", pull_batch=4, prefetch=4,
                        ack_interval_ms=NEVER_MS, heartbeat_interval_ms=NEVER_MS, wait_ms=1_000)
    async with consumer:
        sub = consumer.subscribe("orders")
        async with asyncio.timeout(10):
            await broker_a.wait_until(lambda: len(broker_a.ops("pull")) >= 1)
        await asyncio.sleep(0.05)
        # Full: no further pull is sent until half a batch fits again.
        assert sub.prefetched == 4 and len(broker_a.ops("pull")) == 1
        bodies = []
        for _ in range(20):
            async with asyncio.timeout(10):
                bodies.append((await sub.__anext__()).body)
            assert sub.prefetched <= 4
    assert bodies == [b"%d" % i for i in range(20)]
    assert all(op["max_count"] <= 4 for op in broker_a.ops("pull"))


async def test_a_pull_asks_only_for_what_fits_in_the_prefetch(meta, broker_a):
    meta.set_route("orders", [broker_a])
    broker_a.publish("orders", *(b"%d" % i for i in range(10)))
    consumer = Consumer(meta.url, group="billing", consumer_id="c1", pull_batch=4, prefetch=6,
                        ack_interval_ms=NEVER_MS, heartbeat_interval_ms=NEVER_MS, wait_ms=1_000)
    async with consumer:
        sub = consumer.subscribe("orders")
        async with asyncio.timeout(10):
            await broker_a.wait_until(lambda: len(broker_a.ops("pull")) >= 2)
        await asyncio.sleep(0.05)
        # 4 pulled, then the 2 that still fit; the third pull waits for room for 2.
        assert [op["max_count"] for op in broker_a.ops("pull")] == [4, 2]
        assert sub.prefetched == 6


async def test_a_pull_loop_waiting_for_room_is_woken_although_another_waits_too():
    buffer = _Prefetch(capacity=4, refill_min=2)
    await buffer.put_all([1, 2, 3, 4])
    waiting = [asyncio.create_task(buffer.wait_room()) for _ in range(2)]
    await asyncio.sleep(0)
    await buffer.get()
    await asyncio.sleep(0)
    assert not any(task.done() for task in waiting)  # one free slot: below refill_min
    await buffer.get()
    async with asyncio.timeout(5):
        await asyncio.gather(*waiting)


async def test_a_reader_cancelled_after_its_wake_up_passes_it_to_the_next_reader():
    buffer = _Prefetch(capacity=10)
    first = asyncio.create_task(buffer.get())
    second = asyncio.create_task(buffer.get())
    await asyncio.sleep(0)
    buffer.put_nowait("only")  # wakes the first reader...
    first.cancel()  # ...which is cancelled before it runs
    async with asyncio.timeout(5):
        assert await second == "only"


def test_the_pull_size_doubles_on_a_full_pull_up_to_its_ceiling_and_halves_on_a_thin_one():
    size = PullSize(floor=256, ceiling=1024, prefetch=None)
    assert (size.size, size.capacity(), size.refill_min()) == (256, 256, 128)
    assert size.answered(256, 256, 128) and (size.size, size.capacity()) == (512, 1024)
    assert size.answered(512, 512, 256) and (size.size, size.capacity()) == (1024, 2048)
    assert not size.answered(1024, 1024, 1024) and size.size == 1024  # at the ceiling
    assert not size.answered(1024, 600, 1024) and size.size == 1024  # over half full: kept
    assert size.answered(1024, 100, 1024) and size.size == 512  # a burst's share, a trickle
    assert size.answered(512, 0, 0) and size.size == 256  # a long poll that ended empty
    assert not size.answered(256, 3, 3) and (size.size, size.capacity()) == (256, 256)


def test_the_pull_size_does_not_grow_while_the_application_takes_nothing():
    size = PullSize(floor=8, ceiling=1024, prefetch=None)
    assert not size.answered(8, 8, 0) and (size.size, size.capacity()) == (8, 8)
    assert not size.answered(8, 8, 3) and size.size == 8  # less than half a pull taken
    assert size.answered(8, 8, 4) and size.size == 16


def test_with_a_given_prefetch_the_pull_size_grows_only_up_to_it_and_the_bound_stays():
    size = PullSize(floor=4, ceiling=64, prefetch=6)
    assert size.capacity() == 6 and size.refill_min() == 2
    assert size.answered(4, 4, 4) and size.size == 6  # never asks for more than prefetch
    assert (size.capacity(), size.refill_min()) == (6, 2)
    assert not size.answered(2, 2, 6) and size.size == 6  # 2 of a pull of 6: no evidence
    assert size.answered(6, 1, 6) and size.size == 4


async def test_a_lone_consumer_behind_a_backlog_asks_for_more_with_each_full_pull(meta, broker_a):
    meta.set_route("orders", [broker_a])
    broker_a.publish("orders", *(b"%d" % i for i in range(60)))
    consumer = Consumer(meta.url, group="billing", consumer_id="c1", pull_batch=4,
                        pull_batch_max=16, ack_interval_ms=NEVER_MS,
                        heartbeat_interval_ms=NEVER_MS, wait_ms=1_000)
    async with consumer:
        sub = consumer.subscribe("orders")
        bodies = []
        for _ in range(60):
            async with asyncio.timeout(10):
                bodies.append((await sub.__anext__()).body)
            assert sub.prefetched <= 32  # two pulls of the ceiling at most
    assert bodies == [b"%d" % i for i in range(60)]
    asked = [op["max_count"] for op in broker_a.ops("pull")]
    assert asked[0] == 4 and max(asked) == 16 and len(asked) < 60 // 4


async def test_pulls_fixed_at_pull_batch_when_pull_batch_max_equals_it(meta, broker_a):
    meta.set_route("orders", [broker_a])
    broker_a.publish("orders", *(b"%d" % i for i in range(20)))
    consumer = Consumer(meta.url, group="billing", consumer_id="c1", pull_batch=4,
                        pull_batch_max=4, ack_interval_ms=NEVER_MS,
                        heartbeat_interval_ms=NEVER_MS, wait_ms=1_000)
    async with consumer:
        sub = consumer.subscribe("orders")
        for _ in range(20):
            async with asyncio.timeout(10):
                await sub.__anext__()
            assert sub.prefetched <= 4
    assert all(op["max_count"] <= 4 for op in broker_a.ops("pull"))
