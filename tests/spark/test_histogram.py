"""spark_audit.histogram: power-of-two millisecond buckets."""

from __future__ import annotations

from pyspark.testing import assertDataFrameEqual

from spark_audit import histogram


def test_values_fall_in_power_of_two_buckets_with_negatives_and_zero_apart(spark):
    values = spark.createDataFrame([(v,) for v in (-7, -1, 0, 1, 2, 3, 4, 1023, 1024, None)],
                                   "ms long")
    expected = spark.createDataFrame([
        (None, 0, 2), (0, 1, 1), (1, 2, 1), (2, 4, 2), (4, 8, 1), (512, 1024, 1),
        (1024, 2048, 1),
    ], "lo_ms long, hi_ms long, count long")
    assertDataFrameEqual(histogram(values, "ms"), expected)
