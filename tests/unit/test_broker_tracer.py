"""realtime.tracing.BrokerTracer: the acked events an ack gives, whatever the shape of its ranges,
the members remembered from a store for the first pull, and the one stored line (flagged
produced) a producer's own message costs."""

from __future__ import annotations

import json

import pytest

import realtime.tracing
from realtime.tracing import (RECENT_PER_SUBJECT_MAX, RECENT_SUBJECTS_MAX, STORED_FEW_MAX,
                              BrokerTracer)
from wire.message import Message, encode_message
from serverkit.send_check import Checked
from tracelog.events import PRODUCED_MEMBER, locator_member, message_members
from tracelog.reading import read_events
from tracelog.writer import TraceWriter

T0_MS = 1_767_225_600_000


def pulled_entries(count: int) -> list[dict]:
    return [{"payload": encode_message(Message.create("orders", b"x", now_ms=T0_MS, id=f"m{i}")),
             "pull_seq": i, "redelivered": 0} for i in range(count)]


@pytest.mark.parametrize("ranges, acked", [
    ([(2, 4)], ["m2", "m3", "m4"]),  # narrow: walks the sequences
    ([(7, 7), (0, 1), (1, 2)], ["m0", "m1", "m2", "m7"]),  # overlapping: each acked once
    ([(0, 99)], [f"m{i}" for i in range(10)]),  # wide: walks the holdings
    ([(0, 60), (1, 2)], [f"m{i}" for i in range(10)]),  # wide, one inside another
    ([(5, 3), (20, 30)], []),  # empty or outside what is held
    ([(3, 3)], ["m3"]),  # one entry (a consumer acking each message: the one-entry path)
    ([(42, 42)], []),  # one entry not held
])
def test_an_ack_traces_exactly_the_held_entries_in_its_ranges_once_each(tmp_path, ranges,
                                                                         acked):
    writer = TraceWriter(tmp_path, "realtime:rt", clock_ms=lambda: T0_MS, background=False)
    tracer = BrokerTracer(writer)
    tracer.pulled("orders", "billing", "c1", pulled_entries(10), T0_MS + 1)
    tracer.held_before_restart("orders", "billing", "c1", {100: 55, 101: 56})

    assert tracer.acked("orders", "billing", "c1", ranges, T0_MS + 2) == []
    assert tracer.acked("orders", "billing", "c1", [(101, 101)], T0_MS + 3) == [56]
    writer.close()
    events = [e for e in read_events([tmp_path]) if e["event"] == "acked"]
    assert [e["msg_id"] for e in events] == acked
    assert all((e["group"], e["consumer"], e["ts_ms"]) == ("billing", "c1", T0_MS + 2)
               for e in events)


def checked(msg_id: str, subject: str = "orders") -> Checked:
    return Checked(msg_id, subject, (), None, None, T0_MS, 0, None)


def test_a_message_pulled_soon_after_it_was_stored_is_traced_without_decoding_its_payload(
        tmp_path):
    writer = TraceWriter(tmp_path, "realtime:rt", clock_ms=lambda: T0_MS, background=False)
    tracer = BrokerTracer(writer)
    tracer.stored([checked("m0"), checked("m1")], [0, 1], T0_MS)
    # Unreadable payloads: only the members remembered at store time can name the messages.
    garbage = [{"payload": b"\xc1", "pull_seq": i, "redelivered": 0} for i in range(2)]
    tracer.pulled("orders", "billing", "c1", garbage, T0_MS + 1, [0, 1])
    tracer.pulled("orders", "search", "c2", garbage, T0_MS + 1, [0, 1])  # taken: decodes, skips
    writer.close()
    pulled = [(e["msg_id"], e["group"]) for e in read_events([tmp_path]) if e["event"] == "pulled"]
    assert pulled == [("m0", "billing"), ("m1", "billing")]


def test_the_recently_stored_members_stay_within_their_bounds(tmp_path):
    tracer = BrokerTracer(TraceWriter(tmp_path, "realtime:rt", background=False))
    tracer.stored([checked(f"m{i}") for i in range(3 * RECENT_PER_SUBJECT_MAX)],
                  list(range(3 * RECENT_PER_SUBJECT_MAX)), T0_MS)
    for s in range(RECENT_SUBJECTS_MAX + 5):
        tracer.stored([checked("x", f"s{s}")], [0], T0_MS)
    assert len(tracer._recent["orders"]) == RECENT_PER_SUBJECT_MAX
    assert min(tracer._recent["orders"]) == 2 * RECENT_PER_SUBJECT_MAX
    assert len(tracer._recent) == RECENT_SUBJECTS_MAX


def test_subjects_stored_and_not_pulled_give_up_their_oldest_members_to_a_busy_subject(
        tmp_path, monkeypatch):
    monkeypatch.setattr(realtime.tracing, "RECENT_PER_SUBJECT_MAX", 8)
    monkeypatch.setattr(realtime.tracing, "RECENT_ENTRIES_MAX", 10)
    tracer = BrokerTracer(TraceWriter(tmp_path, "realtime:rt", background=False))
    tracer.stored([checked(f"a{i}", "a") for i in range(8)], list(range(8)), T0_MS)
    assert sorted(tracer._recent["a"]) == list(range(8))  # alone: its whole window
    # "a" is never pulled; "b" stores: 11 > 10, so each keeps its share of 10 / 2 subjects,
    # "a" losing its oldest, and "b"'s batch is kept (review s13 rvperf-3: it was not).
    tracer.stored([checked(f"b{i}", "b") for i in range(3)], [0, 1, 2], T0_MS)
    assert sorted(tracer._recent["b"]) == [0, 1, 2]
    assert sorted(tracer._recent["a"]) == [3, 4, 5, 6, 7]
    tracer.stored([checked(f"b{i}", "b") for i in range(3, 9)], list(range(3, 9)), T0_MS)
    assert sorted(tracer._recent["b"]) == [4, 5, 6, 7, 8]  # its share: the last 5
    assert sum(map(len, tracer._recent.values())) <= 10


@pytest.mark.parametrize("gaps", [False, True], ids=["one run", "with gaps"])
def test_a_message_stored_alone_is_remembered_and_traced_as_the_few_messages_path_does(
        tmp_path, monkeypatch, gaps):
    """``stored``'s one-message path writes the line and keeps ``_recent`` as ``_stored_few``
    (and its ``_remember``) do for that message; with gaps between the sequences nothing
    falls out of a subject's window, and RECENT_ENTRIES_MAX bounds what is kept."""
    monkeypatch.setattr(realtime.tracing, "RECENT_PER_SUBJECT_MAX", 8)
    monkeypatch.setattr(realtime.tracing, "RECENT_ENTRIES_MAX", 10)
    one = BrokerTracer(TraceWriter(tmp_path / "one", "realtime:rt", clock_ms=lambda: T0_MS,
                                   background=False))
    few = BrokerTracer(TraceWriter(tmp_path / "few", "realtime:rt", clock_ms=lambda: T0_MS,
                                   background=False))
    sequences = [3 * n if gaps else n for n in range(30)]
    for index, seq in enumerate(sequences):
        subject = "other" if index == 20 else "orders"  # a second subject: the general step
        message = checked(f"m{seq}", subject)
        one.stored([message], [seq], T0_MS)
        assert few._stored_few([message], [seq], T0_MS)
        assert one._recent == few._recent
    assert sum(map(len, one._recent.values())) <= 10
    for tracer in (one, few):
        assert tracer.writer is not None
        tracer.writer.close()
    assert raw_lines(tmp_path / "one") == raw_lines(tmp_path / "few")
    assert len(raw_lines(tmp_path / "one")) == 30


def test_entries_pulled_and_acked_one_at_a_time_are_held_named_and_traced(tmp_path):
    writer = TraceWriter(tmp_path, "realtime:rt", clock_ms=lambda: T0_MS, background=False)
    tracer = BrokerTracer(writer)
    tracer.stored([checked("m0")], [0], T0_MS)
    tracer.stored([checked("m1")], [1], T0_MS)
    tracer.pulled_columns("orders", "billing", "c1", [10], [b"\xc1"], None, T0_MS + 1, [0])
    tracer.pulled_columns("orders", "billing", "c1", [11], [b"\xc1"], None, T0_MS + 1, [1])
    tracer.pulled_columns("orders", "billing", "c1", [12], [b"\xc1"], None, T0_MS + 1, [0])
    # The third names nothing (its member taken, its payload unreadable): not held.
    assert [(seq, log_seq) for seq, (_members, log_seq)
            in tracer._held[("orders", "billing", "c1")].items()] == [(10, 0), (11, 1)]
    assert tracer.acked("orders", "billing", "c1", [(11, 11)], T0_MS + 2) == []
    assert tracer.acked("orders", "billing", "c1", [(10, 10)], T0_MS + 2) == []
    assert ("orders", "billing", "c1") not in tracer._held
    writer.close()
    events = [(e["event"], e["msg_id"]) for e in read_events([tmp_path])
              if e["event"] in ("pulled", "acked")]
    assert events == [("pulled", "m0"), ("pulled", "m1"), ("acked", "m1"), ("acked", "m0")]


class _PulledMeanwhile(dict):
    """A subject's recent members whose oldest is taken by a pull (the pull-log thread's pop)
    right after the eviction listed it."""

    def __iter__(self):
        keys = list(super().__iter__())
        for index, key in enumerate(keys):
            if index == 1:
                self.pop(keys[0], None)
            yield key


def test_the_eviction_of_old_members_survives_a_pull_taking_one_it_listed(tmp_path, monkeypatch):
    monkeypatch.setattr(realtime.tracing, "RECENT_PER_SUBJECT_MAX", 8)
    monkeypatch.setattr(realtime.tracing, "RECENT_ENTRIES_MAX", 16)
    tracer = BrokerTracer(TraceWriter(tmp_path, "realtime:rt", background=False))
    tracer.stored([checked(f"a{n}", "a") for n in range(8)], list(range(8)), T0_MS)
    tracer.stored([checked(f"b{n}", "b") for n in range(8)], list(range(8)), T0_MS)
    tracer._recent["a"] = _PulledMeanwhile(tracer._recent["a"])
    # A third subject: the share drops to 16 // 3 = 5 and "a" gives up its oldest; a KeyError
    # here would escape the broker's publishing of a stored batch (review s13 rvperf-8).
    tracer.stored([checked(f"c{n}", "c") for n in range(2)], [0, 1], T0_MS)
    assert sorted(tracer._recent["a"]) == [3, 4, 5, 6, 7]
    assert sum(map(len, tracer._recent.values())) <= 16


def raw_lines(directory) -> list[dict]:
    return [json.loads(line) for path in sorted(directory.glob("*/*.jsonl"))
            for line in path.read_text().splitlines()]


def test_a_producers_own_message_is_one_stored_line_that_reads_as_produced_then_stored(
        tmp_path):
    writer = TraceWriter(tmp_path, "realtime:rt", clock_ms=lambda: T0_MS, background=False)
    tracer = BrokerTracer(writer)
    retry_copy = Checked("m1.r1", "%retry%orders%billing", (), None, None, T0_MS - 50, 1, "m1")
    tracer.stored([checked("m1"), retry_copy], [0, 0], T0_MS + 7)
    writer.close()
    assert [(line["event"], line["msg_id"], line.get("produced")) for line in raw_lines(tmp_path)] \
        == [("stored", "m1", True), ("stored", "m1.r1", None)]
    assert [(e["event"], e["msg_id"], e["ts_ms"], e["server"]) for e in read_events([tmp_path])] \
        == [("produced", "m1", T0_MS, "realtime:rt"), ("stored", "m1", T0_MS + 7, "realtime:rt"),
            ("stored", "m1.r1", T0_MS + 7, "realtime:rt")]


@pytest.mark.parametrize("msg_id, subject", [
    ("m1", "orders"), ('quote"back\\slash', "orders.créé"), ("\U0001f600\ud800", "a-b_c.d")])
def test_the_store_fast_path_writes_the_line_the_general_encoder_writes(tmp_path, msg_id,
                                                                          subject):
    writer = TraceWriter(tmp_path, "realtime:rt", clock_ms=lambda: T0_MS, background=False)
    tracer = BrokerTracer(writer)
    tracer.stored([checked(msg_id, subject)], [0], T0_MS + 1)
    expected = writer.line("stored", T0_MS + 1, message_members(msg_id, subject,
                                                                created_at_ms=T0_MS)
                           + locator_member(0), PRODUCED_MEMBER)
    writer.close()
    (path,) = tmp_path.glob("*/*.jsonl")
    assert path.read_text() == expected + "\n"


@pytest.mark.parametrize("deliver_at_ms", [None, T0_MS + 5], ids=["produced", "dispatched"])
@pytest.mark.parametrize("with_duplicate", [False, True], ids=["batch", "message by message"])
@pytest.mark.parametrize("ids", [["m1", "a/b~c", "!#$%&'()*+,-.:;<=>?@[]^_`{|}"],
                                 ["m1", 'quote"back\\slash', "\U0001f600\ud800"],
                                 ["m1", "tab\there", "del\x7f"]],
                         ids=["plain ids", "escaped ids", "control characters"])
@pytest.mark.parametrize("one_by_one", [False, True])
@pytest.mark.parametrize("copies", [1, 2], ids=["a few (STORED_FEW_MAX)", "more (by columns)"])
def test_stored_lines_are_the_general_encoders_whether_built_per_batch_or_per_message(
        tmp_path, deliver_at_ms, with_duplicate, ids, one_by_one, copies):
    """A batch of one subject takes the few messages' path (up to STORED_FEW_MAX) or the
    columns' path; a duplicate in it sends it down the general per-message path; a lone
    message takes the few messages' path: all write what message_members and
    TraceWriter.line write."""
    assert len(ids) == STORED_FEW_MAX < 2 * len(ids)
    ids = [f"{msg_id}{copy or ''}" for copy in range(copies) for msg_id in ids]
    writer = TraceWriter(tmp_path, "realtime:rt", clock_ms=lambda: T0_MS, background=False)
    tracer = BrokerTracer(writer)
    messages = [checked(i, "orders.créé")._replace(deliver_at_ms=deliver_at_ms,
                                                   created_at_ms=T0_MS + n % 2)
                for n, i in enumerate(ids)]
    stored_sequences = list(range(5, 5 + len(ids)))
    sequences: list[int | None] = list(stored_sequences)
    if with_duplicate:
        messages.append(checked("m1", "orders.créé"))
        sequences.append(None)
    if one_by_one:  # each message its own commit: the lone message's path
        for message, sequence in zip(messages, sequences):
            tracer.stored([message], [sequence], T0_MS + 1)
    else:
        tracer.stored(messages, sequences, T0_MS + 1)
    members = [message_members(msg_id, "orders.créé", created_at_ms=T0_MS + n % 2,
                               deliver_at_ms=deliver_at_ms) for n, msg_id in enumerate(ids)]
    assert tracer._recent["orders.créé"] == dict(zip(stored_sequences, members))
    writer.close()
    (path,) = tmp_path.glob("*/*.jsonl")
    flag = PRODUCED_MEMBER if deliver_at_ms is None else ""
    assert path.read_text() == "".join(
        writer.line("stored", T0_MS + 1, m + locator_member(seq), flag) + "\n"
        for m, seq in zip(members, stored_sequences))


@pytest.mark.parametrize("count", [2, STORED_FEW_MAX + 2], ids=["a few", "more"])
@pytest.mark.parametrize("gaps", [False, True], ids=["one run", "with gaps"])
def test_stored_lines_queued_for_the_writer_to_join_keep_their_bytes_and_order(tmp_path, count,
                                                                                  gaps):
    """The stored lines of a commit are joined by the writer's thread: the bytes and the
    order are the per-line path's, between lines queued before and after, and a caller that
    reuses its sequence list afterwards does not change what is written."""
    writer = TraceWriter(tmp_path, "realtime:rt", clock_ms=lambda: T0_MS, background=False)
    tracer = BrokerTracer(writer)
    ids = [f"m{i}" for i in range(count)]
    sequences = [7 + i * (3 if gaps else 1) for i in range(count)]
    writer.emit_lines([writer.line("acked", T0_MS, '"msg_id":"before","subject":"orders"')])
    tracer.stored([checked(i) for i in ids], sequences, T0_MS + 1)
    written_sequences = list(sequences)
    sequences[:] = [0] * count  # the caller's list is not the writer's
    tracer.stored([checked("after")], [99], T0_MS + 2)
    writer.close()
    (path,) = tmp_path.glob("*/*.jsonl")
    assert path.read_text() == "".join(
        [writer.line("acked", T0_MS, '"msg_id":"before","subject":"orders"') + "\n"]
        + [writer.line("stored", T0_MS + 1, message_members(i, "orders", created_at_ms=T0_MS)
                       + locator_member(seq), PRODUCED_MEMBER) + "\n"
           for i, seq in zip(ids, written_sequences)]
        + [writer.line("stored", T0_MS + 2, message_members("after", "orders",
                                                            created_at_ms=T0_MS)
                       + locator_member(99), PRODUCED_MEMBER) + "\n"])


def test_a_few_stored_messages_of_mixed_kinds_each_get_the_line_of_their_kind(tmp_path):
    writer = TraceWriter(tmp_path, "realtime:rt", clock_ms=lambda: T0_MS, background=False)
    tracer = BrokerTracer(writer)
    own, dispatched = checked("own"), checked("due")._replace(deliver_at_ms=T0_MS + 9)
    tracer.stored([own, dispatched, checked("own2")], [3, 4, 5], T0_MS + 1)
    writer.close()
    (path,) = tmp_path.glob("*/*.jsonl")
    assert path.read_text() == "".join(
        writer.line("stored", T0_MS + 1, message_members(i, "orders", created_at_ms=T0_MS,
                                                         deliver_at_ms=due)
                    + locator_member(seq), PRODUCED_MEMBER if due is None else "") + "\n"
        for i, due, seq in [("own", None, 3), ("due", T0_MS + 9, 4), ("own2", None, 5)])


def test_a_duplicate_in_a_stored_batch_gets_no_line(tmp_path):
    writer = TraceWriter(tmp_path, "realtime:rt", clock_ms=lambda: T0_MS, background=False)
    tracer = BrokerTracer(writer)
    tracer.stored([checked("m1"), checked("m2"), checked("m3")], [0, None, 1], T0_MS)
    writer.close()
    assert [line["msg_id"] for line in raw_lines(tmp_path)] == ["m1", "m3"]


def test_stored_lines_carry_the_time_and_flag_of_their_own_call(tmp_path):
    writer = TraceWriter(tmp_path, "realtime:rt", clock_ms=lambda: T0_MS, background=False)
    tracer = BrokerTracer(writer)
    tracer.stored([checked("m1")], [0], T0_MS + 1)
    tracer.stored([checked("m2")._replace(deliver_at_ms=T0_MS)], [1], T0_MS + 1)
    tracer.stored([checked("m3")], [2], T0_MS + 2)
    writer.close()
    assert [(line["msg_id"], line["ts_ms"], line.get("produced")) for line in raw_lines(tmp_path)] \
        == [("m1", T0_MS + 1, True), ("m2", T0_MS + 1, None), ("m3", T0_MS + 2, True)]


def test_a_tagged_message_carries_its_tags_on_its_stored_line(tmp_path):
    writer = TraceWriter(tmp_path, "realtime:rt", clock_ms=lambda: T0_MS, background=False)
    tracer = BrokerTracer(writer)
    tagged = Checked("t1", "orders", ("vip", "eu"), None, None, T0_MS, 0, None)
    tracer.stored([checked("m0"), tagged], [0, 1], T0_MS)
    writer.close()
    assert [(e["event"], e["msg_id"], e["tags"]) for e in read_events([tmp_path])] == [
        ("produced", "m0", None), ("stored", "m0", None),
        ("produced", "t1", ["vip", "eu"]), ("stored", "t1", ["vip", "eu"])]


def test_a_consumers_filter_is_traced_when_it_first_pulls_and_when_it_changes(tmp_path):
    writer = TraceWriter(tmp_path, "realtime:rt", clock_ms=lambda: T0_MS, background=False)
    tracer = BrokerTracer(writer)
    for at, tags in ((1, frozenset()), (2, frozenset()), (3, frozenset({"vip"})),
                     (4, frozenset({"vip"}))):
        tracer.subscribed("orders", "billing", "c1", tags, T0_MS + at)
    tracer.subscribed("%retry%orders%billing", "billing", "c1", frozenset(), T0_MS + 5)
    tracer.subscribed("orders", "billing", "c2", frozenset(), T0_MS + 6)
    tracer.subscribed("orders", "audit#a1", "a1", frozenset(), T0_MS + 6)
    tracer.unsubscribed([("orders", "billing", "c1")], T0_MS + 7, "left")
    # c2 last seen 1 s ago and a1 just now: with a 500 ms expiry only c2 expires.
    last_seen = {("orders", "billing"): {"c2": T0_MS + 6}, ("orders", "audit#a1"): {"a1": T0_MS + 1_000}}
    tracer.expire_subscriptions(last_seen, T0_MS + 1_006, 500)
    tracer.expire_subscriptions(last_seen, T0_MS + 1_007, 500)  # nothing more
    writer.close()
    assert [(e["event"], e["ts_ms"] - T0_MS, e["group"], e["consumer"], e["tags"], e["reason"])
            for e in read_events([tmp_path])] == [
        ("subscribed", 1, "billing", "c1", None, None),
        ("subscribed", 3, "billing", "c1", ["vip"], None),
        ("subscribed", 6, "billing", "c2", None, None),
        ("subscribed", 6, "audit#a1", "a1", None, None),
        ("unsubscribed", 7, "billing", "c1", None, "left"),
        ("unsubscribed", 1_006, "billing", "c2", None, "expired")]


def test_an_unreadable_redelivery_is_traced_as_given_up_under_the_name_it_was_released_with(
        tmp_path):
    writer = TraceWriter(tmp_path, "realtime:rt", clock_ms=lambda: T0_MS, background=False)
    tracer = BrokerTracer(writer)
    payloads = [encode_message(Message.create("orders", b"x", now_ms=T0_MS, id=f"m{i}"))
                for i in range(3)]
    tracer.pulled_columns("orders", "billing", "c1", [0, 1, 2], payloads, None, T0_MS, [10, 11, 12])
    tracer.prune("orders", "billing", "c1", {2})  # 0 and 1 released, 2 still held
    # m0 comes back readable (named without a decode: its payload here is garbage), m1 does not.
    tracer.pulled_columns("orders", "billing", "c2", [3], [b"\xc1"], [1], T0_MS + 1, [10])
    tracer.redeliveries_unreadable("orders", "billing", [11, 99], T0_MS + 2)
    writer.close()
    assert [(e["event"], e["msg_id"], e["consumer"], e["reason"])
            for e in read_events([tmp_path]) if e["ts_ms"] > T0_MS] == [
        ("pulled", "m0", "c2", None), ("redelivered", "m0", "c2", None),
        ("gave_up", "m1", None, "redelivery_unreadable"),
        ("gave_up", "orders@99", None, "redelivery_unreadable")]
    assert tracer.gave_up_counts == {"redelivery_unreadable": 2}


def test_after_a_restart_held_and_queued_entries_are_named_from_the_store_once(tmp_path):
    writer = TraceWriter(tmp_path, "realtime:rt", clock_ms=lambda: T0_MS, background=False)
    tracer = BrokerTracer(writer)
    stored = {seq: encode_message(Message.create("orders", b"x", now_ms=T0_MS, id=f"m{seq}"))
              for seq in (5, 6, 8)}

    def read(subject, seq):
        return stored[seq]  # 7 and 9 are unreadable: KeyError

    tracer.held_before_restart("orders", "billing", "c1", {0: 5, 1: 7})
    tracer.queued_before_restart("orders", "billing", [8, 9])
    tracer.name_from_store(read)
    assert tracer.acked("orders", "billing", "c1", [(0, 1)], T0_MS + 1) == [7]  # unnamed
    tracer.acks_unreadable("orders", "billing", "c1", [7], T0_MS + 1)
    tracer.redeliveries_unreadable("orders", "billing", [8, 9], T0_MS + 2)
    writer.close()
    assert [(e["event"], e["msg_id"], e["reason"]) for e in read_events([tmp_path])] == [
        ("acked", "m5", None), ("gave_up", "orders@7", "ack_unreadable"),
        ("gave_up", "m8", "redelivery_unreadable"), ("gave_up", "orders@9", "redelivery_unreadable")]
    # the unnamed ack carries its locator: the audit ties it to the copy stored there
    lines = [line for path in tmp_path.rglob("*.jsonl") for line in path.read_text().splitlines()]
    assert [json.loads(line).get("seq") for line in lines if "ack_unreadable" in line] == [7]


def test_records_passed_over_and_messages_the_hard_cap_deleted_are_given_up_with_reasons(
        tmp_path):
    writer = TraceWriter(tmp_path, "realtime:rt", clock_ms=lambda: T0_MS, background=False)
    tracer = BrokerTracer(writer)
    tracer.records_unreadable("orders", "billing", [(4, "m4"), (5, None)], T0_MS + 1)
    tracer.records_unreadable("%retry%orders%billing", "billing", [(0, "m9.r1")], T0_MS + 1)
    retry = encode_message(Message.create("orders", b"x", now_ms=T0_MS, id="m7"))
    members = [BrokerTracer.members_of(retry)]
    assert BrokerTracer.members_of(b"\xc1") is None
    tracer.retention_deleted(3, members, T0_MS + 2)  # 3 deleted, 1 named (tracing on here)
    writer.close()
    assert [(e["event"], e["msg_id"], e["subject"], e["group"], e["reason"])
            for e in read_events([tmp_path])] == [
        ("gave_up", "m4", "orders", "billing", "record_unreadable"),
        ("gave_up", "orders@5", "orders", "billing", "record_unreadable"),
        ("gave_up", "m9.r1", "orders", "billing", "record_unreadable"),
        ("gave_up", "m7", "orders", None, "retention_hard_cap")]
    assert tracer.gave_up_counts == {"record_unreadable": 3, "retention_hard_cap": 3}
