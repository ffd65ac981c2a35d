"""The Spark schema of a trace event, built from ``tracelog.events.EVENT_FIELDS`` (one source of truth).

Spark is always given this schema: inference would cost a pass over the data and would guess
types from whatever lines it sampled (an hour with no ``lateness_ms`` would drop the column).
"""

from __future__ import annotations

from pyspark.sql.types import (ArrayType, BooleanType, IntegerType, LongType, StringType,
                               StructField, StructType)

from tracelog.events import EVENT_FIELDS, EVENT_KINDS, LINE_FIELDS

_SPARK_TYPES = {"string": StringType(), "long": LongType(), "int": IntegerType(),
                "boolean": BooleanType(), "array<string>": ArrayType(StringType())}

# The events DataFrame's schema (what every job gets).
EVENT_SCHEMA = StructType([StructField(name, _SPARK_TYPES[kind], True)
                           for name, kind in EVENT_FIELDS])
# What a trace line is read with: the event fields plus the ``produced`` flag the loader expands.
LINE_SCHEMA = StructType([StructField(name, _SPARK_TYPES[kind], True)
                          for name, kind in LINE_FIELDS])

# Lifecycle order of the kinds, to order events of one message that share a millisecond.
# Subscription events have no message, so never appear in a history; they are listed last.
LIFECYCLE_ORDER = ("produced", "scheduled", "handed", "cancelled", "dispatched", "stored",
                   "expired",
                   "redelivered", "pulled", "nacked", "retried", "acked", "dead", "gave_up",
                   "subscribed", "unsubscribed")
assert sorted(LIFECYCLE_ORDER) == sorted(EVENT_KINDS), "every kind needs a lifecycle position"

# The fields of one entry of an anomaly's history, in order.
HISTORY_FIELDS = ("ts_ms", "event", "server", "group", "consumer", "retries", "reason")
