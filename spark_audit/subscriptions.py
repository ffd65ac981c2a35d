"""What each group's subscriptions exclude: tag filters, and broadcast consumers that left.

The broker traces a consumer's tag filter (``subscribed``, on its first pull and whenever the
filter changes) and its end (``unsubscribed``, left or expired). A group expects only what its
filters select:

- **Tag filters.** The consumers of a group share one cursor, so a pull with a filter passes
  over, for the whole group, the messages the filter excludes. A message is therefore not
  expected by a group when, at any time between it becoming deliverable and its deadline, a
  consumer of the group was subscribed with a filter that excludes it (no tag in common). A
  filter lasts from its ``subscribed`` to the consumer's next subscription event.
- **Broadcast consumers** (groups ``<group>#<consumer>``) each have their own cursor. One that
  left or expired expects nothing that became deliverable until it subscribes again; what it
  was owed before it left is still owed (the broker keeps it for the consumer's return).
- A shared group outlives its consumers: its expectation never ends.

This errs towards expecting less when filters change during a message's window (no false
alarm), and it only knows the filters of pulls it saw: a trace that begins after a consumer's
first pull knows its filter from its next change.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from tracelog.events import SUBSCRIPTION_KINDS

TIME_MAX_MS = 2**62  # "until the end of the trace" for an interval that never closes
RULE_TYPE = "array<struct<from_ms:bigint,to_ms:bigint,tags:array<string>,gap:boolean>>"


def subscription_rules(events: DataFrame) -> DataFrame:
    """(subject, group, rules): per group with a tag filter or a broadcast consumer that left,
    its exclusion rules: ``struct(from_ms, to_ms, tags, gap)``; ``gap`` true: nothing deliverable
    in [from_ms, to_ms) is expected; else a filter ``tags`` in force over [from_ms, to_ms).
    Small: a few rows per consumer."""
    order = F.when(F.col("event") == "unsubscribed", 0).otherwise(1)  # same ms: end, then start
    window = Window.partitionBy("subject", "group", "consumer").orderBy("ts_ms", order)
    changes = (events.where(F.col("event").isin(*SUBSCRIPTION_KINDS))
               .select("subject", "group", "consumer", "event", "ts_ms", "tags")
               .withColumn("to_ms", F.coalesce(F.lead("ts_ms").over(window),
                                               F.lit(TIME_MAX_MS))))
    is_filter = (F.col("event") == "subscribed") & (F.coalesce(F.size("tags"), F.lit(0)) > 0)
    is_gap = (F.col("event") == "unsubscribed") & F.col("group").contains("#")
    rule = F.struct(F.col("ts_ms").alias("from_ms"), F.col("to_ms"),
                    F.when(is_filter, F.col("tags")).alias("tags"), is_gap.alias("gap"))
    return (changes.where(is_filter | is_gap).groupBy("subject", "group")
            .agg(F.collect_list(rule).alias("rules")))


def excluded_by(rules: Column, tags: Column, deliverable_ms: Column, deadline_ms: int) -> Column:
    """True when ``rules`` (``subscription_rules``) exclude a message with ``tags``
    deliverable at ``deliverable_ms``; null rules exclude nothing (false)."""
    message_tags = F.coalesce(tags, F.array().cast("array<string>"))
    due_ms = deliverable_ms + F.lit(deadline_ms)

    def excludes(rule: Column) -> Column:
        in_gap = rule["gap"] & (deliverable_ms >= rule["from_ms"]) & (deliverable_ms < rule["to_ms"])
        filtered = (~rule["gap"] & (rule["from_ms"] <= due_ms) & (rule["to_ms"] > deliverable_ms)
                    & ~F.coalesce(F.arrays_overlap(message_tags, rule["tags"]), F.lit(False)))
        return in_gap | filtered

    return F.coalesce(F.exists(rules, excludes), F.lit(False))
