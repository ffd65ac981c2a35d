"""sdk.consumer against a fake broker and a fake MetaServer: pulls, acks, handlers, close."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest

from sdk.consumer import Consumer, Subscription, seqs_to_ranges
from sdk.received import PullSize, _PulledBatch
from wire.errors import BadRequest, Forbidden, NotSupported
from wire.message import Message, encode_message
from wire.protocol import pull_response
from tests.unit.test_sdk_fakes import broker_a, broker_b, meta  # noqa: F401  (fixtures)

# Timers are set far away unless a test is about them, so nothing happens by the clock.
NEVER_MS = 3_600_000


def consumer(meta, **options) -> Consumer:
    options.setdefault("ack_interval_ms", NEVER_MS)
    options.setdefault("heartbeat_interval_ms", NEVER_MS)
    options.setdefault("reconnect_backoff_max_ms", 0)
    options.setdefault("wait_ms", 1_000)
    options.setdefault("consumer_id", "c1")
    return Consumer(meta.url, group="billing", **options)


async def take(iterator, count: int) -> list:
    return [await iterator.__anext__() for _ in range(count)]


def test_pull_sequences_become_the_fewest_inclusive_ranges():
    assert seqs_to_ranges({7, 1, 2, 3, 9, 8}) == [[1, 3], [7, 9]]
    assert seqs_to_ranges([5]) == [[5, 5]]
    assert seqs_to_ranges(set()) == []
    assert seqs_to_ranges([4, 2, 3, 3, 2]) == [[2, 4]]  # recorded twice: one range
    assert seqs_to_ranges([1, 1, 3]) == [[1, 1], [3, 3]]  # as many as there are seqs, not dense


async def test_subscribe_yields_the_pulled_messages_with_their_broker_group(meta, broker_a):
    meta.set_route("orders", [broker_a])
    sent = broker_a.publish("orders", b"one", b"two")
    async with consumer(meta) as c:
        got = await take(c.subscribe("orders"), 2)
    assert [m.id for m in got] == [m.id for m in sent]
    assert [m.body for m in got] == [b"one", b"two"]
    assert {m.broker_group for m in got} == {"group-a"}
    assert got[0].message.subject == got[0].subject == "orders"
    pull = broker_a.ops("pull")[0]
    assert (pull["group"], pull["consumer_id"], pull["start"], pull["broadcast"]) == (
        "billing", "c1", "latest", False)


def _note_pulls_of_orders(c, events: list[str]) -> None:
    """Append "pull" to ``events`` as each pull of subject orders is written."""
    original_get = c._pool.get

    async def get(address):
        conn = await original_get(address)
        if "request_nowait" not in vars(conn):
            original = conn.request_nowait

            def request_nowait(op, *rest):
                if op["op"] == "pull" and op["subject"] == "orders":
                    events.append("pull")  # written before it returns
                return original(op, *rest)

            conn.request_nowait = request_nowait
        return conn

    c._pool.get = get


async def test_a_waiting_application_gets_pulled_messages_before_the_next_pull_is_written(
        meta, broker_a):
    meta.set_route("orders", [broker_a])
    broker_a.publish("orders", b"one")
    events: list[str] = []
    async with consumer(meta) as c:
        _note_pulls_of_orders(c, events)
        sub = c.subscribe("orders")

        async def read() -> None:
            async for msg in sub:
                events.append(msg.body.decode())

        reader = asyncio.create_task(read())
        try:
            async with asyncio.timeout(10):
                await broker_a.wait_until(lambda: len(broker_a.ops("pull")) >= 2 and "one" in events)
        finally:
            reader.cancel()
    assert events[:3] == ["pull", "one", "pull"]


async def test_a_handler_gets_a_pulled_message_before_the_next_pull_is_written(meta, broker_a):
    meta.set_route("orders", [broker_a])
    broker_a.publish("orders", b"one")
    events: list[str] = []
    c = consumer(meta)
    _note_pulls_of_orders(c, events)

    @c.handler("orders")
    async def handle(msg) -> None:
        events.append(msg.body.decode())

    async with c:
        async with asyncio.timeout(10):
            await broker_a.wait_until(lambda: len(broker_a.ops("pull")) >= 2 and "one" in events)
    assert events[:3] == ["pull", "one", "pull"]


async def test_acks_are_coalesced_into_ranges_and_may_complete_out_of_order(meta, broker_a):
    meta.set_route("orders", [broker_a])
    broker_a.publish("orders", *(b"%d" % i for i in range(5)))
    async with consumer(meta) as c:
        # All five are handed out although none is acked: the iterator never waits for acks.
        first, second, third, fourth, fifth = await take(c.subscribe("orders"), 5)
        for msg in (fifth, third, fourth, first):
            await msg.ack()
        await c.flush_acks()
        assert broker_a.ack_ranges == [[[1, 1], [3, 5]]]
        await second.ack()
        await c.flush_acks()
        assert broker_a.ack_ranges[1:] == [[[2, 2]]]
    ack = broker_a.ops("ack")[0]
    assert (ack["subject"], ack["group"], ack["consumer_id"]) == ("orders", "billing", "c1")


async def test_acks_go_to_the_broker_groups_new_master_after_a_failover(meta, broker_a):
    from tests.unit.test_sdk_fakes import FakeBroker

    meta.set_route("orders", [broker_a])
    broker_a.publish("orders", b"1", b"2")
    promoted = await FakeBroker("group-a").start()  # the same group, another server
    try:
        async with consumer(meta) as c:
            first, second = await take(c.subscribe("orders"), 2)
            meta.set_route("orders", [promoted])
            await c._routes.refresh("orders", "consumer")
            await first.ack()
            await second.ack()
            await c.flush_acks()
        # The new master holds a copy of the pull log: the same pull sequences ack there.
        assert promoted.ack_ranges == [[[1, 2]]]
        assert broker_a.ack_ranges == []
    finally:
        await promoted.stop()


async def test_pulls_go_to_the_broker_groups_new_master_once_the_route_names_it(meta, broker_a):
    from tests.unit.test_sdk_fakes import FakeBroker

    meta.set_route("orders", [broker_a])
    promoted = await FakeBroker("group-a").start()  # the same group, another server
    try:
        async with consumer(meta, wait_ms=50) as c:
            sub = c.subscribe("orders")
            await broker_a.wait_until(lambda: len(broker_a.ops("pull")) >= 2)
            meta.set_route("orders", [promoted])
            await c._routes.refresh("orders", "consumer")
            async with asyncio.timeout(10):
                await promoted.wait_until(lambda: promoted.ops("pull"))
            pulls = len(broker_a.ops("pull"))
            promoted.publish("orders", b"there")
            (msg,) = await take(sub, 1)
            # At most the one pull out when the route changed went to the old master since.
            assert len(broker_a.ops("pull")) <= pulls + 1
        assert msg.body == b"there"
    finally:
        await promoted.stop()


async def test_acks_are_sent_by_the_ack_timer_without_a_flush(meta, broker_a):
    meta.set_route("orders", [broker_a])
    broker_a.publish("orders", b"x")
    async with consumer(meta, ack_interval_ms=20) as c:
        (msg,) = await take(c.subscribe("orders"), 1)
        await msg.ack()
        await broker_a.wait_until(lambda: broker_a.ack_ranges)
    assert broker_a.ack_ranges == [[[1, 1]]]


async def test_acks_are_sent_at_once_when_ack_pending_max_are_waiting(meta, broker_a):
    meta.set_route("orders", [broker_a])
    broker_a.publish("orders", b"1", b"2", b"3", b"4")
    async with consumer(meta, ack_pending_max=3) as c:
        msgs = await take(c.subscribe("orders"), 4)
        for msg in msgs[:3]:
            await msg.ack()
        await broker_a.wait_until(lambda: broker_a.ack_ranges)
        assert broker_a.ack_ranges == [[[1, 3]]]
        await msgs[3].ack()
    assert broker_a.ack_ranges == [[[1, 3]], [[4, 4]]]


async def test_acking_twice_sends_one_ack(meta, broker_a):
    meta.set_route("orders", [broker_a])
    broker_a.publish("orders", b"x")
    async with consumer(meta) as c:
        (msg,) = await take(c.subscribe("orders"), 1)
        await msg.ack()
        await msg.ack()
        assert msg.settled
    assert broker_a.acked_seqs() == [1]


async def test_graceful_close_sends_pending_acks(meta, broker_a):
    meta.set_route("orders", [broker_a])
    broker_a.publish("orders", b"1", b"2")
    c = consumer(meta)
    async with c:
        for msg in await take(c.subscribe("orders"), 2):
            await msg.ack()
        assert broker_a.ack_ranges == []
    assert broker_a.ack_ranges == [[[1, 2]]]


async def test_close_leaves_every_broker_it_pulled_from_and_the_metaserver_after_its_last_acks(
        meta, broker_a, broker_b):
    meta.set_route("orders", [broker_a, broker_b])
    broker_a.publish("orders", b"1")
    c = consumer(meta)
    async with c:
        [msg] = await take(c.subscribe("orders"), 1)
        await msg.ack()
        await broker_b.wait_until(lambda: any(r["op"] == "pull" for r in broker_b.requests))
        assert broker_a.leaves == [] and meta.leaves == []
    for broker in (broker_a, broker_b):
        assert [(r["consumer_id"], r["subscriptions"]) for r in broker.leaves] == [
            ("c1", [["orders", "billing"]])]
    ops = [r["op"] for r in broker_a.requests]
    assert ops.index("leave") > ops.index("ack"), "acks first: a leave hands on what is unacked"
    assert meta.leaves == [{"client_id": "c1"}]


async def test_close_waits_for_an_ack_in_flight_before_it_leaves(meta, broker_a):
    # A leave overtaking an unanswered ack would hand the acked message to another consumer.
    meta.set_route("orders", [broker_a])
    broker_a.publish("orders", b"1")
    broker_a.ack_gate = asyncio.Event()
    c = consumer(meta, ack_pending_max=1)
    await c.__aenter__()
    [msg] = await take(c.subscribe("orders"), 1)
    await msg.ack()  # the ack timer sends it at once and waits for the answer
    await broker_a.wait_until(lambda: broker_a.ops("ack"))
    closing = asyncio.create_task(c.close())
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(0.5):  # a leave that does not wait arrives well within this
            await broker_a.wait_until(lambda: broker_a.leaves)
    assert broker_a.leaves == [], "no leave while an ack is unanswered"
    broker_a.ack_gate.set()
    await closing
    assert broker_a.acked_seqs() == [1]
    assert len(broker_a.leaves) == 1


async def test_close_sends_again_an_ack_that_failed_with_a_retriable_error(meta, broker_a):
    meta.set_route("orders", [broker_a])
    broker_a.publish("orders", b"1")
    broker_a.fail_next("ack", "error", ("overloaded", "broker busy"))
    async with consumer(meta) as c:
        [msg] = await take(c.subscribe("orders"), 1)
        await msg.ack()
    assert broker_a.acked_seqs() == [1]
    assert [r["op"] for r in broker_a.requests if r["op"] in ("ack", "leave")] == [
        "ack", "ack", "leave"]


async def test_close_ends_the_iterator(meta, broker_a):
    meta.set_route("orders", [broker_a])
    c = consumer(meta, wait_ms=60_000)
    await c.__aenter__()
    sub = c.subscribe("orders")
    waiting = asyncio.create_task(take(sub, 1))
    await broker_a.wait_until(lambda: broker_a.ops("pull"))
    await c.close()
    with pytest.raises(StopAsyncIteration):
        await waiting


async def test_nack_raises_not_supported_and_leaves_the_message_unacked(meta, broker_a):
    meta.set_route("orders", [broker_a])
    broker_a.publish("orders", b"x")
    async with consumer(meta) as c:
        (msg,) = await take(c.subscribe("orders"), 1)
        with pytest.raises(NotSupported):
            await msg.nack(retry_after=10_000)
        assert not msg.settled
    nack = broker_a.ops("nack")[0]
    assert (nack["pull_seqs"], nack["retry_after_ms"]) == ([1], 10_000)
    assert broker_a.ack_ranges == []


async def test_handler_concurrency_limit_is_respected(meta, broker_a):
    meta.set_route("orders", [broker_a])
    broker_a.publish("orders", *(b"%d" % i for i in range(6)))
    c = consumer(meta)
    gate = asyncio.Event()
    running = asyncio.Condition()
    active = 0
    most = 0
    done = 0

    @c.handler("orders", concurrency=2)
    async def handle(msg):
        nonlocal active, most, done
        async with running:
            active += 1
            most = max(most, active)
            running.notify_all()
        await gate.wait()
        async with running:
            active -= 1
            done += 1
            running.notify_all()

    async with c:
        async with running:
            await running.wait_for(lambda: active == 2)
        for _ in range(50):  # every chance for a third handler to start; no time passes
            await asyncio.sleep(0)
        assert active == 2
        gate.set()
        async with running:
            await running.wait_for(lambda: done == 6)
    assert most == 2
    assert broker_a.acked_seqs() == [1, 2, 3, 4, 5, 6]


async def test_a_handler_that_raises_leaves_its_message_unacked_and_logs_why(
    meta, broker_a, caplog
):
    meta.set_route("orders", [broker_a])
    broker_a.publish("orders", b"good", b"bad", b"good")
    c = consumer(meta)
    finished = asyncio.Event()
    seen = []

    @c.handler("orders")
    async def handle(msg):
        seen.append(msg.body)
        if len(seen) == 3:
            finished.set()
        if msg.body == b"bad":
            raise ValueError("cannot bill")

    with caplog.at_level(logging.WARNING):
        async with c:
            await finished.wait()
            await broker_a.wait_until(lambda: broker_a.ops("nack"))
    assert broker_a.acked_seqs() == [1, 3]
    assert broker_a.ops("nack")[0]["pull_seqs"] == [2]
    assert "cannot bill" in caplog.text
    assert "redelivered after the group's ack timeout" in caplog.text


async def test_graceful_close_waits_for_running_handlers_then_sends_their_acks(meta, broker_a):
    meta.set_route("orders", [broker_a])
    broker_a.publish("orders", b"slow")
    c = consumer(meta)
    started = asyncio.Event()
    release = asyncio.Event()

    @c.handler("orders")
    async def handle(msg):
        started.set()
        await release.wait()

    await c.__aenter__()
    await started.wait()
    closing = asyncio.create_task(c.close())
    for _ in range(20):
        await asyncio.sleep(0)
    assert not closing.done()  # waiting for the handler
    release.set()
    await closing
    assert broker_a.ack_ranges == [[[1, 1]]]


async def test_close_cancels_handlers_that_outlast_close_timeout_and_leaves_them_unacked(
    meta, broker_a
):
    meta.set_route("orders", [broker_a])
    broker_a.publish("orders", b"stuck")
    c = consumer(meta, close_timeout_ms=0)
    started = asyncio.Event()
    cancelled = asyncio.Event()

    @c.handler("orders")
    async def handle(msg):
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async with c:
        await started.wait()
    assert cancelled.is_set()
    assert broker_a.ack_ranges == []


async def test_run_serves_handlers_until_close(meta, broker_a):
    meta.set_route("orders", [broker_a])
    broker_a.publish("orders", b"x")
    c = consumer(meta)
    handled = asyncio.Event()

    @c.handler("orders")
    async def handle(msg):
        handled.set()

    running = asyncio.create_task(c.run())
    await handled.wait()
    assert not running.done()
    await c.close()
    await running
    assert broker_a.acked_seqs() == [1]


async def test_heartbeats_name_the_subscriptions_to_the_broker_and_the_metaserver(meta, broker_a):
    meta.set_route("orders", [broker_a])
    broker_a.publish("orders", b"fills the prefetch")
    # A full prefetch buffer: no pull is out, so the broker needs heartbeats.
    async with consumer(meta, heartbeat_interval_ms=10, prefetch=1, pull_batch=1) as c:
        c.subscribe("orders")
        await broker_a.wait_until(lambda: broker_a.heartbeats)
        await meta.wait_until(lambda: any(h["subjects"] == ["orders"] for h in meta.heartbeats))
    beat = broker_a.heartbeats[0]
    assert (beat["consumer_id"], beat["subscriptions"]) == ("c1", [["orders", "billing"]])
    meta_beat = next(h for h in meta.heartbeats if h["subjects"] == ["orders"])
    assert meta_beat == {"client_id": "c1", "app": "default", "group": "billing",
                         "subjects": ["orders"], "role": "consumer"}


async def test_the_consumers_of_a_process_share_one_heartbeat_and_their_leaves(meta, broker_a):
    meta.set_route("orders", [broker_a])
    pool = [consumer(meta, consumer_id=f"c{i}") for i in range(3)]
    for c in pool:
        await c.__aenter__()
        c.subscribe("orders")
    await meta.wait_until(lambda: any(
        len(b["clients"]) == 3 and all(h["subjects"] == ["orders"] for h in b["clients"])
        for b in meta.batches))
    await pool[0].heartbeat()  # a round of its own, naming every member
    assert sorted(h["client_id"] for h in meta.batches[-1]["clients"]) == ["c0", "c1", "c2"]
    await asyncio.gather(pool[1].close(), pool[2].close())
    assert sorted(meta.batches[-1]["left"]) == ["c1", "c2"]
    assert [h["client_id"] for h in meta.batches[-1]["clients"]] == ["c0"]
    await pool[0].close()
    assert meta.batches[-1] == {"clients": [], "left": ["c0"]}
    assert meta.route_requests and not [h for b in meta.batches for h in b["clients"]
                                        if h["subjects"] not in ([], ["orders"])]


async def test_a_metaserver_without_batched_heartbeats_gets_one_per_consumer(meta, broker_a):
    meta.set_route("orders", [broker_a])
    meta.batched = False
    pool = [consumer(meta, consumer_id=f"c{i}") for i in range(2)]
    for c in pool:
        await c.__aenter__()
        c.subscribe("orders")
    await meta.wait_until(lambda: {h["client_id"] for h in meta.heartbeats
                                   if h["subjects"] == ["orders"]} == {"c0", "c1"})
    for c in pool:
        await c.close()
    assert sorted(leave["client_id"] for leave in meta.leaves) == ["c0", "c1"]
    assert meta.batches == []


async def test_a_consumer_parked_in_long_polls_sends_its_broker_no_heartbeat(meta, broker_a):
    meta.set_route("orders", [broker_a])
    # Long polls of 50 ms: each pull, begun more recently than the 2 s interval, tells the
    # broker the consumer is alive; the MetaServer still gets its heartbeats.
    async with consumer(meta, heartbeat_interval_ms=2_000, wait_ms=50) as c:
        c.subscribe("orders")
        await broker_a.wait_until(lambda: len(broker_a.ops("pull")) >= 4)
        await c.heartbeat()
        await meta.wait_until(lambda: any(h["subjects"] == ["orders"] for h in meta.heartbeats))
    assert broker_a.heartbeats == []


async def test_a_broker_group_that_joins_the_route_gets_a_pull_loop(meta, broker_a, broker_b):
    meta.set_route("orders", [broker_a])
    broker_b.publish("orders", b"from b")
    async with consumer(meta, route_refresh_ms=10) as c:
        sub = c.subscribe("orders")
        await broker_a.wait_until(lambda: broker_a.ops("pull"))
        meta.set_route("orders", [broker_a, broker_b])
        (msg,) = await take(sub, 1)
        await msg.ack()
    assert (msg.body, msg.broker_group) == (b"from b", "group-b")
    assert broker_b.acked_seqs() == [1] and broker_a.acked_seqs() == []


async def test_messages_from_two_groups_are_acked_to_the_broker_that_sent_them(
    meta, broker_a, broker_b
):
    meta.set_route("orders", [broker_a, broker_b])
    broker_a.publish("orders", b"a1", b"a2")
    broker_b.publish("orders", b"b1")
    async with consumer(meta) as c:
        for msg in await take(c.subscribe("orders"), 3):
            await msg.ack()
    assert broker_a.ack_ranges == [[[1, 2]]]
    assert broker_b.ack_ranges == [[[1, 1]]]


async def test_a_dropped_connection_is_reconnected_and_pulling_goes_on(meta, broker_a):
    meta.set_route("orders", [broker_a])
    async with consumer(meta, wait_ms=60_000) as c:
        sub = c.subscribe("orders")
        await broker_a.wait_until(lambda: broker_a.ops("pull"))
        broker_a.drop_connections()
        await broker_a.wait_until(lambda: len(broker_a.ops("hello")) == 2 and
                                  len(broker_a.ops("pull")) == 2)
        broker_a.publish("orders", b"after")
        (msg,) = await take(sub, 1)
    assert msg.body == b"after"


async def test_pulling_goes_on_from_the_cached_route_when_the_metaserver_is_down(
    meta, broker_a, caplog
):
    meta.set_route("orders", [broker_a])
    # Short pulls and route refreshes: while the MetaServer is down, many refreshes fail.
    async with consumer(meta, route_refresh_ms=5, wait_ms=5) as c:
        sub = c.subscribe("orders")
        await broker_a.wait_until(lambda: broker_a.ops("pull"))
        await meta.stop()
        pulls = len(broker_a.ops("pull"))
        with caplog.at_level(logging.WARNING, logger="sdk.routes"):
            await broker_a.wait_until(lambda: len(broker_a.ops("pull")) >= pulls + 20)
        broker_a.publish("orders", b"still here")
        (msg,) = await take(sub, 1)
    assert "cached" in caplog.text
    assert msg.body == b"still here"


async def test_a_refused_pull_is_raised_by_the_iterator(meta, broker_a):
    meta.set_route("orders", [broker_a])
    broker_a.fail_next("pull", "error", ("forbidden", "billing may not consume orders"))
    async with consumer(meta) as c:
        with pytest.raises(Forbidden):
            await take(c.subscribe("orders"), 1)


async def test_bad_subscriptions_and_options_fail_at_once(meta):
    with pytest.raises(BadRequest):
        Consumer(meta.url, group="bad group")
    with pytest.raises(ValueError, match="pull_batch"):
        Consumer(meta.url, group="g", pull_batch=0)
    with pytest.raises(ValueError, match="pull_batch_max must be an int 300..1024, got 256"):
        Consumer(meta.url, group="g", pull_batch=300, pull_batch_max=256)
    async with consumer(meta) as c:
        with pytest.raises(BadRequest):
            c.subscribe("bad subject")
        c.subscribe("orders")
        with pytest.raises(ValueError, match="already subscribed"):
            c.subscribe("orders")
        with pytest.raises(TypeError, match="must be a function"):
            c.handler("refunds")("not callable")
        with pytest.raises(ValueError, match="handler_threads"):
            Consumer(meta.url, group="g", handler_threads=0)


async def test_a_pull_that_outlives_its_timeout_reconnects(meta, broker_a, monkeypatch):
    import sdk.pulling

    # The fake broker holds a pull for wait_ms; with no slack the client times out first.
    monkeypatch.setattr(sdk.pulling, "PULL_TIMEOUT_SLACK_MS", -950)
    meta.set_route("orders", [broker_a])
    async with consumer(meta, wait_ms=1_000) as c:
        c.subscribe("orders")
        await broker_a.wait_until(
            lambda: len(broker_a.ops("hello")) >= 2 and len(broker_a.ops("pull")) >= 2)
    # The second pull went over a new connection: a new hello came before it.
    kinds = [r["op"] for r in broker_a.requests if r["op"] in ("hello", "pull")]
    assert kinds[:4] == ["hello", "pull", "hello", "pull"]


def test_an_unreadable_pulled_message_is_logged_and_skipped_and_the_others_are_received(caplog):
    good = [encode_message(Message.create("orders", b"%d" % i, now_ms=1, id=f"m{i}"))
            for i in range(2)]
    answer = pull_response([5, 6, 7], [good[0], b"\xc1", good[1]], [0, 3, 1])
    batch = _PulledBatch(None, "group-a", "127.0.0.1:1", ("127.0.0.1:1", "group-a", "orders"))
    sub = Subscription("orders", [], PullSize(10, 10, None))
    with caplog.at_level(logging.ERROR, logger="sdk.consumer"):
        got = Consumer._received(answer, sub, batch)
    assert [(m.pull_seq, m.id, m.redelivered) for m in got] == [(5, "m0", 0), (7, "m1", 1)]
    assert "unreadable message" in caplog.text and "pull seq 6" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="sdk.consumer"):
        assert Consumer._received({"pull_seqs": [1], "payloads": []}, sub, batch) == []
    assert "unreadable columns" in caplog.text
