"""spark_audit.anomalies: one row per anomalous message with its chain's ordered history."""

from __future__ import annotations

from pyspark.testing import assertDataFrameEqual

from spark_audit import anomalies
from tests.spark.scenario import DEADLINE_MS, DS, RT, T, events_frame
from tracelog.events import trace_event

HISTORY = "array<struct<ts_ms long, event string, server string, group string, consumer string, " \
          "retries int, reason string>>"
SCHEMA = f"kind string, subject string, group string, msg_id string, origin_id string, " \
         f"reason string, holder string, holder_consumer string, held_ms long, history {HISTORY}"


def test_the_scenario_has_one_anomaly_of_each_kind_with_its_history(spark, scenario):
    def h(dt, event, server=RT, group=None, consumer=None, retries=0, reason=None):
        return (T + dt, event, server, group, consumer, retries, reason)

    billing = "billing"
    none = (None, None, None, None)
    expected = spark.createDataFrame([
        # Lost: the delay server gave up on it; the give-up's server and reason.
        ("lost", "orders", billing, "m12", "m12", "dispatch_refused", DS, None, None, [
            h(300, "produced", DS), h(301, "scheduled", DS),
            h(1000, "gave_up", DS, reason="dispatch_refused")]),
        # Overdue: held by the broker that stored it, from T+10 to the horizon T+25000.
        ("overdue", "orders", billing, "m2", "m2", "held", RT, None, 24_990,
         [h(10, "produced"), h(11, "stored")]),
        ("duplicate", "orders", billing, "m3", "m3", *none, [
            h(20, "produced"), h(21, "stored"), h(30, "pulled", group=billing, consumer="c1"),
            # same millisecond: lifecycle order puts the redelivered marker first
            h(40, "redelivered", group=billing, consumer="c2"),
            h(40, "pulled", group=billing, consumer="c2"),
            h(45, "acked", group=billing, consumer="c2")]),
        ("early", "orders", None, "m4", "m4", *none, [
            h(50, "produced", DS), h(51, "scheduled", DS), h(990, "dispatched", DS),
            h(990, "stored"), h(995, "pulled", group=billing, consumer="c1"),
            h(996, "acked", group=billing, consumer="c1")]),
        ("dead", "orders", billing, "m6.r2", "m6", *none, [
            h(100, "produced"), h(101, "stored"), h(110, "pulled", group=billing, consumer="c1"),
            h(111, "nacked", group=billing, consumer="c1"),
            h(112, "retried", group=billing, retries=1),
            h(113, "scheduled", DS, group=billing, retries=1),
            h(201, "dispatched", DS, group=billing, retries=1),
            h(201, "stored", group=billing, retries=1),
            h(205, "pulled", group=billing, consumer="c1", retries=1),
            h(206, "nacked", group=billing, consumer="c1", retries=1),
            h(207, "dead", group=billing, retries=2)]),
    ], SCHEMA)
    assertDataFrameEqual(anomalies(scenario, DEADLINE_MS), expected)


def test_an_overdue_message_a_consumer_holds_names_the_consumer_and_the_broker(spark):
    def e(kind, dt, msg_id, **fields):
        return {**trace_event(kind, ts_ms=T + dt, msg_id=msg_id, subject="s",
                              created_at_ms=T + (dt if msg_id == "end" else 0), **fields),
                "server": RT}

    events = events_frame(spark, [e("produced", 0, "x"), e("stored", 1, "x"),
                                  e("pulled", 5, "x", group="g", consumer="c9"),
                                  e("produced", 1_000, "end")])
    (row,) = anomalies(events, deadline_ms=100).collect()
    assert (row.kind, row.msg_id, row.reason, row.holder, row.holder_consumer, row.held_ms) == (
        "overdue", "x", "held", RT, "c9", 1_000)


def test_a_clean_trace_has_no_anomalies(spark, scenario):
    clean = scenario.where(~scenario.msg_id.isin("m2", "m3", "m4", "m6", "m6.r1", "m6.r2",
                                                  "m12"))
    assert anomalies(clean, DEADLINE_MS).count() == 0


def test_a_handed_message_is_held_by_the_broker_group_it_was_handed_to(spark):
    """The delay server handed both ahead of their due time (``handed``, reason = the group):
    the one that group made visible and was acked is no anomaly; the one it never made visible
    is overdue and held by that group, not by the delay server."""
    held_by = "realtime:rt-7"

    def e(kind, dt, msg_id, server=DS, **fields):
        return {**trace_event(kind, ts_ms=T + dt, msg_id=msg_id, subject="s",
                              created_at_ms=T, deliver_at_ms=T + 3_000, **fields),
                "server": server}

    def handed(msg_id):
        return [e("produced", 0, msg_id), e("scheduled", 1, msg_id),
                e("handed", 10, msg_id, reason=held_by)]

    events = events_frame(spark, [
        *handed("kept"), e("stored", 3_000, "kept", RT), e("dispatched", 3_000, "kept", RT),
        e("pulled", 3_002, "kept", RT, group="g", consumer="c"),
        e("acked", 3_003, "kept", RT, group="g", consumer="c"),
        *handed("lost"),
        {**trace_event("produced", ts_ms=T + 9_000, msg_id="end", subject="s",
                       created_at_ms=T + 9_000), "server": RT}])
    rows = [(r.kind, r.msg_id, r.reason, r.holder) for r in anomalies(
        events, deadline_ms=1_000).collect()]
    assert rows == [("overdue", "lost", "held", held_by)]
