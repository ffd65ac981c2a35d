"""``qmq audit`` end to end: a trace written by TraceWriter in, Parquet + report.md + exit code out.

The command reuses the session's SparkSession (it only creates and stops its own when none is
active), so these tests cost a few Spark jobs, not a JVM start each.
"""

from __future__ import annotations

import os

import pytest
from pyspark.testing import assertDataFrameEqual

from qmq.cli import main
from tracelog.writer import TraceWriter
from tests.spark.scenario import DEADLINE_MS, T, scenario_events
from tests.spark.test_delivery import DELIVERY_SCHEMA


def write_trace(directory, events):
    """Write ``events`` as the servers would: one TraceWriter per server, the hour of T."""
    writers = {}
    for event in events:
        server = event.pop("server")
        if server not in writers:
            writers[server] = TraceWriter(directory, server, clock_ms=lambda: T,
                                          background=False)
        writers[server].emit(event)
    for writer in writers.values():
        writer.close()


def audit(*args) -> int:
    return main(["audit", "--deadline-ms", str(DEADLINE_MS), *map(str, args)])


def test_the_audit_of_the_scenario_fails_and_writes_every_output(spark, tmp_path, capsys):
    trace, out = tmp_path / "trace", tmp_path / "out"
    write_trace(trace, scenario_events())
    assert sorted(p.name for p in (trace / "2026010100").iterdir()) == [
        f"delay_d-1-{os.getpid()}.jsonl", f"realtime_rt-1-{os.getpid()}.jsonl"]

    assert audit("--trace-dir", trace, "--out", out) == 1

    assertDataFrameEqual(spark.read.parquet(str(out / "delivery")), spark.createDataFrame([
        ("orders", "billing", 10, 7, 6, 1, 1, 1, 1, 10, 30),
        ("orders", "search", 3, 2, 2, 0, 0, 1, 0, 5, 20)], DELIVERY_SCHEMA))
    assert [r.early for r in spark.read.parquet(str(out / "delay")).collect()] == [1]
    assert sorted((r.kind, r.msg_id) for r in spark.read.parquet(str(out / "anomalies"))
                  .collect()) == [("dead", "m6.r2"), ("duplicate", "m3"), ("early", "m4"),
                                  ("lost", "m12"), ("overdue", "m2")]
    assert spark.read.parquet(str(out / "retries")).count() == 4
    assert spark.read.parquet(str(out / "retry_summary")).count() == 2
    assert spark.read.parquet(str(out / "latency_histogram")).count() == 5
    assert spark.read.parquet(str(out / "lateness_histogram")).count() == 4
    assert [tuple(r) for r in spark.read.parquet(str(out / "gave_up")).collect()] == [
        ("orders", None, "dispatch_refused", "delay:d-1", 1)]
    assert spark.read.parquet(str(out / "timeline")).count() > 0

    report = (out / "report.md").read_text()
    assert "- Verdict: **FAIL** (1 lost, 1 overdue, 1 early)" in report
    assert "| orders | billing | 10 | 7 | 6 | 1 | 1 | 1 | 1 | 10 | 30 |" in report
    assert "| orders | 6 | 4 | 1 | 1 | 4 | 4 | 1 |" in report  # delay
    assert "| orders | billing | 7 | 2 | 1 | 1 | 2 |" in report  # retry summary
    assert ("| lost | orders | billing | m12 | dispatch_refused at delay:d-1 | "
            "00:00:00.300Z produced @delay:d-1; ") in report
    assert ("| overdue | orders | billing | m2 | held at realtime:rt-1 for 24.99 s | "
            "00:00:00.010Z produced @realtime:rt-1; ") in report
    assert "| orders | - | dispatch_refused | delay:d-1 | 1 |" in report  # give-ups
    page = (out / "report.html").read_text()
    assert "FAIL: 1 lost, 1 overdue, 1 early" in page and page.count("<svg") == 3
    assert "8 ms - <16 ms | " + "#" * 40 in report  # the tallest latency bar: 10, 10, 10
    printed = capsys.readouterr()
    assert printed.out.startswith("FAIL: 1 lost, 1 overdue, 1 early (63 events)")
    for line in ("reading events", "63 events", "delivery, delay and retry audits...",
                 "1 lost, 1 overdue, 1 early; anomalies", "writing outputs...", "done"):
        assert line in printed.err


def test_a_clean_window_passes_with_exit_code_zero(spark, tmp_path, capsys):
    events = [e for e in scenario_events() if e["msg_id"] in ("m1", "m2", "m5", "m7", "m7.r1")]
    write_trace(tmp_path / "trace", events)
    # m2 (produced at T+10, never pulled) is due at T+10010: the window ends before it is late.
    assert audit("--trace-dir", tmp_path / "trace", "--out", tmp_path / "out",
                 "--since", "2026-01-01T00:00:00Z", "--until", T + 10_010) == 0
    report = (tmp_path / "out" / "report.md").read_text()
    assert "- Verdict: **PASS** (0 lost, 0 overdue, 0 early)" in report
    assert "| orders | billing | 4 | 3 | 3 | 0 | 0 | 1 | 0 | 10 | 30 |" in report
    assert capsys.readouterr().out.startswith("PASS")


def test_the_window_arguments_reach_the_audit_as_epoch_ms(monkeypatch, tmp_path):
    import spark_audit.main

    seen = []
    monkeypatch.setattr(spark_audit.main, "run", lambda options: seen.append(options) or 0)
    assert audit("--trace-dir", tmp_path, "--trace-dir", "hdfs://nn/t", "--out", tmp_path / "o",
                 "--since", "2026-01-01T00:00:00Z", "--until", "2026-01-01T02:00:00+01:00",
                 "--master", "spark://h:7077") == 0
    (options,) = seen
    assert (options.trace_dirs, options.since_ms, options.until_ms, options.deadline_ms,
            options.master) == ((str(tmp_path), "hdfs://nn/t"), T, T + 3_600_000, DEADLINE_MS,
                                "spark://h:7077")
    assert audit("--trace-dir", tmp_path, "--out", tmp_path / "o", "--since", T + 1,
                 "--until", "2026-01-01T00:00:01") == 0
    assert (seen[1].since_ms, seen[1].until_ms) == (T + 1, T + 1_000)  # no zone: UTC


@pytest.mark.parametrize("args, message", [
    (["--since", "yesterday"], "neither ISO 8601"),
    (["--deadline-ms", "0"], "must be a positive number of ms"),
    (["--since", "2026-01-02", "--until", "2026-01-01"], "must be before --until"),
])
def test_bad_arguments_exit_with_code_two(tmp_path, capsys, args, message):
    try:
        code = audit("--trace-dir", tmp_path, "--out", tmp_path / "out", *args)
    except SystemExit as exc:  # argparse's own exit for a bad value
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_a_missing_trace_directory_exits_with_code_two(tmp_path, capsys):
    assert audit("--trace-dir", tmp_path / "nope", "--out", tmp_path / "out") == 2
    assert "is not a directory" in capsys.readouterr().err


def test_a_trace_directory_without_trace_files_exits_with_code_two(spark, tmp_path, capsys):
    (tmp_path / "2026010100").mkdir()
    assert audit("--trace-dir", tmp_path, "--out", tmp_path / "out") == 2
    assert "no trace files (<hour>/*.jsonl) under" in capsys.readouterr().err


def test_overdue_messages_alone_exit_with_code_four_unless_allowed(spark, tmp_path, capsys):
    # m2 is owed to billing and never pulled: overdue once its deadline passed (m10 at T+3000
    # is the last event and the horizon); m1 and m10 were acked in time.
    events = [e for e in scenario_events() if e["msg_id"] in ("m1", "m2", "m10")
              and e.get("group") in (None, "billing")]
    write_trace(tmp_path / "trace", events)
    args = ("--trace-dir", tmp_path / "trace", "--out", tmp_path / "out", "--deadline-ms", 100)
    assert main(["audit", *map(str, args)]) == 4
    assert capsys.readouterr().out.startswith("FAIL: 0 lost, 1 overdue, 0 early")
    assert main(["audit", *map(str, args), "--allow-overdue"]) == 0
    assert capsys.readouterr().out.startswith("PASS: 0 lost, 1 overdue, 0 early; allowed: "
                                              "overdue")


def test_a_data_dir_gives_every_trace_directory_under_it_once(monkeypatch, tmp_path, capsys):
    import spark_audit.main

    def server(path, name):
        write_trace(path, [{**scenario_events()[0], "server": name}])

    server(tmp_path / "up" / "realtime" / "trace", "realtime:rt-1")
    server(tmp_path / "up" / "delay" / "trace", "delay:d-1")
    server(tmp_path / "nodes" / "rt-2" / "data" / "trace", "realtime:rt-2")
    server(tmp_path / "nodes" / "rt-2" / "data" / "trace" / "2026010100" / "nested", "x")
    (tmp_path / "nodes" / "rt-3" / "2026010100").mkdir(parents=True)  # an hour dir, no file
    seen = []
    monkeypatch.setattr(spark_audit.main, "run", lambda options: seen.append(options) or 0)
    up, nodes = tmp_path / "up", tmp_path / "nodes"
    assert audit("--data-dir", up, "--data-dir", nodes, "--trace-dir", up / "delay" / "trace",
                 "--out", tmp_path / "o", "--conf", "spark.executor.memory=4g",
                 "--conf", "spark.x= a=b") == 0
    assert seen[0].trace_dirs == (str(up / "delay" / "trace"), str(up / "realtime" / "trace"),
                                  str(nodes / "rt-2" / "data" / "trace"))
    assert seen[0].conf == (("spark.executor.memory", "4g"), ("spark.x", " a=b"))
    assert "trace directories: " in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert audit("--data-dir", tmp_path / "empty", "--out", tmp_path / "o") == 2
    assert "holds no trace directory" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--conf", "spark.executor.memory"], "is not KEY=VALUE"),
    (["--data-dir", "hdfs://nn/qmq"], "is not a local directory"),
])
def test_bad_discovery_and_conf_arguments_exit_with_code_two(tmp_path, capsys, args, message):
    try:
        code = audit("--out", tmp_path / "out", *args)
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_without_any_trace_or_data_dir_the_audit_exits_with_code_two(tmp_path, capsys):
    assert audit("--out", tmp_path / "out") == 2
    assert "give at least one --trace-dir or --data-dir" in capsys.readouterr().err
