"""realtime.tail and the broker's two pull paths: from the in-memory tail, and from the message
store for a consumer behind it. Both must hand out every message once, in order."""

from __future__ import annotations

import gc

import pytest

import realtime.broker
from realtime.config import RealtimeConfig
from realtime.server import RealtimeServer
from realtime.tail import Tail
from wire.message import decode_message
from tests.rawclient import FakeClock, RawClient, message


def entry(size: int, tags: tuple[str, ...] = (), expire_at_ms: int | None = None):
    return (b"x" * size, tags, expire_at_ms)


def add(tail: Tail, subject: str, first: int, entries: list, size_bytes: int) -> None:
    """``tail.add`` of ``(payload, tags, expire_at_ms)`` entries, split into its columns."""
    tail.add(subject, first, [e[0] for e in entries], [e[1] for e in entries],
             [e[2] for e in entries], size_bytes)


def test_the_tail_keeps_at_most_its_byte_limit_evicting_the_oldest_commits():
    tail = Tail(bytes_max=1000)
    for commit in range(10):
        add(tail, "s", commit * 5, [entry(100)] * 5, 500)
        assert tail.size_bytes <= 1000
    assert tail.get("s", 40) is not None and tail.get("s", 49) is not None
    assert tail.get("s", 39) is None  # evicted with its commit
    assert tail.covering("s", 50) is not None  # right after the end: a pull may start there
    assert tail.covering("s", 10) is None


def test_the_tail_keeps_no_object_the_garbage_collector_tracks_per_commit():
    # Every gen-0 pass promotes and every older one scans again what the collector tracks; the
    # entries of atomic fields are untracked by the first pass, what holds a run is not.
    tail = Tail(bytes_max=10**9)
    add(tail, "s", 0, [entry(1)], 1)
    gc.collect()
    before = len(gc.get_objects())
    for commit in range(1, 1001):
        add(tail, "s", commit, [entry(1)], 1)
    gc.collect()
    assert len(gc.get_objects()) - before < 100  # a few: not one per commit
    assert tail.get("s", 1000) is not None


def test_the_tail_holds_no_object_the_garbage_collector_tracks_per_message():
    # A tracked object held counts towards the next young pass, which then scans it; bytes,
    # ints, None and the empty tuple are not tracked, so the columns hold none per message.
    tail = Tail(bytes_max=10**9)
    payloads = [b"x" * 10 for _ in range(5000)]
    gc.disable()
    try:
        before = len(gc.get_objects())
        for commit in range(1000):
            tail.add("s", commit * 5, payloads[commit * 5:commit * 5 + 5], [()] * 5,
                     [None] * 5, 50)
        assert len(gc.get_objects()) - before < 100  # a few: not one per message
    finally:
        gc.enable()
    assert tail.get("s", 4999) == (b"x" * 10, (), None)


def test_a_gap_in_sequences_starts_the_subject_anew():
    tail = Tail(bytes_max=10_000)
    add(tail, "s", 0, [entry(1)] * 3, 3)
    add(tail, "s", 7, [entry(1)] * 2, 2)
    assert tail.get("s", 2) is None and tail.get("s", 7) is not None


def test_take_skips_other_tags_and_expired_entries_and_moves_the_cursor_past_them():
    tail = Tail(bytes_max=10_000)
    add(tail, "s", 0, [entry(1, ("a",)), entry(1, ("b",)), entry(1, ("a",), expire_at_ms=5),
                      entry(1, ("a",))], 4)
    run = tail.covering("s", 0)
    payloads: dict[int, bytes] = {}
    chosen: list[int] = []
    cursor = run.take(0, 4, 10, frozenset({"a"}), 10, 1 << 20, payloads, chosen)
    assert (chosen, cursor) == ([0, 3], 4)


def test_take_stops_at_the_byte_budget_but_always_takes_one():
    tail = Tail(bytes_max=10_000)
    add(tail, "s", 0, [entry(300)] * 3, 900)
    run = tail.covering("s", 0)
    chosen: list[int] = []
    assert run.take(0, 3, 10, frozenset(), 0, 100, {}, chosen) == 1
    assert chosen == [0]


@pytest.mark.parametrize("entries, count, budget, chosen, cursor", [
    ([entry(10)] * 5, 3, 1 << 20, [0, 1, 2], 3),  # count reached
    ([entry(10)] * 5, 10, 1 << 20, [0, 1, 2, 3, 4], 5),  # the end of the run reached
    ([entry(10)] * 5, 10, 25, [0, 1], 2),  # the budget reached: the rest waits
    ([entry(10), entry(10, expire_at_ms=5), entry(10)], 10, 1 << 20, [0, 2], 3),  # one expired
    ([entry(10), entry(10, expire_at_ms=50), entry(10)], 10, 1 << 20, [0, 1, 2], 3),  # not yet
])
def test_take_without_tags_takes_the_whole_window_unless_an_entry_expired_or_it_is_too_big(
        entries, count, budget, chosen, cursor):
    tail = Tail(bytes_max=10_000)
    add(tail, "s", 7, entries, 10 * len(entries))
    got: list[int] = []
    payloads: dict[int, bytes] = {}
    expired: list[bytes] = []
    assert tail.covering("s", 7).take(7, 100, count, frozenset(), 10, budget, payloads, got,
                                      expired) == cursor + 7
    assert got == [seq + 7 for seq in chosen] and sorted(payloads) == got
    assert len(expired) == (1 if any(e[2] == 5 for e in entries) else 0)


def test_retention_below_the_tail_forgets_the_subject():
    tail = Tail(bytes_max=10_000)
    add(tail, "s", 5, [entry(1)] * 3, 3)
    tail.drop_below("s", 6)
    assert tail.get("s", 7) is None


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.mark.parametrize("tail_bytes_max", [1 << 20, 600], ids=["in the tail", "behind the tail"])
async def test_every_message_is_pulled_once_in_order_from_the_tail_or_the_store(
        tmp_path, clock, monkeypatch, tail_bytes_max):
    monkeypatch.setattr(realtime.broker, "TAIL_BYTES_MAX", tail_bytes_max)
    server = RealtimeServer(RealtimeConfig(data_dir=str(tmp_path / "rt"), port=0,
                                           expiry_check_interval_ms=3_600_000), clock)
    await server.start()
    client = await RawClient.connect(server.port)
    try:
        await client.pull("s", "g", "c", start="latest")  # the group starts before any message
        bodies = [b"%03d" % i for i in range(60)]
        for first in range(0, 60, 20):
            await client.send(*(message("s", b, clock) for b in bodies[first:first + 20]))
        got: list[bytes] = []
        for _ in range(10):
            pulled = await client.pull("s", "g", "c", max_count=7)
            got += [decode_message(p).body for p in pulled["payloads"]]
            if len(got) >= 60:
                break
        assert got == bodies
        assert (await client.pull("s", "g", "c"))["payloads"] == []
    finally:
        await client.close()
        await server.stop()
