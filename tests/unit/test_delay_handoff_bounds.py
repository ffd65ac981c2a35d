"""The hand-off's bounds (the Scheduler alone, a fake clock, fake broker functions): the
handed ids (HANDED_IDS_MAX, pruning by due time) and the brokers' clocks (review s10 R9: a
hand-off is visible no earlier than its due time by our clock)."""

from __future__ import annotations

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


def test_the_clock_bound_is_the_smallest_lead_seen_in_the_window_per_group_the_largest_of_groups():
    from delayserver.broker_clocks import CLOCK_SKEW_WINDOW_MS, BrokerClocks
    clocks = BrokerClocks()
    assert clocks.ahead_ms(0) == 0
    clocks.observe("g0", 1_000, 1_050, 1_010)  # 50: skew plus the way there
    clocks.observe("g0", 2_000, 2_020, 2_010)  # 20: tighter
    clocks.observe("g0", 3_000, 3_090, 3_010)
    clocks.observe("g1", 3_000, 2_900, 3_010)  # behind: never a negative shift
    assert clocks.ahead_ms(3_010) == 20
    assert clocks.ahead_ms(2_010 + CLOCK_SKEW_WINDOW_MS) == 90  # the 20 left the window
    assert clocks.ahead_ms(3_010 + CLOCK_SKEW_WINDOW_MS) == 0  # nothing left in it
