"""The hand-off's bounds (the Scheduler alone, a fake clock, fake broker functions): the
handed ids (HANDED_IDS_MAX, pruning by due time) and the brokers' clocks (review s10 R9: a
hand-off is visible no earlier than its due time by our clock)."""

from __future__ import annotations

from delayserver.handoff import HANDOFF_STEP_MS
from tests.rawclient import FakeClock
from tests.unit.delay_handoff_support import (
    LEAD_MS, HoldingBroker, started, schedule, into_the_lead)
from tests.unit.test_delay_scheduler_races import settle


async def test_hand_offs_past_handed_ids_max_are_sent_at_their_due_time(tmp_path, monkeypatch):
    # review s10 R10: nothing bounded the ids a delay server remembers as handed.
    monkeypatch.setattr("delayserver.handed_ids.HANDED_IDS_MAX", 2, raising=False)
    clock = FakeClock()
    broker = HoldingBroker(clock)
    scheduler = await started(tmp_path, clock, broker)
    try:
        due, messages = await into_the_lead(scheduler, clock, b"a", b"b", b"c")
        assert broker.held == [] and len(scheduler.dispatcher.handed) == 0
        clock.advance(LEAD_MS)
        await settle(scheduler)
        assert sorted(m.id for _, m in broker.received) == sorted(m.id for m in messages)
        assert min(at for at, _ in broker.received) >= due, "never early"
    finally:
        await scheduler.stop()


class _NoScan(dict):
    """A dict whose full scans fail: pruning must cost what it prunes."""

    def items(self):
        raise AssertionError("prune_handed scanned every handed id")

    def values(self):
        raise AssertionError("prune_handed scanned every handed id")

    def __iter__(self):
        raise AssertionError("prune_handed scanned every handed id")


async def test_pruning_the_handed_ids_costs_what_it_prunes_not_what_is_kept(tmp_path):
    clock = FakeClock()
    broker = HoldingBroker(clock)
    scheduler = await started(tmp_path, clock, broker)
    try:
        due, [early_one] = await into_the_lead(scheduler, clock, b"a")
        dispatcher = scheduler.dispatcher
        dispatcher.handed = _NoScan(dispatcher.handed)
        for i in range(1_000):  # due later: kept
            dispatcher.handed[f"later-{i}"] = ("s", due + 60_000, False)
        clock.advance(LEAD_MS + 1_000)
        assert dispatcher.prune_handed(clock()) == 1
        assert early_one.id not in dispatcher.handed and len(dispatcher.handed) == 1_000
    finally:
        await scheduler.stop()


async def test_a_hot_slot_of_handed_ids_is_forgotten_at_once_and_later_ones_kept(tmp_path):
    # More than 1/PRUNE_POPS_SHARE of the heap due: taken in one pass, not popped one by one.
    clock = FakeClock()
    scheduler = await started(tmp_path, clock, HoldingBroker(clock))
    try:
        dispatcher = scheduler.dispatcher
        due = clock() + 5_000
        for i in range(200):
            dispatcher.note_handed(f"hot-{i}", "s", due, False)
        for i in range(20):
            dispatcher.note_handed(f"later-{i}", "s", due + 60_000, False)
        dispatcher.note_handed("moved", "s", due, False)  # handed again, due later
        dispatcher.note_handed("moved", "s", due + 60_000, False)
        dispatcher.note_handed("dropped", "s", due, True)
        assert dispatcher.prune_handed(due + 999) == 0  # within HELD_CANCEL_GRACE_MS
        assert dispatcher.prune_handed(due + 1_000) == 201
        assert sorted(dispatcher.handed) == sorted([f"later-{i}" for i in range(20)]
                                                   + ["moved"])
        assert len(dispatcher._handed_due) == 21
        assert dispatcher.prune_handed(due + 61_000) == 21
        assert dispatcher.handed == {} and dispatcher._handed_due == []
    finally:
        await scheduler.stop()


class AheadBroker(HoldingBroker):
    """Holds and answers with its clock, ``ahead_ms`` ahead of ours (PayloadSender puts it in
    each result as ``broker_now_ms``); makes a held message visible by its own clock."""

    def __init__(self, clock: FakeClock, ahead_ms: int) -> None:
        super().__init__(clock)
        self.ahead_ms = ahead_ms

    async def hold(self, subject, payloads, visible_at_ms):
        group, results = await super().hold(subject, payloads, visible_at_ms)
        for result in results:
            result.update(group=group, broker_now_ms=self.clock() + self.ahead_ms)
        return group, results

    def visible_at_our_ms(self) -> dict[str, int]:
        """When each held message becomes visible, by our clock."""
        return {i: v - self.ahead_ms for _, i, v in self.held}


async def test_a_broker_clock_ahead_of_ours_makes_later_hand_offs_visible_no_earlier_than_due(
        tmp_path):
    # review s10 R9: a broker clock d ms ahead made handed messages visible d ms early.
    clock = FakeClock()
    broker = AheadBroker(clock, ahead_ms=300)
    scheduler = await started(tmp_path, clock, broker)
    try:
        first_due, [first] = await into_the_lead(scheduler, clock, b"a")
        second_due = clock() + 10_000
        [second] = await schedule(scheduler, clock, second_due, b"b")
        clock.advance(10_000 - LEAD_MS)
        await settle(scheduler)
        visible = broker.visible_at_our_ms()
        assert set(visible) == {first.id, second.id}
        # The first hold showed the skew (its messages were sent with no bound yet).
        assert visible[second.id] >= second_due, "visible before its due time by our clock"
    finally:
        await scheduler.stop()


async def test_a_broker_clock_ahead_by_more_than_the_bound_stops_the_hand_off(tmp_path):
    from delayserver.broker_clocks import HOLD_CLOCK_AHEAD_MS_MAX
    clock = FakeClock()
    broker = AheadBroker(clock, ahead_ms=HOLD_CLOCK_AHEAD_MS_MAX + 1)
    scheduler = await started(tmp_path, clock, broker)
    try:
        await into_the_lead(scheduler, clock, b"a")
        second_due = clock() + 10_000
        [second] = await schedule(scheduler, clock, second_due, b"b")
        clock.advance(10_000 - LEAD_MS)
        await settle(scheduler)
        assert second.id not in broker.visible_at_our_ms(), "handed to a broker far ahead"
        clock.advance(LEAD_MS)
        await settle(scheduler)
        assert [(at, m.id) for at, m in broker.received] == [(second_due, second.id)]
    finally:
        await scheduler.stop()


def test_the_clock_shift_is_the_smallest_upper_bound_in_the_window():
    from delayserver.broker_clocks import CLOCK_SKEW_WINDOW_MS, BrokerClocks
    clocks = BrokerClocks()
    assert clocks.ahead_ms(0) == 0
    # (sent, broker's clock, received) of a broker 30 ms ahead
    clocks.observe("g0", 1_000, 1_035, 1_020)  # 5 ms there: at most 35 ahead
    clocks.observe("g0", 2_000, 2_032, 2_004)  # 2 ms there: at most 32, the tightest
    clocks.observe("g0", 3_000, 3_530, 3_600)  # a slow one (500 there): never chosen
    clocks.observe("g1", 3_000, 2_900, 3_010)  # behind: never a negative shift
    assert clocks.ahead_ms(3_600) == 32
    # The tight ones left: the slow one's upper bound (530) is all that is known.
    assert clocks.ahead_ms(2_004 + CLOCK_SKEW_WINDOW_MS) == 530
    assert clocks.ahead_ms(3_600 + CLOCK_SKEW_WINDOW_MS) == 0  # nothing left in it


def visible_early_by_ms(clocks: "BrokerClocks", skew_ms: int, now_ms: int) -> int:
    """How long before its due time (by our clock) a hand-off shifted now is made visible by
    a broker whose clock runs ``skew_ms`` ahead of ours (negative: late)."""
    return skew_ms - clocks.ahead_ms(now_ms)


def test_a_hand_off_is_never_visible_early_when_the_answers_come_back_slowly():
    # Review s12 rvdelay-1: the broker reads its clock as the hold arrives, then writes
    # (fsync, sync slaves) before it answers, so the way back is the slow one.
    from delayserver.broker_clocks import BrokerClocks
    for there_ms, back_ms, skew_ms in [(1, 119, 80), (5, 295, 500), (0, 100, 500), (2, 2, 40)]:
        clocks = BrokerClocks()
        for i in range(5):
            sent = 10_000 + i * 1_000
            clocks.observe("g1", sent, sent + there_ms + skew_ms, sent + there_ms + back_ms)
        early_ms = visible_early_by_ms(clocks, skew_ms, 15_000)
        assert early_ms <= 0, (there_ms, back_ms, skew_ms, early_ms)
        assert -early_ms <= there_ms, "late by more than the quickest way there"


def test_the_shift_is_the_largest_of_the_groups():
    from delayserver.broker_clocks import BrokerClocks
    clocks = BrokerClocks()
    clocks.observe("g0", 1_000, 1_012, 1_004)  # 10 ahead, 2 ms there
    clocks.observe("g1", 1_000, 1_102, 1_004)  # 100 ahead, 2 ms there
    assert clocks.ahead_ms(1_004) == 102


def test_one_slow_round_trip_does_not_make_a_broker_clock_surely_ahead():
    from delayserver.broker_clocks import HOLD_CLOCK_AHEAD_MS_MAX, BrokerClocks
    clocks = BrokerClocks()
    # The broker's clock agrees with ours; the hold took 1.5 s to get there (a busy loop).
    clocks.observe("g0", 0, 1_500, 1_510)
    assert clocks.surely_ahead_ms(1_510) <= HOLD_CLOCK_AHEAD_MS_MAX
    # The shift stays never-early: late by that way there until a quicker hold is seen.
    assert clocks.ahead_ms(1_510) == 1_500
    clocks.observe("g0", 2_000, 2_001, 2_003)
    assert clocks.ahead_ms(2_003) == 1


def test_a_broker_clock_ahead_by_more_than_any_round_trip_is_surely_ahead():
    from delayserver.broker_clocks import CLOCK_SKEW_WINDOW_MS, BrokerClocks
    clocks = BrokerClocks()
    clocks.observe("g0", 1_000, 2_205, 1_010)  # at least 1_195 ahead, at most 1_205
    clocks.observe("g0", 2_000, 3_300, 2_100)  # at least 1_200: the surest
    assert clocks.surely_ahead_ms(2_100) == 1_200
    assert clocks.ahead_ms(2_100) == 1_205  # the smallest upper bound
    assert clocks.surely_ahead_ms(2_100 + CLOCK_SKEW_WINDOW_MS) == 0


class SlowOnceBroker(AheadBroker):
    """``AheadBroker`` whose first hold arrives ``slow_ms`` after it was sent (its answer back
    10 ms later): its clock agrees with ours, the trip there was slow (a busy event loop)."""

    def __init__(self, clock, slow_ms: int) -> None:
        super().__init__(clock, ahead_ms=0)
        self.slow_ms = slow_ms

    async def hold(self, subject, payloads, visible_at_ms):
        group, results = await super().hold(subject, payloads, visible_at_ms)
        if self.slow_ms:
            self.clock.advance(self.slow_ms)
            for result in results:
                result["broker_now_ms"] = self.clock()
            self.clock.advance(10)
            self.slow_ms = 0
        return group, results


async def test_one_hold_slow_on_its_way_does_not_stop_the_hand_off(tmp_path):
    # Before, its lead (1.5 s: the skew plus the way there) was taken as the bound on the skew,
    # over HOLD_CLOCK_AHEAD_MS_MAX: the hand-off paused for NO_HOLD_PAUSE_MS. Now it goes on,
    # never early: late by that way there while it is the tightest bound in the window.
    clock = FakeClock()
    broker = SlowOnceBroker(clock, slow_ms=1_500)
    scheduler = await started(tmp_path, clock, broker)
    try:
        await into_the_lead(scheduler, clock, b"a")
        second_due = clock() + 10_000
        [second] = await schedule(scheduler, clock, second_due, b"b")
        clock.advance(10_000 - LEAD_MS + HANDOFF_STEP_MS)  # the slow trip left the grid
        await settle(scheduler)
        visible = broker.visible_at_our_ms()
        assert second.id in visible, "the hand-off stopped after one slow hold"
        assert second_due <= visible[second.id] <= second_due + 1_500 + 10
    finally:
        await scheduler.stop()
