"""Power-of-two histograms of a millisecond column, for the report's text charts.

Buckets: every negative value in one bucket (hi_ms 0, lo_ms null), 0 in [0, 1), then
[1, 2), [2, 4), [4, 8)... A power-of-two scale keeps a 2 ms p50 and a 30 s tail on one chart.
"""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F


def histogram(values: DataFrame, column: str) -> DataFrame:
    """(lo_ms, hi_ms, count) for the non-null values of ``column``, one row per non-empty bucket:
    lo_ms <= value < hi_ms (lo_ms null for the negative bucket)."""
    value = F.col(column)
    # log2 and pow in double precision are exact at powers of two, and ms values are < 2^53.
    exponent = F.when(value >= 1, F.floor(F.log2(value)).cast("int"))
    lo = (F.when(value < 0, F.lit(None))
          .when(value == 0, F.lit(0))
          .otherwise(F.pow(F.lit(2), exponent)))
    hi = (F.when(value < 0, F.lit(0))
          .when(value == 0, F.lit(1))
          .otherwise(F.pow(F.lit(2), exponent + 1)))
    return (values.where(value.isNotNull())
            .select(lo.cast("long").alias("lo_ms"), hi.cast("long").alias("hi_ms"))
            .groupBy("lo_ms", "hi_ms").agg(F.count(F.lit(1)).alias("count")))
