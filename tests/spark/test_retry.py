"""spark_audit.retry: retries reached per origin message, dead letters, success after retries."""

from __future__ import annotations

from pyspark.testing import assertDataFrameEqual

from spark_audit import retry_audit, retry_summary

RETRY_SCHEMA = "subject string, group string, retries int, messages long, acked long, dead long"


def test_the_scenario_has_one_chain_dead_after_two_retries_and_one_acked_after_one(
        spark, scenario):
    expected = spark.createDataFrame([
        ("orders", "billing", 0, 5, 5, 0),  # m1 m3 m4 m5 m10
        ("orders", "billing", 1, 1, 1, 0),  # m7 -> m7.r1 acked
        ("orders", "billing", 2, 1, 0, 1),  # m6 -> m6.r1 -> dead copy m6.r2
        ("orders", "search", 0, 2, 2, 0),  # m5 m10
    ], RETRY_SCHEMA)
    assertDataFrameEqual(retry_audit(scenario), expected)


def test_the_summary_rolls_the_distribution_up_per_group(spark):
    table = spark.createDataFrame([
        ("s", "g", 0, 10, 9, 0),
        ("s", "g", 1, 4, 3, 0),
        ("s", "g", 3, 2, 0, 2),
        ("s", "h", 0, 1, 1, 0),
    ], RETRY_SCHEMA)
    expected = spark.createDataFrame([("s", "g", 16, 6, 2, 3, 3), ("s", "h", 1, 0, 0, 0, 0)],
                                     "subject string, group string, messages long, retried long, "
                                     "dead long, succeeded_after_retries long, max_retries int")
    assertDataFrameEqual(retry_summary(table), expected)
