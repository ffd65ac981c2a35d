"""Anomalies: one row per anomalous message, with its chain's whole event history.

Kinds (and the key of a row): ``lost`` (subject, group, origin id: see spark_audit.delivery),
``duplicate`` (subject, group, msg id pulled more than once by the group), ``early`` (subject,
msg id dispatched or pulled before its deliver time; group null), ``dead`` (subject, group, the
dead-lettered copy's msg id). ``history`` is every event of the retry chain (same subject and
origin_id), all groups, ordered by time and then by lifecycle position.
"""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from spark_audit.delay import delayed_messages
from spark_audit.delivery import delivery_facts, duplicate_pulls, kind
from spark_audit.schema import HISTORY_FIELDS, LIFECYCLE_ORDER

ANOMALY_COLUMNS = ["kind", "subject", "group", "msg_id", "origin_id"]


def flagged_messages(facts: DataFrame, duplicates: DataFrame, delayed: DataFrame,
                     events: DataFrame) -> DataFrame:
    """(kind, subject, group, msg_id, origin_id) of every anomaly, without history, from
    ``delivery_facts``, ``duplicate_pulls``, ``delayed_messages`` and the events (dead)."""
    lost = facts.where(F.col("lost")).select(F.lit("lost").alias("kind"), "subject", "group",
                                             F.col("origin_id").alias("msg_id"), "origin_id")
    duplicate = duplicates.select(F.lit("duplicate").alias("kind"), "subject", "group",
                                  "msg_id", "origin_id")
    early = (delayed.where(F.col("early"))
             .select(F.lit("early").alias("kind"), "subject",
                     F.lit(None).cast("string").alias("group"), "msg_id", "origin_id"))
    dead = (events.where(kind("dead")).select(F.lit("dead").alias("kind"), "subject", "group",
                                              "msg_id", "origin_id").distinct())
    return lost.unionByName(duplicate).unionByName(early).unionByName(dead)


def chain_histories(events: DataFrame, chains: DataFrame, *, broadcast: bool = False
                    ) -> DataFrame:
    """(subject, origin_id, history) for the (subject, origin_id) pairs in ``chains``.
    ``broadcast``: ship ``chains`` to every task instead of shuffling all events to meet it (say
    so when it is known to be small: Spark cannot know before running it)."""
    order = F.create_map(*[x for i, name in enumerate(LIFECYCLE_ORDER)
                           for x in (F.lit(name), F.lit(i))])
    entry = F.struct(F.col("ts_ms"), order[F.col("event")].alias("order"),
                     *[F.col(name) for name in HISTORY_FIELDS[1:]])
    wanted = F.broadcast(chains) if broadcast else chains
    history = (events.join(wanted, ["subject", "origin_id"], "left_semi")
               .groupBy("subject", "origin_id")
               .agg(F.array_sort(F.collect_list(entry)).alias("entries")))
    return history.select("subject", "origin_id", F.transform(
        "entries", lambda e: F.struct(*[e[name].alias(name) for name in HISTORY_FIELDS])
    ).alias("history"))


def with_history(flagged: DataFrame, events: DataFrame, *, broadcast: bool = False
                 ) -> DataFrame:
    """``flagged_messages`` rows with their chain's ``history`` (``broadcast``: see
    ``chain_histories``)."""
    chains = flagged.select("subject", "origin_id").distinct()
    histories = chain_histories(events, chains, broadcast=broadcast)
    return flagged.join(histories, ["subject", "origin_id"], "left").select(
        *ANOMALY_COLUMNS, "history")


def anomalies(events: DataFrame, deadline_ms: int, horizon_ms: int | None = None) -> DataFrame:
    """kind, subject, group, msg_id, origin_id, history (array of struct ts_ms, event, server,
    group, consumer, retries)."""
    flagged = flagged_messages(delivery_facts(events, deadline_ms, horizon_ms),
                               duplicate_pulls(events), delayed_messages(events), events)
    return with_history(flagged, events)
