"""sdk.send_batch: how one broker answer to a send settles the messages of several calls that
shared its batch, and which messages are resent."""

from __future__ import annotations

import asyncio

import pytest

from wire.errors import Forbidden, Internal, Overloaded
from sdk.send_batch import Batch, Call, Part, Receipt, fail_parts, settle


def stored(message_id: str) -> dict:
    return {"id": message_id, "status": "stored"}


def refused(message_id: str, code: str) -> dict:
    return {"id": message_id, "error": {"code": code, "message": f"{code} for {message_id}"}}


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def call_of(loop, count: int) -> Call:
    return Call(count, loop.create_future())


def test_a_fully_stored_batch_gives_each_call_its_receipts_in_order(loop):
    first, second = call_of(loop, 2), call_of(loop, 1)
    parts = [Part(first, 0, ["a", "b"], [b"pa", b"pb"], None),
             Part(second, 0, ["c"], [b"pc"], [5_000])]
    retry, _ = settle("orders", "rt-1", parts,
                      {"results": [stored("a"), {"id": "b", "status": "duplicate"}, stored("c")]})
    assert retry == []
    assert first.future.result() == [Receipt("a", "orders", "rt-1", "stored"),
                                     Receipt("b", "orders", "rt-1", "duplicate")]
    assert second.future.result() == [Receipt("c", "orders", "rt-1", "stored", 5_000)]
    assert second.future.result()[0].delayed


def test_only_the_retriable_failures_are_resent_and_a_refusal_fails_its_message_at_once(loop):
    call = call_of(loop, 4)
    part = Part(call, 0, ["a", "b", "c", "d"], [b"pa", b"pb", b"pc", b"pd"], [1, 2, 3, 4])
    retry, error = settle("orders", "rt-1", [part], {"results": [
        stored("a"), refused("b", "overloaded"), refused("c", "forbidden"), stored("d")]})
    assert isinstance(error, Overloaded)
    [left] = retry
    assert (left.ids, left.payloads, left.dues, left.slots) == (["b"], [b"pb"], [2], [1])
    assert not call.future.done()
    assert call.failed == 1 and isinstance(call.results[2], Forbidden)
    # The resend of "b" is stored: the call is complete, every slot in its place.
    retry, _ = settle("orders", "rt-2", retry, {"results": [stored("b")]})
    assert retry == []
    results = call.future.result()
    assert [r.message_id if isinstance(r, Receipt) else type(r) for r in results] == [
        "a", "b", Forbidden, "d"]
    assert results[1] == Receipt("b", "orders", "rt-2", "stored", 2)


def test_an_answer_that_cannot_be_matched_resends_the_whole_batch(loop):
    call = call_of(loop, 2)
    parts = [Part(call, 0, ["a"], [b"pa"], None), Part(call, 1, ["b"], [b"pb"], None)]
    retry, error = settle("orders", "rt-1", parts, {"results": [stored("a")]})
    assert retry == parts and isinstance(error, Internal)
    retry, error = settle("orders", "rt-1", parts, {"results": [stored("b"), stored("a")]})
    assert [p.ids for p in retry] == [["a"], ["b"]] and isinstance(error, Internal)
    assert not call.future.done()


def test_failing_a_batch_leaves_the_messages_already_settled_alone(loop):
    call = call_of(loop, 3)
    part = Part(call, 0, ["a", "b", "c"], [b"pa", b"pb", b"pc"], None)
    retry, _ = settle("orders", "rt-1", [part], {"results": [
        stored("a"), refused("b", "overloaded"), refused("c", "overloaded")]})
    fail_parts([part], Internal("the producer was cancelled"))
    results = call.future.result()
    assert results[0] == Receipt("a", "orders", "rt-1", "stored")
    assert [type(r) for r in results[1:]] == [Internal, Internal]
    assert call.failed == 2


def test_a_result_that_says_stored_but_carries_an_error_is_an_error(loop):
    call = call_of(loop, 2)
    part = Part(call, 0, ["a", "b"], [b"pa", b"pb"], None)
    contradictory = {**refused("b", "forbidden"), "status": "stored"}
    retry, _ = settle("orders", "rt-1", [part], {"results": [stored("a"), contradictory]})
    assert retry == []
    assert call.results[0] == Receipt("a", "orders", "rt-1", "stored")
    assert isinstance(call.results[1], Forbidden)


def test_results_that_are_not_maps_are_resent_not_crashed_on(loop):
    call = call_of(loop, 2)
    part = Part(call, 0, ["a", "b"], [b"pa", b"pb"], None)
    retry, error = settle("orders", "rt-1", [part], {"results": [stored("a"), ["b", "stored"]]})
    assert [p.ids for p in retry] == [["b"]] and isinstance(error, Internal)
    assert call.results[0] == Receipt("a", "orders", "rt-1", "stored")


def test_calls_of_one_message_each_settle_alike_whether_stored_duplicate_refused_or_mismatched(
        loop):
    calls = [call_of(loop, 1) for _ in range(5)]
    parts = [Part(call, 0, [message_id], [b"p"], [7_000 + i])
             for i, (call, message_id) in enumerate(zip(calls, "abcde"))]
    retry, error = settle("orders", "delay-1", parts, {"results": [
        {"id": "a", "status": "stored", "deliver_at_ms": 7_000},
        {"id": "b", "status": "duplicate"},
        refused("c", "forbidden"),
        refused("d", "overloaded"),
        {"id": "x", "status": "stored"},  # not e's id: e is resent, never given x's receipt
    ]})
    assert calls[0].future.result() == [Receipt("a", "orders", "delay-1", "stored", 7_000)]
    assert calls[1].future.result() == [Receipt("b", "orders", "delay-1", "duplicate", 7_001)]
    assert isinstance(calls[2].future.result()[0], Forbidden)
    assert [part.ids for part in retry] == [["d"], ["e"]]
    assert not calls[3].future.done() and not calls[4].future.done()
    assert isinstance(error, Internal)  # the last kept part's reason: results out of order


def test_a_compact_answer_settles_every_part_as_stored_with_the_due_times_sent(loop):
    first, second, third = call_of(loop, 3), call_of(loop, 1), call_of(loop, 2)
    parts = [Part(first, 0, ["a", "b", "c"], [b"pa", b"pb", b"pc"], [7, 8, 9]),
             Part(second, 0, ["d"], [b"pd"], [10]),
             Part(third, 0, ["e"], [b"pe"], None, slots=[1])]
    third.settle(0, Receipt("x", "orders", "rt-0", "stored"))
    retry, _ = settle("orders", "dg-1", parts, {"stored": 5})
    assert retry == []
    assert first.future.result() == [Receipt(i, "orders", "dg-1", "stored", due)
                                     for i, due in (("a", 7), ("b", 8), ("c", 9))]
    assert second.future.result() == [Receipt("d", "orders", "dg-1", "stored", 10)]
    assert third.future.result()[1] == Receipt("e", "orders", "dg-1", "stored")


@pytest.mark.parametrize("answer", [{"stored": 1}, {"stored": 3}, {"stored": True},
                                    {"stored": "2"}])
def test_a_compact_answer_of_another_count_resends_the_whole_batch(loop, answer):
    call = call_of(loop, 2)
    parts = [Part(call, 0, ["a", "b"], [b"pa", b"pb"], None)]
    retry, error = settle("orders", "rt-1", parts, answer)
    assert retry == parts and isinstance(error, Internal)
    assert not call.future.done()


def batch_of_singles(loop, count: int, *, with_part: Call | None = None) -> Batch:
    """A delayed batch: one part of ``with_part`` (ids p0, p1), then ``count`` single sends."""
    batch = Batch("orders", delayed=True)
    if with_part is not None:
        batch.parts.append(Part(with_part, 0, ["p0", "p1"], [b"x0", b"x1"], [10, 11]))
        batch.count += 2
    for k in range(count):
        batch.one_futures.append(loop.create_future())
        batch.one_ids.append(f"s{k}")
        batch.one_payloads.append(f"y{k}".encode())
        batch.one_dues.append(100 + k)
        batch.count += 1
    return batch


def test_a_compact_answer_settles_the_single_sends_of_a_batch_with_their_own_receipts(loop):
    call = call_of(loop, 2)
    batch = batch_of_singles(loop, 3, with_part=call)
    assert batch.payloads() == [b"x0", b"x1", b"y0", b"y1", b"y2"]
    batch.one_futures[1].cancel()  # its caller is gone: no receipt, no error
    assert batch.settle_stored("dl-1", {"stored": 5})
    assert call.future.result() == [Receipt("p0", "orders", "dl-1", "stored", 10),
                                    Receipt("p1", "orders", "dl-1", "stored", 11)]
    assert batch.one_futures[0].result() == Receipt("s0", "orders", "dl-1", "stored", 100)
    assert batch.one_futures[2].result() == Receipt("s2", "orders", "dl-1", "stored", 102)


def test_an_answer_that_is_not_all_stored_leaves_a_batch_for_settling_part_by_part(loop):
    batch = batch_of_singles(loop, 2)
    assert not batch.settle_stored("dl-1", {"stored": 1})  # a count that is not the batch's
    assert not batch.settle_stored("dl-1", {"results": [stored("s0"), stored("s1")]})
    assert not any(future.done() for future in batch.one_futures)
    # As parts, each single send is settled alone: a stored one gets its receipt, a refused
    # one its error as the result (send raises it), a retriable one is resent.
    retry, error = settle("orders", "dl-1", batch.all_parts(), {"results": [
        stored("s0"), refused("s1", "overloaded")]})
    assert batch.one_futures[0].result() == Receipt("s0", "orders", "dl-1", "stored", 100)
    assert isinstance(error, Overloaded) and [p.ids for p in retry] == [["s1"]]
    fail_parts(retry, Internal("gave up"))
    assert isinstance(batch.one_futures[1].result(), Internal)
    fail_parts(batch.all_parts(), Forbidden("too late"))  # the first outcome stays
    assert isinstance(batch.one_futures[1].result(), Internal)
