"""The thin main behind ``qmq audit``: read the trace, run the jobs, write Parquet and reports.

Outputs under ``out_dir`` (any Hadoop URI or a local path; each overwritten):

    delivery/            delivery_audit          per (subject, group)
    delay/               delay_audit             per subject
    retries/             retry_audit             per (subject, group, retries)
    retry_summary/       retry_summary           per (subject, group)
    anomalies/           anomalies               per anomalous message, with history
    gave_up/             activity.give_ups       per (subject, group, reason, server)
    latency_histogram/   histogram of first-pull latency (all groups)
    lateness_histogram/  histogram of dispatch lateness (all subjects)
    timeline/            activity.timeline       deliveries, redeliveries, retries per bucket
    report.md, report.html

Returns an exit code (``exit_code``): 1 when a message was lost or delivered early, 4 when
messages are only overdue, else 0 (a kind the options allow does not count). The events are
read once and persisted (memory, spilling to disk) because every job scans them.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from pyspark import StorageLevel
from py4j.java_gateway import JavaClass
from py4j.protocol import Py4JError
from pyspark.errors import AnalysisException
from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from spark_audit import class_archive, html_report, launch, report
from spark_audit.activity import give_ups, timeline, timeline_bucket_ms
from spark_audit.anomalies import KIND_ORDER, flagged_messages, with_history
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
from tracelog.events import LOCATOR_FIELD_NAMES
from spark_audit.load import is_local, load_events, local_trace_bytes
from spark_audit.names import has_locators, located_give_ups, name_give_ups
from spark_audit.output import Table, collect_tables, rows_as_dicts, write_tables, write_text
from spark_audit.retry import retry_distribution, retry_summary

DEADLINE_MS_DEFAULT = 300_000  # 5 min: well past the default 60 s ack timeout
ANOMALY_SAMPLES_MAX = 20  # anomaly rows shown in report.md (all of them are in the Parquet)
# Up to this many anomalies, their keys are broadcast to find their histories (a few tens of
# MB at most); beyond, all events are shuffled to meet them.
HISTORY_BROADCAST_ROWS_MAX = 200_000
# Up to this many anomalies are collected with their histories (a few kB each at most) and
# written from the driver; beyond, Spark writes them (spark_audit.output: a job per write).
ANOMALY_COLLECT_ROWS_MAX = 10_000
LOCAL_SHUFFLE_PARTITIONS = 8  # local[*] on a few cores: Spark's default 200 is mostly overhead
# A local audit of a trace this small is mostly JVM start and per-job costs: it runs with fewer
# shuffle partitions and a JVM tuned to start fast (C1 only, serial GC) rather than to run long.
SMALL_TRACE_BYTES = 64 << 20
SMALL_TRACE_SHUFFLE_PARTITIONS = 2
# The metaspace size and young generation: a small audit's JVM loads ~17,000 classes (the
# default first metaspace threshold forced a full collection during the query) and allocates
# most of its heap during start-up and planning; a larger young generation halves the
# collections, each of which copies the same long-lived objects again.
SMALL_TRACE_JAVA_OPTIONS = ("-XX:TieredStopAtLevel=1 -XX:+UseSerialGC -XX:MetaspaceSize=256m "
                            "-Xmn256m")
SMALL_TRACE_CONF = (
    # A sort or hash aggregation takes its memory in pages; by default a page is up to 64 MB
    # (1/16 of the execution memory per core), and each task of each aggregating stage took
    # one: a 10k-event audit allocated several GB of pages for a few kB of rows, and the
    # driver's heap filled with them (full collections). 2 MB pages hold this trace's tasks;
    # a record larger than a page still gets a page of its own size.
    ("spark.buffer.pageSize", "2m"),
    # Adaptive execution re-plans the rest of a query after each of its stages and runs each
    # stage as a job of its own: dozens of re-optimisations of the audit's big plans, to tune
    # partitions that hold a few kB.
    ("spark.sql.adaptive.enabled", "false"),
    # Generated code is compiled by Janino (on the driver for each query's stages, in the
    # executors for each projection), and Janino looks up the names it resolves through every
    # jar of the class path: a sampled profile of a 10k-event audit spent a quarter of the
    # driver's time in jar lookups and a tenth in Janino. Interpreted rows cost nothing here.
    ("spark.sql.codegen.wholeStage", "false"),
    ("spark.sql.codegen.factoryMode", "NO_CODEGEN"),
    # Constraint propagation infers filters (IsNotNull and the like) from every operator's
    # constraints, over and over on plans as large as the audit's, to skip rows that a few kB
    # of data do not need skipped: about 0.5 CPU-s of a warm audit's 6.7 (docs/AUDIT.md).
    ("spark.sql.constraintPropagation.enabled", "false"),
)
# A large local trace's events are cached uncompressed when that cache fits in the part of
# the driver's memory that Spark's unified memory manager never evicts for execution: (heap -
# 300 MB reserved) x spark.memory.fraction 0.6 x spark.memory.storageFraction 0.5 (its
# defaults). Building the compressed cache gathers compression statistics over every value of
# every column: uncompressed it took about 40% less task CPU (1 M benchmark events, one warm
# JVM: 4.6-5.0 against 7.7 task CPU-s; docs/AUDIT.md "Performance") for three times the
# memory (128 against 43 MB), about UNCOMPRESSED_CACHE_BYTES_PER_TRACE_BYTE of the trace.
UNCOMPRESSED_CACHE_BYTES_PER_TRACE_BYTE = 0.75
# spark-submit first runs a JVM of its own (org.apache.spark.launcher.Main) only to compute the
# driver JVM's command line, before the driver JVM starts: a few hundred classes, well under a
# second, all of it on the audit's critical path. With the JVM's defaults (G1, both JIT tiers)
# it took about twice the wall time of these and a fifth more CPU (docs/AUDIT.md, Performance).
# -XX:-UsePerfData: no hsperfdata file for a JVM that lives a moment.
LAUNCHER_JAVA_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC -XX:-UsePerfData"
LAUNCHER_OPTIONS_ENV = "SPARK_LAUNCHER_OPTS"  # read by Spark's bin/spark-class
_RESERVED_HEAP_BYTES = 300 << 20
_UNEVICTABLE_STORAGE_SHARE = 0.6 * 0.5
_MEMORY_SUFFIXES = "kmgt"  # JVM memory units: 2^10, 2^20, 2^30, 2^40 bytes
EXIT_OK, EXIT_FOUND, EXIT_OVERDUE = 0, 1, 4
# Settings of every session the audit starts, whatever the trace's size.
SESSION_CONF = (
    # PySpark's DataFrame debugging wraps every Column and functions call in a capture of its
    # Python call site, sent to the JVM (the active session and a setting looked up, the site
    # set and cleared): about 6,800 of a 10k-event audit's 12,400 py4j calls, each a round trip
    # the driver's py4j thread serves. It only adds that call site to the message of an error
    # raised while a query runs; the audit's messages and outputs do not change
    # (docs/AUDIT.md "Performance").
    ("spark.python.sql.dataFrameDebugging.enabled", "false"),
)


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
    conf: tuple[tuple[str, str], ...] = ()  # Spark settings (key, value), applied last
    allow_lost: bool = False  # lost messages are reported but do not fail the gate
    allow_overdue: bool = False  # overdue messages are reported but do not fail the gate
    json: bool = False  # stdout: the verdict and counts as one JSON document, not the tables
    # the driver JVM's class-data-sharing archive cache (spark_audit.class_archive); None: off
    class_archive_dir: str | None = None
    # the driver JVM's cached command line (spark_audit.launch), local masters; None: off
    launch_cache_dir: str | None = None


@dataclass(frozen=True)
class Session:
    """The audit's SparkSession; ``created``: started here (stopped after the audit);
    ``archive``: its driver JVM records its class list (or the top layer) for this class
    archive."""

    spark: SparkSession
    created: bool
    archive: class_archive.ClassArchive | None = None


def _driver_java_options(options: AuditOptions, small: bool
                         ) -> tuple[str, class_archive.ClassArchive | None]:
    """The driver JVM's options, and the class archive it records a class list for (if any).
    An operator's own spark.driver.extraJavaOptions (--conf) replaces them all."""
    java = SMALL_TRACE_JAVA_OPTIONS if small else ""
    if any(key == "spark.driver.extraJavaOptions" for key, _ in options.conf):
        return java, None
    archive = class_archive.plan(options.class_archive_dir)
    if archive is None:
        return java, None
    archived, recording = archive.java_options(os.getpid())
    return f"{java} {archived}".strip(), archive if recording else None


def memory_bytes(size: str) -> int | None:
    """Bytes of a JVM memory string as spark.driver.memory takes it (``6g``, ``2048m``,
    ``512mb``; a bare number is MiB), or None when it is not one."""
    text = size.strip().lower().removesuffix("b")
    suffix = text[-1:]
    digits = text[:-1] if suffix and suffix in _MEMORY_SUFFIXES else text
    if not digits.isdigit():
        return None
    unit = suffix if digits != text else "m"
    return int(digits) << (10 * (_MEMORY_SUFFIXES.index(unit) + 1))


def cache_uncompressed(trace_bytes: int, driver_memory: str | None) -> bool:
    """Whether a local audit of ``trace_bytes`` of trace with ``driver_memory`` (None: Spark's
    default 1g) caches its events uncompressed (UNCOMPRESSED_CACHE_BYTES_PER_TRACE_BYTE):
    only when that cache fits in the storage memory execution cannot evict."""
    heap = memory_bytes(driver_memory or "1g")
    if heap is None:
        return False
    storage = (heap - _RESERVED_HEAP_BYTES) * _UNEVICTABLE_STORAGE_SHARE
    return trace_bytes * UNCOMPRESSED_CACHE_BYTES_PER_TRACE_BYTE <= storage


@contextmanager
def launcher_options() -> Iterator[None]:
    """LAUNCHER_JAVA_OPTIONS in $SPARK_LAUNCHER_OPTS while a session starts (pyspark passes this
    process's environment to spark-submit), unless the operator set their own; the environment
    is as it was afterwards."""
    if LAUNCHER_OPTIONS_ENV in os.environ:
        yield
        return
    os.environ[LAUNCHER_OPTIONS_ENV] = LAUNCHER_JAVA_OPTIONS
    try:
        yield
    finally:
        os.environ.pop(LAUNCHER_OPTIONS_ENV, None)


def spark_session(options: AuditOptions) -> Session:
    """The active session if there is one (tests, notebooks), else a new one (a local one's
    driver JVM started from the launch cache when it can: ``spark_audit.launch``)."""
    active = SparkSession.getActiveSession()
    if active is not None:
        return Session(active, False)
    settings = [("spark.master", options.master), ("spark.app.name", "qmq-audit"),
                ("spark.ui.showConsoleProgress", "false"),
                ("spark.sql.session.timeZone", "UTC"), *SESSION_CONF]
    small = False
    local = options.master.startswith("local")
    if local:
        size = local_trace_bytes(options.trace_dirs)
        small = size is not None and size <= SMALL_TRACE_BYTES
        partitions = SMALL_TRACE_SHUFFLE_PARTITIONS if small else LOCAL_SHUFFLE_PARTITIONS
        # No web UI for a one-shot local job: it costs start-up time and a port.
        settings += [("spark.sql.shuffle.partitions", str(partitions)),
                     ("spark.ui.enabled", "false")]
        if small:
            settings += SMALL_TRACE_CONF
        elif size is not None and cache_uncompressed(size, options.driver_memory):
            settings.append(("spark.sql.inMemoryColumnarStorage.compressed", "false"))
        if options.driver_memory:
            settings.append(("spark.driver.memory", options.driver_memory))
    java_options, archive = _driver_java_options(options, small)
    if java_options:
        settings.append(("spark.driver.extraJavaOptions", java_options))
    settings += options.conf
    builder = SparkSession.builder
    for key, value in settings:
        builder = builder.config(key, value)
    with launcher_options():
        # A JVM recording a class list is named by this process: its command is never cached.
        session = launch.get_or_create(builder, settings,
                                       options.launch_cache_dir if local else None,
                                       record=archive is None)
    session.sparkContext.setLogLevel("ERROR")
    return Session(session, True, archive)


def _keep(df: DataFrame, kept: list[DataFrame]) -> DataFrame:
    """``df`` persisted (added to ``kept``, to unpersist), as a frame whose plan is only its
    cache (``_over_cache``)."""
    # Deserialized: a serialized cache is decoded again on every scan (2-3x slower here).
    kept.append(df.persist(StorageLevel.MEMORY_AND_DISK_DESER))
    return _over_cache(df)


def _over_cache(df: DataFrame) -> DataFrame:
    """A persisted ``df`` as a frame whose logical plan is one leaf, its cache, instead of the
    plan that computes it. The same rows and the same physical plans (Spark puts the cache in
    place of a persisted plan before optimising), but every later transformation is analysed,
    and every query looked up in the cache, over that leaf instead of the whole plan again:
    the audit builds a few hundred frames over the events, and re-analysing their read and
    normalisation each time was most of a small audit's planning (the analyser's rules took
    10 CPU-s of a 10k-event audit). Without that JVM entry point (another Spark version) the
    frame itself, which computes the same."""
    jvm = df.sparkSession._jvm
    # Spark 4 has the DataFrame API's Dataset in .classic, Spark 3.5 in .sql itself.
    datasets = [found for found in (jvm.org.apache.spark.sql.classic.Dataset,
                                    jvm.org.apache.spark.sql.Dataset)
                if isinstance(found, JavaClass)]
    if not datasets:
        return df
    try:
        plan = df._jdf.queryExecution().withCachedData()
        return type(df)(datasets[0].ofRows(df._jdf.sparkSession(), plan), df.sparkSession)
    except Py4JError:
        return df


@dataclass(frozen=True)
class _Derived:
    """The intermediate frames that feed several outputs each, persisted (``_keep``)."""

    chains: DataFrame
    duplicates: DataFrame
    delayed: DataFrame


def _derive(events: DataFrame, deadline_ms: int, kept: list[DataFrame]) -> _Derived:
    """``_Derived`` of ``events``: built and persisted, which plans them (no job)."""
    return _Derived(_keep(chain_facts(events, deadline_ms), kept),
                    _keep(duplicate_pulls(events), kept), _keep(delayed_messages(events), kept))


def _read_events(spark: SparkSession, options: AuditOptions, kept: list[DataFrame]
                 ) -> tuple[DataFrame, int, int, int, _Derived]:
    """The events, persisted (added to ``kept``, to unpersist), with their count and first and
    latest time (one job that also fills the cache and lists the give-ups to name by location:
    ``spark_audit.names``, a second small job only when there are any), and the ``_Derived``
    frames over them. Raises NoTraceFiles when a path has no trace file.

    Nothing in the derived frames depends on the job's results unless a give-up is named by
    location: they are built on a second driver thread while the job runs (Spark analyses and
    plans them on a py4j thread of their own), so the driver's planning uses both cores instead
    of waiting for the job; in the rare case of a named give-up they are built again."""
    try:
        events = _keep(load_events(spark, list(options.trace_dirs), options.since_ms,
                                   options.until_ms, locators=True), kept)
        located = [located_give_ups()] if has_locators(events) else []
        plain = events.drop(*LOCATOR_FIELD_NAMES) if located else events
        ahead: list[DataFrame] = []
        try:
            with ThreadPoolExecutor(1, thread_name_prefix="audit-plan") as planner:
                derived = planner.submit(_derive, plain, options.deadline_ms, ahead)
                total, first_ms, latest_ms, *locations = events.agg(
                    F.count(F.lit(1)), F.min("ts_ms"), F.max("ts_ms"), *located).first()
        finally:  # the planner is done here (the with block waited for it)
            kept.extend(ahead)
        result = derived.result()
    except AnalysisException as exc:
        if "PATH_NOT_FOUND" in str(exc) or "Path does not exist" in str(exc):
            raise NoTraceFiles(", ".join(options.trace_dirs), str(exc).splitlines()[0]) from exc
        raise
    if located and locations[0]:  # give-ups named by location: looked up, then dropped
        plain = name_give_ups(events, locations[0]).drop(*LOCATOR_FIELD_NAMES)
        for df in ahead:
            df.unpersist()
            kept.remove(df)
        result = _derive(plain, options.deadline_ms, kept)
    return plain, total, first_ms or 0, latest_ms or 0, result


def _small_tables(events: DataFrame, chains: DataFrame, facts: DataFrame,
                  duplicates: DataFrame, delayed: DataFrame, flagged: DataFrame,
                  bucket_ms: int) -> dict[str, tuple[DataFrame, list[str]]]:
    """Every small result: name -> (DataFrame, sort columns). Computed in one job."""
    retry_table = retry_distribution(chains)
    return {
        "delivery": (summarize_delivery(facts, duplicates), ["subject", "group"]),
        "latency_histogram": (histogram(latency_values(facts), "latency_ms"), ["hi_ms"]),
        "delay": (summarize_delay(delayed), ["subject"]),
        "lateness_histogram": (histogram(lateness_values(delayed), "lateness_ms"), ["hi_ms"]),
        "retries": (retry_table, ["subject", "group", "retries"]),
        "retry_summary": (retry_summary(retry_table), ["subject", "group"]),
        "gave_up": (give_ups(events), ["subject", "group", "reason", "server"]),
        "timeline": (timeline(events, bucket_ms), ["start_ms", "event"]),
        "_anomaly_counts": (flagged.groupBy("kind").count(), ["kind"]),
    }


def _sample_order(row: dict) -> tuple:
    return KIND_ORDER.index(row["kind"]), row["subject"], row["group"] or "", row["msg_id"]


def _anomaly_samples(flagged: DataFrame, events: DataFrame) -> list[dict]:
    """The first ANOMALY_SAMPLES_MAX anomalies of each kind, with their histories."""
    rank = F.row_number().over(Window.partitionBy("kind").orderBy("subject", "group", "msg_id"))
    first = flagged.withColumn("_rank", rank).where(F.col("_rank") <= ANOMALY_SAMPLES_MAX)
    samples = rows_as_dicts(with_history(first.drop("_rank"), events, broadcast=True).collect())
    return sorted(samples, key=_sample_order)


def _samples_of(anomalies: list[dict]) -> list[dict]:
    """``_anomaly_samples`` from every anomaly row, on the driver: per kind the first
    ANOMALY_SAMPLES_MAX by (subject, group, msg_id), a null group first as Spark sorts it."""
    picked: dict[str, list[dict]] = {}
    for row in sorted(anomalies, key=lambda r: (r["subject"], r["group"] is not None,
                                                 r["group"] or "", r["msg_id"])):
        of_kind = picked.setdefault(row["kind"], [])
        if len(of_kind) < ANOMALY_SAMPLES_MAX:
            of_kind.append(row)
    return sorted((row for rows in picked.values() for row in rows), key=_sample_order)


def _write_outputs(spark: SparkSession, out: str, tables: dict[str, Table],
                   flagged: DataFrame, events: DataFrame, anomalies: int) -> list[dict]:
    """Write every output (the small tables and the anomalies with their histories); returns
    the report's anomaly samples. Up to ANOMALY_COLLECT_ROWS_MAX anomalies are collected with
    their histories in one job and written from the driver like the small tables (none: no
    job); more are written by Spark while their samples are fetched."""
    base = out.rstrip("/")
    if anomalies <= ANOMALY_COLLECT_ROWS_MAX:
        rows = with_history(flagged, events, broadcast=True)
        table = (collect_tables({"anomalies": (rows, ["kind", "subject", "group", "msg_id"])})
                 ["anomalies"] if anomalies else Table(rows.schema, []))
        write_tables(spark, base, {**tables, "anomalies": table})
        return _samples_of(table.dicts())
    samples: list[dict] = []

    def write_anomalies() -> None:
        broadcast = anomalies <= HISTORY_BROADCAST_ROWS_MAX
        with_history(flagged, events, broadcast=broadcast).write.mode("overwrite").parquet(
            f"{base}/anomalies")

    def fetch_samples() -> None:
        samples.extend(_anomaly_samples(flagged, events))

    write_tables(spark, base, tables, write_anomalies, fetch_samples)
    return samples


def audit(spark: SparkSession, options: AuditOptions, progress: Callable[[str], None],
          tables_ready: Callable[[dict[str, Table], int], None] | None = None
          ) -> report.AuditResults:
    """Run every job over the trace, writing each result under ``options.out_dir``;
    ``tables_ready`` (if given) is called with the small tables and the timeline's bucket width
    as soon as they are collected, before the outputs are written."""
    started = time.perf_counter()

    def step(message: str) -> None:
        progress(f"[{time.perf_counter() - started:6.1f} s] {message}")

    step(f"reading events from {', '.join(options.trace_dirs)}...")
    kept: list[DataFrame] = []
    try:
        events, total, first_ms, latest_ms, derived = _read_events(spark, options, kept)
        step(f"{total:,} events")
        step("delivery, delay and retry audits...")
        # The intermediate tables feed several outputs each: computed once, kept.
        horizon_ms = latest_ms if options.until_ms is None else options.until_ms
        chains, duplicates, delayed = derived.chains, derived.duplicates, derived.delayed
        facts = judge_delivery(chains, options.deadline_ms, horizon_ms)
        flagged = _keep(flagged_messages(facts, duplicates, delayed, events), kept)
        bucket_ms = timeline_bucket_ms(first_ms, latest_ms)
        tables = collect_tables(_small_tables(events, chains, facts, duplicates, delayed,
                                              flagged, bucket_ms))
        counts = {row[0]: row[1] for row in tables.pop("_anomaly_counts").rows}
        if tables_ready is not None:
            tables_ready(tables, bucket_ms)
        delivery, delay = tables["delivery"].dicts(), tables["delay"].dicts()
        step(f"{len(delivery):,} (subject, group) pairs: "
             f"{sum(r['produced'] for r in delivery):,} expected, "
             f"{sum(r['lost'] for r in delivery):,} lost, "
             f"{sum(r['overdue'] for r in delivery):,} overdue, "
             f"{sum(r['early'] for r in delay):,} early; anomalies {counts}")
        step("writing outputs...")
        samples = _write_outputs(spark, options.out_dir, tables, flagged, events,
                                 sum(counts.values()))
    finally:
        for df in kept:
            df.unpersist()
    step("done")
    return report.AuditResults(
        trace_dirs=options.trace_dirs, since_ms=options.since_ms, until_ms=options.until_ms,
        deadline_ms=options.deadline_ms, events=total, delivery=delivery, delay=delay,
        retry_summary=tables["retry_summary"].dicts(), retries=tables["retries"].dicts(),
        anomaly_counts=counts, anomaly_samples=samples,
        latency_histogram=tables["latency_histogram"].dicts(),
        lateness_histogram=tables["lateness_histogram"].dicts(),
        gave_up=tables["gave_up"].dicts(), timeline=tables["timeline"].dicts(),
        timeline_bucket_ms=bucket_ms,
        allow_lost=options.allow_lost, allow_overdue=options.allow_overdue,
        generated_at_ms=time.time_ns() // 1_000_000,
        notes=() if total else ("no events in the trace window: nothing was audited",))


def _warm_up() -> None:
    html_report.warm_up()
    import pyarrow.parquet  # noqa: F401  (spark_audit.output.parquet_bytes)


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def exit_code(results: report.AuditResults) -> int:
    """EXIT_FOUND if anything counted by the gate was lost or delivered early, else
    EXIT_OVERDUE if anything counted was overdue, else EXIT_OK (docs/AUDIT.md)."""
    if results.early or (results.lost and not results.allow_lost):
        return EXIT_FOUND
    if results.overdue and not results.allow_overdue:
        return EXIT_OVERDUE
    return EXIT_OK


def run(options: AuditOptions, progress: Callable[[str], None] = _stderr) -> int:
    """Audit, write report.md and report.html, print the summary (or with ``options.json``
    its JSON document, ``report.summary_json``); returns the exit code (``exit_code``). Raises NoTraceFiles when a trace path holds no trace file."""
    # py4j narrates its connections at INFO; only its warnings matter here.
    logging.getLogger("py4j").setLevel(max(logging.WARNING, logging.getLogger().level))
    # The charts' and Parquet's imports, while this thread waits for the JVM (import is
    # thread-safe).
    threading.Thread(target=_warm_up, name="audit-warm-up", daemon=True).start()
    session = spark_session(options)
    spark = session.spark
    out = options.out_dir.rstrip("/")
    stopping: threading.Thread | None = None
    # The charts are drawn on this thread while Spark collects the anomalies (the driver's
    # Python only waits for the JVM then).
    with ThreadPoolExecutor(1, thread_name_prefix="audit-charts") as drawing:
        charts: list[Future[html_report.Charts]] = []

        def draw(tables: dict[str, Table], bucket_ms: int) -> None:
            charts.append(drawing.submit(
                html_report.draw_charts, tables["latency_histogram"].dicts(),
                tables["lateness_histogram"].dicts(), tables["timeline"].dicts(), bucket_ms))

        try:
            results = audit(spark, options, progress, draw)
            if session.archive is not None and class_archive.start_build(
                    session.archive, spark, os.getpid()):
                progress(f"building the driver JVM's class archive (or its top layer) for "
                         f"later audits in the background: {session.archive.archive_path}")
            if session.created and is_local(out):
                # Nothing below needs Spark (a local --out is written with Python's file calls):
                # the session stops while the reports are rendered.
                stopping = threading.Thread(target=spark.stop, name="audit-stop")
                stopping.start()
            write_text(spark, f"{out}/report.md", report.render(results))
            write_text(spark, f"{out}/report.html",
                       html_report.render(results, charts[0].result() if charts else None))
            progress(f"wrote {out}/report.md and {out}/report.html")
        finally:
            if stopping is not None:
                stopping.join()
            elif session.created:
                spark.stop()
    code = exit_code(results)
    print(report.summary_json(results, code) if options.json else report.summary(results),
          flush=True)
    return code
