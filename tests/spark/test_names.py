"""spark_audit.names: give-ups the broker could not name, tied to the copy stored there."""

from __future__ import annotations

from pyspark.sql import functions as F

from spark_audit import load_events
from spark_audit.activity import give_ups
from spark_audit.delivery import delivery_audit
from spark_audit.names import located_give_ups, name_give_ups
from tracelog.events import LOCATOR_FIELD_NAMES, trace_event
from tracelog.writer import TraceWriter

T = 1_767_225_600_000  # 2026-01-01T00:00:00Z
RT = "realtime:rt-1"
DEADLINE_MS = 6_000


def _stored(msg_id, seq, dt):
    return {**trace_event("stored", ts_ms=T + dt, msg_id=msg_id, subject="orders",
                          created_at_ms=T + dt, produced=True), "seq": seq}


def _by_group(kind, msg_id, dt, consumer="c1", **extra):
    return trace_event(kind, ts_ms=T + dt, msg_id=msg_id, subject="orders", group="billing",
                       consumer=consumer, created_at_ms=T, **extra)


def _named_events(spark, directory):
    events = load_events(spark, [str(directory)], locators=True)
    (locations,) = events.agg(located_give_ups()).first()
    return name_give_ups(events, locations).drop(*LOCATOR_FIELD_NAMES)


_ACK_UNREADABLE_TRACE = [
    _stored("m1", 1, 0), _by_group("pulled", "m1", 1), _by_group("acked", "m1", 2),
    _stored("m2", 2, 0), _by_group("pulled", "m2", 1),
    # the broker restarted and could not read m2's record when c1 acked it
    {**_by_group("gave_up", "orders@2", 5_000, reason="ack_unreadable"), "seq": 2},
    # an ack whose stored line is not in the trace keeps the broker's name
    {**_by_group("gave_up", "orders@9", 5_000, reason="ack_unreadable"), "seq": 9},
    _stored("m3", 3, 9_000),  # moves the horizon past m2's deadline
]


def _write_ack_unreadable_trace(directory):
    with TraceWriter(directory, RT, clock_ms=lambda: T, background=False) as writer:
        for event in _ACK_UNREADABLE_TRACE:
            writer.emit(dict(event))


def test_an_ack_the_broker_could_not_name_counts_as_the_ack_of_the_copy_stored_there(
        spark, tmp_path):
    _write_ack_unreadable_trace(tmp_path)
    events = _named_events(spark, tmp_path)
    [row] = delivery_audit(events, DEADLINE_MS).collect()
    assert (row.produced, row.delivered, row.acked, row.lost, row.overdue, row.in_flight) == (
        3, 2, 2, 0, 0, 1)
    m2 = (events.where(F.col("origin_id") == "m2").orderBy("ts_ms", "event")
          .select("event", "msg_id", "group", "consumer", "reason").collect())
    assert [tuple(r) for r in m2] == [
        ("produced", "m2", None, None, None), ("stored", "m2", None, None, None),
        ("pulled", "m2", "billing", "c1", None), ("acked", "m2", "billing", "c1", None),
        ("gave_up", "m2", "billing", "c1", "ack_unreadable")]
    assert [(r.reason, r.messages) for r in give_ups(events).collect()] == [
        ("ack_unreadable", 2)]
    assert events.where(F.col("msg_id") == "orders@9").select("event").collect()[0][0] == \
        "gave_up"


def test_the_whole_audit_counts_a_named_ack_so_the_message_is_not_overdue(spark, tmp_path):
    # qmq audit plans its intermediate frames while the events are read, before it knows of any
    # give-up named by location: here it must build them again over the named events (unnamed,
    # m2 was pulled and never acked: overdue, exit code 4).
    import pyarrow.parquet as pq

    from qmq.cli import main

    _write_ack_unreadable_trace(tmp_path / "trace")
    out = tmp_path / "out"
    assert main(["audit", "--deadline-ms", str(DEADLINE_MS), "--trace-dir",
                 str(tmp_path / "trace"), "--out", str(out)]) == 0
    [row] = pq.read_table(out / "delivery").to_pylist()
    assert (row["produced"], row["acked"], row["overdue"], row["in_flight"]) == (3, 2, 0, 1)
