"""spark_audit.anomalies: one row per anomalous message with its chain's ordered history."""

from __future__ import annotations

from pyspark.testing import assertDataFrameEqual

from spark_audit import anomalies
from tests.spark.scenario import DEADLINE_MS, DS, RT, T

HISTORY = "array<struct<ts_ms long, event string, server string, group string, consumer string, " \
          "retries int>>"
SCHEMA = f"kind string, subject string, group string, msg_id string, origin_id string, " \
         f"history {HISTORY}"


def test_the_scenario_has_one_anomaly_of_each_kind_with_its_history(spark, scenario):
    def h(dt, event, server=RT, group=None, consumer=None, retries=0):
        return (T + dt, event, server, group, consumer, retries)

    billing = "billing"
    expected = spark.createDataFrame([
        ("lost", "orders", billing, "m2", "m2", [h(10, "produced"), h(11, "stored")]),
        ("duplicate", "orders", billing, "m3", "m3", [
            h(20, "produced"), h(21, "stored"), h(30, "pulled", group=billing, consumer="c1"),
            # same millisecond: lifecycle order puts the redelivered marker first
            h(40, "redelivered", group=billing, consumer="c2"),
            h(40, "pulled", group=billing, consumer="c2"),
            h(45, "acked", group=billing, consumer="c2")]),
        ("early", "orders", None, "m4", "m4", [
            h(50, "produced", DS), h(51, "scheduled", DS), h(990, "dispatched", DS),
            h(990, "stored"), h(995, "pulled", group=billing, consumer="c1"),
            h(996, "acked", group=billing, consumer="c1")]),
        ("dead", "orders", billing, "m6.r2", "m6", [
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


def test_a_clean_trace_has_no_anomalies(spark, scenario):
    clean = scenario.where(~scenario.msg_id.isin("m2", "m3", "m4", "m6", "m6.r1", "m6.r2"))
    assert anomalies(clean, DEADLINE_MS).count() == 0
