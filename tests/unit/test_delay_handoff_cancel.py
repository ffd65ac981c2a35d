"""Cancels of messages the delay server handed off (the Scheduler alone, a fake clock, fake
broker functions): a cancel of a handed message asks the broker and says what it answered, also
after a restart; one of a message never handed never asks; drops are recorded in the store so a
repeated cancel says already_cancelled."""

from __future__ import annotations

import asyncio

import pytest

from delayserver.config import DelayConfig
from delayserver.scheduler import Scheduler
from tests.rawclient import FakeClock
from tests.unit.delay_handoff_support import (
    BUCKET_MS, LEAD_MS, HoldingBroker, started, schedule, into_the_lead, one_handed, restarted,
    DroppingBroker, UnreachableBroker, OlderUnreachableBroker, DropThenLoseHoldAnswer,
    dropped_before_its_record)
from tests.unit.test_delay_scheduler_races import settle
from logstore.errors import DiskFull
from wire.errors import ConnectionLost, Unavailable


async def test_a_cancel_of_a_handed_message_says_what_the_broker_answered(tmp_path):
    clock = FakeClock()
    broker = HoldingBroker(clock)
    scheduler = await started(tmp_path, clock, broker)
    try:
        due, (kept, dropped) = await into_the_lead(scheduler, clock, b"kept", b"dropped")
        assert len(broker.held) == 2
        broker.cancel_answers = {dropped.id: True}
        assert await scheduler.cancel(dropped.id, due) == "cancelled"
        assert await scheduler.cancel(dropped.id, due) == "already_cancelled"
        assert await scheduler.cancel(kept.id, due) == "already_dispatched"
        assert broker.cancels == [("s", [dropped.id]), ("s", [kept.id])]
    finally:
        await scheduler.stop()


async def test_after_a_restart_a_cancel_of_a_message_handed_but_not_recorded_asks_the_broker(
        tmp_path):
    """kill -9 between the broker's hold answer and the dispatch record: the restarted server
    finds the message in its wheel; answering "cancelled" without asking the broker lets the
    broker deliver it at its due time."""
    clock = FakeClock()
    broker = HoldingBroker(clock)
    scheduler = await started(tmp_path, clock, broker)
    due = clock() + 10_000
    try:
        [m] = await schedule(scheduler, clock, due, b"a")
        scheduler.dispatcher._record_soon = lambda *args, **kwargs: None  # dies before it
        clock.advance(10_000 - LEAD_MS)
        await settle(scheduler)
        assert [i for _, i, _ in broker.held] == [m.id]
    finally:
        await scheduler.stop()
    # Restarted with the hand-off off (an operator backing it out), or before its first tick.
    again = await restarted(tmp_path, clock, broker, 0)
    try:
        await settle(again)
        # No live group drops it (its group has no broker online, so it is not asked):
        # review s10 N4, it answered cancelled and the group delivered it when back.
        with pytest.raises(Unavailable):
            await again.cancel(m.id, due)
        assert broker.cancels, "the live groups were asked"
        broker.cancel_answers = {m.id: True}  # its group is back
        assert await again.cancel(m.id, due) == "cancelled"
        assert await again.cancel(m.id, due) == "already_cancelled"
        clock.advance(LEAD_MS)
        await settle(again)
        assert broker.received == [], "cancelled, never sent"
    finally:
        await again.stop()


class RefusingFirstBroker(HoldingBroker):
    """Refuses the first message of each hand-off for good (``bad_request``: say its
    visible_at_ms is past HOLD_AHEAD_MS_MAX by the broker's clock), holds the rest."""

    async def hold(self, subject, payloads, visible_at_ms):
        _group, results = await super().hold(subject, payloads, visible_at_ms)
        results[0] = {"id": results[0]["id"],
                      "error": {"code": "bad_request", "message": "too far ahead"}}
        return "rt", results


async def test_a_cancel_of_a_handed_message_asks_the_broker_when_its_batch_had_a_refusal(
        tmp_path):
    """_confirmed zips the batch's entries (refused ones included) with the payloads (refused
    ones left out): the handed id gets another entry's due time, and its cancel never reaches
    the broker that holds it."""
    clock = FakeClock()
    broker = RefusingFirstBroker(clock)
    scheduler = await started(tmp_path, clock, broker)
    try:
        due = clock() + 10_000
        await schedule(scheduler, clock, due - 100, b"refused")
        [kept] = await schedule(scheduler, clock, due, b"kept")
        clock.advance(10_000 - LEAD_MS)
        await settle(scheduler)
        assert kept.id in [i for _, i, _ in broker.held]
        broker.cancel_answers = {kept.id: True}
        assert await scheduler.cancel(kept.id, due) == "cancelled"
    finally:
        await scheduler.stop()


async def test_two_cancels_of_a_handed_message_at_once_never_say_already_dispatched(tmp_path):
    """A client resending its cancel (the first answer was slow) is told already_dispatched
    for a message that was cancelled and will never be delivered."""
    async with one_handed(tmp_path, DroppingBroker) as (scheduler, clock, broker, due, m):
        broker.cancel_answers = {m.id: True}
        answers = await asyncio.gather(scheduler.cancel(m.id, due), scheduler.cancel(m.id, due))
        assert sorted(answers) == ["already_cancelled", "cancelled"]


@pytest.mark.parametrize("lead_ms, min_messages", [(0, 1), (LEAD_MS, 3)])
async def test_a_cancel_of_a_message_never_handed_off_never_asks_the_broker(
        tmp_path, lead_ms, min_messages):
    """With the hand-off off, or of a message in no hot step: an unreachable broker must not
    fail it."""
    clock = FakeClock()
    broker = UnreachableBroker(clock)
    config = DelayConfig(data_dir=str(tmp_path / "delay"), port=0, bucket_ms=BUCKET_MS,
                         trace=False, handoff_lead_ms=lead_ms,
                         handoff_min_messages=min_messages)
    scheduler = await Scheduler.open(config, clock, broker.dispatch, hold=broker.hold,
                                     cancel_held=broker.cancel_held)
    await scheduler.start()
    try:
        due, [m] = await into_the_lead(scheduler, clock, b"a")
        assert broker.held == []
        assert await scheduler.cancel(m.id, due) == "cancelled"
        assert await scheduler.cancel(m.id, due) == "already_cancelled"
        assert broker.cancels == []
    finally:
        await scheduler.stop()


@pytest.mark.parametrize("lead_ms", [0, LEAD_MS])
async def test_after_a_restart_a_cancel_of_a_handed_and_recorded_message_is_dropped_by_the_broker(
        tmp_path, lead_ms):
    """The handed record tells the restarted server (hand-off on or off) that the broker may
    hold it: it asks, and says cancelled when the broker dropped it."""
    clock = FakeClock()
    broker = HoldingBroker(clock)
    scheduler = await started(tmp_path, clock, broker)
    due = clock() + 10_000
    try:
        kept, dropped = await schedule(scheduler, clock, due, b"kept", b"dropped")
        clock.advance(10_000 - LEAD_MS)
        await settle(scheduler)
        assert scheduler.stats.handed == 2
    finally:
        await scheduler.stop()
    again = await restarted(tmp_path, clock, broker, lead_ms)
    try:
        await settle(again)
        broker.cancel_answers = {dropped.id: True}
        assert await again.cancel(dropped.id, due) == "cancelled"
        assert await again.cancel(kept.id, due) == "already_dispatched"
        assert broker.cancels == [("s", [dropped.id]), ("s", [kept.id])]
        assert broker.received == [], "handed, not sent again"
    finally:
        await again.stop()


class UnreachableOnceBroker(HoldingBroker):
    """Holds hand-offs; the first cancel_held cannot reach it; at the held message's due time
    it makes it visible, so later cancels find nothing (found in review, reviewho R3)."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.unreachable = 1

    async def cancel_held(self, subject, ids):
        self.cancels.append((subject, ids))
        if self.unreachable:
            self.unreachable -= 1
            raise ConnectionLost("broker unreachable")
        return ["" for _ in ids]

    def delivered(self, message_id: str) -> bool:
        return any(i == message_id and v <= self.clock() for _w, i, v in self.held)


async def test_a_cancel_that_could_not_reach_the_broker_records_nothing_so_its_retry_is_true(
        tmp_path):
    """kill -9 before the dispatch record, restart: the store recorded the cancel before the
    broker was asked, so the retry after the broker delivered it said already_cancelled."""
    clock = FakeClock()
    broker = UnreachableOnceBroker(clock)
    scheduler = await started(tmp_path, clock, broker)
    due = clock() + 10_000
    try:
        [m] = await schedule(scheduler, clock, due, b"a")
        scheduler.dispatcher._record_soon = lambda *args, **kwargs: None  # kill -9 before it
        clock.advance(10_000 - LEAD_MS)
        await settle(scheduler)
        assert [i for _, i, _ in broker.held] == [m.id]
    finally:
        await scheduler.stop()
    again = await restarted(tmp_path, clock, broker, LEAD_MS)
    try:
        with pytest.raises(ConnectionLost):
            await again.cancel(m.id, due)
        clock.advance(LEAD_MS)  # the due time: the broker makes it visible
        await settle(again)
        assert broker.delivered(m.id)
        assert await again.cancel(m.id, due) == "already_dispatched"
    finally:
        await again.stop()


class FailFirstThenDropOnce(HoldingBroker):
    """The first cancel_held cannot reach the broker; then it drops a held id once (True) and
    says False after, each answer a loop turn later (reviewho's test)."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.calls = 0
        self.dropped: set[str] = set()

    async def cancel_held(self, subject, ids):
        self.calls += 1
        await asyncio.sleep(0)
        if self.calls == 1:
            raise ConnectionLost("unreachable")
        answers = ["" if i in self.dropped else "dropped" for i in ids]
        self.dropped.update(ids)
        return answers


async def test_three_cancels_at_once_whose_first_fails_never_say_already_dispatched(tmp_path):
    """Every waiter of the failed first cancel started its own at once: two reached the broker,
    one was told already_dispatched for a message that is never delivered."""
    async with one_handed(tmp_path, FailFirstThenDropOnce) as (scheduler, clock, broker, due, m):
        answers = await asyncio.gather(*(scheduler.cancel(m.id, due) for _ in range(3)),
                                       return_exceptions=True)
        kinds = sorted(a if isinstance(a, str) else type(a).__name__ for a in answers)
        assert kinds == ["ConnectionLost", "already_cancelled", "cancelled"], kinds


async def test_a_repeated_cancel_after_the_due_time_of_a_handed_message_the_broker_dropped_says_already_cancelled(
        tmp_path):
    # reviewho2 N3 (its after_due case): the drop was forgotten at the due time.
    async with one_handed(tmp_path, DroppingBroker) as (scheduler, clock, broker, due, m):
        assert [i for _, i, _ in broker.held] == [m.id]
        broker.cancel_answers = {m.id: True}
        assert await scheduler.cancel(m.id, due) == "cancelled"
        clock.advance(LEAD_MS + 2_000)
        await settle(scheduler)
        scheduler.dispatcher.prune_handed(clock())  # the housekeeping's round
        # The store knows the drop; once the done watermark retired the bucket (the
        # housekeeping's round may have moved it), any cancel there says already_past.
        assert await scheduler.cancel(m.id, due) in ("already_cancelled", "already_past")
        await scheduler.advance_done()
        assert await scheduler.cancel(m.id, due) == "already_past"


@pytest.mark.parametrize("after_ms", [100, 3_600_000 + LEAD_MS + 1_000])
async def test_a_second_cancel_of_a_handed_message_the_broker_dropped_says_already_cancelled_after_a_restart(
        tmp_path, after_ms):
    # review s10 N3: the drop lived in the delay master's memory only (an hour past the due
    # time); after a restart, or after the hour, the store said already_dispatched.
    async with one_handed(tmp_path, DroppingBroker) as (scheduler, clock, broker, due, m):
        broker.cancel_answers = {m.id: True}
        assert await scheduler.cancel(m.id, due) == "cancelled"
    clock.advance(after_ms)
    again = await restarted(tmp_path, clock, broker, LEAD_MS)
    try:
        await settle(again)
        assert await again.cancel(m.id, due) == "already_cancelled"
        assert broker.received == [], "dropped, never sent"
    finally:
        await again.stop()


async def test_a_drop_of_a_handed_message_whose_dispatch_is_not_recorded_yet_is_recorded_after_it(
        tmp_path):
    clock = FakeClock()
    broker = DroppingBroker(clock)
    scheduler = await started(tmp_path, clock, broker)
    try:
        # the dispatch record waits until the cancel is answered
        due, m, gate = await dropped_before_its_record(scheduler, clock, broker)
        gate.set()
        await settle(scheduler)
    finally:
        await scheduler.stop()
    again = await restarted(tmp_path, clock, broker, LEAD_MS)
    try:
        assert await again.cancel(m.id, due) == "already_cancelled"
    finally:
        await again.stop()


async def test_a_cancel_of_a_message_a_handed_record_covers_but_never_handed_does_not_ask_the_broker(
        tmp_path):
    # review s10 S1: the handed record is written before the hold; the broker refused it, so
    # the message waits for its due time, and its cancel failed while the broker was
    # unreachable although no broker held it.
    async with one_handed(tmp_path, OlderUnreachableBroker) as (scheduler, clock, broker, due, m):
        assert await scheduler.on_io(scheduler.store.handed_ids_until_ms) >= due
        assert broker.held == []
        assert await scheduler.cancel(m.id, due) == "cancelled"
        assert broker.cancels == []
        clock.advance(LEAD_MS)
        await settle(scheduler)
        assert broker.received == []


async def test_a_held_message_dropped_while_its_hold_answer_was_lost_is_never_sent_at_its_due_time(
        tmp_path):
    async with one_handed(tmp_path, DropThenLoseHoldAnswer) as (scheduler, clock, broker, due, m):
        assert [i for _, i, _ in broker.held] == [m.id]
        assert await scheduler.cancel(m.id, due) == "cancelled"
        broker.answer.set()
        await settle(scheduler)
        clock.advance(LEAD_MS)
        await settle(scheduler)
        assert broker.received == [], "answered cancelled, then sent at its due time"
        assert await scheduler.cancel(m.id, due) == "already_cancelled"


class LostDropAnswerBroker(HoldingBroker):
    """Drops a held id at the first cancel_held but the answer is lost (the connection
    drops); later it answers dropped_before (docs/PROTOCOL.md "cancel_held")."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.dropped: set[str] = set()

    async def cancel_held(self, subject, ids):
        self.cancels.append((subject, ids))
        if not self.dropped:
            self.dropped.update(ids)
            raise ConnectionLost("the answer was lost")
        return ["dropped_before" if i in self.dropped else "" for i in ids]


@pytest.mark.parametrize("restart", [False, True])
async def test_a_retried_cancel_whose_first_answer_was_lost_after_the_drop_says_already_cancelled(
        tmp_path, restart):
    # review R5: the broker dropped it, the answer was lost; the retry said already_dispatched.
    clock = FakeClock()
    broker = LostDropAnswerBroker(clock)
    scheduler = await started(tmp_path, clock, broker)
    try:
        due, [m] = await into_the_lead(scheduler, clock, b"a")
        with pytest.raises(ConnectionLost):
            await scheduler.cancel(m.id, due)
        if restart:
            await scheduler.stop()
            scheduler = await restarted(tmp_path, clock, broker, LEAD_MS)
        assert await scheduler.cancel(m.id, due) == "already_cancelled"
    finally:
        await scheduler.stop()


async def test_a_drop_during_a_hold_whose_dispatch_record_a_full_disk_held_back_is_recorded_with_it(
        tmp_path):
    clock = FakeClock()
    broker = DroppingBroker(clock)
    scheduler = await started(tmp_path, clock, broker)
    try:
        store = scheduler.store
        real_record = store.record_dispatched
        full = [True]

        def record_or_full(*args):
            if full[0]:
                raise DiskFull("delay", 1)
            return real_record(*args)

        store.record_dispatched = record_or_full
        # recorded after the cancel was answered, on a full disk
        due, m, gate = await dropped_before_its_record(scheduler, clock, broker, record_or_full)
        gate.set()
        await settle(scheduler)
        assert scheduler.dispatcher.unrecorded, "the full disk held the dispatch record back"
        full[0] = False
        assert await scheduler.record_unrecorded() == 1
    finally:
        await scheduler.stop()
    again = await restarted(tmp_path, clock, broker, LEAD_MS)
    try:
        assert await again.cancel(m.id, due) == "already_cancelled"
    finally:
        await again.stop()


async def test_a_drop_record_a_slave_cannot_read_is_logged_on_one_line_with_its_values(
        tmp_path, caplog):
    """The broker dropped a handed message but a slave does not read the dropped record (kind
    5): the cancel stands, and the refusal is one warning naming the message, its due time and
    the reason, with no traceback."""
    clock = FakeClock()
    broker = HoldingBroker(clock)
    scheduler = await started(tmp_path, clock, broker)
    try:
        due, [m] = await into_the_lead(scheduler, clock, b"a")
        scheduler.replica.kind_refusal = (  # type: ignore[method-assign]
            lambda log, kind: "slave d2 does not read done kind 5" if kind == 5 else None)
        broker.cancel_answers = {m.id: True}
        with caplog.at_level("WARNING", logger="delayserver.handoff"):
            assert await scheduler.cancel(m.id, due) == "cancelled"
        [line] = [r for r in caplog.records if r.name == "delayserver.handoff"]
        assert line.exc_info is None
        text = line.getMessage()
        assert m.id in text and str(due) in text and "slave d2 does not read" in text
    finally:
        await scheduler.stop()
