"""TimingWheel: never early, every entry exactly once, deliver_at order, removal, wakeup rounding."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from delayserver.storage import ScheduleEntry
from delayserver.wheel import TimingWheel


def test_an_entry_is_not_returned_one_ms_before_it_is_due_and_is_returned_at_its_time():
    wheel = TimingWheel(tick_ms=10)
    wheel.add("a", 1_005)
    assert wheel.advance(1_004) == []
    assert len(wheel) == 1
    assert wheel.advance(1_005) == ["a"]
    assert len(wheel) == 0
    assert wheel.advance(10**12) == []


def test_items_added_in_one_call_are_held_and_returned_as_added_one_by_one():
    one_by_one, in_one_call = TimingWheel(tick_ms=10), TimingWheel(tick_ms=10)
    rows = [(1_030, "c", "c"), (1_010, "a", "a"), (1_020, "b1", "b1"), (1_020, "b2", "b2"),
            (1_025, "a", "a-again")]  # the last replaces a's entry
    for at, key, entry in rows:
        one_by_one.add(entry, at, key)
    in_one_call.add_items(rows)
    assert len(in_one_call) == len(one_by_one) == 4
    assert in_one_call.next_due_ms() == one_by_one.next_due_ms() == 1_020
    assert in_one_call.advance(1_030) == one_by_one.advance(1_030) == [
        "b1", "b2", "a-again", "c"]


def test_a_batch_with_a_due_time_that_is_not_an_int_is_refused_whole():
    wheel = TimingWheel()
    with pytest.raises(ValueError, match="1000.5"):
        wheel.add_items([(1_000, "a", "a"), (1000.5, "b", "b")])
    assert len(wheel) == 0
    assert wheel.advance(10**12) == []


def test_advance_returns_entries_in_deliver_at_order_and_ties_in_add_order():
    wheel = TimingWheel()
    for name, at in [("c", 30), ("a", 10), ("b1", 20), ("b2", 20), ("d", 40)]:
        wheel.add(name, at)
    assert wheel.advance(35) == ["a", "b1", "b2", "c"]
    assert wheel.advance(40) == ["d"]


def test_next_due_ms_rounds_up_to_the_tick_and_is_never_before_the_earliest_entry():
    wheel = TimingWheel(tick_ms=10)
    assert wheel.next_due_ms() is None
    wheel.add("x", 1_001)
    assert wheel.next_due_ms() == 1_010
    wheel.add("y", 1_000)
    assert wheel.next_due_ms() == 1_000
    exact = TimingWheel(tick_ms=1)
    exact.add("z", 1_001)
    assert exact.next_due_ms() == 1_001


def test_a_removed_entry_is_never_returned_and_next_due_skips_it():
    wheel = TimingWheel(tick_ms=1)
    wheel.add("early", 5, key="k1")
    wheel.add("late", 9, key="k2")
    assert wheel.remove("k1") is True
    assert wheel.remove("k1") is False
    assert "k1" not in wheel and "k2" in wheel
    assert wheel.next_due_ms() == 9
    assert wheel.advance(100) == ["late"]
    assert wheel.remove("k2") is False


def test_an_entry_added_without_a_key_is_held_under_itself():
    wheel = TimingWheel()
    entry = ScheduleEntry(bucket_ms=60_000, index=3, deliver_at_ms=60_500, delay_log_offset=0,
                          size_bytes=10, id_hash=1)
    wheel.add(entry, entry.deliver_at_ms)
    assert entry in wheel
    assert wheel.remove(entry)
    assert wheel.advance(10**9) == []


def test_adding_a_held_key_again_replaces_the_entry_and_returns_it_once():
    wheel = TimingWheel(tick_ms=1)
    wheel.add("first", 10, key="k")
    wheel.add("second", 20, key="k")
    assert len(wheel) == 1
    assert wheel.advance(15) == []
    assert wheel.advance(20) == ["second"]


def test_many_removals_do_not_keep_dead_items_in_the_heap():
    wheel = TimingWheel()
    for i in range(10_000):
        wheel.add(i, 1_000 + i)
    for i in range(9_990):
        wheel.remove(i)
    assert len(wheel) == 10
    assert wheel._stored <= 2 * 10 + 64
    assert wheel.advance(10**9) == list(range(9_990, 10_000))


@pytest.mark.parametrize("tick_ms", [0, -1, 1.5])
def test_a_tick_below_one_ms_is_refused(tick_ms):
    with pytest.raises(ValueError, match="tick_ms"):
        TimingWheel(tick_ms=tick_ms)


operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 2_000)),
        st.tuples(st.just("advance"), st.integers(0, 2_500)),
        st.tuples(st.just("remove"), st.integers(0, 60)),
    ),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(operations, st.sampled_from([1, 7, 10, 1_000]))
def test_random_adds_removes_and_advances_never_return_early_and_return_each_entry_once(
    ops, tick_ms
):
    wheel = TimingWheel(tick_ms=tick_ms)
    held: dict[int, int] = {}  # key -> deliver_at
    returned: list[int] = []
    now = 0
    next_key = 0
    for op, value in ops:
        if op == "add":
            wheel.add(next_key, value)
            held[next_key] = value
            next_key += 1
        elif op == "remove":
            assert wheel.remove(value) == (value in held)
            held.pop(value, None)
        else:
            now = max(now, value)  # the clock never goes back
            due = wheel.advance(now)
            assert all(held[key] <= now for key in due), "returned early"
            expected = sorted((at, key) for key, at in held.items() if at <= now)
            assert due == [key for _at, key in expected]
            for key in due:
                del held[key]
            returned += due
        assert len(wheel) == len(held)
        if held:
            due_ms = wheel.next_due_ms()
            earliest = min(held.values())
            assert earliest <= due_ms < earliest + tick_ms
        else:
            assert wheel.next_due_ms() is None
    assert len(returned) == len(set(returned))
    final = wheel.advance(10**9)
    assert sorted(final) == sorted(held)
