"""Message lookup over trace files: what it finds, where it looks, and where it stops."""

from __future__ import annotations

import json
import os

from metaserver.trace_lookup import find_message, hour_names, trace_directories
from tracelog.events import HOUR_MS, trace_event
from tracelog.writer import TraceWriter

T0 = 1_700_000_000_000 - 1_700_000_000_000 % HOUR_MS  # an hour boundary


def write(directory: str, server: str, events: list[dict[str, object]], now_ms: int) -> None:
    writer = TraceWriter(directory, server, clock_ms=lambda: now_ms, background=False)
    for event in events:
        writer.emit(event)
    writer.close()


def test_a_lookup_finds_the_message_and_its_retry_chain_in_time_order_across_servers(tmp_path):
    rt, delay = str(tmp_path / "rt" / "trace"), str(tmp_path / "delay" / "trace")
    write(rt, "realtime:rt1", [
        trace_event("stored", ts_ms=T0 + 5, msg_id="m1", subject="orders", produced=True,
                    created_at_ms=T0 + 1),
        trace_event("stored", ts_ms=T0 + 6, msg_id="m10", subject="orders"),
        trace_event("nacked", ts_ms=T0 + 9, msg_id="m1", subject="orders", group="billing"),
    ], T0 + 10)
    write(delay, "delay:d1", [
        trace_event("scheduled", ts_ms=T0 + HOUR_MS + 7, msg_id="m1.r1", origin_id="m1",
                    subject="orders", retries=1)], T0 + HOUR_MS + 7)
    found = find_message((str(tmp_path),), "m1", T0, T0 + 2 * HOUR_MS)
    assert [(e["event"], e["msg_id"]) for e in found.events] == [
        ("produced", "m1"), ("stored", "m1"), ("nacked", "m1"), ("scheduled", "m1.r1")]
    assert found.events[-1]["server"] == "delay:d1"
    assert (found.files_scanned, found.truncated) == (2, False)
    assert sorted(found.directories) == sorted([rt, delay])


def test_hours_outside_the_window_are_not_read(tmp_path):
    write(str(tmp_path), "realtime:rt1", [
        trace_event("stored", ts_ms=T0, msg_id="m1", subject="orders")], T0)
    assert hour_names(T0 + HOUR_MS, T0 + 3 * HOUR_MS - 1) == {
        name for name in hour_names(T0 + HOUR_MS, T0 + 2 * HOUR_MS)}
    assert find_message((str(tmp_path),), "m1", T0 + HOUR_MS, T0 + 5 * HOUR_MS).events == []
    assert len(find_message((str(tmp_path),), "m1", T0 - 1, T0).events) == 1


def test_a_torn_last_line_and_garbage_are_skipped(tmp_path):
    write(str(tmp_path), "realtime:rt1", [
        trace_event("stored", ts_ms=T0, msg_id="m1", subject="orders")], T0)
    (path,) = [os.path.join(d, f) for d, _, files in os.walk(tmp_path) for f in files]
    with open(path, "ab") as file:
        file.write(b'not json "m1"\n{"event":"acked","ts_ms":1,"msg_id":"m1","subj')
    found = find_message((str(tmp_path),), "m1", T0, T0)
    assert [e["event"] for e in found.events] == ["stored"]


def test_the_byte_and_event_limits_stop_the_search_and_say_so(tmp_path):
    events = [trace_event("pulled", ts_ms=T0 + i, msg_id="hot", subject="orders", group="g")
              for i in range(50)]
    write(str(tmp_path), "realtime:rt1", events, T0)
    capped = find_message((str(tmp_path),), "hot", T0, T0, events_max=10)
    assert (len(capped.events), capped.truncated) == (10, True)
    small = find_message((str(tmp_path),), "hot", T0, T0, scan_bytes_max=100)
    assert small.truncated and small.bytes_scanned >= 100


def test_an_id_needing_json_escapes_is_found_and_missing_roots_are_ignored(tmp_path):
    odd = 'a"b\\c'
    write(str(tmp_path), "realtime:rt1", [
        trace_event("stored", ts_ms=T0, msg_id=odd, subject="orders")], T0)
    found = find_message((str(tmp_path), str(tmp_path / "missing")), odd, T0, T0)
    assert [e["msg_id"] for e in found.events] == [odd]
    assert trace_directories((str(tmp_path / "missing"),)) == []
    assert json.dumps(found.to_json())
