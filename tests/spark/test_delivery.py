"""spark_audit.delivery: per (subject, group) delivered, acked, lost, duplicated, latency."""

from __future__ import annotations

import re

from pyspark.sql import functions as F
from pyspark.testing import assertDataFrameEqual

from spark_audit import delivery_audit
from spark_audit.delivery import one_of
from tests.spark.scenario import DEADLINE_MS, T, events_frame, trace_event
from tracelog.events import subscription_event

DELIVERY_SCHEMA = ("subject string, group string, produced long, delivered long, acked long, "
                   "lost long, overdue long, in_flight long, duplicated long, "
                   "latency_p50_ms long, latency_p99_ms long")


def test_the_scenario_finds_the_lost_overdue_and_duplicate_messages_and_only_those(spark,
                                                                                 scenario):
    # billing expects m1-m7, m9, m10, m12 (m8 cancelled, m11 expired): m12 lost (its dispatch
    # was refused), m2 overdue (the broker holds it), m9 in flight, m3 pulled twice; m6 ended
    # dead (not lost), m7 succeeded after a retry. search started at m5's deliver time, so of
    # the older messages none is owed to it.
    # Latencies: billing -5 (m4, early) 3 5 10 10 10 30; search 5 20.
    expected = spark.createDataFrame([
        ("orders", "billing", 10, 7, 6, 1, 1, 1, 1, 10, 30),
        ("orders", "search", 3, 2, 2, 0, 0, 1, 0, 5, 20),
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
    return [tuple(r) for r in df.select("group", "produced", "acked", "lost", "overdue",
                                        "in_flight").orderBy("group").collect()]


def test_an_ack_after_the_deadline_counts_as_overdue(spark):
    events = events_frame(spark, [*_message("a", 0, 100), *_message("b", 0, 101),
                                  *_message("end", 500)])
    # a acked exactly at its deadline, b 1 ms after; "end" is still in flight.
    assert _counts(delivery_audit(events, deadline_ms=100)) == [("g", 3, 2, 0, 1, 1)]


def test_the_deadline_runs_from_the_deliver_time_of_a_delayed_message(spark):
    events = events_frame(spark, [*_message("a", 0, 1_050, deliver_at_dt=1_000),
                                  *_message("end", 5_000)])
    assert _counts(delivery_audit(events, deadline_ms=100)) == [("g", 2, 1, 0, 0, 1)]


def test_a_message_due_after_the_horizon_is_in_flight_not_overdue(spark):
    events = events_frame(spark, [*_message("first", 0, 10), *_message("a", 100)])
    assert _counts(delivery_audit(events, deadline_ms=1_000)) == [("g", 2, 1, 0, 0, 1)]
    # a is due at T+1100: in flight while the horizon is not past it, overdue once it is.
    assert _counts(delivery_audit(events, deadline_ms=1_000, horizon_ms=T + 1_100)) == [
        ("g", 2, 1, 0, 0, 1)]
    assert _counts(delivery_audit(events, deadline_ms=1_000, horizon_ms=T + 1_101)) == [
        ("g", 2, 1, 0, 1, 0)]


def test_a_group_is_not_expected_to_receive_messages_from_before_it_started(spark):
    events = events_frame(spark, [*_message("old", 0, 10, group="early"),
                                  *_message("new", 1_000, 1_010, group="early"),
                                  *_message("new", 1_000, 1_020, group="late")[1:]])
    assert _counts(delivery_audit(events, deadline_ms=100)) == [
        ("early", 2, 2, 0, 0, 0), ("late", 1, 1, 0, 0, 0)]


def test_an_expired_message_is_not_expected(spark):
    expired = trace_event("expired", ts_ms=T + 5, msg_id="x", subject="s")
    events = events_frame(spark, [*_message("a", 0, 10), *_message("x", 1), expired,
                                  *_message("end", 10_000)])
    assert _counts(delivery_audit(events, deadline_ms=100)) == [("g", 2, 1, 0, 0, 1)]


def _tagged(msg_id, produced_dt, tags, ack_dt=None, group="g"):
    events = _message(msg_id, produced_dt, ack_dt, group=group)
    events[0]["tags"] = list(tags)
    return events


def _subscription(kind, dt, group="g", consumer="c", tags=(), reason=None):
    return subscription_event(kind, ts_ms=T + dt, subject="s", group=group, consumer=consumer,
                              tags=tags, reason=reason)


def test_a_group_expects_only_what_its_tag_filter_selects(spark):
    events = events_frame(spark, [
        _subscription("subscribed", 0, tags=["vip"]),
        *_tagged("vip", 10, ["vip", "eu"], 20), *_tagged("plain", 11, ["eu"]),
        *_message("untagged", 12), *_message("end", 10_000)])
    # "plain" and "untagged" were never delivered: the filter excluded them, nothing is owed.
    assert _counts(delivery_audit(events, deadline_ms=100)) == [("g", 1, 1, 0, 0, 0)]


def test_a_filter_excludes_what_became_deliverable_while_it_was_in_force_or_within_a_deadline(
        spark):
    events = events_frame(spark, [
        _subscription("subscribed", 0),  # everything
        *_message("before", 100, 110),
        *_message("at-the-change", 850),  # its deadline reaches the filter: excluded
        _subscription("subscribed", 1_000, tags=["vip"]),
        *_message("while", 1_100),
        _subscription("subscribed", 2_000),  # everything again
        *_message("after", 2_100),  # owed and never acked: overdue
        *_message("end", 10_000)])
    assert _counts(delivery_audit(events, deadline_ms=200)) == [("g", 3, 1, 0, 1, 1)]


def test_a_broadcast_consumer_that_left_is_owed_nothing_until_it_subscribes_again(spark):
    b = "bc#b1"
    events = events_frame(spark, [
        _subscription("subscribed", 0, group=b, consumer="b1"),
        *_message("while-in", 100, 110, group=b),
        _subscription("unsubscribed", 200, group=b, consumer="b1", reason="left"),
        *_message("while-away", 300),
        _subscription("subscribed", 1_000, group=b, consumer="b1"),
        *_message("back", 1_100, 1_120, group=b),
        *_message("end", 10_000)])
    assert _counts(delivery_audit(events, deadline_ms=100)) == [(b, 3, 2, 0, 0, 1)]
    # A shared group outlives its consumers: what it did not take while none was there is owed.
    shared = events_frame(spark, [
        _subscription("subscribed", 0), *_message("a", 100, 110),
        _subscription("unsubscribed", 200, reason="left"), *_message("b", 300),
        *_message("end", 10_000)])
    assert _counts(delivery_audit(shared, deadline_ms=100)) == [("g", 3, 1, 0, 1, 1)]


def test_a_message_a_server_gave_up_on_is_lost_unless_the_group_settled_it(spark):
    def gave_up(msg_id, dt, reason, group=None):
        return trace_event("gave_up", ts_ms=T + dt, msg_id=msg_id, subject="s", group=group,
                           reason=reason)

    events = events_frame(spark, [
        _subscription("subscribed", 0),
        *_message("refused", 1), gave_up("refused", 5, "dispatch_refused"),
        *_message("unreadable", 2), gave_up("unreadable", 6, "redelivery_unreadable", "g"),
        *_message("other-group", 3, 13), gave_up("other-group", 7, "redelivery_unreadable", "h"),
        *_message("unrecorded", 4), gave_up("unrecorded", 8, "dispatch_unrecorded"),
        *_message("recorded", 5, 20), gave_up("recorded", 9, "dispatch_unrecorded"),
        *_message("end", 10_000)])
    # Lost at once, due or not; an unrecorded dispatch is no loss (overdue when never acked).
    # Group h exists from its give-up at T+7: it is owed only "end".
    assert _counts(delivery_audit(events, deadline_ms=100)) == [
        ("g", 6, 2, 2, 1, 1), ("h", 1, 0, 0, 0, 1)]
    assert _counts(delivery_audit(events, deadline_ms=100, horizon_ms=T + 50)) == [
        ("g", 6, 2, 2, 0, 2), ("h", 1, 0, 0, 0, 1)]


def test_a_message_in_the_middle_of_its_retries_is_neither_lost_nor_overdue(spark):
    copy = dict(msg_id="m.r1", origin_id="m", subject="s", group="g", retries=1,
                created_at_ms=T + 50, deliver_at_ms=T + 5_000)
    events = events_frame(spark, [
        *_message("m", 0),
        trace_event("pulled", ts_ms=T + 40, msg_id="m", subject="s", group="g", consumer="c",
                    created_at_ms=T),
        trace_event("nacked", ts_ms=T + 50, msg_id="m", subject="s", group="g", consumer="c",
                    created_at_ms=T),
        trace_event("retried", ts_ms=T + 50, **copy),
        *_message("end", 1_000)])
    assert _counts(delivery_audit(events, deadline_ms=100)) == [("g", 2, 0, 0, 0, 2)]


def _plan(df) -> str:
    return re.sub(r"#\d+L?", "#", df._jdf.queryExecution().analyzed().toString())


def test_one_of_is_the_same_expression_as_isin_and_quotes_what_sql_cannot_hold(spark,
                                                                                 scenario):
    kinds = ("pulled", "acked", "gave_up")
    assert _plan(scenario.where(one_of("event", *kinds))) == _plan(
        scenario.where(F.col("event").isin(*kinds)))
    assertDataFrameEqual(scenario.where(one_of("event", *kinds)),
                         scenario.where(F.col("event").isin(*kinds)))
    # A value with a quote (or a name SQL would need quoted) is given to isin as it is.
    frame = spark.createDataFrame([("it's",), ("its",)], "v string")
    assert [row.v for row in frame.where(one_of("v", "it's")).collect()] == ["it's"]


def test_one_of_no_values_is_always_false_as_isin_of_none_is(spark):
    frame = spark.createDataFrame([("a",), (None,)], "event string")
    assert frame.where(F.col("event").isin()).count() == 0
    assert frame.where(one_of("event")).count() == 0
    assert frame.where(~one_of("event")).count() == frame.where(~F.col("event").isin()).count()
