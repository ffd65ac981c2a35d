"""realtime.tracing.BrokerTracer: the acked events an ack gives, whatever the shape of its ranges,
and the members remembered from a store for the first pull."""

from __future__ import annotations

import pytest

from realtime.tracing import RECENT_PER_SUBJECT_MAX, RECENT_SUBJECTS_MAX, BrokerTracer
from sdk.message import Message, encode_message
from sdk.send_check import Checked
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


def checked(msg_id: str, subject: str = "orders") -> Checked:
    return Checked(msg_id, subject, (), None, None, T0_MS, 0, None)


def test_a_message_pulled_soon_after_it_was_stored_is_traced_without_decoding_its_payload(
        tmp_path):
    writer = TraceWriter(tmp_path, "realtime:rt", clock_ms=lambda: T0_MS, background=False)
    tracer = BrokerTracer(writer)
    tracer.stored([(checked("m0"), 0), (checked("m1"), 1)], T0_MS)
    # Unreadable payloads: only the members remembered at store time can name the messages.
    garbage = [{"payload": b"\xc1", "pull_seq": i, "redelivered": 0} for i in range(2)]
    tracer.pulled("orders", "billing", "c1", garbage, T0_MS + 1, [0, 1])
    tracer.pulled("orders", "search", "c2", garbage, T0_MS + 1, [0, 1])  # taken: decodes, skips
    writer.close()
    pulled = [(e["msg_id"], e["group"]) for e in read_events([tmp_path]) if e["event"] == "pulled"]
    assert pulled == [("m0", "billing"), ("m1", "billing")]


def test_the_recently_stored_members_stay_within_their_bounds(tmp_path):
    tracer = BrokerTracer(TraceWriter(tmp_path, "realtime:rt", background=False))
    tracer.stored([(checked(f"m{i}"), i) for i in range(3 * RECENT_PER_SUBJECT_MAX)], T0_MS)
    for s in range(RECENT_SUBJECTS_MAX + 5):
        tracer.stored([(checked("x", f"s{s}"), 0)], T0_MS)
    assert len(tracer._recent["orders"]) == RECENT_PER_SUBJECT_MAX
    assert min(tracer._recent["orders"]) == 2 * RECENT_PER_SUBJECT_MAX
    assert len(tracer._recent) == RECENT_SUBJECTS_MAX
