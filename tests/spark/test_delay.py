"""spark_audit.delay: per subject scheduled, dispatched, cancelled, lateness, early."""

from __future__ import annotations

from pyspark.testing import assertDataFrameEqual

from spark_audit import delay_audit
from tests.spark.scenario import T, events_frame, trace_event

DELAY_SCHEMA = ("subject string, scheduled long, dispatched long, cancelled long, "
                "lateness_p50_ms long, lateness_p99_ms long, lateness_max_ms long, early long")


def test_the_scenario_counts_retry_copies_and_finds_the_early_dispatch(spark, scenario):
    # Scheduled: m4 m5 m8 m12 m6.r1 m7.r1; dispatched all but m8 (cancelled) and m12 (refused),
    # lateness -10 4 1 2.
    expected = spark.createDataFrame([("orders", 6, 4, 1, 1, 4, 4, 1)], DELAY_SCHEMA)
    assertDataFrameEqual(delay_audit(scenario), expected)


def test_a_pull_before_the_deliver_time_is_early_even_after_an_on_time_dispatch(spark):
    def at(kind, dt, **fields):
        return trace_event(kind, ts_ms=T + dt, msg_id="m", subject="s", deliver_at_ms=T + 100,
                           **fields)

    events = events_frame(spark, [at("scheduled", 0), at("dispatched", 100),
                                  at("pulled", 99, group="g", consumer="c")])
    expected = spark.createDataFrame([("s", 1, 1, 0, 0, 0, 0, 1)], DELAY_SCHEMA)
    assertDataFrameEqual(delay_audit(events), expected)


def test_subjects_without_delayed_messages_have_no_row(spark):
    events = events_frame(spark, [
        trace_event("produced", ts_ms=T, msg_id="a", subject="now", created_at_ms=T),
        trace_event("pulled", ts_ms=T + 1, msg_id="a", subject="now", group="g",
                    created_at_ms=T)])
    assert delay_audit(events).count() == 0
