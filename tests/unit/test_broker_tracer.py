"""realtime.tracing.BrokerTracer: which acked events an ack gives, whatever the shape of its ranges."""

from __future__ import annotations

import pytest

from realtime.tracing import BrokerTracer
from sdk.message import Message, encode_message
from sdk.trace import TraceWriter, read_events

T0_MS = 1_767_225_600_000


def pulled_entries(count: int) -> list[dict]:
    return [{"payload": encode_message(Message.create("orders", b"x", now_ms=T0_MS, id=f"m{i}")),
             "pull_seq": i, "redelivered": 0} for i in range(count)]


@pytest.mark.parametrize("ranges, acked", [
    ([(2, 4)], ["m2", "m3", "m4"]),  # narrow: walks the sequences
    ([(7, 7), (0, 1), (1, 2)], ["m0", "m1", "m2", "m7"]),  # overlapping: each acked once
    ([(0, 99)], [f"m{i}" for i in range(10)]),  # wide: walks the holdings
    ([(5, 3), (20, 30)], []),  # empty or outside what is held
])
def test_an_ack_traces_exactly_the_held_entries_in_its_ranges_once_each(tmp_path, ranges,
                                                                         acked):
    writer = TraceWriter(tmp_path, "realtime:rt", clock_ms=lambda: T0_MS, background=False)
    tracer = BrokerTracer(writer)
    tracer.pulled("orders", "billing", "c1", pulled_entries(10), T0_MS + 1)
    tracer.held_before_restart("orders", "billing", "c1", {100: 55, 101: 56})

    assert tracer.acked("orders", "billing", "c1", ranges, T0_MS + 2) == []
    assert tracer.acked("orders", "billing", "c1", [(101, 101)], T0_MS + 3) == [56]
    writer.close()
    events = [e for e in read_events([tmp_path]) if e["event"] == "acked"]
    assert [e["msg_id"] for e in events] == acked
    assert all((e["group"], e["consumer"], e["ts_ms"]) == ("billing", "c1", T0_MS + 2)
               for e in events)
