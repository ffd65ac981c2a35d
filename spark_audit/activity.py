"""What happened when: the give-ups per reason, and a timeline of deliveries, redeliveries and
retries for the report's chart.

``give_ups``: one row per (subject, group, reason, server) with the number of ``gave_up``
events; every give-up is listed, including those that are no loss (``dispatch_unrecorded``) and
those the audit could not attach to a message (an ``ack_unreadable`` whose ``stored`` line is not
in the trace).

``timeline``: counts of ``pulled`` (every hand-out, redeliveries included), ``redelivered``
and ``retried`` events per time bucket. ``timeline_bucket_ms`` picks a round bucket width that
gives at most TIMELINE_BUCKETS_MAX buckets over the trace's span.
"""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from spark_audit.delivery import kind

TIMELINE_KINDS = ("pulled", "redelivered", "retried")
TIMELINE_BUCKETS_MAX = 240
# Round widths to choose from, smallest first: 1 s ... 1 day.
_WIDTHS_MS = (1_000, 2_000, 5_000, 10_000, 15_000, 30_000, 60_000, 120_000, 300_000, 600_000,
              900_000, 1_800_000, 3_600_000, 7_200_000, 10_800_000, 21_600_000, 43_200_000,
              86_400_000)


def give_ups(events: DataFrame) -> DataFrame:
    """(subject, group, reason, server, messages): ``gave_up`` events per kind of give-up."""
    return (events.where(F.col("event") == "gave_up")
            .groupBy("subject", "group", "reason", "server")
            .agg(F.count(F.lit(1)).alias("messages")))


def timeline_bucket_ms(first_ms: int, last_ms: int) -> int:
    """The smallest round width that covers [first_ms, last_ms] in at most
    TIMELINE_BUCKETS_MAX buckets (whole days beyond the table)."""
    span_ms = max(0, last_ms - first_ms) + 1
    for width in _WIDTHS_MS:
        if -(-span_ms // width) <= TIMELINE_BUCKETS_MAX:
            return width
    days = -(-span_ms // (_WIDTHS_MS[-1] * TIMELINE_BUCKETS_MAX))
    return _WIDTHS_MS[-1] * days


def timeline(events: DataFrame, bucket_ms: int) -> DataFrame:
    """(start_ms, event, count): TIMELINE_KINDS events per bucket of ``bucket_ms`` (buckets
    start at multiples of it since the epoch)."""
    start = (F.floor(F.col("ts_ms") / F.lit(bucket_ms)) * F.lit(bucket_ms)).cast("long")
    return (events.where(kind(*TIMELINE_KINDS))
            .groupBy(start.alias("start_ms"), "event").agg(F.count(F.lit(1)).alias("count")))
