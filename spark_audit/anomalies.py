"""Anomalies: one row per anomalous message, with its chain's whole event history.

Kinds (and the key of a row): ``lost`` and ``overdue`` (subject, group, origin id: see
spark_audit.delivery), ``duplicate`` (subject, group, msg id pulled more than once by the group),
``early`` (subject, msg id dispatched or pulled before its deliver time; group null), ``dead``
(subject, group, the dead-lettered copy's msg id). ``history`` is every event of the retry chain
(same subject and origin_id), all groups, ordered by time and then by lifecycle position.

Lost and overdue rows also say why and where: ``reason`` (lost: the ``gave_up`` reason; overdue:
``held``, or ``acked late`` / ``dead late`` for one settled after its deadline), ``holder`` (the
server of the chain's last event that concerns the group: the broker or delay server that holds
it, or the one that gave up; after a ``handed`` event, the realtime broker group the delay server
handed it to, which its ``reason`` names), ``holder_consumer`` (the consumer it was last handed to, when that
was the last event) and ``held_ms`` (overdue: from deliverable until settled or the horizon).
"""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from spark_audit.delay import delayed_messages
from spark_audit.delivery import (NOT_A_LOSS_REASONS, delivery_facts, duplicate_pulls, kind,
                                   one_of)
from spark_audit.schema import HISTORY_FIELDS, LIFECYCLE_ORDER

ANOMALY_COLUMNS = ["kind", "subject", "group", "msg_id", "origin_id", "reason", "held_ms"]
KIND_ORDER = ("lost", "overdue", "early", "duplicate", "dead")  # as the report lists them


def flagged_messages(facts: DataFrame, duplicates: DataFrame, delayed: DataFrame,
                     events: DataFrame) -> DataFrame:
    """(kind, subject, group, msg_id, origin_id, reason, held_ms) of every anomaly, without
    history, from ``delivery_facts``, ``duplicate_pulls``, ``delayed_messages`` and the events
    (dead). ``reason`` of a lost row is filled from its history (``with_history``)."""
    none_string, none_long = F.lit(None).cast("string"), F.lit(None).cast("long")
    late = (F.when(F.col("acked_ms").isNotNull(), F.lit("acked late"))
            .when(F.col("dead_ms").isNotNull(), F.lit("dead late")).otherwise(F.lit("held")))
    judged = facts.where(F.col("lost") | F.col("overdue")).select(
        F.when(F.col("lost"), F.lit("lost")).otherwise(F.lit("overdue")).alias("kind"),
        "subject", "group", F.col("origin_id").alias("msg_id"), "origin_id",
        F.when(F.col("overdue"), late).alias("reason"), "held_ms")
    duplicate = duplicates.select(F.lit("duplicate").alias("kind"), "subject", "group",
                                  "msg_id", "origin_id", none_string.alias("reason"),
                                  none_long.alias("held_ms"))
    early = (delayed.where(F.col("early"))
             .select(F.lit("early").alias("kind"), "subject", none_string.alias("group"),
                     "msg_id", "origin_id", none_string.alias("reason"),
                     none_long.alias("held_ms")))
    dead = (events.where(kind("dead")).select(F.lit("dead").alias("kind"), "subject", "group",
                                              "msg_id", "origin_id", none_string.alias("reason"),
                                              none_long.alias("held_ms")).distinct())
    return judged.unionByName(duplicate).unionByName(early).unionByName(dead)


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
    ``chain_histories``), and for lost and overdue rows the reason and holder read from it
    (module docstring)."""
    chains = flagged.select("subject", "origin_id").distinct()
    histories = chain_histories(events, chains, broadcast=broadcast)
    # The chain's events that concern the row's group (its own, and those of no group).
    mine = F.filter("history", lambda e: (e["event"] != "produced")
                    & (e["group"].isNull() | (e["group"] == F.col("group"))))
    gave_up = F.filter(mine, lambda e: (e["event"] == "gave_up")
                       & ~e["reason"].isin(*NOT_A_LOSS_REASONS))
    last = F.get(mine, F.size(mine) - 1)
    judged = one_of("kind", "lost", "overdue")
    holder = (F.when(F.col("kind") == "lost", F.get(gave_up, 0)["server"])
              .when(last["event"] == "handed", last["reason"]).otherwise(last["server"]))
    return flagged.join(histories, ["subject", "origin_id"], "left").select(
        "kind", "subject", "group", "msg_id", "origin_id",
        F.when(F.col("kind") == "lost", F.get(gave_up, 0)["reason"])
        .otherwise(F.col("reason")).alias("reason"),
        F.when(judged, holder).alias("holder"),
        F.when(judged & last["event"].isin("pulled", "redelivered"), last["consumer"])
        .alias("holder_consumer"),
        "held_ms", "history")


def anomalies(events: DataFrame, deadline_ms: int, horizon_ms: int | None = None) -> DataFrame:
    """kind, subject, group, msg_id, origin_id, reason, holder, holder_consumer, held_ms,
    history (array of struct ts_ms, event, server, group, consumer, retries, reason)."""
    flagged = flagged_messages(delivery_facts(events, deadline_ms, horizon_ms),
                               duplicate_pulls(events), delayed_messages(events), events)
    return with_history(flagged, events)
