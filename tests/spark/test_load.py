"""spark_audit.load: reading the hourly JSON Lines layout with the explicit schema."""

from __future__ import annotations

from pyspark.testing import assertDataFrameEqual

from tracelog.events import trace_event
from tracelog.writer import TraceWriter
from spark_audit import load_events
from spark_audit.load import trace_globs
from spark_audit.schema import EVENT_SCHEMA

HOUR_MS = 3_600_000
T = 1_767_225_600_000  # 2026-01-01T00:00:00Z


def _write(directory, server, clock_ms, *events):
    with TraceWriter(directory, server, clock_ms=lambda: clock_ms, background=False) as writer:
        for event in events:
            writer.emit(event)


def test_load_events_reads_every_hour_of_every_directory_and_drops_bad_lines(spark, tmp_path):
    _write(tmp_path / "a", "realtime:rt-1", T,
           trace_event("produced", ts_ms=T, msg_id="m1", subject="s", created_at_ms=T))
    _write(tmp_path / "a", "realtime:rt-1", T + HOUR_MS,
           trace_event("retried", ts_ms=T + HOUR_MS, msg_id="m1.r1", origin_id="m1",
                       subject="s", group="g", retries=1, deliver_at_ms=T + HOUR_MS + 5))
    _write(tmp_path / "b", "delay:d-1", T,
           trace_event("dispatched", ts_ms=T + 7, msg_id="m2", subject="s",
                       deliver_at_ms=T + 5))
    (path,) = (tmp_path / "b" / "2026010100").iterdir()
    with open(path, "a", encoding="ascii") as file:
        file.write('{"event":"acked","ts_ms":"soon","msg_id":"x","subject":"s"}\n'  # bad type
                   '{"event":"acked","ts_ms":1,"subject":"s"}\n'  # no msg_id
                   'garbage\n'
                   '{"event":"acked","ts_ms":9,"msg_id":"torn","sub')  # torn last line
    expected = spark.createDataFrame([
        ("produced", T, "realtime:rt-1", "m1", "m1", "s", None, None, T, None, 0, None, None,
         None),
        ("retried", T + HOUR_MS, "realtime:rt-1", "m1.r1", "m1", "s", "g", None, None,
         T + HOUR_MS + 5, 1, None, None, None),
        ("dispatched", T + 7, "delay:d-1", "m2", "m2", "s", None, None, None, T + 5, 0, 2, None,
         None),
    ], EVENT_SCHEMA)
    events = load_events(spark, [str(tmp_path / "a"), f"file://{tmp_path / 'b'}"])
    assertDataFrameEqual(events, expected)


def test_since_and_until_keep_events_in_the_half_open_window(spark, tmp_path):
    _write(tmp_path, "rt", T, *[trace_event("stored", ts_ms=T + dt, msg_id=str(dt), subject="s")
                               for dt in (0, 1, 2, 3)])
    events = load_events(spark, [str(tmp_path)], since_ms=T + 1, until_ms=T + 3)
    assert sorted(r.msg_id for r in events.collect()) == ["1", "2"]


def test_a_window_skips_local_hour_directories_more_than_an_hour_outside_it(tmp_path):
    for hour in ("2026010101", "2026010102", "2026010103", "2026010105"):
        (tmp_path / hour).mkdir()
        (tmp_path / hour / "rt-1.jsonl").write_text("")
    (tmp_path / "2026010104").mkdir()  # no file: a glob matching nothing would fail Spark
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "x.jsonl").write_text("")  # not an hour: read rather than guessed at
    # Window [03:00:00.001, 04:00) widened by an hour: writes in [02:00:00.001, 05:00).
    since, until = T + 3 * HOUR_MS + 1, T + 4 * HOUR_MS
    assert trace_globs([str(tmp_path)], since, until) == [
        f"{tmp_path}/{name}/*.jsonl" for name in ("2026010102", "2026010103", "notes")]
    assert trace_globs([str(tmp_path) + "/", "hdfs://nn/trace"], since, None)[-1] == \
        "hdfs://nn/trace/*/*.jsonl"
    assert trace_globs([str(tmp_path)]) == [f"{tmp_path}/*/*.jsonl"]


def test_a_line_flagged_produced_loads_as_a_produced_row_and_its_own_row(spark, tmp_path):
    _write(tmp_path, "realtime:rt-1", T,
           trace_event("stored", ts_ms=T + 4, msg_id="m1", subject="s", created_at_ms=T,
                       produced=True),
           trace_event("stored", ts_ms=T + 4, msg_id="m1.r1", origin_id="m1", subject="s",
                       created_at_ms=T + 1, deliver_at_ms=T + 3, retries=1))
    _write(tmp_path, "delay:d-1", T,
           trace_event("scheduled", ts_ms=T + 2, msg_id="m2", subject="s", created_at_ms=T + 1,
                       deliver_at_ms=T + 900, produced=True))
    expected = spark.createDataFrame([
        ("produced", T, "realtime:rt-1", "m1", "m1", "s", None, None, T, None, 0, None, None,
         None),
        ("stored", T + 4, "realtime:rt-1", "m1", "m1", "s", None, None, T, None, 0, None, None,
         None),
        ("stored", T + 4, "realtime:rt-1", "m1.r1", "m1", "s", None, None, T + 1, T + 3, 1,
         None, None, None),
        ("produced", T + 1, "delay:d-1", "m2", "m2", "s", None, None, T + 1, T + 900, 0, None,
         None, None),
        ("scheduled", T + 2, "delay:d-1", "m2", "m2", "s", None, None, T + 1, T + 900, 0, None,
         None, None),
    ], EVENT_SCHEMA)
    assertDataFrameEqual(load_events(spark, [str(tmp_path)]), expected)
    # The window applies to the derived row's own time.
    assert [(r.event, r.msg_id) for r in
            load_events(spark, [str(tmp_path)], since_ms=T + 1, until_ms=T + 2).collect()] == [
        ("produced", "m2")]


def test_a_file_from_before_the_produced_flag_loads_one_produced_row_per_message(spark, tmp_path):
    hour = tmp_path / "2026010100"
    hour.mkdir()
    (hour / "realtime_rt-1-1.jsonl").write_text(
        f'{{"event":"produced","ts_ms":{T},"msg_id":"m1","subject":"s","created_at_ms":{T},'
        f'"server":"realtime:rt-1"}}\n'
        f'{{"event":"stored","ts_ms":{T + 4},"msg_id":"m1","subject":"s","created_at_ms":{T},'
        f'"server":"realtime:rt-1"}}\n')
    rows = load_events(spark, [str(tmp_path)]).orderBy("ts_ms").collect()
    assert [(r.event, r.ts_ms) for r in rows] == [("produced", T), ("stored", T + 4)]
