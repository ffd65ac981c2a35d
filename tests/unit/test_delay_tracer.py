"""delayserver.tracing.DelayTracer: a producer's own delayed message costs one scheduled line,
flagged produced, that reads as produced then scheduled."""

from __future__ import annotations

import asyncio
import json

from delayserver.tracing import DelayTracer
from wire.message import Message, encode_message
from serverkit.send_check import QuickCheck
from tracelog.reading import read_events
from tracelog.writer import TraceWriter

T0_MS = 1_767_225_600_000


def test_a_producers_delayed_message_is_one_scheduled_line_that_reads_as_produced_then_scheduled(
        tmp_path):
    writer = TraceWriter(tmp_path, "delay:d1", clock_ms=lambda: T0_MS, background=False)
    own = Message.create("orders", b"x", now_ms=T0_MS, deliver_at_ms=T0_MS + 60_000, id="m1")
    copy = Message.create("%retry%orders%billing", b"x", now_ms=T0_MS, deliver_at_ms=T0_MS + 5,
                          properties={"qmq-origin-id": "m0"}, id="m0.r1")
    copy = Message(**{**copy.__dict__, "retries": 1})
    DelayTracer(writer).scheduled([encode_message(own), encode_message(copy)], T0_MS + 3)
    writer.close()
    (path,) = tmp_path.glob("*/*.jsonl")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(line["event"], line["msg_id"], line.get("produced")) for line in lines] == [
        ("scheduled", "m1", True), ("scheduled", "m0.r1", None)]
    assert [(e["event"], e["msg_id"], e["ts_ms"]) for e in read_events([tmp_path])] == [
        ("produced", "m1", T0_MS), ("scheduled", "m1", T0_MS + 3),
        ("scheduled", "m0.r1", T0_MS + 3)]


def _lines(tmp_path, name: str, emit) -> list[str]:
    directory = tmp_path / name
    writer = TraceWriter(directory, "delay:d1", clock_ms=lambda: T0_MS, background=False)
    emit(DelayTracer(writer))
    writer.close()
    (path,) = directory.glob("*/*.jsonl")
    return path.read_text().splitlines()


def test_scheduled_lines_from_the_quick_checks_fields_equal_those_read_from_the_payloads(
        tmp_path):
    plain = Message.create("orders", b"x", now_ms=T0_MS, deliver_at_ms=T0_MS + 60_000, id="m1")
    escaped = Message.create("orders", b"y", now_ms=T0_MS + 1, deliver_at_ms=T0_MS + 7,
                             id='m"2\\x')  # its id needs escaping in JSON
    tagged = Message.create("orders", b"x", now_ms=T0_MS, deliver_at_ms=T0_MS + 60_000, id="m2",
                            properties={"k": "v"}, tags=["vip"])
    due_now = Message.create("other", b"x", now_ms=T0_MS, id="m3")
    copy = Message.create("%retry%orders%billing", b"x", now_ms=T0_MS, deliver_at_ms=T0_MS + 5,
                          properties={"qmq-origin-id": "m0"}, id="m0.r1")
    copy = Message(**{**copy.__dict__, "retries": 1})
    payloads = [encode_message(m) for m in (plain, escaped, tagged, due_now, copy)]
    check = QuickCheck()
    checks = [check.check(payload, T0_MS + 10**12) for payload in payloads]
    assert None not in checks[:3]
    # The last comes without fields (as after the full check): the tracer reads its payload.
    checks[-1] = None
    from_fields = _lines(tmp_path, "fields",
                         lambda t: t.scheduled_checked(checks, payloads, T0_MS + 3))
    from_payloads = _lines(tmp_path, "payloads", lambda t: t.scheduled(payloads, T0_MS + 3))
    assert from_fields == from_payloads and len(from_fields) == 5


def _kept_payloads() -> list[bytes]:
    own = Message.create("orders", b"x", now_ms=T0_MS, deliver_at_ms=T0_MS + 60_000, id="m1")
    tagged = Message.create("orders", b"y", now_ms=T0_MS, deliver_at_ms=T0_MS + 60_001, id="m2",
                            tags=["vip"])
    copy = Message.create("%retry%orders%billing", b"z", now_ms=T0_MS, deliver_at_ms=T0_MS + 5,
                          properties={"qmq-origin-id": "m0"}, id="m0.r1")
    copy = Message(**{**copy.__dict__, "retries": 1})
    return [encode_message(own), encode_message(tagged), encode_message(copy)]


def test_dispatched_lines_from_kept_fields_equal_those_read_from_the_payloads(tmp_path):
    payloads = _kept_payloads() + [_kept_payloads()[0]]
    checks = QuickCheck().check_many(payloads[:3], T0_MS + 10**12)

    def from_kept(tracer: DelayTracer) -> None:
        # Offset 40 is not in the window: its fields are not kept and its payload is read.
        tracer.keep([10, 20, 30, 40], checks + [checks[0]], {10, 20, 30})
        assert tracer.kept_count() == 3
        tracer.dispatched_entries([10, 20, 30, 40], payloads, T0_MS + 60_007)
        assert tracer.kept_count() == 0  # dispatched: no longer kept

    kept = _lines(tmp_path, "kept", from_kept)
    read = _lines(tmp_path, "read", lambda t: t.dispatched(payloads, T0_MS + 60_007))
    assert kept == read and len(kept) == 4
    assert [json.loads(line)["lateness_ms"] for line in kept] == [7, 6, 60_002, 7]


def test_fields_are_kept_up_to_the_limit_and_a_cancelled_messages_are_dropped(tmp_path):
    writer = TraceWriter(tmp_path, "delay:d1", clock_ms=lambda: T0_MS, background=False)
    tracer = DelayTracer(writer, kept_max=2)
    checked = QuickCheck().check(_kept_payloads()[0], T0_MS + 10**12)
    tracer.keep([1, 2, 3], [checked, checked, checked], {1, 2, 3})
    assert tracer.kept_count() == 2  # the third is read from its payload when dispatched
    tracer.drop_kept({1})  # cancelled
    tracer.keep([4], [checked], {2, 4})
    assert tracer.kept_count() == 2
    tracer.forget_kept()  # the window was built afresh (promoted, demoted)
    assert tracer.kept_count() == 0
    writer.close()


def test_nothing_is_kept_when_tracing_is_off():
    tracer = DelayTracer(None)
    tracer.keep([1], [None], {1})
    assert tracer.kept_count() == 0


def _written(directory) -> list[str]:
    return [line for path in sorted(directory.glob("*/*.jsonl"))
            for line in path.read_text().splitlines()]


async def test_deferred_scheduled_lines_wait_for_build_deferred_and_equal_the_others(tmp_path):
    payloads = _kept_payloads()
    checks = QuickCheck().check_many(payloads, T0_MS + 10**12)
    writer = TraceWriter(tmp_path / "soon", "delay:d1", clock_ms=lambda: T0_MS,
                         background=False)
    tracer = DelayTracer(writer)
    tracer.scheduled_soon(checks, payloads, T0_MS + 3)  # as the commit does, then it answers
    for _ in range(3):  # no loop callback of its own: the scheduler's placement builds them
        await asyncio.sleep(0)
    writer.flush()
    assert _written(tmp_path / "soon") == []
    tracer.build_deferred()
    writer.close()
    assert _written(tmp_path / "soon") == _lines(
        tmp_path, "now", lambda t: t.scheduled_checked(checks, payloads, T0_MS + 3))


async def test_scheduled_lines_still_waiting_are_built_by_build_deferred(tmp_path):
    payloads = _kept_payloads()
    writer = TraceWriter(tmp_path, "delay:d1", clock_ms=lambda: T0_MS, background=False)
    tracer = DelayTracer(writer)
    tracer.scheduled_soon([None] * 3, payloads, T0_MS)
    tracer.scheduled_soon([None], payloads[:1], T0_MS + 1)
    tracer.build_deferred()  # what a stop does before the trace writer closes
    writer.close()
    assert [json.loads(line)["msg_id"] for line in _written(tmp_path)] == [
        "m1", "m2", "m0.r1", "m1"]
    tracer.build_deferred()  # the loop's own call finds nothing left: no line twice
    assert tracer._deferred == []
