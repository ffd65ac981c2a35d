"""Delay audit: per subject, how the delay server kept time.

Counts are of distinct message ids, retry copies included (they go through the delay server
too). Lateness is the first ``dispatched`` event's ``lateness_ms`` (or ts_ms - deliver_at_ms when
absent). *Early*: a message dispatched or pulled (by any group) before its deliver_at_ms; it
must be zero. Note that dispatch and pull times come from different servers' clocks, so clock
skew between a delay server and a broker shows up here as lateness or as early pulls.
"""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from spark_audit.delivery import PERCENTILE_ACCURACY, kind

_DELAY_KINDS = ("scheduled", "dispatched", "cancelled")


def delayed_messages(events: DataFrame) -> DataFrame:
    """Per (subject, msg_id) with a deliver time or a delay-server event: scheduled, dispatched,
    cancelled (booleans), deliver_at_ms, lateness_ms, first_out_ms (first dispatch or pull),
    origin_id, early."""
    lateness = F.coalesce(F.col("lateness_ms"), F.col("ts_ms") - F.col("deliver_at_ms"))
    relevant = events.where(kind(*_DELAY_KINDS)
                            | (kind("pulled") & F.col("deliver_at_ms").isNotNull()))
    # origin_id is a function of msg_id: a key, not a first() with a string buffer (see
    # delivery.duplicate_pulls).
    per_message = relevant.groupBy("subject", "msg_id", "origin_id").agg(
        F.max(kind("scheduled")).alias("scheduled"),
        F.max(kind("dispatched")).alias("dispatched"),
        F.max(kind("cancelled")).alias("cancelled"),
        F.max("deliver_at_ms").alias("deliver_at_ms"),
        F.min_by(F.when(kind("dispatched"), lateness),
                 F.when(kind("dispatched"), F.col("ts_ms"))).alias("lateness_ms"),
        F.min(F.when(kind("dispatched", "pulled"), F.col("ts_ms"))).alias("first_out_ms"),
    )
    return per_message.withColumn(
        "early", F.coalesce(F.col("first_out_ms") < F.col("deliver_at_ms"), F.lit(False)))


def summarize_delay(delayed: DataFrame) -> DataFrame:
    """Per subject from ``delayed_messages``: scheduled, dispatched, cancelled, lateness_p50_ms,
    lateness_p99_ms, lateness_max_ms (percentile_approx), early."""
    lateness = F.percentile_approx("lateness_ms", [0.5, 0.99], PERCENTILE_ACCURACY)
    return (delayed.where(F.col("scheduled") | F.col("dispatched") | F.col("cancelled")
                          | F.col("early"))
            .groupBy("subject").agg(
                F.count(F.when(F.col("scheduled"), 1)).alias("scheduled"),
                F.count(F.when(F.col("dispatched"), 1)).alias("dispatched"),
                F.count(F.when(F.col("cancelled"), 1)).alias("cancelled"),
                lateness.alias("lateness"),
                F.max("lateness_ms").alias("lateness_max_ms"),
                F.count(F.when(F.col("early"), 1)).alias("early"))
            .select("subject", "scheduled", "dispatched", "cancelled",
                    F.col("lateness")[0].alias("lateness_p50_ms"),
                    F.col("lateness")[1].alias("lateness_p99_ms"),
                    "lateness_max_ms", "early"))


def delay_audit(events: DataFrame) -> DataFrame:
    """Per subject with delayed messages: scheduled, dispatched, cancelled, lateness_p50_ms,
    lateness_p99_ms, lateness_max_ms (percentile_approx), early."""
    return summarize_delay(delayed_messages(events))


def lateness_values(delayed: DataFrame) -> DataFrame:
    """(subject, lateness_ms) of every dispatched message (from ``delayed_messages``), for
    histograms."""
    return delayed.where(F.col("lateness_ms").isNotNull()).select("subject", "lateness_ms")
