"""Tying a give-up to the message it gave up on when the broker could not read the message.

A realtime broker that gives up on a record it cannot read fully names it as best it can: by
the id its damaged record still holds (a retry copy then has no origin id, so the audit could
not attach it to the message it retries), or, when even the header is damaged, as
``<subject>@<consumer-log sequence>``. Either way its ``gave_up`` line carries the record's
location (``seq``, and ``log_subject`` for a retry or dead copy: ``tracelog.events
.LOCATOR_FIELDS``), and so does the ``stored`` line the broker wrote when it stored that copy,
with the copy's real id and origin id. ``located_give_ups`` lists the located give-ups (a
column for the job that fills the events cache, so the usual audit, with none, costs no job);
``name_give_ups`` looks their locations up among the ``stored`` events in one small job and
rewrites the give-ups' ``msg_id`` and ``origin_id``, so the audit reports the message lost with
the give-up's reason. A location of a server that never traced the store (a trace window that
starts later, a lost trace file) keeps the name the broker gave.

One give-up is no loss: ``ack_unreadable``, a consumer's ack of an entry whose record the broker
could no longer read after a restart. Named like the others, it is also what it is, an ack of
that copy by the group and consumer on the line: ``name_give_ups`` adds an ``acked`` event
beside it (the ``gave_up`` line stays, for the give-up table and the message's history), so the
message counts as acked, not overdue (``spark_audit.delivery.NOT_A_LOSS_REASONS``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from tracelog.events import LOCATOR_FIELD_NAMES

# A located give-up of this reason that is found is also an ``acked`` event of its copy.
ACK_REASON = "ack_unreadable"
# Located give-ups looked up at most (a damaged disk, not a flood): beyond, the rest keep the
# broker's names and the audit reports them under those.
LOCATED_GIVE_UPS_MAX = 10_000
_SEPARATOR = "\u0001"  # in no subject or server name


def has_locators(events: DataFrame) -> bool:
    """Whether ``events`` carries the locator columns (read from trace files, not built)."""
    return all(name in events.columns for name in LOCATOR_FIELD_NAMES)


def _location() -> Column:
    """The location of a row as one string: server, wire subject, consumer-log sequence."""
    return F.concat_ws(_SEPARATOR, F.col("server"),
                       F.coalesce(F.col("log_subject"), F.col("subject")),
                       F.col("seq").cast("string"))


def _located_give_up() -> Column:
    return (F.col("event") == "gave_up") & F.col("seq").isNotNull()


def located_give_ups() -> Column:
    """An aggregate: the distinct locations of located give-ups (at most
    LOCATED_GIVE_UPS_MAX), for ``name_give_ups``."""
    return F.slice(F.collect_set(F.when(_located_give_up(), _location())), 1,
                   LOCATED_GIVE_UPS_MAX)


def name_give_ups(events: DataFrame, locations: Sequence[str]) -> DataFrame:
    """``events`` with each located give-up (``locations`` from ``located_give_ups``) named by
    the ``stored`` event of the same location: its ``msg_id`` and ``origin_id``. No location:
    ``events`` unchanged, and no job run."""
    if not locations:
        return events
    found: list[Any] = (events.where((F.col("event") == "stored") & F.col("seq").isNotNull()
                                     & _location().isin(*locations))
                        .select(_location().alias("at"), "msg_id", "origin_id")
                        .dropDuplicates(["at"]).collect())
    if not found:
        return events
    ids = F.create_map(*[F.lit(v) for row in found for v in (row.at, row.msg_id)])
    origins = F.create_map(*[F.lit(v) for row in found for v in (row.at, row.origin_id)])
    at = F.when(_located_give_up(), _location())
    named = events.withColumns({
        "msg_id": F.coalesce(F.try_element_at(ids, at), F.col("msg_id")),
        "origin_id": F.coalesce(F.try_element_at(origins, at), F.col("origin_id")),
    })
    # A named ack_unreadable is two events: the give-up, and the ack it was (no reason).
    acked = (F.col("reason") == ACK_REASON) & F.try_element_at(ids, at).isNotNull()
    kinds = F.when(acked, F.array(F.lit("gave_up"), F.lit("acked"))).otherwise(
        F.array(F.col("event")))
    ack_row = F.col("_kind") == "acked"
    columns = {"event": F.col("_kind"), "reason": F.when(~ack_row, F.col("reason"))}
    return named.select("*", F.explode(kinds).alias("_kind")).select(
        *[columns.get(name, F.col(name)).alias(name) for name in events.columns])
