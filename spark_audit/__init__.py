"""PySpark audit jobs over the trace events written by ``tracelog.events`` (DESIGN.md section 12).

Every job is a pure ``DataFrame -> DataFrame`` transform over the events DataFrame that
``load_events`` reads (schema ``EVENT_SCHEMA``); ``spark_audit.main.run`` is the thin main behind
``qmq audit`` that reads, runs the jobs, writes Parquet, ``report.md`` and ``report.html``.
docs/AUDIT.md describes the event semantics and every output column.

    load_events(spark, paths, since_ms, until_ms)       -> events
    delivery_audit(events, deadline_ms[, horizon_ms])   -> per (subject, group)
    delay_audit(events)                                 -> per subject
    retry_audit(events)                                 -> per (subject, group, retries)
    retry_summary(retry_audit(events))                  -> per (subject, group)
    anomalies(events, deadline_ms[, horizon_ms])        -> per anomalous message, with history
    subscription_rules(events)                          -> per group: what its subscriptions exclude
    give_ups(events), timeline(events, bucket_ms)       -> give-ups per reason; activity over time

Each top-level job is a composition of smaller steps, also exported, so that ``main`` can
compute a shared intermediate once (``delivery_facts``, ``duplicate_pulls``,
``delayed_messages``) and feed it to several outputs. Importing this package imports pyspark
(the ``audit`` extra).
"""

from spark_audit.activity import give_ups, timeline
from spark_audit.anomalies import anomalies, flagged_messages, with_history
from spark_audit.delay import delay_audit, delayed_messages, lateness_values, summarize_delay
from spark_audit.delivery import (
    delivery_audit,
    delivery_facts,
    duplicate_pulls,
    latency_values,
    summarize_delivery,
)
from spark_audit.histogram import histogram
from spark_audit.load import load_events, normalize_events
from spark_audit.retry import retry_audit, retry_summary
from spark_audit.schema import EVENT_SCHEMA
from spark_audit.subscriptions import subscription_rules

__all__ = [
    "EVENT_SCHEMA",
    "anomalies",
    "delay_audit",
    "delayed_messages",
    "delivery_audit",
    "delivery_facts",
    "duplicate_pulls",
    "flagged_messages",
    "give_ups",
    "histogram",
    "latency_values",
    "lateness_values",
    "load_events",
    "normalize_events",
    "retry_audit",
    "retry_summary",
    "summarize_delay",
    "subscription_rules",
    "summarize_delivery",
    "timeline",
    "with_history",
]
