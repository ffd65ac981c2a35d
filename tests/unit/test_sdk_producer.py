"""sdk.producer against a fake broker and a fake MetaServer: batching, retries, routes, errors."""

from __future__ import annotations

import asyncio
import logging
import random
import re
from datetime import UTC, datetime, timedelta

import pytest

from wire.errors import (
    BadRequest, ConnectionLost, DelayOutOfRange, Forbidden, NotMaster, Overloaded, TooLarge,
)
from wire.limits import MAX_BODY_BYTES, MAX_SEND_BATCH_MESSAGES
from wire.message import Message, decode_message, encode_message
from sdk.batching import WrongEventLoop
from sdk.producer import Producer, Receipt
from sdk.routes import RouteCache
from tests.unit.test_sdk_fakes import broker_a, broker_b, meta  # noqa: F401  (fixtures)


def producer(meta, **options) -> Producer:
    options.setdefault("retry_backoff_ms", 0)
    options.setdefault("route_start", 0)  # the first batch goes to the route's first group
    return Producer(meta.url, app="shop", **options)


async def test_sends_issued_within_the_linger_go_to_the_broker_in_one_send_op(meta, broker_a):
    meta.set_route("orders", [broker_a])
    async with producer(meta, linger_ms=20) as p:
        receipts = await asyncio.gather(*(p.send("orders", b"%d" % i) for i in range(5)))
    assert len(broker_a.ops("send")) == 1
    assert broker_a.sent_ids() == [[r.message_id for r in receipts]]
    assert {r.status for r in receipts} == {"stored"}
    assert {r.broker_group for r in receipts} == {"group-a"}


async def test_a_full_batch_is_sent_without_waiting_for_the_linger(meta, broker_a):
    meta.set_route("orders", [broker_a])
    # A linger of an hour: if the batch waited for it, the test would hit its timeout.
    p = producer(meta, linger_ms=3_600_000, batch_size_max=3)
    receipts = await asyncio.gather(*(p.send("orders", b"x") for _ in range(3)))
    assert [len(ids) for ids in broker_a.sent_ids()] == [3]
    assert len(receipts) == 3
    await p.close()


async def test_sends_that_would_pass_the_frame_limit_together_go_in_separate_batches(meta, broker_a):
    meta.set_route("orders", [broker_a])
    bodies = [b"a", b"b" * MAX_BODY_BYTES, b"c" * MAX_BODY_BYTES, b"d"]
    async with producer(meta, linger_ms=3_600_000) as p:
        receipts = await asyncio.gather(*(p.send("orders", body) for body in bodies))
    # Two bodies of MAX_BODY_BYTES never share a frame: the open batch leaves when the next
    # would not fit, and the last small one shares the second big one's batch.
    assert broker_a.sent_ids() == [[receipts[0].message_id, receipts[1].message_id],
                                   [receipts[2].message_id, receipts[3].message_id]]
    assert {r.status for r in receipts} == {"stored"}


async def test_batch_size_max_is_capped_at_the_protocol_limit(meta):
    p = producer(meta, batch_size_max=MAX_SEND_BATCH_MESSAGES + 1)
    assert p.batch_size_max == MAX_SEND_BATCH_MESSAGES
    assert producer(meta, batch_size_max=MAX_SEND_BATCH_MESSAGES).batch_size_max == (
        MAX_SEND_BATCH_MESSAGES)
    await p.close()


async def test_messages_of_different_subjects_go_in_different_batches(meta, broker_a):
    meta.set_route("orders", [broker_a])
    meta.set_route("refunds", [broker_a])
    async with producer(meta, linger_ms=20) as p:
        await asyncio.gather(p.send("orders", b"1"), p.send("refunds", b"2"), p.send("orders", b"3"))
    subjects = sorted(
        tuple(decode_message(m).subject for m in op["messages"]) for op in broker_a.ops("send")
    )
    assert subjects == [("orders", "orders"), ("refunds",)]


async def test_the_message_sent_carries_body_tags_properties_and_expiry(meta, broker_a):
    meta.set_route("orders", [broker_a])
    expire_at = datetime(2030, 1, 1, tzinfo=UTC)
    async with producer(meta, clock_ms=lambda: 1_234) as p:
        receipt = await p.send("orders", b"body", tags=["vip"], properties={"k": "v"},
                               message_id="order-42", expire_at=expire_at)
    stored = broker_a.stored["order-42"]
    assert receipt == Receipt("order-42", "orders", "group-a", "stored")
    assert (stored.body, stored.tags, stored.properties) == (b"body", ("vip",), {"k": "v"})
    assert stored.created_at_ms == 1_234
    assert stored.expire_at_ms == int(expire_at.timestamp() * 1000)


async def test_a_batch_whose_connection_drops_is_resent_with_the_same_ids(meta, broker_a):
    meta.set_route("orders", [broker_a])
    broker_a.fail_next("send", "store_then_drop")
    async with producer(meta, linger_ms=20) as p:
        receipts = await asyncio.gather(*(p.send("orders", b"%d" % i) for i in range(3)))
    first, second = broker_a.sent_ids()
    assert first == second == [r.message_id for r in receipts]
    # The broker had stored them before the drop: the resend is de-duplicated.
    assert [r.status for r in receipts] == ["duplicate"] * 3
    assert len(broker_a.ops("hello")) == 2  # reconnected


async def test_a_non_retriable_error_surfaces_with_its_code_and_is_not_retried(meta, broker_a):
    meta.set_route("orders", [broker_a])
    broker_a.fail_next("send", "error", ("forbidden", "app shop may not produce orders"))
    async with producer(meta) as p:
        with pytest.raises(Forbidden) as caught:
            await p.send("orders", b"x")
    assert caught.value.code == "forbidden"
    assert "may not produce" in caught.value.message
    assert len(broker_a.ops("send")) == 1


async def test_a_per_message_error_fails_that_send_only(meta, broker_a):
    meta.set_route("orders", [broker_a])
    broker_a.fail_next("send", "result_error", ("too_large", "over the broker's limit"))
    async with producer(meta) as p:
        with pytest.raises(TooLarge):
            await p.send("orders", b"x")
        assert (await p.send("orders", b"y")).status == "stored"


async def test_a_failed_send_refreshes_the_route_and_moves_to_another_broker(
    meta, broker_a, broker_b
):
    meta.set_route("orders", [broker_a])
    async with producer(meta) as p:
        assert (await p.send("orders", b"1")).broker_group == "group-a"
        meta.set_route("orders", [broker_b])  # broker a went away; the cached route still says a
        broker_a.fail_next("send", "drop")
        receipt = await p.send("orders", b"2")
    assert receipt.broker_group == "group-b"
    assert broker_b.sent_ids() == [[receipt.message_id]]
    assert broker_a.sent_ids()[1] == [receipt.message_id]


async def test_a_retriable_error_answer_moves_the_batch_to_the_next_group(meta, broker_a, broker_b):
    meta.set_route("orders", [broker_a, broker_b])
    broker_a.fail_next("send", "result_error", ("readonly", "group-a is draining"))
    async with producer(meta) as p:
        receipt = await p.send("orders", b"1")  # first batch starts at group-a
    assert receipt.broker_group == "group-b"
    assert broker_a.sent_ids() == broker_b.sent_ids() == [[receipt.message_id]]


async def test_batches_are_spread_over_the_route_groups_round_robin(meta, broker_a, broker_b):
    meta.set_route("orders", [broker_a, broker_b])
    async with producer(meta) as p:
        groups = [(await p.send("orders", b"x")).broker_group for _ in range(4)]
    assert groups == ["group-a", "group-b", "group-a", "group-b"]


async def test_each_new_producer_starts_its_round_robin_at_a_random_group(meta, broker_a, broker_b):
    meta.set_route("orders", [broker_a, broker_b])
    first_groups = set()
    random.seed(17)  # the producers draw route_start from the random module
    for _ in range(40):
        async with Producer(meta.url, retry_backoff_ms=0) as p:
            first_groups.add((await p.send("orders", b"x")).broker_group)
    assert first_groups == {"group-a", "group-b"}


async def test_the_cached_route_is_used_when_the_metaserver_is_down(meta, broker_a, caplog):
    meta.set_route("orders", [broker_a])
    clock = {"now_ms": 0}
    routes = RouteCache(meta.url, ttl_ms=1_000, clock_ms=lambda: clock["now_ms"])
    async with Producer(meta.url, routes=routes, retry_backoff_ms=0) as p:
        await p.send("orders", b"1")
        await meta.stop()
        clock["now_ms"] = 1_000  # the route has expired: the next send asks the MetaServer
        with caplog.at_level(logging.WARNING, logger="sdk.routes"):
            receipt = await p.send("orders", b"2")
    assert receipt.broker_group == "group-a"
    assert "cached" in caplog.text


async def test_an_invalid_message_is_rejected_before_anything_is_sent(meta, broker_a):
    meta.set_route("orders", [broker_a])
    async with producer(meta) as p:
        with pytest.raises(BadRequest):
            await p.send("not a subject", b"x")
        with pytest.raises(TooLarge):
            await p.send("orders", b"x" * (MAX_BODY_BYTES + 1))
        with pytest.raises(BadRequest):
            await p.send("orders", b"x", expire_at=datetime(2030, 1, 1))  # naive
    assert broker_a.ops("send") == []


async def test_a_plain_send_to_a_subject_checked_before_sends_the_bytes_the_full_path_would(
        meta, broker_a):
    meta.set_route("orders", [broker_a])
    async with producer(meta, clock_ms=lambda: 1_234) as p:
        first = await p.send("orders", b"one")  # full check; the subject is remembered
        second = await p.send("orders", b"two", deliver_at=5_000)
        third = await p.send("orders", b"three", delay=timedelta(seconds=1))
    payloads = [m for op in broker_a.ops("send") for m in op["messages"]]
    assert payloads[1:] == [
        encode_message(Message(second.message_id, "orders", b"two", created_at_ms=1_234,
                               deliver_at_ms=5_000)),
        encode_message(Message(third.message_id, "orders", b"three", created_at_ms=1_234,
                               deliver_at_ms=2_234)),
    ]
    assert decode_message(payloads[0]) == Message(first.message_id, "orders", b"one",
                                                   created_at_ms=1_234)


async def test_a_plain_send_to_a_subject_checked_before_is_still_refused_when_invalid(
        meta, broker_a):
    meta.set_route("orders", [broker_a])
    async with producer(meta) as p:
        await p.send("orders", b"ok")
        with pytest.raises(TooLarge):
            await p.send("orders", b"x" * (MAX_BODY_BYTES + 1))
        with pytest.raises(BadRequest, match="body must be bytes"):
            await p.send("orders", "text")  # type: ignore[arg-type]
        with pytest.raises(DelayOutOfRange, match="MAX_DELAY_MS"):
            await p.send("orders", b"x", delay=timedelta(days=731))
        with pytest.raises(BadRequest, match="deliver_at_ms must be >= 0"):
            await p.send("orders", b"x", deliver_at=-1)
    assert len(broker_a.ops("send")) == 1


async def test_a_bad_delayed_send_is_refused_before_anything_is_sent(meta, broker_a):
    meta.set_route("orders", [broker_a])
    async with producer(meta) as p:
        with pytest.raises(BadRequest, match="timezone-aware"):
            await p.send("orders", b"x", deliver_at=datetime(2030, 1, 1))
        with pytest.raises(BadRequest, match="not both"):
            await p.send("orders", b"x", delay=1000, deliver_at=datetime(2030, 1, 1, tzinfo=UTC))
        with pytest.raises(BadRequest, match="must not be negative"):
            await p.send("orders", b"x", delay=timedelta(seconds=-1))
        with pytest.raises(DelayOutOfRange, match="MAX_DELAY_MS"):
            await p.send("orders", b"x", delay=timedelta(days=731))
    assert broker_a.ops("send") == []


async def test_only_a_delayed_message_can_be_cancelled(meta, broker_a):
    meta.set_route("orders", [broker_a])
    async with producer(meta) as p:
        receipt = await p.send("orders", b"x")
        assert not receipt.delayed and receipt.deliver_at_ms is None
        with pytest.raises(BadRequest, match="was not delayed"):
            await p.cancel(receipt)
    assert [r["op"] for r in broker_a.requests] == ["hello", "send"]


async def test_a_cancel_refused_as_not_master_during_a_failover_asks_the_route_again_and_lands(
        meta, broker_a):
    meta.set_route("orders", [broker_a])
    async with producer(meta) as p:
        receipt = await p.send("orders", b"cancel order 42", delay=timedelta(minutes=30))
        routes_before = len(meta.route_requests)
        broker_a.fail_next("cancel", "error", ("not_master", "its lease ran out (epoch 1)"))
        assert await p.cancel(receipt) == "cancelled"
        assert len(meta.route_requests) > routes_before  # the route was asked again
        # Its answer lost, a cancel sent again is told the truth: it was cancelled before.
        broker_a.fail_next("cancel", "store_then_drop")
        assert await p.cancel(receipt) == "already_cancelled"
    assert [r["op"] for r in broker_a.requests].count("cancel") == 4


async def test_a_cancel_refused_for_good_is_not_tried_again(meta, broker_a):
    meta.set_route("orders", [broker_a])
    async with producer(meta) as p:
        receipt = await p.send("orders", b"x", delay=timedelta(minutes=30))
        broker_a.fail_next("cancel", "error", ("forbidden", "app shop may not cancel orders"))
        with pytest.raises(Forbidden, match="may not cancel"):
            await p.cancel(receipt)
    assert [r["op"] for r in broker_a.requests].count("cancel") == 1


async def test_close_flushes_pending_batches(meta, broker_a):
    meta.set_route("orders", [broker_a])
    p = producer(meta, linger_ms=3_600_000)
    pending = asyncio.create_task(p.send("orders", b"x"))
    await asyncio.sleep(0)  # let the send join its batch
    assert broker_a.ops("send") == []
    await p.close()
    assert (await pending).status == "stored"
    with pytest.raises(RuntimeError, match="closed"):
        await p.send("orders", b"late")


async def test_in_flight_batches_are_bounded(meta, broker_a):
    meta.set_route("orders", [broker_a])
    broker_a.send_gate = asyncio.Event()
    p = producer(meta, batch_size_max=1, in_flight_max=2, linger_ms=0)
    sends = [asyncio.create_task(p.send("orders", b"%d" % i)) for i in range(5)]
    await broker_a.wait_until(lambda: len(broker_a.ops("send")) == 2)
    for _ in range(50):  # give a third batch every chance to go out; no time passes
        await asyncio.sleep(0)
    assert len(broker_a.ops("send")) == 2
    broker_a.send_gate.set()
    await asyncio.gather(*sends)
    await p.close()
    assert len(broker_a.ops("send")) == 5


async def test_tags_given_as_one_string_are_rejected_rather_than_split(meta, broker_a):
    meta.set_route("orders", [broker_a])
    async with producer(meta) as p:
        with pytest.raises(BadRequest, match="list of str"):
            await p.send("orders", b"x", tags="vip")
    assert broker_a.ops("send") == []


async def test_a_send_without_an_answer_in_time_is_resent_to_the_next_group(
    meta, broker_a, broker_b
):
    meta.set_route("orders", [broker_a, broker_b])
    broker_a.send_gate = asyncio.Event()  # group-a never answers sends
    async with producer(meta, send_timeout_ms=50) as p:
        receipt = await p.send("orders", b"x")
    broker_a.send_gate.set()
    assert receipt.broker_group == "group-b"
    assert broker_a.sent_ids() == broker_b.sent_ids() == [[receipt.message_id]]


async def test_a_delayed_send_that_reaches_no_delay_server_says_so(meta, broker_a):
    meta.set_route("orders", [broker_a])  # the fake answers the delay route with it too
    for _ in range(3):
        broker_a.fail_next("send", "drop")
    async with producer(meta, retries_max=2, retry_budget_ms=0) as p:
        with pytest.raises(ConnectionLost, match="no delay server reachable") as caught:
            await p.send("orders", b"x", delay=60_000)
    assert caught.value.retriable
    assert "'orders'" in caught.value.message


async def test_a_send_from_another_event_loop_raises_wrong_event_loop_and_sends_nothing(
        meta, broker_a):
    meta.set_route("orders", [broker_a])
    async with producer(meta) as p:
        first = await p.send("orders", b"first")  # the test's loop is now the producer's

        async def from_another_loop(send):
            with pytest.raises(WrongEventLoop, match=r"first send \(running.*one Producer per"):
                await send()

        await asyncio.to_thread(asyncio.run, from_another_loop(lambda: p.send("orders", b"x")))
        await asyncio.to_thread(
            asyncio.run, from_another_loop(lambda: p.send_many("orders", [b"y", b"z"])))
        assert broker_a.sent_ids() == [[first.message_id]]
        assert (await p.send("orders", b"after")).status == "stored"  # its own loop still works


async def test_a_send_after_the_loop_of_the_first_send_closed_raises_wrong_event_loop(
        meta, broker_a):
    meta.set_route("orders", [broker_a])
    p = producer(meta)

    async def send_and_close_connections():
        await p.send("orders", b"first")
        await p._pool.close()  # what a closed loop leaves is the test's concern, not the send's

    await asyncio.to_thread(asyncio.run, send_and_close_connections())
    with pytest.raises(WrongEventLoop, match=r"first send \(closed"):
        await p.send("orders", b"second")
    with pytest.raises(RuntimeError):  # a RuntimeError still, as before
        await p.send_many("orders", [b"third"])
    assert len(broker_a.sent_ids()) == 1


async def test_a_send_refused_as_not_master_longer_than_retries_max_lands_within_the_retry_budget(
        meta, broker_a):
    # A master stall: the group refuses not_master for 5 attempts (~1.5 s with the default
    # backoff, 50 ms doubled), past the 4 attempts of retries_max 3, then serves again.
    meta.set_route("orders", [broker_a])
    for _ in range(5):
        broker_a.fail_next("send", "error", ("not_master", "its lease ran out (epoch 1)"))
    async with Producer(meta.url, app="shop", route_start=0) as p:  # the default options
        receipt = await p.send("orders", b"x")
    assert receipt.status == "stored"
    assert broker_a.sent_ids() == [[receipt.message_id]] * 6


@pytest.mark.parametrize("options, refusal, error, attempts", [
    # A budget of 0: the 3 quick resends only, as before there was a budget.
    ({"retry_budget_ms": 0}, ("overloaded", "shedding load"), Overloaded, 4),
    # retries_max given: that many resends and no more, whatever the budget.
    ({"retries_max": 2}, ("overloaded", "shedding load"), Overloaded, 3),
    ({"retries_max": 0}, ("not_master", "its lease ran out (epoch 1)"), NotMaster, 1),
    # Pauses of 40, 80, 160, then 320 ms: the budget of 500 ms is over before the 5th attempt.
    ({"retry_backoff_ms": 40, "retry_budget_ms": 500},
     ("not_master", "its lease ran out (epoch 1)"), NotMaster, 4),
], ids=["budget 0", "retries_max 2", "retries_max 0", "budget spent"])
async def test_retries_stop_after_retries_max_and_the_budget_and_raise_the_last_error(
        meta, broker_a, options, refusal, error, attempts):
    meta.set_route("orders", [broker_a])
    for _ in range(attempts):
        broker_a.fail_next("send", "error", refusal)
    async with producer(meta, **options) as p:
        with pytest.raises(error, match=re.escape(refusal[1])):
            await p.send("orders", b"x")
        assert len(broker_a.ops("send")) == attempts
        assert (await p.send("orders", b"y")).status == "stored"

async def test_a_cancel_refused_as_not_master_longer_than_retries_max_lands_within_the_budget(
        meta, broker_a):
    meta.set_route("orders", [broker_a])
    async with producer(meta, retry_backoff_ms=1) as p:
        receipt = await p.send("orders", b"x", delay=timedelta(minutes=30))
        for _ in range(5):
            broker_a.fail_next("cancel", "error", ("not_master", "its lease ran out (epoch 1)"))
        assert await p.cancel(receipt) == "cancelled"
    assert [r["op"] for r in broker_a.requests].count("cancel") == 6
