"""realtime.consumers.ConsumerBook, told the time by a fake clock: who is offline, who left
since a pull began, and when a group's cursor may be trusted without asking the pull log."""

from __future__ import annotations

import pytest

from realtime.consumers import ConsumerBook, group_key
from tests.rawclient import FakeClock
from wire.limits import MAX_PULL_WAIT_MS

EXPIRY_MS = 30_000
GROUP = ("orders", "billing")


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def book(clock: FakeClock) -> ConsumerBook:
    return ConsumerBook(started_ms=clock(), consumer_expiry_ms=EXPIRY_MS)


def test_a_consumer_silent_for_longer_than_the_expiry_is_offline_and_one_seen_within_it_is_not(
        book: ConsumerBook, clock: FakeClock) -> None:
    book.seen("orders", "billing", "quiet", clock())
    clock.advance(1)
    book.seen("orders", "billing", "busy", clock())
    clock.advance(EXPIRY_MS)  # quiet: EXPIRY_MS + 1 ago; busy: exactly EXPIRY_MS ago
    view = book.offline_view(clock())
    assert view.offline("orders", "billing", "quiet")
    assert not view.offline("orders", "billing", "busy")


def test_a_consumer_not_seen_since_the_start_counts_as_seen_at_the_start(
        book: ConsumerBook, clock: FakeClock) -> None:
    start_ms = clock()
    clock.advance(EXPIRY_MS)
    assert not book.offline_view(clock()).offline("orders", "billing", "from-before")
    clock.advance(1)
    view = book.offline_view(clock())
    assert view.offline("orders", "billing", "from-before")
    assert view.last_seen_ms("orders", "billing", "from-before") == start_ms


def test_an_offline_view_is_a_copy_that_later_pulls_do_not_change(
        book: ConsumerBook, clock: FakeClock) -> None:
    book.seen("orders", "billing", "c1", clock())
    clock.advance(EXPIRY_MS + 1)
    view = book.offline_view(clock())
    book.seen("orders", "billing", "c1", clock())
    assert view.offline("orders", "billing", "c1")
    assert not book.offline_view(clock()).offline("orders", "billing", "c1")


def test_a_consumer_removed_as_offline_is_forgotten_unless_it_was_seen_again_meanwhile(
        book: ConsumerBook, clock: FakeClock) -> None:
    book.seen("orders", "billing", "gone", clock())
    book.seen("orders", "billing", "back", clock())
    clock.advance(EXPIRY_MS + 1)
    view = book.offline_view(clock())
    removed = [("orders", "billing", c, view.last_seen_ms("orders", "billing", c))
               for c in ("gone", "back")]
    book.seen("orders", "billing", "back", clock())  # pulls while the expiry round runs
    book.forget_offline(removed)
    assert book.consumer_counts() == {GROUP: 1}
    assert not book.offline_view(clock()).offline("orders", "billing", "back")


def test_consumers_are_counted_per_subject_and_group_until_they_leave(
        book: ConsumerBook, clock: FakeClock) -> None:
    for consumer in ("c1", "c2"):
        book.seen("orders", "billing", consumer, clock())
    book.seen("orders", "audit", "c1", clock())
    assert book.consumer_counts() == {GROUP: 2, ("orders", "audit"): 1}
    book.forget([("orders", "billing", "c1")])
    assert book.consumer_counts() == {GROUP: 1, ("orders", "audit"): 1}


def test_an_ack_means_the_broadcast_group_too_once_the_consumer_pulled_as_a_broadcast_one(
        book: ConsumerBook, clock: FakeClock) -> None:
    assert book.keys_for("news", "all", "a") == ["all"]
    book.seen("news", group_key("all", "a", True), "a", clock())
    assert book.keys_for("news", "all", "a") == ["all", "all#a"]
    assert book.keys_for("news", "all", "b") == ["all"]
    assert book.keys_for("other", "all", "a") == ["all"]


def test_a_pull_that_began_before_a_leave_sees_it_and_one_that_began_after_does_not(
        book: ConsumerBook, clock: FakeClock) -> None:
    leaving = ("orders", "billing", "c1")
    before = book.leaves
    assert not book.left_since(leaving, before)
    book.left([leaving], monotonic_ms=5_000.0)
    after = book.leaves
    assert book.left_since(leaving, before)
    assert not book.left_since(leaving, after)
    assert not book.left_since(("orders", "billing", "c2"), before)


def test_a_consumer_that_leaves_again_is_seen_leaving_by_the_pulls_begun_before_its_last_leave(
        book: ConsumerBook) -> None:
    leaving = ("orders", "billing", "c1")
    book.left([leaving], monotonic_ms=1_000.0)
    between = book.leaves
    book.left([leaving], monotonic_ms=2_000.0)
    assert book.left_since(leaving, between)


def test_leaves_older_than_the_longest_pull_wait_are_forgotten_at_the_next_leave(
        book: ConsumerBook) -> None:
    old, recent = ("orders", "billing", "old"), ("orders", "billing", "recent")
    mark = book.leaves
    book.left([old], monotonic_ms=0.0)
    book.left([recent], monotonic_ms=float(MAX_PULL_WAIT_MS))
    assert book.left_since(old, mark)  # exactly MAX_PULL_WAIT_MS old: still kept
    book.left([("s", "g", "other")], monotonic_ms=MAX_PULL_WAIT_MS + 1.0)
    assert not book.left_since(old, mark)
    assert book.left_since(recent, mark)


def test_a_group_is_caught_up_only_when_its_known_cursor_reaches_the_end(
        book: ConsumerBook) -> None:
    assert not book.caught_up(GROUP, 0)  # no known cursor: ask the pull log
    book.remember_cursor(GROUP, 10, book.release_round())
    assert book.caught_up(GROUP, 10)
    assert not book.caught_up(GROUP, 11)


def test_a_cursor_is_not_remembered_when_a_release_round_passed_while_the_pull_ran(
        book: ConsumerBook) -> None:
    release_round = book.release_round()
    book.released([("orders", "audit")])
    book.remember_cursor(GROUP, 10, release_round)
    assert book.take_cursor(GROUP) == (None, release_round + 1)
    book.remember_cursor(GROUP, 10, book.release_round())
    known, taken_round = book.take_cursor(GROUP)
    assert known == 10
    assert book.take_cursor(GROUP)[0] is None  # taken: the pull about to run moves it
    book.released([("orders", "audit")])
    book.remember_cursor(GROUP, 11, taken_round)
    assert book.take_cursor(GROUP)[0] is None, "the round taken with the cursor is the one compared"


def test_a_release_forgets_the_cursors_of_the_groups_it_touched_and_keeps_the_others(
        book: ConsumerBook) -> None:
    other = ("orders", "audit")
    book.remember_cursor(GROUP, 10, book.release_round())
    book.remember_cursor(other, 7, book.release_round())
    book.released([GROUP])
    assert not book.caught_up(GROUP, 10)
    assert book.caught_up(other, 7)


def test_a_release_of_nothing_is_no_release_round(book: ConsumerBook) -> None:
    release_round = book.release_round()
    book.released([])
    assert book.release_round() == release_round


def test_a_consumer_parked_in_a_long_poll_stays_present_however_long_it_waits(
        book: ConsumerBook, clock: FakeClock) -> None:
    consumer = ("orders", "billing", "idle")
    book.seen(*consumer, clock())
    book.park(consumer)
    clock.advance(3 * EXPIRY_MS)  # a wait far past the expiry, with nothing sent meanwhile
    assert not book.offline_view(clock()).offline(*consumer)
    assert book.unpark(consumer, clock())  # the poll ends: seen then (and says so)
    clock.advance(EXPIRY_MS)
    assert not book.offline_view(clock()).offline(*consumer)
    clock.advance(1)
    assert book.offline_view(clock()).offline(*consumer)


def test_a_parked_poll_that_ends_after_its_consumer_left_does_not_bring_it_back(
        book: ConsumerBook, clock: FakeClock) -> None:
    consumer = ("orders", "billing", "gone")
    book.seen(*consumer, clock())
    book.park(consumer)
    book.forget([consumer])
    assert not book.unpark(consumer, clock())  # not marked seen: the caller marks nothing
    assert book.consumer_counts() == {GROUP: 0}


def test_a_poll_that_parks_at_once_is_seen_by_park_itself(
        book: ConsumerBook, clock: FakeClock) -> None:
    consumer = ("orders", "billing", "new")
    book.park(consumer, clock())  # seen and parked in one call, as a parking pull does
    assert book.last_seen()[("orders", "billing")] == {"new": clock()}
    clock.advance(3 * EXPIRY_MS)
    assert not book.offline_view(clock()).offline(*consumer)  # parked: present
    assert book.unpark(consumer, clock())  # known to the book: seen as the poll ends
