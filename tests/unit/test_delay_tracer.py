"""delayserver.tracing.DelayTracer: a producer's own delayed message costs one scheduled line,
flagged produced, that reads as produced then scheduled."""

from __future__ import annotations

import json

from delayserver.tracing import DelayTracer
from sdk.message import Message, encode_message
from sdk.trace import TraceWriter, read_events

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
