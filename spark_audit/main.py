"""The thin main behind ``qmq audit``: read the trace, run the jobs, write Parquet and report.md.

Outputs under ``out_dir`` (any Hadoop URI or a local path; each overwritten):

    delivery/            delivery_audit          per (subject, group)
    delay/               delay_audit             per subject
    retries/             retry_audit             per (subject, group, retries)
    retry_summary/       retry_summary           per (subject, group)
    anomalies/           anomalies               per anomalous message, with history
    latency_histogram/   histogram of first-pull latency (all groups)
    lateness_histogram/  histogram of dispatch lateness (all subjects)
    report.md

Returns 1 when a message was lost or delivered early, else 0. The events are read once and
persisted (memory, spilling to disk) because every job scans them.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from pyspark import StorageLevel
from pyspark.errors import AnalysisException
from pyspark.sql import DataFrame, Row, SparkSession
from pyspark.sql import functions as F

from spark_audit import report
from spark_audit.anomalies import flagged_messages, with_history
from spark_audit.delay import delayed_messages, lateness_values, summarize_delay
from spark_audit.delivery import (
    chain_facts,
    duplicate_pulls,
    judge_delivery,
    latency_values,
    summarize_delivery,
)
from spark_audit.errors import NoTraceFiles
from spark_audit.histogram import histogram
from spark_audit.load import load_events
from spark_audit.retry import retry_distribution, retry_summary

DEADLINE_MS_DEFAULT = 300_000  # 5 min: well past the default 60 s ack timeout
ANOMALY_SAMPLES_MAX = 20  # anomaly rows shown in report.md (all of them are in the Parquet)
# Up to this many anomalies, their keys are broadcast to find their histories (a few tens of
# MB at most); beyond, all events are shuffled to meet them.
HISTORY_BROADCAST_ROWS_MAX = 200_000
LOCAL_SHUFFLE_PARTITIONS = 8  # local[*] on a few cores: Spark's default 200 is mostly overhead
EXIT_OK, EXIT_FOUND = 0, 1


@dataclass(frozen=True)
class AuditOptions:
    """One audit run. Times are epoch ms."""

    trace_dirs: tuple[str, ...]
    out_dir: str
    since_ms: int | None = None  # events with ts_ms >= since_ms (None: from the start)
    until_ms: int | None = None  # events with ts_ms < until_ms; also the lost/in-flight horizon
    deadline_ms: int = DEADLINE_MS_DEFAULT  # ack deadline after a message became deliverable
    master: str = "local[*]"  # Spark master URL
    driver_memory: str | None = "2g"  # local mode: the executors live in the driver's JVM


def spark_session(options: AuditOptions) -> tuple[SparkSession, bool]:
    """The active session if there is one (tests, notebooks), else a new one; True if new."""
    active = SparkSession.getActiveSession()
    if active is not None:
        return active, False
    builder = (SparkSession.builder.master(options.master).appName("qmq-audit")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.session.timeZone", "UTC"))
    if options.master.startswith("local"):
        builder = builder.config("spark.sql.shuffle.partitions", str(LOCAL_SHUFFLE_PARTITIONS))
        if options.driver_memory:
            builder = builder.config("spark.driver.memory", options.driver_memory)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    return session, True


def write_text(spark: SparkSession, uri: str, text: str) -> None:
    """Write ``text`` to ``uri`` through Hadoop's FileSystem, so --out may be HDFS/S3 or local."""
    jvm = spark.sparkContext._jvm
    path = jvm.org.apache.hadoop.fs.Path(uri)
    stream = path.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration()).create(path, True)
    try:
        stream.write(bytearray(text.encode("utf-8")))
    finally:
        stream.close()


def _sort_key(order: list[str]) -> Callable[[Row], tuple]:
    return lambda row: tuple((row[c] is None, row[c]) for c in order)


def _save(spark: SparkSession, df: DataFrame, out_dir: str, name: str,
          order: list[str]) -> list[dict]:
    """Collect a small result, sort it by ``order`` on the driver, write it as one Parquet file
    and return its rows. Collecting first computes the result once (an ``orderBy`` would add a
    sampling job); the write then only serialises the collected rows."""
    rows = sorted(df.collect(), key=_sort_key(order))
    spark.createDataFrame(rows, df.schema).coalesce(1).write.mode("overwrite").parquet(
        f"{out_dir.rstrip('/')}/{name}")
    return [row.asDict(recursive=True) for row in rows]


def _keep(df: DataFrame) -> DataFrame:
    # Deserialized: a serialized cache is decoded again on every scan (2-3x slower here).
    return df.persist(StorageLevel.MEMORY_AND_DISK_DESER)


def _read_events(spark: SparkSession, options: AuditOptions) -> tuple[DataFrame, int, int]:
    """The events, persisted, with their count and latest time (one job that also fills the
    cache). Raises NoTraceFiles when a path has no trace file."""
    try:
        events = _keep(load_events(spark, list(options.trace_dirs), options.since_ms,
                                   options.until_ms))
        total, latest_ms = events.agg(F.count(F.lit(1)), F.max("ts_ms")).first()
    except AnalysisException as exc:
        if "PATH_NOT_FOUND" in str(exc) or "Path does not exist" in str(exc):
            raise NoTraceFiles(", ".join(options.trace_dirs), str(exc).splitlines()[0]) from exc
        raise
    return events, total, latest_ms or 0


def _save_anomalies(spark: SparkSession, flagged: DataFrame, events: DataFrame,
                    out_dir: str) -> tuple[dict[str, int], list[dict]]:
    """Write the flagged anomalies with their histories (possibly many rows: straight to
    Parquet); return the count per kind and the first few rows for the report."""
    path = f"{out_dir.rstrip('/')}/anomalies"
    broadcast = flagged.count() <= HISTORY_BROADCAST_ROWS_MAX
    with_history(flagged, events, broadcast=broadcast).write.mode("overwrite").parquet(path)
    flagged.unpersist()
    written = spark.read.parquet(path)
    counts = {r["kind"]: r["count"] for r in written.groupBy("kind").count().collect()}
    kind_order = F.array_position(F.array(*map(F.lit, ("lost", "early", "duplicate", "dead"))),
                                  F.col("kind"))
    samples = [r.asDict(recursive=True) for r in written.orderBy(
        kind_order, "subject", "group", "msg_id").limit(ANOMALY_SAMPLES_MAX).collect()]
    return counts, samples


def audit(spark: SparkSession, options: AuditOptions,
          progress: Callable[[str], None]) -> report.AuditResults:
    """Run every job over the trace, writing each result under ``options.out_dir``."""
    out = options.out_dir
    started = time.perf_counter()

    def step(message: str) -> None:
        progress(f"[{time.perf_counter() - started:6.1f} s] {message}")

    step(f"reading events from {', '.join(options.trace_dirs)}...")
    events, total, latest_ms = _read_events(spark, options)
    try:
        step(f"{total:,} events")
        step("delivery audit...")
        # The intermediate tables feed several outputs each: computed once, kept.
        horizon_ms = latest_ms if options.until_ms is None else options.until_ms
        chains = _keep(chain_facts(events))
        facts = judge_delivery(chains, options.deadline_ms, horizon_ms)
        duplicates = _keep(duplicate_pulls(events))
        delayed = _keep(delayed_messages(events))
        delivery = _save(spark, summarize_delivery(facts, duplicates), out, "delivery",
                         ["subject", "group"])
        step(f"{len(delivery):,} (subject, group) pairs: {sum(r['produced'] for r in delivery):,}"
             f" expected, {sum(r['lost'] for r in delivery):,} lost, "
             f"{sum(r['duplicated'] for r in delivery):,} duplicated")
        latency = _save(spark, histogram(latency_values(facts), "latency_ms"), out,
                        "latency_histogram", ["hi_ms"])
        step("delay audit...")
        delay = _save(spark, summarize_delay(delayed), out, "delay", ["subject"])
        lateness = _save(spark, histogram(lateness_values(delayed), "lateness_ms"), out,
                         "lateness_histogram", ["hi_ms"])
        step(f"{sum(r['dispatched'] for r in delay):,} dispatched, "
             f"{sum(r['early'] for r in delay):,} early")
        step("retry audit...")
        retry_table = retry_distribution(chains)
        retries = _save(spark, retry_table, out, "retries", ["subject", "group", "retries"])
        collected = spark.createDataFrame([tuple(r.values()) for r in retries], retry_table.schema)
        summary = _save(spark, retry_summary(collected), out, "retry_summary",
                        ["subject", "group"])
        step(f"{sum(r['dead'] for r in summary):,} dead, "
             f"{sum(r['succeeded_after_retries'] for r in summary):,} succeeded after retries")
        step("anomalies...")
        flagged = _keep(flagged_messages(facts, duplicates, delayed, events))
        for kept in (chains, duplicates, delayed):
            kept.unpersist()
        counts, samples = _save_anomalies(spark, flagged, events, out)
        step(f"{sum(counts.values()):,} anomalies {counts}")
    finally:
        events.unpersist()
    return report.AuditResults(
        trace_dirs=options.trace_dirs, since_ms=options.since_ms, until_ms=options.until_ms,
        deadline_ms=options.deadline_ms, events=total, delivery=delivery, delay=delay,
        retry_summary=summary, retries=retries, anomaly_counts=counts, anomaly_samples=samples,
        latency_histogram=latency, lateness_histogram=lateness,
        generated_at_ms=time.time_ns() // 1_000_000,
        notes=() if total else ("no events in the trace window: nothing was audited",))


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run(options: AuditOptions, progress: Callable[[str], None] = _stderr) -> int:
    """Audit, write report.md, print the summary; 1 if anything was lost or early, else 0.
    Raises NoTraceFiles when a trace path holds no trace file."""
    # py4j narrates its connections at INFO; only its warnings matter here.
    logging.getLogger("py4j").setLevel(max(logging.WARNING, logging.getLogger().level))
    spark, created = spark_session(options)
    try:
        results = audit(spark, options, progress)
        write_text(spark, f"{options.out_dir.rstrip('/')}/report.md", report.render(results))
        progress(f"wrote {options.out_dir.rstrip('/')}/report.md")
    finally:
        if created:
            spark.stop()
    print(report.summary(results), flush=True)
    return EXIT_OK if results.passed else EXIT_FOUND
