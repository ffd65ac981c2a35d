"""Delivery audit: per (subject, group), was every message delivered and acked, once, in time?

A message is keyed by its ``origin_id``, so the retry copies of a chain count as the message.
It is *expected* by a group when it was offered (``produced``, or ``dispatched`` by the delay
server) as a first delivery, not cancelled, not expired (for that group, or with no group),
became deliverable (max(created_at_ms, deliver_at_ms)) no earlier than the group's start, and
the group's subscriptions select it (``spark_audit.subscriptions``: tag filters, broadcast
consumers that left). A group starts at its first event, or at the deliverable time of the
earliest message it pulled if that is earlier (it was evidently subscribed by then, e.g. a group
started at ``earliest``).

An expected chain is *settled* by the group's first ``acked`` or ``dead`` (a dead letter is an
outcome, reported by the retry audit, not a loss). It is due deadline_ms after it became
deliverable, or after its latest retry copy became deliverable (a nack restarts the clock: the
consumer asked for the retry). Then, at the horizon:

- *lost*: a server gave up on it (``gave_up``, for this group or for all; not
  ``dispatch_unrecorded`` or ``ack_unreadable``, which are no loss) and the group never settled
  it. Evidence that it is gone: reported at once, due or not.
- *overdue*: otherwise due before the horizon and not settled by its due time: still held by a
  server (the anomaly names the holder and for how long), or settled late.
- *in flight*: due at or after the horizon, not settled yet, nothing given up. A message in the
  middle of its retries is due after its latest retry copy's time, so it is in flight.

The horizon is ``horizon_ms`` (the end of the audited window) or else the latest event time, so
messages sent in the last deadline_ms of a trace are not called late.
"""

from __future__ import annotations

import re

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from spark_audit.subscriptions import RULE_TYPE, excluded_by, subscription_rules

KEY = ["subject", "group", "origin_id"]
PERCENTILE_ACCURACY = 10_000  # percentile_approx: relative rank error 1/10000
# gave_up reasons that are no evidence of a loss (tracelog.events.GIVE_UP_REASONS): a dispatch
# whose record failed, and an ack the broker could not name (spark_audit.names makes it an ack)
NOT_A_LOSS_REASONS = ("dispatch_unrecorded", "ack_unreadable")


_SQL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SQL_STRING_SAFE = re.compile(r"[A-Za-z0-9_.:#%@-]*")


def one_of(column: str, *values: str) -> Column:
    """True where ``column`` is one of ``values``: ``column.isin(*values)``, written as one SQL
    expression. The same expression (an ``In`` of string literals), but built in three py4j
    round trips instead of three per value plus the list's and the call's (about 20 for four
    values); a 10k-event audit builds these about 50 times. Names or values a SQL string could
    not hold as they are are given to ``isin``, and so are no values (always false: SQL has no
    empty ``IN ()``)."""
    if (not values or not _SQL_NAME.fullmatch(column)
            or not all(_SQL_STRING_SAFE.fullmatch(value) for value in values)):
        return F.col(column).isin(*values)
    literals = ", ".join(f"'{value}'" for value in values)
    return F.expr(f"`{column}` IN ({literals})")


def kind(*kinds: str) -> Column:
    """True for events of these kinds (``one_of``)."""
    return one_of("event", *kinds)


def group_starts(events: DataFrame) -> DataFrame:
    """(subject, group, start_ms): when each group is known to have existed (module docstring).
    One row per (subject, group): always small."""
    pulled_from = F.least(F.col("ts_ms"), F.greatest("created_at_ms", "deliver_at_ms"))
    start = F.when(kind("pulled"), pulled_from).otherwise(F.col("ts_ms"))
    return (events.where(F.col("group").isNotNull())
            .groupBy("subject", "group").agg(F.min(start).alias("start_ms")))


def group_table(events: DataFrame) -> DataFrame:
    """(subject, group, start_ms, rules): ``group_starts`` with each group's subscription rules
    (``spark_audit.subscriptions``; null for a group with none). Small."""
    return group_starts(events).join(subscription_rules(events), ["subject", "group"], "left")


_OFFER_KINDS = ("produced", "scheduled", "dispatched", "cancelled", "expired", "gave_up")
_HANDLED = ("pulled", "redelivered", "acked", "nacked", "retried", "dead")


def chain_facts(events: DataFrame, deadline_ms: int = 0) -> DataFrame:
    """One row per (subject, group, origin_id) that the group was expected to receive or touched:
    expected (module docstring), deliverable_ms, first_pull_ms, acked_ms, dead_ms (first of
    each), handled (the group pulled, acked, nacked, retried or dead-lettered a copy), retries
    (highest among those events), chain_deliver_at_ms (deliver time of the chain's latest copy)
    and given_up (a server gave up on a copy, for this group or all). ``deadline_ms`` only
    widens the window in which a tag filter can exclude a message (the subscriptions module);
    the delivery and retry audits both derive from this.

    One aggregation does it, with no join of big tables: the message-level events (no group) are
    copied to every group of their subject (a broadcast of ``group_table``) and aggregated with
    the group's own events under the same key. Every aggregation buffer is fixed-width (the
    tags and rules are only read inside a boolean)."""
    columns = ["subject", "origin_id", "msg_id", "event", "ts_ms", "created_at_ms",
               "deliver_at_ms", "retries", "tags", "reason"]
    offers = (events.where(F.col("group").isNull() & kind(*_OFFER_KINDS)).select(*columns)
              .join(F.broadcast(group_table(events)), "subject")
              .withColumn("offer", F.lit(True)))
    # Only the kinds read below: a retry copy's stored/scheduled/dispatched carry its group but
    # nothing needed here (``retried`` carries the copy's deliver time).
    touched = (events.where(F.col("group").isNotNull() & kind(*_HANDLED, "expired", "gave_up"))
               .select(*columns, "group", F.lit(None).cast("long").alias("start_ms"),
                       F.lit(None).cast(RULE_TYPE).alias("rules"),
                       F.lit(False).alias("offer")))
    ts = F.col("ts_ms")
    first_offer = F.col("offer") & (F.col("msg_id") == F.col("origin_id"))
    handled = kind(*_HANDLED)
    row_deliverable = F.coalesce(F.greatest("created_at_ms", "deliver_at_ms"), ts)
    gave_up = kind("gave_up") & ~F.coalesce(one_of("reason", *NOT_A_LOSS_REASONS),
                                             F.lit(False))
    chains = offers.unionByName(touched).groupBy(*KEY).agg(
        F.min(F.when(first_offer & kind("produced", "dispatched"), ts)).alias("offered_ms"),
        F.max(first_offer & kind("cancelled")).alias("cancelled"),
        F.max(kind("expired")).alias("expired"),  # for all groups (offer rows) or for this one
        F.max(F.when(first_offer & kind("produced", "dispatched"),
                     excluded_by(F.col("rules"), F.col("tags"), row_deliverable, deadline_ms))
              ).alias("filtered"),
        F.max(gave_up).alias("given_up"),
        F.max(F.when(first_offer, F.col("created_at_ms"))).alias("created_at_ms"),
        F.max(F.when(first_offer, F.col("deliver_at_ms"))).alias("deliver_at_ms"),
        F.max("start_ms").alias("start_ms"),
        F.min(F.when(kind("pulled"), ts)).alias("first_pull_ms"),
        F.min(F.when(kind("acked"), ts)).alias("acked_ms"),
        F.min(F.when(kind("dead"), ts)).alias("dead_ms"),
        F.max(handled).alias("handled"),
        F.max(F.when(handled, F.col("retries"))).alias("retries"),
        F.max(F.when(~F.col("offer"), F.col("deliver_at_ms"))).alias("chain_deliver_at_ms"),
    )
    deliverable = F.coalesce(F.greatest("created_at_ms", "deliver_at_ms"), F.col("offered_ms"))
    expected = (F.col("offered_ms").isNotNull() & ~F.col("cancelled") & ~F.col("expired")
                & (F.col("deliverable_ms") >= F.col("start_ms"))
                & ~F.coalesce(F.col("filtered"), F.lit(False)))
    return (chains.withColumn("deliverable_ms", F.when(F.col("offered_ms").isNotNull(),
                                                       deliverable))
            .select(*KEY, F.coalesce(expected, F.lit(False)).alias("expected"),
                    F.when(expected, F.col("deliverable_ms")).alias("deliverable_ms"),
                    "first_pull_ms", "acked_ms", "dead_ms", "handled", "retries",
                    "chain_deliver_at_ms", "given_up"))


def _judge(chains: DataFrame, deadline_ms: int, horizon_ms: Column) -> DataFrame:
    due_ms = F.greatest("deliverable_ms", "chain_deliver_at_ms") + F.lit(deadline_ms)
    settled_ms = F.least("acked_ms", "dead_ms")
    unsettled = settled_ms.isNull()
    lost = F.col("expected") & F.col("given_up") & unsettled
    # Strictly before the horizon: an ack at exactly due_ms is in time, and the horizon's own
    # millisecond may not be (an exclusive --until) or not yet be (the last event) fully seen.
    overdue = (F.col("expected") & ~F.col("lost") & (F.col("due_ms") < horizon_ms)
               & (unsettled | (settled_ms > F.col("due_ms"))))
    in_flight = F.col("expected") & ~F.col("lost") & (F.col("due_ms") >= horizon_ms) & unsettled
    held_ms = F.when(F.col("overdue"), F.coalesce(settled_ms, horizon_ms) - F.col("deliverable_ms"))
    return (chains.withColumn("due_ms", F.when(F.col("expected"), due_ms))
            .withColumn("lost", lost)
            .withColumn("overdue", overdue)
            .withColumn("in_flight", in_flight)
            .withColumn("held_ms", held_ms)
            .withColumn("latency_ms", F.col("first_pull_ms") - F.col("deliverable_ms")))


def judge_delivery(chains: DataFrame, deadline_ms: int, horizon_ms: int) -> DataFrame:
    """``chain_facts`` plus due_ms, lost, overdue, in_flight, held_ms (overdue: settled time or
    horizon minus deliverable time) and latency_ms (module docstring)."""
    return _judge(chains, deadline_ms, F.lit(horizon_ms).cast("long"))


def delivery_facts(events: DataFrame, deadline_ms: int, horizon_ms: int | None = None
                   ) -> DataFrame:
    """``judge_delivery(chain_facts(events), ...)``; the horizon defaults to the latest event
    time (a one-row aggregate joined in, so this stays lazy)."""
    chains = chain_facts(events, deadline_ms)
    if horizon_ms is not None:
        return judge_delivery(chains, deadline_ms, horizon_ms)
    latest = events.agg(F.max("ts_ms").alias("_horizon_ms"))
    return _judge(chains.crossJoin(latest), deadline_ms, F.col("_horizon_ms")).drop("_horizon_ms")


def duplicate_pulls(events: DataFrame) -> DataFrame:
    """(subject, group, msg_id, origin_id, pulls): message ids a group pulled more than once."""
    return (events.where(kind("pulled") & F.col("group").isNotNull())
            # origin_id is a function of msg_id; grouping by it keeps every aggregation buffer
            # fixed-width (a string buffer such as first() forces a slower sort aggregation).
            .groupBy("subject", "group", "msg_id", "origin_id")
            .agg(F.count(F.lit(1)).alias("pulls"))
            .where(F.col("pulls") > 1))


def summarize_delivery(facts: DataFrame, duplicates: DataFrame) -> DataFrame:
    """Per (subject, group) counts and first-pull latency percentiles (percentile_approx)."""
    latency = F.percentile_approx("latency_ms", [0.5, 0.99], PERCENTILE_ACCURACY)
    per_group = facts.groupBy("subject", "group").agg(
        F.count(F.when(F.col("expected"), 1)).alias("produced"),
        F.count("first_pull_ms").alias("delivered"),
        F.count("acked_ms").alias("acked"),
        F.count(F.when(F.col("lost"), 1)).alias("lost"),
        F.count(F.when(F.col("overdue"), 1)).alias("overdue"),
        F.count(F.when(F.col("in_flight"), 1)).alias("in_flight"),
        latency.alias("latency"),
    )
    duplicated = duplicates.groupBy("subject", "group").agg(F.count(F.lit(1)).alias("duplicated"))
    return per_group.join(duplicated, ["subject", "group"], "left").select(
        "subject", "group", "produced", "delivered", "acked", "lost", "overdue", "in_flight",
        F.coalesce(F.col("duplicated"), F.lit(0)).alias("duplicated"),
        F.col("latency")[0].alias("latency_p50_ms"), F.col("latency")[1].alias("latency_p99_ms"),
    )


def delivery_audit(events: DataFrame, deadline_ms: int, horizon_ms: int | None = None
                   ) -> DataFrame:
    """Per (subject, group): produced (expected), delivered, acked, lost, overdue, in_flight,
    duplicated, latency_p50_ms, latency_p99_ms (first pull minus deliverable time, expected
    messages)."""
    return summarize_delivery(delivery_facts(events, deadline_ms, horizon_ms),
                              duplicate_pulls(events))


def latency_values(facts: DataFrame) -> DataFrame:
    """(subject, group, latency_ms) of every expected message a group pulled (from
    ``delivery_facts``), for histograms."""
    return facts.where(F.col("expected") & F.col("latency_ms").isNotNull()).select(
        "subject", "group", "latency_ms")
