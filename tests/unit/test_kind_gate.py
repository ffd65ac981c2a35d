"""The record-kind gate of replication (serverkit.kind_gate, docs/REPLICATION.md 8.2): a master
serves a slave no record of a gated kind the slave did not say it reads (the answer ends before
it; a fetch at it is refused ``unreadable_record`` and still acknowledges the slave's offset),
and says a kind may be written only while every slave it counts (the MetaServer's slaves,
the in-sync set, recent fetchers) said it reads it; a slave that says nothing reads nothing."""

from __future__ import annotations

from typing import Any

import pytest

from delayserver.storage import done_journal
from logstore.epoch_history import EpochHistory
from logstore.record import encode_record
from realtime.storage import control_record
from realtime.storage.message_record import encode_message_record
from serverkit.kind_gate import (
    ANNOUNCED_MAX, RECENT_FETCH_MS, UNHEARD_GRACE_MS, KindReads, RecordKinds, first_unread,
)
from serverkit.replica_log import ReplicatedLog
from serverkit.replica_source import ReplicaSource
from wire.errors import BadRequest, UnreadableRecord
from wire.replication import Fetch, fetch_request, parse_fetch
from tests.laters import fetched

MESSAGE_KINDS = RecordKinds(control_record.GATED_KINDS, control_record.gated_kind_at)
ALL = control_record.GATED_KINDS
NOTHING_READ: frozenset[int] = frozenset()


def message(n: int) -> bytes:
    return encode_record(encode_message_record(1, n, 0, "orders", f"m-{n}", b"payload"))


def held(n: int) -> bytes:
    return encode_record(control_record.encode_held(1, 2, 0, "orders", f"h-{n}", b"payload"))


class BytesLog:
    """A log whose bytes are ``data`` (the store API a fetch reads)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def copy_bounds(self) -> tuple[int, int]:
        return 0, len(self.data)

    def read_copy(self, offset: int, max_bytes: int) -> bytes:
        return self.data[offset:offset + max_bytes]


async def run(fn: Any, *args: Any) -> Any:
    return fn(*args)


class Clock:
    def __init__(self) -> None:
        self.ms = 1_000

    def __call__(self) -> int:
        return self.ms


def master(tmp_path: Any, data: bytes, slaves: tuple[str, ...] = ("s1",),
           clock: Clock | None = None) -> ReplicaSource:
    history = EpochHistory(str(tmp_path / "message.epochs"))
    history.append(1, 0)
    log = ReplicatedLog("message", BytesLog(data), history, run, kinds=MESSAGE_KINDS)
    source = ReplicaSource("rt1", {"message": log}, clock_ms=clock or Clock(),
                           on_insync_change=lambda: None)
    source.start(1, {"message": len(data)}, ())
    source.settings("sync", 0, (), slaves)
    return source


def fetch(offset: int, reads: frozenset[int] = frozenset(), slave: str = "s1") -> Fetch:
    return Fetch(1, slave, 1, "message", offset, 1, 1 << 20, 0, reads)


def test_a_fetch_says_what_it_reads_only_when_it_reads_something_and_absent_means_nothing():
    assert "reads" not in fetch_request("s1", 1, "message", 0, 1, 100, 0)
    assert parse_fetch(fetch_request("s1", 1, "message", 0, 1, 100, 0), 1).reads == frozenset()
    sent = fetch_request("s1", 1, "message", 0, 1, 100, 0, (5, 1))
    assert sent["reads"] == [1, 5]
    assert parse_fetch(sent, 1).reads == {1, 5}


@pytest.mark.parametrize("reads", [[1, 300], [1, True], "1", [1] * 33, [[1]], [{}], [1, [2]]])
def test_a_fetch_whose_reads_is_not_a_short_list_of_kinds_is_a_bad_request(reads):
    frame = fetch_request("s1", 1, "message", 0, 1, 100, 0, (1,))
    assert parse_fetch(frame, 1).reads == {1}  # the same list, seen before, is taken
    frame["reads"] = reads
    with pytest.raises(BadRequest, match="fetch.reads"):
        parse_fetch(frame, 1)


def test_the_first_unread_record_is_found_by_its_kind_and_message_records_are_never_gated():
    data = message(0) + message(1) + held(2) + message(3)
    assert first_unread(data, frozenset(), control_record.gated_kind_at) == (
        len(message(0) + message(1)), control_record.KIND_HELD)
    assert first_unread(data, ALL, control_record.gated_kind_at) is None
    assert first_unread(message(0), frozenset(), control_record.gated_kind_at) is None


def test_only_the_handed_and_dropped_journal_kinds_are_gated():
    def record(kind: int) -> bytes:
        return encode_record(done_journal.encode_journal_record(kind, 0, [], [], [], {}))

    data = b"".join(record(k) for k in (1, 2, 3, 4, 5))
    found = first_unread(data, frozenset(), done_journal.gated_kind_at)
    assert found == (len(b"".join(record(k) for k in (1, 2, 3))), done_journal.KIND_HANDED)
    assert first_unread(data, frozenset({4}), done_journal.gated_kind_at)[1] == 5
    assert first_unread(data, frozenset({4, 5}), done_journal.gated_kind_at) is None


async def test_a_slave_that_says_nothing_is_served_the_records_before_the_first_held_one(
        tmp_path):
    before = message(0) + message(1)
    source = master(tmp_path, before + held(2) + message(3))
    answer = await fetched(source, fetch(0))
    assert answer["data"] == before
    assert answer["next_offset"] == len(before)
    assert source.kind_reads.unreadable_fetches == 1


async def test_a_fetch_at_a_record_the_slave_does_not_read_is_refused_and_acknowledges_it(
        tmp_path):
    before = message(0)
    source = master(tmp_path, before + held(1))
    with pytest.raises(UnreadableRecord, match=f"offset {len(before)} .* kind 1"):
        await fetched(source, fetch(len(before)))
    assert source.tracker.acked("s1", "message") == len(before)


async def test_a_slave_that_reads_every_kind_is_served_everything(tmp_path):
    data = message(0) + held(1) + message(2)
    source = master(tmp_path, data)
    answer = await fetched(source, fetch(0, ALL))
    assert answer["data"] == data


async def test_a_kind_may_be_written_only_once_every_listed_slave_said_it_reads_it(tmp_path):
    source = master(tmp_path, b"", slaves=("s1", "s2"))
    assert "s1, s2" in source.kind_refusal("message", 1)  # not heard from: they read nothing
    await fetched(source, fetch(0, ALL, "s1"))
    why = source.kind_refusal("message", 1)
    assert why is not None and "s2" in why and "s1" not in why
    await fetched(source, fetch(0, frozenset(), "s2"))  # an older server: says nothing
    assert source.kind_refusal("message", 1) is not None
    await fetched(source, fetch(0, ALL, "s2"))  # upgraded
    assert source.kind_refusal("message", 1) is None


async def test_a_recent_fetcher_the_metaserver_does_not_list_counts_until_it_goes_quiet(
        tmp_path):
    clock = Clock()
    source = master(tmp_path, b"", slaves=(), clock=clock)
    assert source.kind_refusal("message", 1) is None  # solo: nobody to read it
    await fetched(source, fetch(0, frozenset(), "stranger"))
    assert "stranger" in source.kind_refusal("message", 1)
    clock.ms += RECENT_FETCH_MS + 1
    assert source.kind_refusal("message", 1) is None


async def test_a_new_term_forgets_what_slaves_read_and_a_stopped_master_refuses(tmp_path):
    source = master(tmp_path, b"")
    await fetched(source, fetch(0, ALL))
    assert source.kind_refusal("message", 4) is None
    source.stop("demoted")
    assert "not serving as the master" in source.kind_refusal("message", 4)
    source.start(2, {"message": 0}, ())
    source.settings("sync", 0, (), ("s1",))
    assert source.kind_refusal("message", 4) is not None  # s1 may have been downgraded


async def test_a_listed_slave_not_heard_from_this_term_counts_only_within_the_grace(tmp_path):
    """A slave down since before this term (crashed, or the old master after a failover)
    would otherwise keep the kinds unwritten for its whole outage (review rvdelay-2)."""
    clock = Clock()
    source = master(tmp_path, b"", slaves=("up", "down"), clock=clock)
    assert "down, up" in source.kind_refusal("message", 5)
    await fetched(source, fetch(0, ALL, "up"))
    clock.ms += UNHEARD_GRACE_MS - 1
    assert "down" in source.kind_refusal("message", 5)  # it may yet fetch, older
    clock.ms += 1
    assert source.kind_refusal("message", 5) is None
    await fetched(source, fetch(0, NOTHING_READ, "down"))  # back, older: counts again
    assert "down" in source.kind_refusal("message", 5)


async def test_a_slave_listed_again_after_it_was_dropped_gets_a_whole_grace(tmp_path):
    clock = Clock()
    source = master(tmp_path, b"", slaves=("s1",), clock=clock)
    clock.ms += UNHEARD_GRACE_MS
    assert source.kind_refusal("message", 5) is None  # taken to be down
    source.settings("sync", 0, (), ())  # deregistered
    clock.ms += 60_000
    source.settings("sync", 0, (), ("s1",))  # registered again: it may fetch, older
    assert "s1" in source.kind_refusal("message", 5)
    clock.ms += UNHEARD_GRACE_MS
    assert source.kind_refusal("message", 5) is None


async def test_a_slave_heard_from_that_goes_quiet_still_counts_with_what_it_said(tmp_path):
    clock = Clock()
    source = master(tmp_path, b"", slaves=("old",), clock=clock)
    await fetched(source, fetch(0, NOTHING_READ, "old"))
    clock.ms += UNHEARD_GRACE_MS + RECENT_FETCH_MS
    assert "old" in source.kind_refusal("message", 5)  # listed: what it said stands


async def test_a_slave_back_older_after_kinds_were_written_in_its_absence_stops_whole(tmp_path):
    """What makes the grace safe: the fetch rule alone keeps a returning older slave's copy
    whole, before the first record written while it was down."""
    clock = Clock()
    before = message(0) + message(1)
    source = master(tmp_path, before + held(2) + message(3), slaves=("down",), clock=clock)
    clock.ms += UNHEARD_GRACE_MS
    assert source.kind_refusal("message", 1) is None
    answer = await fetched(source, fetch(0, NOTHING_READ, "down"))
    assert answer["data"] == before
    with pytest.raises(UnreadableRecord):
        await fetched(source, fetch(len(before), NOTHING_READ, "down"))
    assert source.tracker.acked("down", "message") == len(before)


def test_the_view_names_each_counted_slave_what_it_reads_and_where_it_stopped():
    reads = KindReads({"message": MESSAGE_KINDS})
    reads.announced("s1", "message", frozenset({1, 3}), 0)
    assert reads.stopped("s1", "message", 40, 4)
    assert not reads.stopped("s1", "message", 40, 4)  # logged once per place
    assert reads.view(("s1", "s2"), 0) == {
        "s1": {"message": {"reads": [1, 3], "stopped_at": (40, 4)}},
        "s2": {"message": {"reads": None, "stopped_at": None}},
    }


def test_fetchers_not_heard_from_for_long_are_forgotten_once_there_are_many():
    reads = KindReads({"message": MESSAGE_KINDS})
    for n in range(ANNOUNCED_MAX):
        reads.announced(f"tool-{n}", "message", NOTHING_READ, 0)
    reads.announced("late", "message", NOTHING_READ, RECENT_FETCH_MS + 1)
    assert reads.counted("message", (), RECENT_FETCH_MS + 1) == ["late"]
    assert reads.reads("tool-0", "message") is None


def test_a_refusal_is_counted_and_raised_each_time_and_logged_once_per_new_reason(caplog):
    import logging

    from serverkit.kind_gate import KindRefusals
    from wire.errors import NotSupported

    refusals = KindRefusals(logging.getLogger("test.kind_refusals"))
    with caplog.at_level("WARNING", logger="test.kind_refusals"):
        for why in ("slave a", "slave a", "slave b", "slave b"):
            with pytest.raises(NotSupported, match=f"hold refused: {why}"):
                refusals.refuse(why, NotSupported, f"hold refused: {why}")
        refusals.allowed()
        with pytest.raises(NotSupported):
            refusals.refuse("slave b", NotSupported, "hold refused: slave b")
    assert refusals.count == 5 and refusals.why == "slave b"
    assert [r.getMessage() for r in caplog.records] == [
        "hold refused: slave a", "hold refused: slave b", "hold refused: slave b"]
