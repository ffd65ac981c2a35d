"""spark_audit.delivery: per (subject, group) delivered, acked, lost, duplicated, latency."""

from __future__ import annotations

from pyspark.testing import assertDataFrameEqual

from spark_audit import delivery_audit
from tests.spark.scenario import DEADLINE_MS, T, events_frame, trace_event

DELIVERY_SCHEMA = ("subject string, group string, produced long, delivered long, acked long, "
                   "lost long, in_flight long, duplicated long, latency_p50_ms long, "
                   "latency_p99_ms long")


def test_the_scenario_finds_the_lost_and_duplicate_message_and_only_those(spark, scenario):
    # billing expects m1-m7, m9, m10 (m8 cancelled, m11 expired): m2 lost, m9 in flight, m3
    # pulled twice; m6 ended dead (not lost), m7 succeeded after a retry. search started at
    # m5's deliver time, so of the older messages none is lost for it.
    # Latencies: billing -5 (m4, early) 3 5 10 10 10 30; search 5 20.
    expected = spark.createDataFrame([
        ("orders", "billing", 9, 7, 6, 1, 1, 1, 10, 30),
        ("orders", "search", 3, 2, 2, 0, 1, 0, 5, 20),
    ], DELIVERY_SCHEMA)
    assertDataFrameEqual(delivery_audit(scenario, DEADLINE_MS), expected)


def _message(msg_id, produced_dt, ack_dt=None, *, group="g", deliver_at_dt=None):
    created = T + produced_dt
    deliver_at = None if deliver_at_dt is None else T + deliver_at_dt
    events = [trace_event("produced", ts_ms=created, msg_id=msg_id, subject="s",
                          created_at_ms=created, deliver_at_ms=deliver_at)]
    if ack_dt is not None:
        for kind, dt in (("pulled", ack_dt - 1), ("acked", ack_dt)):
            events.append(trace_event(kind, ts_ms=T + dt, msg_id=msg_id, subject="s",
                                      group=group, consumer="c", created_at_ms=created,
                                      deliver_at_ms=deliver_at))
    return events


def _counts(df):
    return [tuple(r) for r in df.select("group", "produced", "acked", "lost", "in_flight")
            .orderBy("group").collect()]


def test_an_ack_after_the_deadline_counts_as_lost(spark):
    events = events_frame(spark, [*_message("a", 0, 100), *_message("b", 0, 101),
                                  *_message("end", 500)])
    # a acked exactly at its deadline, b 1 ms after; "end" is still in flight.
    assert _counts(delivery_audit(events, deadline_ms=100)) == [("g", 3, 2, 1, 1)]


def test_the_deadline_runs_from_the_deliver_time_of_a_delayed_message(spark):
    events = events_frame(spark, [*_message("a", 0, 1_050, deliver_at_dt=1_000),
                                  *_message("end", 5_000)])
    assert _counts(delivery_audit(events, deadline_ms=100)) == [("g", 2, 1, 0, 1)]


def test_a_message_due_after_the_horizon_is_in_flight_not_lost(spark):
    events = events_frame(spark, [*_message("first", 0, 10), *_message("a", 100)])
    assert _counts(delivery_audit(events, deadline_ms=1_000)) == [("g", 2, 1, 0, 1)]
    # a is due at T+1100: in flight while the horizon is not past it, lost once it is.
    assert _counts(delivery_audit(events, deadline_ms=1_000, horizon_ms=T + 1_100)) == [
        ("g", 2, 1, 0, 1)]
    assert _counts(delivery_audit(events, deadline_ms=1_000, horizon_ms=T + 1_101)) == [
        ("g", 2, 1, 1, 0)]


def test_a_group_is_not_expected_to_receive_messages_from_before_it_started(spark):
    events = events_frame(spark, [*_message("old", 0, 10, group="early"),
                                  *_message("new", 1_000, 1_010, group="early"),
                                  *_message("new", 1_000, 1_020, group="late")[1:]])
    assert _counts(delivery_audit(events, deadline_ms=100)) == [
        ("early", 2, 2, 0, 0), ("late", 1, 1, 0, 0)]


def test_an_expired_message_is_not_expected(spark):
    expired = trace_event("expired", ts_ms=T + 5, msg_id="x", subject="s")
    events = events_frame(spark, [*_message("a", 0, 10), *_message("x", 1), expired,
                                  *_message("end", 10_000)])
    assert _counts(delivery_audit(events, deadline_ms=100)) == [("g", 2, 1, 0, 1)]
