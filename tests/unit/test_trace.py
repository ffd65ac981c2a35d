"""tracelog: the event builder (events), the batching hourly TraceWriter (writer) and read_events (reading)."""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tracelog.events import (EVENT_FIELD_NAMES, EVENT_KINDS, SUBSCRIPTION_KINDS, consumer_members,
                             hour_dir_name, message_members, reason_member, safe_server_name,
                             subscription_event, trace_event)
from tracelog.reading import read_events
from tracelog.writer import TraceWriter

MESSAGE_KINDS = [kind for kind in EVENT_KINDS if kind not in SUBSCRIPTION_KINDS]

HOUR_MS = 3_600_000
T0_MS = 1_767_225_600_000  # 2026-01-01T00:00:00Z


class FakeClock:
    def __init__(self, now_ms: int) -> None:
        self.now_ms = now_ms

    def __call__(self) -> int:
        return self.now_ms


def lines_of(path) -> list[str]:
    with open(path, encoding="ascii") as file:
        return file.read().splitlines()


def ev(msg_id: str, kind: str = "pulled", ts_ms: int = T0_MS) -> dict:
    return trace_event(kind, ts_ms=ts_ms, msg_id=msg_id, subject="orders", group="billing",
                       consumer="c1")


def test_trace_event_leaves_out_null_fields_and_defaults_origin_and_lateness():
    assert trace_event("dispatched", ts_ms=1_010, msg_id="m1", subject="orders",
                       deliver_at_ms=1_000) == {
        "event": "dispatched", "ts_ms": 1_010, "msg_id": "m1", "subject": "orders",
        "deliver_at_ms": 1_000, "lateness_ms": 10}
    copy = trace_event("retried", ts_ms=5, msg_id="m1.r1", origin_id="m1", subject="orders",
                       group="g", retries=1)
    assert copy["origin_id"] == "m1" and copy["retries"] == 1 and "consumer" not in copy


def test_trace_event_rejects_an_unknown_kind():
    with pytest.raises(ValueError, match="'delivered' is not one of produced"):
        trace_event("delivered", ts_ms=1, msg_id="m", subject="s")


def test_the_hour_directory_is_utc_and_the_file_name_is_safe():
    assert hour_dir_name(T0_MS + HOUR_MS * 13 + 59 * 60_000) == "2026010113"
    assert safe_server_name("realtime:rt-1/a b") == "realtime_rt-1_a_b"


def test_files_rotate_when_the_writer_clock_enters_a_new_hour(tmp_path):
    clock = FakeClock(T0_MS + HOUR_MS - 1)
    writer = TraceWriter(tmp_path, "realtime:rt-1", clock_ms=clock, background=False)
    writer.emit(ev("a"))
    writer.flush()
    clock.now_ms += 1
    writer.emit(ev("b"))
    writer.emit(ev("c"))
    writer.flush()
    clock.now_ms += 10 * 60_000  # same hour: appended to the open file
    writer.emit(ev("d"))
    writer.close()
    name = f"realtime_rt-1-{os.getpid()}.jsonl"
    assert sorted(os.listdir(tmp_path)) == ["2026010100", "2026010101"]
    first = [json.loads(line)["msg_id"] for line in lines_of(tmp_path / "2026010100" / name)]
    second = [json.loads(line)["msg_id"] for line in lines_of(tmp_path / "2026010101" / name)]
    assert (first, second) == (["a"], ["b", "c", "d"])


def test_the_file_of_an_earlier_hour_is_appended_to_not_replaced(tmp_path):
    clock = FakeClock(T0_MS)
    for msg_id in ("a", "b"):
        with TraceWriter(tmp_path, "delay:d1", clock_ms=clock, background=False) as writer:
            writer.emit(ev(msg_id))
    assert [e["msg_id"] for e in read_events([tmp_path])] == ["a", "b"]


def test_emit_only_buffers_until_a_flush(tmp_path):
    writer = TraceWriter(tmp_path, "rt", clock_ms=FakeClock(T0_MS), background=False)
    writer.emit(ev("a"))
    assert os.listdir(tmp_path) == [] and writer.written_events == 0
    writer.flush()
    assert writer.written_events == 1
    writer.close()


def test_the_writer_adds_the_server_name_to_each_event(tmp_path):
    with TraceWriter(tmp_path, "realtime:rt-9", clock_ms=FakeClock(T0_MS),
                     background=False) as writer:
        writer.emit(ev("a"))
    (event,) = read_events([tmp_path])
    assert event["server"] == "realtime:rt-9"
    assert tuple(event) == EVENT_FIELD_NAMES


def wait_written(writer: TraceWriter, count: int, timeout_s: float = 5.0) -> bool:
    """Poll the background thread's progress (it is real time by design); True if reached."""
    deadline = threading.Event()
    for _ in range(int(timeout_s / 0.005)):
        if writer.written_events >= count:
            return True
        deadline.wait(0.005)
    return False


def test_full_batches_of_half_the_pending_limit_wake_the_background_thread_early(tmp_path):
    # An hour-long interval: only full batches of 4 events (half of pending_events_max 8) can
    # explain a write within the test.
    writer = TraceWriter(tmp_path, "rt", flush_interval_ms=HOUR_MS, batch_max=2,
                         pending_events_max=8, clock_ms=FakeClock(T0_MS))
    for msg_id in ("a", "b", "c", "d"):
        writer.emit(ev(msg_id))
    assert wait_written(writer, 4), "the background thread did not write the full batches"
    writer.emit(ev("e"))
    writer.close()
    assert [e["msg_id"] for e in read_events([tmp_path])] == ["a", "b", "c", "d", "e"]


def test_the_background_thread_writes_a_partial_batch_after_the_interval(tmp_path):
    writer = TraceWriter(tmp_path, "rt", flush_interval_ms=20, clock_ms=FakeClock(T0_MS))
    writer.emit(ev("a"))
    assert wait_written(writer, 1)
    writer.close()


def test_an_idle_writer_thread_waits_for_the_first_line_with_no_timeout(tmp_path):
    # Nothing waiting, the thread takes no look every trickle interval: an idle server's writer
    # does not wake at all (issue 18: idle CPU).
    writer = TraceWriter(tmp_path, "rt", flush_interval_ms=20, trickle_interval_ms=5,
                         clock_ms=FakeClock(T0_MS))
    timeouts: queue.SimpleQueue = queue.SimpleQueue()
    real_wait = writer._cond.wait

    def wait(timeout=None):
        timeouts.put(timeout)
        return real_wait(timeout)

    writer._cond.wait = wait
    writer.emit(ev("a"))
    assert wait_written(writer, 1, timeout_s=30)
    deadline = time.monotonic() + 30  # generous: the thread loops once after the write
    waited = []
    while None not in waited and time.monotonic() < deadline:
        try:
            waited.append(timeouts.get(timeout=1))
        except queue.Empty:
            pass
    assert None in waited, f"the thread kept looking every interval: {waited[-5:]}"
    writer.emit(ev("b"))  # and the next line wakes it
    assert wait_written(writer, 2, timeout_s=30)
    writer.close()


class FakeMonotonic:
    """The writer thread's interval clock: stands still until the test moves it, and counts
    the looks the thread takes (one per trickle interval)."""

    def __init__(self) -> None:
        self.now_s = 100.0
        self.looks = 0
        self._cond = threading.Condition()

    def __call__(self) -> float:
        with self._cond:
            self.looks += 1
            self._cond.notify_all()
            return self.now_s

    def wait_looks(self, more: int, timeout_s: float = 30.0) -> bool:
        """Wait until the thread has looked ``more`` more times; True if it did."""
        with self._cond:
            target = self.looks + more
            return self._cond.wait_for(lambda: self.looks >= target, timeout_s)


def test_a_trickle_is_written_at_the_next_trickle_interval_not_after_the_flush_interval(
        tmp_path):
    # An hour-long flush interval and a clock that never moves: only the trickle rule (at
    # least trickle_events_min and at most trickle_events_max waiting at a look) writes.
    writer = TraceWriter(tmp_path, "rt", flush_interval_ms=HOUR_MS, trickle_interval_ms=5,
                         trickle_events_min=2, trickle_events_max=4, clock_ms=FakeClock(T0_MS),
                         monotonic_s=FakeMonotonic())
    for msg_id in ("a", "b", "c"):
        writer.emit(ev(msg_id))
    assert wait_written(writer, 3, timeout_s=30), "not written at a trickle interval"
    writer.close()
    assert [e["msg_id"] for e in read_events([tmp_path])] == ["a", "b", "c"]


def test_fewer_events_than_a_trickle_write_wait_for_the_flush_interval(tmp_path):
    clock = FakeMonotonic()
    writer = TraceWriter(tmp_path, "rt", flush_interval_ms=1_000, trickle_interval_ms=5,
                         trickle_events_min=2, clock_ms=FakeClock(T0_MS), monotonic_s=clock)
    writer.emit(ev("a"))
    assert clock.wait_looks(5)
    assert writer.written_events == 0
    clock.now_s += 1.0  # the flush interval since nothing waited
    assert wait_written(writer, 1, timeout_s=30), "not written after the flush interval"
    writer.close()


def test_a_burst_is_written_after_the_flush_interval_not_at_trickle_intervals(tmp_path):
    # More than trickle_events_max waiting is a burst: written when the flush interval has
    # passed (or full batches hold half of pending_events_max), not in its middle.
    clock = FakeMonotonic()
    writer = TraceWriter(tmp_path, "rt", flush_interval_ms=1_000, trickle_interval_ms=5,
                         trickle_events_min=1, trickle_events_max=4, batch_max=100,
                         pending_events_max=1_000,
                         clock_ms=FakeClock(T0_MS), monotonic_s=clock)
    writer.emit_lines([json.dumps(ev(f"m{i}") | {"server": "rt"}) for i in range(5)])
    assert clock.wait_looks(5)
    assert writer.written_events == 0
    clock.now_s += 1.0
    assert wait_written(writer, 5, timeout_s=30), "not written after the flush interval"
    writer.emit(ev("after"))  # a trickle again: written at a trickle interval
    assert wait_written(writer, 6, timeout_s=30)
    writer.close()


def test_a_write_of_many_pieces_lets_the_gil_go_between_them_while_the_rest_is_a_trickle(
        tmp_path, monkeypatch):
    # Pieces of WRITE_LINES_MAX lines; a pause after each once WRITE_SLICE_CPU_S (here 0) of
    # CPU is used, as long as what waits meanwhile is a trickle (at most trickle_events_max).
    import tracelog.writer as writer_module
    writer = TraceWriter(tmp_path, "rt", clock_ms=FakeClock(T0_MS), background=False,
                         trickle_events_max=2)
    pauses = []

    def pause(seconds: float) -> None:
        pauses.append(seconds)
        if len(pauses) == 2:  # events come while the write is under way: more than a trickle
            writer.emit_lines([json.dumps(ev(f"late{i}") | {"server": "rt"}) for i in range(3)])

    monkeypatch.setattr(writer_module, "WRITE_SLICE_CPU_S", 0.0)
    monkeypatch.setattr(writer_module, "_pause", pause)
    count = 4 * writer_module.WRITE_LINES_MAX
    members = [message_members(f"m{i}", "orders") for i in range(count)]
    writer.emit_framed("pulled", T0_MS, members, ("g", "c"))
    writer.flush()
    assert pauses == [writer_module.WRITE_PAUSE_S] * 2  # then the late events stopped them
    assert writer.written_events == count
    writer.close()
    assert writer.written_events == count + 3


def test_when_batches_back_up_the_oldest_are_dropped_and_counted(tmp_path, caplog):
    writer = TraceWriter(tmp_path, "rt", batch_max=2, pending_events_max=4,
                         clock_ms=FakeClock(T0_MS), background=False)
    for i in range(7):  # [0,1] [2,3] held; 4 -> drop [0,1]; [4,5] full; 6 -> drop [2,3]
        writer.emit(ev(str(i)))
    assert writer.dropped_events == 4
    with caplog.at_level(logging.WARNING, logger="tracelog.writer"):
        writer.close()
    assert [e["msg_id"] for e in read_events([tmp_path])] == ["4", "5", "6"]
    assert "dropped 4 events" in caplog.text


@pytest.mark.parametrize("events, dropped", [(3, 0), (4, 0), (5, 2)])
def test_memory_holds_pending_events_max_and_drops_at_one_more(tmp_path, events, dropped):
    writer = TraceWriter(tmp_path, "rt", batch_max=2, pending_events_max=4,
                         clock_ms=FakeClock(T0_MS), background=False)
    for i in range(events):
        writer.emit(ev(str(i)))
    assert writer.dropped_events == dropped
    writer.close()
    assert len(read_events([tmp_path])) == events - dropped


def test_a_write_error_drops_the_batch_counts_it_and_the_next_write_recovers(tmp_path):
    blocker = tmp_path / "trace"
    blocker.write_text("a file where the directory should be")
    writer = TraceWriter(blocker, "rt", clock_ms=FakeClock(T0_MS), background=False)
    writer.emit(ev("a"))
    writer.flush()
    assert writer.dropped_events == 1 and writer.written_events == 0
    blocker.unlink()
    writer.emit(ev("b"))
    writer.close()
    assert [e["msg_id"] for e in read_events([blocker])] == ["b"]


def test_a_disabled_writer_writes_nothing_and_starts_no_thread(tmp_path):
    before = threading.active_count()
    writer = TraceWriter(tmp_path, "rt", enabled=False)
    assert threading.active_count() == before
    writer.emit(ev("a"))
    writer.emit({"event": "not even checked"})
    writer.close()
    assert os.listdir(tmp_path) == []


def test_emit_rejects_an_unknown_kind(tmp_path):
    with TraceWriter(tmp_path, "rt", background=False) as writer:
        with pytest.raises(ValueError, match="'oops' is not one of"):
            writer.emit({"event": "oops", "ts_ms": 1, "msg_id": "m", "subject": "s"})


def test_emit_after_close_is_dropped_and_counted(tmp_path):
    writer = TraceWriter(tmp_path, "rt", background=False)
    writer.close()
    writer.emit(ev("late"))
    assert writer.dropped_events == 1


@pytest.mark.parametrize("kwargs, message", [
    ({"flush_interval_ms": 0}, "flush_interval_ms must be > 0, got 0"),
    ({"batch_max": 0}, "batch_max must be >= 1, got 0"),
    ({"trickle_interval_ms": 0}, "trickle_interval_ms must be > 0, got 0"),
    ({"trickle_events_min": -1}, "trickle_events_min must be >= 0, got -1"),
    ({"trickle_events_max": -1}, "trickle_events_max must be >= 0, got -1"),
    ({"batch_max": 10, "pending_events_max": 9}, "pending_events_max 9 must be >= batch_max 10"),
])
def test_bad_limits_fail_at_construction_naming_the_value(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        TraceWriter(tmp_path, "rt", background=False, **kwargs)


def test_read_events_skips_a_torn_last_line_and_garbage(tmp_path):
    with TraceWriter(tmp_path, "rt", clock_ms=FakeClock(T0_MS), background=False) as writer:
        writer.emit(ev("a"))
        writer.emit(ev("b"))
    (path,) = (tmp_path / "2026010100").iterdir()
    with open(path, "a", encoding="ascii") as file:
        file.write('["a list"]\n{"event":"pulled","ts_ms":1}\nnot json\n{"event":"acked","ts_m')
    assert [e["msg_id"] for e in read_events([tmp_path])] == ["a", "b"]


def test_a_reopened_file_with_a_torn_tail_starts_a_new_line(tmp_path):
    clock = FakeClock(T0_MS)
    with TraceWriter(tmp_path, "rt", clock_ms=clock, background=False) as writer:
        writer.emit(ev("a"))
    (path,) = (tmp_path / "2026010100").iterdir()
    with open(path, "a", encoding="ascii") as file:
        file.write('{"event":"acked","ts_')  # the previous process died mid-line
    with TraceWriter(tmp_path, "rt", clock_ms=clock, background=False) as writer:
        writer.emit(ev("b"))
    assert [e["msg_id"] for e in read_events([path])] == ["a", "b"]


def test_read_events_normalises_missing_fields(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"event":"produced","ts_ms":5,"msg_id":"m","subject":"s","extra":1}\n')
    assert read_events([path]) == [{
        "event": "produced", "ts_ms": 5, "server": None, "msg_id": "m", "origin_id": "m",
        "subject": "s", "group": None, "consumer": None, "created_at_ms": None,
        "deliver_at_ms": None, "retries": 0, "lateness_ms": None, "tags": None,
        "reason": None}]


def test_read_events_expands_a_line_flagged_produced_into_produced_then_its_own_event(tmp_path):
    with TraceWriter(tmp_path, "delay:d1", clock_ms=FakeClock(T0_MS), background=False) as w:
        w.emit(trace_event("scheduled", ts_ms=T0_MS + 9, msg_id="m", subject="s",
                           created_at_ms=T0_MS, deliver_at_ms=T0_MS + 60_000, produced=True))
        w.emit(trace_event("stored", ts_ms=T0_MS + 9, msg_id="n", subject="s", produced=True))
    common = {"server": "delay:d1", "subject": "s", "group": None, "consumer": None,
              "retries": 0, "lateness_ms": None, "deliver_at_ms": None, "tags": None,
              "reason": None}
    assert read_events([tmp_path]) == [
        {**common, "event": "produced", "ts_ms": T0_MS, "msg_id": "m", "origin_id": "m",
         "created_at_ms": T0_MS, "deliver_at_ms": T0_MS + 60_000},
        {**common, "event": "scheduled", "ts_ms": T0_MS + 9, "msg_id": "m", "origin_id": "m",
         "created_at_ms": T0_MS, "deliver_at_ms": T0_MS + 60_000},
        # No created_at_ms: produced at the line's own time.
        {**common, "event": "produced", "ts_ms": T0_MS + 9, "msg_id": "n", "origin_id": "n",
         "created_at_ms": None},
        {**common, "event": "stored", "ts_ms": T0_MS + 9, "msg_id": "n", "origin_id": "n",
         "created_at_ms": None},
    ]


def test_a_file_from_before_the_produced_flag_reads_one_produced_event_per_message(tmp_path):
    path = tmp_path / "old.jsonl"
    path.write_text(
        '{"event":"produced","ts_ms":5,"msg_id":"m","subject":"s","created_at_ms":5}\n'
        '{"event":"stored","ts_ms":7,"msg_id":"m","subject":"s","created_at_ms":5}\n')
    assert [(e["event"], e["ts_ms"]) for e in read_events([path])] == [
        ("produced", 5), ("stored", 7)]


def test_a_lines_frame_around_members_is_the_line_itself(tmp_path):
    writer = TraceWriter(tmp_path, 'rt"1', background=False)
    members = message_members("m", "s", created_at_ms=3)
    start, end = writer.frame("acked", T0_MS, consumer_members("g", "c"))
    assert start + members + end == writer.line("acked", T0_MS, members,
                                                 consumer_members("g", "c"))


# ------------------------------------------------------------------ pre-encoded lines (fast path)

_ints = st.integers(min_value=-(2**63), max_value=2**63 - 1)
_maybe_int = st.none() | _ints
_maybe_text = st.none() | st.text()  # any code point, lone surrogates and controls included


@settings(max_examples=300, deadline=None)
@given(kind=st.sampled_from(MESSAGE_KINDS), ts_ms=_ints, msg_id=st.text(), subject=st.text(),
       origin_id=_maybe_text, group=_maybe_text, consumer=_maybe_text,
       created_at_ms=_maybe_int, deliver_at_ms=_maybe_int,
       retries=st.integers(min_value=0, max_value=2**31 - 1), server=st.text(),
       tags=st.lists(st.text(), max_size=3), reason=_maybe_text)
def test_a_pre_encoded_line_parses_to_what_json_dumps_of_the_event_gives(
        kind, ts_ms, msg_id, subject, origin_id, group, consumer, created_at_ms, deliver_at_ms,
        retries, server, tags, reason):
    event = trace_event(kind, ts_ms=ts_ms, msg_id=msg_id, subject=subject, origin_id=origin_id,
                        group=group, consumer=consumer, created_at_ms=created_at_ms,
                        deliver_at_ms=deliver_at_ms, retries=retries, tags=tags, reason=reason)
    lateness = (f',"lateness_ms":{event["lateness_ms"]}' if "lateness_ms" in event else "")
    why = "" if reason is None else reason_member(reason)
    writer = TraceWriter("unused", server, background=False)
    line = writer.line(kind, ts_ms, message_members(
        msg_id, subject, origin_id=origin_id, created_at_ms=created_at_ms,
        deliver_at_ms=deliver_at_ms, retries=retries, tags=tags),
        consumer_members(group, consumer) + lateness + why)
    assert line.isascii() and "\n" not in line
    assert json.loads(line) == json.loads(json.dumps({**event, "server": server}))


@pytest.mark.parametrize("field, value", [
    ("created_at_ms", "5"), ("deliver_at_ms", 1.5), ("retries", True), ("created_at_ms", True)])
def test_message_members_refuses_a_value_the_schema_cannot_hold(field, value):
    with pytest.raises(ValueError, match=f"{field} must be an int, got {value!r}"):
        message_members("m", "s", **{field: value})


def test_a_pre_encoded_line_of_an_unknown_kind_is_refused(tmp_path):
    writer = TraceWriter(tmp_path, "rt", background=False)
    with pytest.raises(ValueError, match="'oops' is not one of"):
        writer.line("oops", 1, message_members("m", "s"))


def test_emit_lines_queues_a_whole_list_under_the_same_limits_as_emit(tmp_path):
    writer = TraceWriter(tmp_path, "rt", batch_max=2, pending_events_max=4,
                         clock_ms=FakeClock(T0_MS), background=False)
    members = [message_members(str(i), "orders") for i in range(7)]
    writer.emit_lines([writer.line("stored", T0_MS, m) for m in members[:3]])  # [0,1,2] full
    writer.emit_lines([writer.line("stored", T0_MS, m) for m in members[3:]])  # drops [0,1,2]
    assert writer.dropped_events == 3
    writer.close()
    assert [e["msg_id"] for e in read_events([tmp_path])] == ["3", "4", "5", "6"]
    assert all(e["server"] == "rt" for e in read_events([tmp_path]))


def test_a_retry_copys_trace_view_names_the_user_subject_and_the_chain_it_belongs_to():
    from tracelog.peek import peek_trace_members
    from wire.message import Message, encode_message

    copy = Message.create("%retry%orders%billing", b"x", now_ms=T0_MS, deliver_at_ms=T0_MS + 5,
                          properties={"qmq-origin-id": "m1"}, id="m1.r1")
    copy = Message(**{**copy.__dict__, "retries": 1})
    peeked = peek_trace_members(encode_message(copy))
    assert peeked is not None and (peeked.internal, peeked.retries) == ("retry", 1)
    assert json.loads("{" + peeked.members + "}") == {
        "msg_id": "m1.r1", "subject": "orders", "origin_id": "m1", "created_at_ms": T0_MS,
        "deliver_at_ms": T0_MS + 5, "retries": 1}
    assert peek_trace_members(b"\xc1 not msgpack") is None


def test_subscription_events_need_no_message_id_and_read_back_with_their_filter(tmp_path):
    with TraceWriter(tmp_path, "realtime:rt-1", clock_ms=FakeClock(T0_MS),
                     background=False) as writer:
        writer.emit(subscription_event("subscribed", ts_ms=T0_MS, subject="s", group="g",
                                       consumer="c1", tags=frozenset({"vip", "eu"})))
        writer.emit(subscription_event("unsubscribed", ts_ms=T0_MS + 1, subject="s", group="g",
                                       consumer="c1", reason="left"))
    (path,) = (tmp_path / "2026010100").iterdir()
    with open(path, "a", encoding="ascii") as file:  # the same without a consumer: dropped
        file.write('{"event":"subscribed","ts_ms":5,"subject":"s","group":"g"}\n')
    assert [(e["event"], e["msg_id"], e["origin_id"], e["tags"], e["reason"])
            for e in read_events([tmp_path])] == [
        ("subscribed", None, None, ["eu", "vip"], None),
        ("unsubscribed", None, None, None, "left")]


@pytest.mark.parametrize("make, message", [
    (lambda: trace_event("subscribed", ts_ms=1, msg_id="m", subject="s"), "is not one of"),
    (lambda: subscription_event("pulled", ts_ms=1, subject="s", group="g", consumer="c"),
     "'pulled' is not one of subscribed, unsubscribed"),
    (lambda: subscription_event("unsubscribed", ts_ms=1, subject="s", group="g", consumer="c",
                                reason="bored"), "reason 'bored' is not one of left, expired"),
])
def test_a_subscription_event_is_built_only_by_its_own_builder_with_a_known_reason(make,
                                                                                  message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize("count", [1, 3, 1_024, 1_025, 2_500])
def test_lines_queued_as_columns_write_the_same_bytes_as_the_lines_themselves(tmp_path, count):
    # Around WRITE_LINES_MAX (1,024): a write joins and encodes at most that many at a time.
    members = [message_members(f"m{i}", "orders") for i in range(count)]
    sequences = list(range(7, 7 + count))
    texts = []
    for name, as_columns in (("lines", False), ("columns", True)):
        with TraceWriter(tmp_path / name, "rt", clock_ms=FakeClock(T0_MS),
                         background=False) as writer:
            start, end = writer.frame("pulled", T0_MS, ',"group":"g","consumer":"c"')
            s_start, s_end = writer.frame("stored", T0_MS)
            writer.emit(ev("first"))
            if as_columns:
                writer.emit_columns([start, members, end])
                writer.emit_columns([s_start, members, ',"seq":', sequences, s_end])
            else:
                writer.emit_lines([start + m + end for m in members])
                writer.emit_lines([f'{s_start}{m},"seq":{q}{s_end}'
                                   for m, q in zip(members, sequences)])
            writer.emit(ev("last"))
        (path,) = (tmp_path / name / "2026010100").iterdir()
        texts.append(path.read_bytes())
    assert texts[0] == texts[1]
    assert texts[0].count(b"\n") == 2 * count + 2


@pytest.mark.parametrize("counts", [[1, 3, 2], [64, 65], [1_023, 1, 1], [1, 2_500, 3]],
                         ids=["a few", "around the joined-together bound", "around a write's piece",
                              "a large one between small ones"])
def test_framed_lines_write_the_same_bytes_as_the_lines_themselves_in_order(tmp_path, counts):
    """emit_framed leaves the frame and the lines to the write: the bytes and their order are
    those of emit_lines of the lines ``line`` builds, with (group, consumer) encoded as
    consumer_members does."""
    texts = []
    for name, framed in (("lines", False), ("framed", True)):
        with TraceWriter(tmp_path / name, "rt", clock_ms=FakeClock(T0_MS),
                         background=False) as writer:
            writer.emit(ev("first"))
            for n, count in enumerate(counts):
                members = [message_members(f"m{n}.{i}", "orders") for i in range(count)]
                kind, ts_ms = ("pulled", "acked")[n % 2], T0_MS + n % 2
                extra = ("g", f"c\"{n}") if n % 2 else ',"produced":true'
                if framed:
                    writer.emit_framed(kind, ts_ms, members, extra)
                else:
                    text = extra if type(extra) is str else consumer_members(*extra)
                    writer.emit_lines([writer.line(kind, ts_ms, m, text) for m in members])
                writer.emit(ev(f"after{n}"))
        (path,) = (tmp_path / name / "2026010100").iterdir()
        texts.append(path.read_bytes())
    assert texts[0] == texts[1]
    assert texts[0].count(b"\n") == sum(counts) + len(counts) + 1


def test_framed_lines_of_an_unknown_kind_or_time_are_refused_by_the_emitter(tmp_path):
    writer = TraceWriter(tmp_path, "rt", clock_ms=FakeClock(T0_MS), background=False)
    with pytest.raises(ValueError, match="trace event kind 'stord'"):
        writer.emit_framed("stord", T0_MS, ['"msg_id":"m"'])
    with pytest.raises(ValueError, match="ts_ms must be an int, got 1.5"):
        writer.emit_framed("stored", 1.5, ['"msg_id":"m"'])  # type: ignore[arg-type]
    writer.emit_framed("stored", T0_MS, [])  # no line at all
    writer.close()
    assert read_events([tmp_path]) == []


def test_columns_count_their_lines_against_the_pending_limit(tmp_path):
    writer = TraceWriter(tmp_path, "rt", batch_max=2, pending_events_max=4,
                         clock_ms=FakeClock(T0_MS), background=False)
    start, end = writer.frame("stored", T0_MS)
    members = [message_members(str(i), "orders") for i in range(7)]
    writer.emit_columns([start, members[:3], end])  # [0,1,2] full
    writer.emit_columns([start, members[3:], end])  # [3..6] full: drops [0,1,2]
    assert writer.dropped_events == 3
    writer.close()
    assert [e["msg_id"] for e in read_events([tmp_path])] == ["3", "4", "5", "6"]


def test_columns_of_different_lengths_are_refused_and_nothing_is_queued(tmp_path):
    writer = TraceWriter(tmp_path, "rt", clock_ms=FakeClock(T0_MS), background=False)
    with pytest.raises(ValueError, match=r"trace columns of \[1, 2\] lines"):
        writer.emit_columns(["{", ["a", "b"], [1], "}"])
    writer.emit_columns(["{", [], "}"])  # no line at all
    writer.close()
    assert read_events([tmp_path]) == []


def test_framed_members_count_against_the_pending_limit_and_after_close(tmp_path):
    """``emit_framed`` queues as ``_queue`` does (it does the same inline): full batches, the
    oldest shed past pending_events_max and counted, and a line after close counted."""
    writer = TraceWriter(tmp_path, "rt", batch_max=2, pending_events_max=4,
                         clock_ms=FakeClock(T0_MS), background=False)
    members = [message_members(str(i), "orders") for i in range(7)]
    for i in range(7):  # [0,1] [2,3] held; 4 -> drop [0,1]; [4,5] full; 6 -> drop [2,3]
        writer.emit_framed("stored", T0_MS, members[i:i + 1])
    assert writer.dropped_events == 4
    writer.close()
    assert [e["msg_id"] for e in read_events([tmp_path])] == ["4", "5", "6"]
    writer.emit_framed("stored", T0_MS, members[:2])
    assert writer.dropped_events == 6
