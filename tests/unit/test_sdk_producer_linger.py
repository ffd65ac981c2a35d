"""sdk.producer's batches on the wire against a fake broker: when a batch leaves at once and
when it lingers behind one of its subject on the wire (``linger_in_flight_min``), and how many
senders in a loop share a batch (``split_sends_min``). Apart from test_sdk_producer.py for its
size."""

from __future__ import annotations

import asyncio

import pytest

from sdk.producer import LINGER_IN_FLIGHT_MIN_DEFAULT, Producer, Receipt
from tests.unit.test_sdk_fakes import broker_a, meta  # noqa: F401  (fixtures)
from tests.unit.test_sdk_producer import producer


async def _sends_on_the_wire(p: Producer, broker, count: int) -> list[asyncio.Task[Receipt]]:
    """``count`` sends, each started once the one before has reached the (gated) broker."""
    sends = []
    for i in range(count):
        sends.append(asyncio.create_task(p.send("orders", b"%d" % i)))
        await broker.wait_until(lambda: len(broker.ops("send")) == 1 + len(sends))
    return sends


async def test_a_lone_send_leaves_at_once_while_fewer_than_linger_in_flight_min_are_on_the_wire(
        meta, broker_a):
    IN_FLIGHT_MIN = 8  # the value measured (docs/BENCHMARKS.md)
    meta.set_route("orders", [broker_a])
    p = producer(meta, linger_ms=3_600_000, linger_in_flight_min=IN_FLIGHT_MIN)
    await p.send("orders", b"warm-up")  # route and connection ready
    broker_a.send_gate = asyncio.Event()
    # Each send reaches the broker while the ones before are unanswered: with a linger of an
    # hour, one that lingered would never arrive (wait_until would fail the test).
    sends = await _sends_on_the_wire(p, broker_a, IN_FLIGHT_MIN)
    assert p._on_wire == {("orders", False): IN_FLIGHT_MIN}
    # The next one finds linger_in_flight_min batches on the wire: it lingers.
    late = [asyncio.create_task(p.send("orders", b"late %d" % i)) for i in range(2)]
    for _ in range(50):  # give it every chance to go out; no time passes
        await asyncio.sleep(0)
    assert len(broker_a.ops("send")) == 1 + IN_FLIGHT_MIN
    assert p._open[("orders", False)].count == 2
    broker_a.send_gate.set()  # the first answer lets the lingering batch go
    await asyncio.gather(*sends, *late)
    await p.close()
    assert [len(ids) for ids in broker_a.sent_ids()] == [1] * (1 + len(sends)) + [2]


async def test_with_linger_in_flight_min_2_the_second_batch_on_the_wire_leaves_and_the_third_lingers(
        meta, broker_a):
    meta.set_route("orders", [broker_a])
    p = producer(meta, linger_ms=3_600_000, linger_in_flight_min=2)
    await p.send("orders", b"warm-up")
    broker_a.send_gate = asyncio.Event()
    sends = await _sends_on_the_wire(p, broker_a, 2)
    third = asyncio.create_task(p.send("orders", b"third"))
    for _ in range(50):
        await asyncio.sleep(0)
    assert len(broker_a.ops("send")) == 3 and ("orders", False) in p._open
    broker_a.send_gate.set()
    await asyncio.gather(*sends, third)
    await p.close()
    assert [len(ids) for ids in broker_a.sent_ids()] == [1, 1, 1, 1]


async def test_a_lingering_batch_leaves_at_the_answer_that_brings_the_count_below_the_option(
        meta, broker_a):
    meta.set_route("orders", [broker_a])
    # No resend either: an unanswered batch stays on the wire until its gate opens.
    p = producer(meta, linger_ms=3_600_000, linger_in_flight_min=2, send_timeout_ms=3_600_000)
    await p.send("orders", b"warm-up")
    first_gate = broker_a.send_gate = asyncio.Event()
    first = asyncio.create_task(p.send("orders", b"first"))
    await broker_a.wait_until(lambda: len(broker_a.ops("send")) == 2)
    broker_a.send_gate = asyncio.Event()  # the second batch waits for a gate of its own
    second = asyncio.create_task(p.send("orders", b"second"))
    await broker_a.wait_until(lambda: len(broker_a.ops("send")) == 3)
    third = asyncio.create_task(p.send("orders", b"third"))
    for _ in range(50):  # two on the wire: it lingers; no time passes
        await asyncio.sleep(0)
    assert len(broker_a.ops("send")) == 3
    first_gate.set()  # one answer leaves one on the wire, below the option
    # With a linger of an hour, a batch that waited for the second answer too never arrives.
    await broker_a.wait_until(lambda: len(broker_a.ops("send")) == 4)
    await first
    assert not second.done()
    broker_a.send_gate.set()
    await asyncio.gather(second, third)
    await p.close()


async def test_a_lingering_batch_is_written_as_the_answer_before_it_is_read_before_its_senders_resume(
        meta, broker_a):
    meta.set_route("orders", [broker_a])
    p = producer(meta, linger_ms=3_600_000)
    await p.send("orders", b"warm-up")
    events: list[str] = []
    original = p._pool.request

    async def request(address, op, *rest):
        if op["op"] == "send":
            events.append("batch written")  # the request's first step writes it
        return await original(address, op, *rest)

    p._pool.request = request
    broker_a.send_gate = asyncio.Event()

    async def first() -> None:
        await p.send("orders", b"first")
        events.append("first resumed")

    one = asyncio.create_task(first())
    await broker_a.wait_until(lambda: len(broker_a.ops("send")) == 2)
    second = asyncio.create_task(p.send("orders", b"second"))
    for _ in range(50):  # one on the wire: it lingers; no time passes
        await asyncio.sleep(0)
    assert events == ["batch written"]
    broker_a.send_gate.set()
    await asyncio.gather(one, second)
    await p.close()
    assert events == ["batch written", "batch written", "first resumed"]


async def test_a_batch_opened_by_the_senders_of_an_answered_batch_leaves_without_a_linger_timer(
        meta, broker_a):
    # Senders that send again as they resume (W1's loop) open the next batch in the step
    # after the one that settled theirs: that batch is off the wire by then, so the new one
    # leaves after its loop turn. Counted off only by the task's done callback, which runs
    # after them, it lingered on a timer made and cancelled in that same turn.
    meta.set_route("orders", [broker_a])
    p = producer(meta, linger_ms=3_600_000)
    await p.send("orders", b"warm-up")
    opened: list[bool] = []
    original = p._open_batch

    def open_batch(key):
        batch = original(key)
        opened.append(batch.lingering)
        return batch

    p._open_batch = open_batch

    async def sender(name: str) -> None:
        for i in range(5):
            await p.send("orders", b"%s %d" % (name.encode(), i))

    await asyncio.gather(*(sender(name) for name in ("a", "b", "c")))
    await p.close()
    assert opened and not any(opened)
    assert sum(len(ids) for ids in broker_a.sent_ids()) == 1 + 15


async def test_a_lone_send_is_written_in_the_loop_turn_after_the_send(meta, broker_a):
    meta.set_route("orders", [broker_a])
    p = producer(meta)
    await p.send("orders", b"warm-up")  # route and connection ready: nothing to wait for
    events: list[str] = []
    original = p._pool.request

    async def request(address, op, *rest):
        events.append("batch written")  # the request's first step writes it
        return await original(address, op, *rest)

    p._pool.request = request
    sending = asyncio.ensure_future(p.send("orders", b"lone"))
    await asyncio.sleep(0)  # the send's first step ran before this: its batch is open
    assert events == [] and ("orders", False) in p._open
    await asyncio.sleep(0)  # the next loop turn: the batch was written before this resumes
    assert events == ["batch written"] and ("orders", False) not in p._open
    await sending
    await p.close()


async def test_by_default_a_new_batch_lingers_behind_any_batch_of_its_subject_on_the_wire(meta):
    assert producer(meta).linger_in_flight_min == LINGER_IN_FLIGHT_MIN_DEFAULT == 1


async def test_linger_in_flight_min_must_be_an_int_of_one_or_more(meta):
    with pytest.raises(ValueError, match="linger_in_flight_min must be an int >= 1, got 0"):
        producer(meta, linger_in_flight_min=0)


async def _looping_senders(p: Producer, senders: int, sends_each: int) -> None:
    async def sender() -> None:
        for _ in range(sends_each):
            await p.send("orders", b"x")

    await asyncio.gather(*(sender() for _ in range(senders)))


async def test_many_senders_in_a_loop_keep_two_batches_of_half_of_them_on_the_wire(meta, broker_a):
    meta.set_route("orders", [broker_a])
    # A linger of an hour: every batch leaves by its count or when the one before is answered.
    async with producer(meta, linger_ms=3_600_000, split_sends_min=8) as p:
        await _looping_senders(p, 32, 4)
    # The first wave is one batch of all 32; from then on half of them leave at once and the
    # other half form the next batch while it is on the wire (the overlap).
    assert [len(ids) for ids in broker_a.sent_ids()] == [32] + [16] * 6


async def test_a_few_senders_in_a_loop_keep_sharing_one_batch(meta, broker_a):
    meta.set_route("orders", [broker_a])
    async with producer(meta, linger_ms=3_600_000, split_sends_min=8) as p:
        await _looping_senders(p, 15, 3)  # fewer than 2 * split_sends_min
    assert [len(ids) for ids in broker_a.sent_ids()] == [15] * 3


async def test_without_split_sends_min_many_senders_in_a_loop_share_one_batch(meta, broker_a):
    meta.set_route("orders", [broker_a])
    async with producer(meta, linger_ms=3_600_000) as p:
        await _looping_senders(p, 32, 3)
    assert [len(ids) for ids in broker_a.sent_ids()] == [32] * 3


async def test_split_sends_min_must_be_an_int_of_zero_or_more(meta):
    with pytest.raises(ValueError, match="split_sends_min must be an int >= 0, got -1"):
        producer(meta, split_sends_min=-1)
