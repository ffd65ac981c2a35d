"""Reading trace files into the events DataFrame.

``load_events`` reads ``<dir>/*/*.jsonl`` (the hourly layout of ``tracelog.events.TraceWriter``) under
each path, local or any Hadoop URI (``hdfs://``, ``s3a://``...), with the explicit schema and
``DROPMALFORMED``: a torn last line or any line that is not a JSON object of the right types is
dropped. ``normalize_events`` is the pure part: required fields present, a line flagged
``produced`` expanded into its two events (``expand_produced``), defaults filled in.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import datetime, timezone
from urllib.parse import urlparse

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from tracelog.events import (EVENT_FIELD_NAMES, HOUR_MS, LOCATOR_FIELD_NAMES, MESSAGE_ID_FIELD,
                             PRODUCED_FLAG,
                             REQUIRED_FIELDS, SUBSCRIPTION_KINDS, SUBSCRIPTION_REQUIRED_FIELDS)
from spark_audit.delivery import kind
from spark_audit.schema import EVENT_SCHEMA, LINE_SCHEMA

# An hour directory holds what a writer wrote during that hour by its clock; an event's ts_ms may
# be earlier (produced carries the producer's created_at_ms, writes lag by the flush interval) or
# later (clock skew). Directories this far outside the window are still read.
HOUR_DIR_SLACK_MS = HOUR_MS


def expand_produced(lines: DataFrame) -> DataFrame:
    """A row flagged ``produced`` (a stored or scheduled line of a message that entered the
    system there, ``tracelog.events``) becomes two: a ``produced`` row at its created_at_ms (its
    ts_ms when it has none), every other field the same, then the row itself. Rows without the
    flag, and frames without the column (files from before the flag), pass unchanged.

    One ``explode`` rather than a union, so Spark parses the files once."""
    if PRODUCED_FLAG not in lines.columns:
        return lines
    flagged = F.coalesce(F.col(PRODUCED_FLAG), F.lit(False)) & (F.col("event") != "produced")
    kinds = F.when(flagged, F.array(F.lit("produced"), F.col("event"))).otherwise(
        F.array(F.col("event")))
    derived = flagged & (F.col("_kind") == "produced")
    columns = {
        "event": F.col("_kind"),
        "ts_ms": F.when(derived, F.coalesce(F.col("created_at_ms"), F.col("ts_ms")))
                  .otherwise(F.col("ts_ms")),
    }
    return lines.select("*", F.explode(kinds).alias("_kind")).select(
        *[columns.get(name, F.col(name)).alias(name) for name in lines.columns
          if name != PRODUCED_FLAG])


def normalize_events(raw: DataFrame, locators: bool = False) -> DataFrame:
    """Drop rows missing a required field (``tracelog.events.complete``: ``msg_id``, or for a
    subscription event ``group`` and ``consumer``); expand ``produced`` flags
    (``expand_produced``); ``origin_id`` defaults to ``msg_id``, ``retries`` to 0; columns in
    schema order; with ``locators``, then the locators the lines have (``spark_audit.names``)."""
    required = F.lit(True)
    for name in REQUIRED_FIELDS:
        required = required & F.col(name).isNotNull()
    subscription = kind(*SUBSCRIPTION_KINDS)
    for_subscription = F.lit(True)
    for name in SUBSCRIPTION_REQUIRED_FIELDS:
        for_subscription = for_subscription & F.col(name).isNotNull()
    required = required & F.when(subscription, for_subscription).otherwise(
        F.col(MESSAGE_ID_FIELD).isNotNull())
    defaults = {
        "origin_id": F.coalesce(F.col("origin_id"), F.col("msg_id")),
        "retries": F.coalesce(F.col("retries"), F.lit(0)),
    }
    # The locators (tracelog.events.LOCATOR_FIELDS) stay beside the event fields when the
    # lines have them: spark_audit.names needs them, and drops them.
    names = EVENT_FIELD_NAMES + tuple(n for n in LOCATOR_FIELD_NAMES
                                      if locators and n in raw.columns)
    return expand_produced(raw.where(required)).select(
        *[defaults.get(name, F.col(name)).alias(name) for name in names])


def is_local(path: str) -> bool:
    """True for a local path (no scheme, ``file:``, or a Windows drive letter)."""
    scheme = urlparse(path).scheme
    return scheme in ("", "file") or len(scheme) == 1  # a one-letter scheme is a Windows drive


def local_path(path: str) -> str:
    """The file-system path of a local ``path`` (``is_local``): a ``file:`` URI's path."""
    return urlparse(path).path if path.startswith("file:") else path


def _hour_start_ms(name: str) -> int | None:
    try:
        hour = datetime.strptime(name, "%Y%m%d%H").replace(tzinfo=timezone.utc)
    except ValueError:
        return None
    return int(hour.timestamp() * 1000)


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except (NotADirectoryError, FileNotFoundError):
        return []


def trace_globs(paths: Sequence[str], since_ms: int | None = None,
                until_ms: int | None = None) -> list[str]:
    """The globs to read: ``<path>/*/*.jsonl``, or for a local directory and a window, one glob
    per hour directory that can hold events of the window (HOUR_DIR_SLACK_MS either side)."""
    globs = []
    for path in paths:
        path = path.rstrip("/") or "/"
        if (since_ms is None and until_ms is None) or not is_local(path):
            globs.append(f"{path}/*/*.jsonl")
            continue
        low = -(2**63) if since_ms is None else since_ms - HOUR_DIR_SLACK_MS
        high = 2**63 if until_ms is None else until_ms + HOUR_DIR_SLACK_MS
        local = local_path(path)
        for name in sorted(os.listdir(local)):
            start = _hour_start_ms(name)
            # A name that is not an hour is read, not guessed at; an hour with no file is skipped
            # (a glob matching nothing is an error to Spark).
            if ((start is None or (start + HOUR_MS > low and start < high))
                    and any(f.endswith(".jsonl") for f in _listdir(os.path.join(local, name)))):
                globs.append(f"{path}/{name}/*.jsonl")
    return globs


def local_trace_bytes(paths: Sequence[str]) -> int | None:
    """The size of the trace files under ``paths`` (``<dir>/*/*.jsonl``), or None when a path
    is not local (its size is not worth a round trip to remote storage)."""
    total = 0
    for path in paths:
        if not is_local(path):
            return None
        local = local_path(path.rstrip("/") or "/")
        for name in _listdir(local):
            hour = os.path.join(local, name)
            for file_name in _listdir(hour):
                if file_name.endswith(".jsonl"):
                    try:
                        total += os.path.getsize(os.path.join(hour, file_name))
                    except OSError:
                        continue
    return total


def load_events(spark: SparkSession, paths: Sequence[str], since_ms: int | None = None,
                until_ms: int | None = None, *, locators: bool = False) -> DataFrame:
    """The events under ``paths`` with ``since_ms <= ts_ms < until_ms`` (either bound optional),
    normalised (with ``locators``: plus the locator columns, for ``spark_audit.names``). A path
    with no trace file makes Spark raise ``AnalysisException``."""
    globs = trace_globs(paths, since_ms, until_ms)
    if not globs:
        return spark.createDataFrame([], EVENT_SCHEMA)
    raw = spark.read.schema(LINE_SCHEMA).option("mode", "DROPMALFORMED").json(globs)
    events = normalize_events(raw, locators)
    if since_ms is not None:
        events = events.where(F.col("ts_ms") >= since_ms)
    if until_ms is not None:
        events = events.where(F.col("ts_ms") < until_ms)
    return events
