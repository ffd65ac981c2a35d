"""Retry audit: how many retries each message needed, per (subject, group).

The distribution is a rows-per-count table, not a column per count: the retry limit is
configurable per group (16 by default), so a column per count would give the output a schema
that changes with the data; a long table is stable, filters and sums naturally, and Parquet
stores it compactly. ``retry_summary`` rolls it up to one row per (subject, group).

A chain (origin_id) counts for a group when the group pulled, acked, nacked, retried or
dead-lettered any copy of it; its retry count is the highest ``retries`` among those events.
"""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from spark_audit.delivery import chain_facts


def retry_distribution(chains: DataFrame) -> DataFrame:
    """``retry_audit`` from ``delivery.chain_facts`` (the chains the group handled)."""
    acked, dead = F.col("acked_ms").isNotNull(), F.col("dead_ms").isNotNull()
    return chains.where(F.col("handled")).groupBy("subject", "group", "retries").agg(
        F.count(F.lit(1)).alias("messages"),
        F.count(F.when(acked & ~dead, 1)).alias("acked"),
        F.count(F.when(dead, 1)).alias("dead"))


def retry_audit(events: DataFrame) -> DataFrame:
    """Per (subject, group, retries): messages (chains that reached exactly this many retries),
    acked (of those, acked and never dead-lettered), dead (dead-lettered)."""
    return retry_distribution(chain_facts(events))


def retry_summary(retry_table: DataFrame) -> DataFrame:
    """Per (subject, group) from ``retry_audit``: messages, retried (retries > 0), dead,
    succeeded_after_retries (acked with retries > 0, not dead), max_retries."""
    retried = F.col("retries") > 0
    return retry_table.groupBy("subject", "group").agg(
        F.sum("messages").alias("messages"),
        F.coalesce(F.sum(F.when(retried, F.col("messages"))), F.lit(0)).alias("retried"),
        F.sum("dead").alias("dead"),
        F.coalesce(F.sum(F.when(retried, F.col("acked"))), F.lit(0))
        .alias("succeeded_after_retries"),
        F.max("retries").alias("max_retries"))
