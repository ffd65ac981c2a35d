"""sdk.producer: ``send_many`` and when a batch leaves (at once when nothing of its subject is on
the wire, else after the linger or when the batch on the wire is answered)."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wire.errors import BadRequest, Forbidden, TooLarge
from wire.limits import MAX_BODY_BYTES
from wire.message import Message, decode_message, encode_message, encode_plain_message
from sdk.producer import Producer, Receipt
from sdk.send_values import plain_middle, plain_payload, spliced_payloads
from tests.unit.test_sdk_fakes import broker_a, meta  # noqa: F401  (fixtures)

HOUR_MS = 3_600_000


def producer(meta, **options) -> Producer:
    options.setdefault("retry_backoff_ms", 0)
    options.setdefault("route_start", 0)  # the first batch goes to the route's first group
    return Producer(meta.url, app="shop", **options)


async def test_send_many_returns_one_receipt_per_body_in_order(meta, broker_a):
    meta.set_route("orders", [broker_a])
    async with producer(meta) as p:
        receipts = await p.send_many("orders", [b"%d" % i for i in range(300)])
    assert [broker_a.stored[r.message_id].body for r in receipts] == [b"%d" % i for i in range(300)]
    assert {(r.subject, r.broker_group, r.status) for r in receipts} == {
        ("orders", "group-a", "stored")}
    assert len({r.message_id for r in receipts}) == 300


async def test_send_many_fills_batches_up_to_batch_size_max(meta, broker_a):
    meta.set_route("orders", [broker_a])
    async with producer(meta, batch_size_max=100, linger_ms=HOUR_MS) as p:
        await p.send_many("orders", [b"x"] * 250)
    assert sorted(len(ids) for ids in broker_a.sent_ids()) == [50, 100, 100]


async def test_send_many_payloads_are_what_encode_message_makes(meta, broker_a):
    meta.set_route("orders", [broker_a])
    async with producer(meta, clock_ms=lambda: 1_234) as p:
        [receipt] = await p.send_many("orders", [b"body"], tags=["vip"],
                                      properties={"k": "v"}, expire_at=99_999)
    [[sent]] = [op["messages"] for op in broker_a.ops("send")]
    expected = Message(receipt.message_id, "orders", b"body", ("vip",), {"k": "v"},
                       created_at_ms=1_234, expire_at_ms=99_999)
    assert sent == encode_message(expected)
    assert decode_message(sent) == expected


async def test_send_many_refuses_a_bad_body_before_sending_anything(meta, broker_a):
    meta.set_route("orders", [broker_a])
    async with producer(meta) as p:
        with pytest.raises(TooLarge):
            await p.send_many("orders", [b"ok", b"x" * (MAX_BODY_BYTES + 1)])
        with pytest.raises(BadRequest):
            await p.send_many("orders", [b"ok", "not bytes"])  # type: ignore[list-item]
        with pytest.raises(BadRequest):
            await p.send_many("not a subject!", [b"ok"])
    assert broker_a.ops("send") == []


async def test_send_many_raises_a_rejection_or_returns_it_in_place(meta, broker_a):
    meta.set_route("orders", [broker_a])
    async with producer(meta) as p:
        broker_a.fail_next("send", "error", ("forbidden", "no"))
        with pytest.raises(Forbidden):
            await p.send_many("orders", [b"1", b"2"])
        broker_a.fail_next("send", "error", ("forbidden", "no"))
        results = await p.send_many("orders", [b"1", b"2"], return_exceptions=True)
    assert [type(r) for r in results] == [Forbidden, Forbidden]


async def test_send_many_of_nothing_sends_nothing(meta, broker_a):
    async with producer(meta) as p:
        assert await p.send_many("orders", []) == []
    assert broker_a.ops("send") == []


async def test_a_lone_send_does_not_wait_for_the_linger(meta, broker_a):
    meta.set_route("orders", [broker_a])
    p = producer(meta, linger_ms=HOUR_MS)
    # With an hour of linger, waiting for it would hit the test's timeout.
    async with asyncio.timeout(10):
        receipt = await p.send("orders", b"x")
    assert isinstance(receipt, Receipt)
    await p.close()


async def test_sends_made_while_a_batch_is_on_the_wire_leave_together_when_it_is_answered(
        meta, broker_a):
    meta.set_route("orders", [broker_a])
    # linger_in_flight_min=1: a new batch lingers behind any batch of its subject on the wire.
    p = producer(meta, linger_ms=HOUR_MS, linger_in_flight_min=1)
    await p.send("orders", b"warm-up")  # route and connection ready
    broker_a.send_gate = asyncio.Event()
    first = asyncio.create_task(p.send("orders", b"first"))
    await broker_a.wait_until(lambda: len(broker_a.ops("send")) == 2)
    later = [asyncio.create_task(p.send("orders", b"%d" % i)) for i in range(3)]
    await asyncio.sleep(0.05)
    assert len(broker_a.ops("send")) == 2  # the three wait behind the batch on the wire
    broker_a.send_gate.set()
    async with asyncio.timeout(10):
        await asyncio.gather(first, *later)
    assert [len(ids) for ids in broker_a.sent_ids()] == [1, 1, 3]
    await p.close()


async def test_delayed_send_many_encodes_each_due_time_and_its_receipts_can_cancel(
    meta, broker_a
):
    meta.set_route("orders", [broker_a])
    async with producer(meta, clock_ms=lambda: 1_000_000) as p:
        receipts = await p.send_many("orders", [b"a", b"b", b"c"], delay=[0, 1_500, 60_000],
                                     properties={"k": "v"})
        same = await p.send_many("orders", [b"d", b"e"], deliver_at=5_000_000)
    assert [r.deliver_at_ms for r in receipts] == [1_000_000, 1_001_500, 1_060_000]
    assert all(r.delayed for r in receipts + same)
    [first, second] = [op["messages"] for op in broker_a.ops("send")]
    for receipt, body, payload in zip(receipts, [b"a", b"b", b"c"], first):
        assert payload == encode_message(Message(
            receipt.message_id, "orders", body, (), {"k": "v"}, created_at_ms=1_000_000,
            deliver_at_ms=receipt.deliver_at_ms))
    assert [decode_message(m).deliver_at_ms for m in second] == [5_000_000, 5_000_000]


async def test_a_bad_delayed_send_many_is_refused_before_anything_is_sent(meta, broker_a):
    from datetime import timedelta

    from wire.errors import DelayOutOfRange
    from wire.limits import MAX_DELAY_MS

    meta.set_route("orders", [broker_a])
    async with producer(meta, clock_ms=lambda: 1_000_000) as p:
        with pytest.raises(BadRequest, match="2 values for 3 bodies"):
            await p.send_many("orders", [b"1", b"2", b"3"], delay=[1, 2])
        with pytest.raises(BadRequest, match="not both"):
            await p.send_many("orders", [b"1"], delay=1, deliver_at=2)
        with pytest.raises(BadRequest, match="negative"):
            await p.send_many("orders", [b"1", b"2"], delay=[5, timedelta(seconds=-1)])
        with pytest.raises(DelayOutOfRange):
            await p.send_many("orders", [b"1", b"2"], delay=[0, MAX_DELAY_MS + 1])
        at_limit = await p.send_many("orders", [b"1"], delay=MAX_DELAY_MS)
    assert at_limit[0].deliver_at_ms == 1_000_000 + MAX_DELAY_MS
    assert len(broker_a.ops("send")) == 1


async def test_send_many_of_large_bodies_splits_batches_at_the_frame_limit(meta, broker_a):
    meta.set_route("orders", [broker_a])
    big = b"x" * (3 * 1024 * 1024)  # two fit in one frame (8 MiB), three do not
    async with producer(meta, linger_ms=HOUR_MS) as p:
        async with asyncio.timeout(30):
            receipts = await p.send_many("orders", [big, b"small", big, big])
    assert [len(ids) for ids in broker_a.sent_ids()] == [3, 1]
    assert [ids for batch in broker_a.sent_ids() for ids in batch] == [
        r.message_id for r in receipts]


async def test_send_many_spanning_batches_shares_them_with_other_calls_in_order(meta, broker_a):
    meta.set_route("orders", [broker_a])
    async with producer(meta, linger_ms=HOUR_MS, batch_size_max=4) as p:
        async with asyncio.timeout(10):
            first, second = await asyncio.gather(
                p.send_many("orders", [b"a%d" % i for i in range(6)]),
                p.send_many("orders", [b"b%d" % i for i in range(3)]))
    assert [len(ids) for ids in broker_a.sent_ids()] == [4, 4, 1]
    assert [broker_a.stored[r.message_id].body for r in first] == [b"a%d" % i for i in range(6)]
    assert [broker_a.stored[r.message_id].body for r in second] == [b"b%d" % i for i in range(3)]


_names = st.text(alphabet="abcdefghij._-0123456789", min_size=1, max_size=20).filter(
    lambda s: s[0].isalnum())


@settings(max_examples=200, deadline=None)
@given(tags=st.lists(_names, max_size=3), properties=st.dictionaries(_names, st.text(max_size=30),
                                                                     max_size=3),
       expire_at_ms=st.none() | st.integers(0, 2**63), delayed=st.booleans(),
       rows=st.lists(st.tuples(st.text(alphabet="0123456789abcdef", min_size=1, max_size=40),
                               st.binary(max_size=300), st.integers(0, 2**64 - 1)),
                     min_size=1, max_size=5))
def test_spliced_payloads_are_byte_for_byte_what_encode_message_makes(
        tags, properties, expire_at_ms, delayed, rows):
    def message(message_id, body, due):
        return Message(message_id, "orders", body, tuple(tags), properties,
                       created_at_ms=1_234, expire_at_ms=expire_at_ms,
                       deliver_at_ms=due if delayed else None)

    template = message(*rows[0])
    payload = encode_message(template)
    columns = {"i": [r[0] for r in rows], "b": [r[1] for r in rows]}
    if delayed:
        columns["d"] = [r[2] for r in rows]
    spliced = spliced_payloads(payload, msgpack.unpackb(payload, raw=False), columns)
    assert spliced == [encode_message(message(*row)) for row in rows]


@settings(max_examples=300, deadline=None)
@given(message_id=st.text(alphabet="0123456789abcdef", min_size=31, max_size=33)
       | st.text(min_size=32, max_size=32),
       subject=st.text(min_size=1, max_size=40),
       body=st.binary(max_size=300) | st.sampled_from([b"x" * 255, b"x" * 256, b"x" * 65535,
                                                      b"x" * 65536]),
       created_at_ms=st.integers(0, 2**64 - 1) | st.sampled_from([2**32 - 1, 2**32]),
       deliver_at_ms=st.none() | st.integers(0, 2**64 - 1) | st.sampled_from([2**32 - 1, 2**32]))
def test_a_plain_payload_is_byte_for_byte_what_encode_plain_message_makes(
        message_id, subject, body, created_at_ms, deliver_at_ms):
    # Spliced for IdMaker's ids and uint64 times, packed otherwise (short, long or non-ASCII
    # ids, times below 2**32): the same bytes either way, at every bin-header boundary.
    assert (plain_payload(message_id, subject, plain_middle(subject), body, created_at_ms,
                          deliver_at_ms)
            == encode_plain_message(message_id, subject, body, created_at_ms, deliver_at_ms))


def test_splicing_is_refused_when_the_template_does_not_encode_canonically():
    # 5 packed as a uint32 (msgpack would use one byte): splicing could not reproduce it.
    payload = (b"\x84\xa1i\xa1x\xa1s\xa6orders\xa1b\xc4\x01y\xa1c\xce\x00\x00\x00\x05")
    fields = msgpack.unpackb(payload, raw=False)
    assert spliced_payloads(payload, fields, {"i": ["a"], "b": [b"z"]}) is None


def test_ids_made_in_bulk_are_the_ids_made_one_by_one_across_every_boundary():
    from sdk.send_values import IdMaker

    bulk = IdMaker()
    single = IdMaker(prefix=bulk._prefix)
    for count in (1, 254, 1, 256, 257, 1024, 3, 511, 1):
        assert bulk.many(count) == [single() for _ in range(count)]
    assert bulk() == single.next()  # one by one after a bulk call, by either name
    bulk = IdMaker(prefix=bulk._prefix, made=2**40 - 3)  # the shared head changes mid-call
    single = IdMaker(prefix=bulk._prefix, made=2**40 - 3)
    assert bulk.many(600) == [single() for _ in range(600)]
    assert len({*bulk.many(1000)}) == 1000
    assert bulk() == f"{bulk._prefix}{2**40 - 3 + 1601:016x}"


async def test_send_many_sends_the_callers_own_ids_one_per_body(meta, broker_a):
    meta.set_route("orders", [broker_a])
    async with producer(meta) as p:
        receipts = await p.send_many("orders", [b"a", b"b"], message_ids=["outbox-1", "outbox-2"])
        assert [r.message_id for r in receipts] == ["outbox-1", "outbox-2"]
        assert broker_a.stored["outbox-2"].body == b"b"
        with pytest.raises(BadRequest, match="message_ids has 1 ids for 2 bodies"):
            await p.send_many("orders", [b"a", b"b"], message_ids=["only-one"])
        with pytest.raises(BadRequest):
            await p.send_many("orders", [b"a"], message_ids=["bad id with spaces\x00"])
