"""The delay server's hand-off when a hold's answer says nothing sure (review s11 rvho-1,
rvho-3): a hold answered NotMaster may be held by its group (the answer can come after the
write), so a cancel asks the group; a cancel that a broker dropped after a hold whose answer
was lost takes the message out of the schedule, so it is not sent at its due time; the
dispatcher's own drop and cancel records wait for the slaves as a cancel's do (rvho-5c); a
cancel answered dropped_before is traced by the delay server (rvho-8); a recorder stopped
while it records a drop still confirms what it recorded (rvho-5a)."""

from __future__ import annotations

import asyncio

import pytest

from delayserver.dispatch import HELD_CANCEL_GRACE_MS
from delayserver.tracing import DelayTracer
from tests.rawclient import FakeClock
from tests.unit.delay_handoff_support import (
    LEAD_MS, DropThenLoseHoldAnswer, DroppingBroker, HoldingBroker, _AnswerLostBroker,
    dropped_before_its_record, into_the_lead, one_handed, restarted, settle, started)
from tracelog.reading import read_events
from tracelog.writer import TraceWriter
from wire.errors import ConnectionLost, NoRoute, NotMaster, Unavailable


async def test_a_cancel_a_broker_dropped_after_a_lost_hold_answer_keeps_the_message_from_being_sent(
        tmp_path):
    async with one_handed(tmp_path, _AnswerLostBroker) as (scheduler, clock, broker, due, m):
        assert [i for _, i, _ in broker.held] == [m.id]  # held, its answer lost
        broker.cancel_answers = {m.id: True}  # the broker holds it: it drops it
        assert await scheduler.cancel(m.id, due) == "cancelled"
        clock.advance(due - clock())
        await settle(scheduler)
        assert broker.received == [], "answered cancelled, then sent at its due time"
        assert await scheduler.cancel(m.id, due) == "already_cancelled"


async def test_such_a_cancel_holds_after_a_restart_which_sends_nothing_and_says_already_cancelled(
        tmp_path):
    async with one_handed(tmp_path, _AnswerLostBroker) as (scheduler, clock, broker, due, m):
        broker.cancel_answers = {m.id: True}
        assert await scheduler.cancel(m.id, due) == "cancelled"
    again = await restarted(tmp_path, clock, broker, LEAD_MS)
    try:
        clock.advance(due - clock() + 10)
        await settle(again)
        assert broker.received == [], "answered cancelled, sent after the restart"
        assert await again.cancel(m.id, due) == "already_cancelled"
    finally:
        await again.stop()


class _HeldThenNotMaster(HoldingBroker):
    """Stores its first hold, then answers NotMaster (its master was demoted while waiting
    for its slaves: the promoted slave may hold it); later holds are refused NotMaster with
    nothing written (the group is failing over)."""

    async def hold(self, subject, payloads, visible_at_ms):
        if not self.held:
            await super().hold(subject, payloads, visible_at_ms)
        raise NotMaster("group rt: demoted; refresh the route and resend")


async def test_a_cancel_after_a_hold_answered_not_master_asks_the_group_and_the_message_is_sent_when_due(
        tmp_path):
    async with one_handed(tmp_path, _HeldThenNotMaster) as (scheduler, clock, broker, due, m):
        assert [i for _, i, _ in broker.held] == [m.id]  # held by the group (its new master)
        broker.cancel_answers = {m.id: True}
        assert await scheduler.cancel(m.id, due) == "cancelled"
        assert broker.cancels == [("s", [m.id])], "answered without asking the group"
        clock.advance(due - clock())
        await settle(scheduler)
        assert broker.received == [] and [i for _, i, _ in broker.held] == [m.id]


async def test_a_hold_answered_not_master_is_never_held_again_but_sent_at_its_due_time(tmp_path):
    async with one_handed(tmp_path, _HeldThenNotMaster) as (scheduler, clock, broker, due, m):
        for _ in range(LEAD_MS // 250 - 1):  # the retry backoffs of a refusal pass
            clock.advance(250)
            await settle(scheduler)
        assert [i for _, i, _ in broker.held] == [m.id] and broker.received == []
        clock.advance(due - clock())
        await settle(scheduler)
        assert [(at, r.id) for at, r in broker.received] == [(due, m.id)]


def _counting_journal_waits(scheduler) -> list[int]:
    """Make ``scheduler`` a master with slaves (``replicating``) whose done-journal waits are
    counted: one entry per wait."""
    waits: list[int] = []

    async def journal_replicated() -> None:
        waits.append(1)

    scheduler.replica.replicating = True
    scheduler.journal_replicated = journal_replicated
    return waits


async def test_a_drop_recorded_once_its_hold_is_recorded_waits_for_the_slaves(tmp_path):
    # review s11 rvho-5c: recorded, it did not wait, so a failover right after lost it.
    clock = FakeClock()
    broker = DroppingBroker(clock)
    scheduler = await started(tmp_path, clock, broker)
    try:
        waits = _counting_journal_waits(scheduler)
        # the dispatch record waits until the cancel is answered
        _due, _m, gate = await dropped_before_its_record(scheduler, clock, broker)
        before = len(waits)
        gate.set()
        await settle(scheduler)
        assert len(waits) == before + 1, "the drop's record did not wait for the slaves"
    finally:
        await scheduler.stop()


async def test_a_cancel_recorded_for_a_drop_during_a_lost_hold_answer_waits_for_the_slaves(
        tmp_path):
    clock = FakeClock()
    broker = DropThenLoseHoldAnswer(clock)
    scheduler = await started(tmp_path, clock, broker)
    try:
        waits = _counting_journal_waits(scheduler)
        due, [m] = await into_the_lead(scheduler, clock, b"a")
        assert await scheduler.cancel(m.id, due) == "cancelled"
        before = len(waits)
        broker.answer.set()
        await settle(scheduler)
        assert len(waits) == before + 1, "the cancel's record did not wait for the slaves"
        clock.advance(LEAD_MS)
        await settle(scheduler)
        assert broker.received == []
    finally:
        await scheduler.stop()


class _DroppedBefore(HoldingBroker):
    """Answers every cancel ``dropped_before``: a broker restarted or promoted since it dropped
    the message at a cancel whose replication wait failed (so it never traced the drop)."""

    async def cancel_held(self, subject, ids):
        self.cancels.append((subject, ids))
        return ["dropped_before" for _ in ids]


async def test_a_cancel_answered_dropped_before_is_traced_cancelled_by_the_delay_server(tmp_path):
    # review s11 rvho-8: nobody traced it, and the audit counted the message lost.
    clock = FakeClock()
    broker = _DroppedBefore(clock)
    writer = TraceWriter(tmp_path / "trace", "delay:d", clock_ms=clock, background=False)
    scheduler = await started(tmp_path, clock, broker, DelayTracer(writer))
    try:
        due, [m] = await into_the_lead(scheduler, clock, b"a")
        assert await scheduler.cancel(m.id, due) == "already_cancelled"
    finally:
        await scheduler.stop()
    writer.flush()
    assert [e["msg_id"] for e in read_events([tmp_path / "trace"])
            if e["event"] == "cancelled"] == [m.id]


async def test_a_recorder_cancelled_while_it_records_a_drop_still_confirms_what_it_recorded(
        tmp_path):
    # review s11 rvho-5a: the batches were recorded as dispatched but stayed in the window,
    # untraced, when a stop cancelled the recorder at the drop's record.
    clock = FakeClock()
    broker = DroppingBroker(clock)
    scheduler = await started(tmp_path, clock, broker)
    try:
        stuck = asyncio.Event()

        async def never_recorded(message_id: str, due_ms: int) -> str:
            stuck.set()  # as a drop record whose slaves never confirm it
            await asyncio.Event().wait()
            return "dropped"

        scheduler.dispatcher._record_dropped = never_recorded
        # the dispatch record waits until the cancel is answered
        _due, _m, gate = await dropped_before_its_record(scheduler, clock, broker)
        gate.set()
        async with asyncio.timeout(10):
            await stuck.wait()
        [recorder] = [t for t in scheduler.dispatcher.tasks if t.get_name() == "delay-recorder"]
        recorder.cancel()
        await asyncio.wait({recorder}, timeout=10)
        assert not scheduler.window.tracked, "recorded as dispatched, still in the window"
    finally:
        await scheduler.stop()


class _LostToGroupBroker(HoldingBroker):
    """Its first hold is stored by group ``rt-a``, whose answer is lost (PayloadSender names
    the group in the error's ``holders``); its plain sends record where they were told to go,
    and one pinned to a group refuses while ``failing_over`` (not in the route: NoRoute)."""

    def __init__(self, clock) -> None:
        super().__init__(clock)
        self.failing_over = 2
        self.sends: list[tuple[int, list | None]] = []  # (when, to_groups)

    async def hold(self, subject, payloads, visible_at_ms):
        await super().hold(subject, payloads, visible_at_ms)
        lost = ConnectionLost("the broker closed the connection")
        lost.holders = ["rt-a"] * len(payloads)
        raise lost

    async def dispatch(self, subject, payloads, visible_at_ms=None, to_groups=None):
        self.sends.append((self.clock(), to_groups))
        if to_groups is not None and self.failing_over:
            self.failing_over -= 1
            raise NoRoute("realtime group rt-a ... is not in the route")
        return await super().dispatch(subject, payloads)


async def test_the_due_time_send_after_a_lost_hold_answer_waits_for_the_group_the_hold_went_to(
        tmp_path):
    # REPLICATION.md 16 "Still open": it went to the id's home over the route then, a second
    # group after a route change, which delivered it beside the group holding it.
    async with one_handed(tmp_path, _LostToGroupBroker) as (scheduler, clock, broker, due, m):
        clock.advance(due - clock())
        await settle(scheduler)
        for _ in range(2):  # the group fails over: retried there, with backoff
            clock.advance(1_000)
            await settle(scheduler)
        assert [groups for _at, groups in broker.sends] == [["rt-a"]] * 3
        assert [got.id for _at, got in broker.received] == [m.id]
        assert scheduler.dispatcher.pinned == {}, "forgotten once recorded"


async def test_a_message_pinned_to_a_group_gone_past_the_wait_is_sent_to_its_home(tmp_path):
    from delayserver.handed_ids import PINNED_WAIT_MS
    async with one_handed(tmp_path, _LostToGroupBroker) as (scheduler, clock, broker, due, m):
        broker.failing_over = 10**6  # removed from the route
        clock.advance(due - clock())
        await settle(scheduler)
        clock.advance(PINNED_WAIT_MS + 1)
        for _ in range(3):
            clock.advance(5_000)  # past the retry backoff's cap
            await settle(scheduler)
        assert broker.sends[0][1] == ["rt-a"] and broker.sends[-1][1] is None
        assert [got.id for _at, got in broker.received] == [m.id]


async def test_a_drop_during_a_lost_hold_answer_is_cancelled_in_the_store_under_the_loader_s_lock_and_traced(
        tmp_path):
    # read-through s12: the dispatcher cancelled it in the store itself, without the loader's
    # lock (a bucket load reading the message as pending before the cancel record could put
    # it back into the window) and without the cancel's trace line.
    clock = FakeClock()
    broker = DropThenLoseHoldAnswer(clock)
    writer = TraceWriter(tmp_path / "trace", "delay:d", clock_ms=clock, background=False)
    scheduler = await started(tmp_path, clock, broker, DelayTracer(writer))
    try:
        due, [m] = await into_the_lead(scheduler, clock, b"a")
        assert await scheduler.cancel(m.id, due) == "cancelled"  # parked: its hold in flight
        async with scheduler._preload_lock:  # a bucket load under way
            broker.answer.set()
            for _ in range(50):
                await asyncio.sleep(0)
            state = await scheduler.on_io(scheduler.store.subject_and_state, m.id, due)
            assert state == ("s", "pending"), "cancelled in the store during a load"
        await settle(scheduler)
        assert await scheduler.on_io(scheduler.store.subject_and_state, m.id, due) == ("s", "done")
        clock.advance(LEAD_MS)
        await settle(scheduler)
        assert broker.received == [] and not scheduler.window.tracked
    finally:
        await scheduler.stop()
    writer.flush()
    lines = [e for e in read_events([tmp_path / "trace"]) if e["event"] == "cancelled"]
    assert [e["msg_id"] for e in lines] == [m.id, m.id], "the drop's and the store's cancel"


async def test_a_message_whose_hold_answer_was_lost_stays_named_and_once_sent_when_due_is_answered_by_the_store(
        tmp_path):
    """A lost hold answer is no refusal: its broker may hold the message, so after a restart
    a cancel before the due time still asks the broker; once the message was sent at its due
    time and the grace passed, a cancel is answered by the store without asking."""
    async with one_handed(tmp_path, _AnswerLostBroker) as (scheduler, clock, broker, due, m):
        assert scheduler.store.handed_state(m.id, due) == ("s", "pending", True)
    again = await restarted(tmp_path, clock, broker, 0)
    try:
        with pytest.raises(Unavailable):  # the broker does not hold it (any more): pending
            await again.cancel(m.id, due)
        assert broker.cancels == [("s", [m.id])], "a broker that may hold it was not asked"
        clock.advance(due - clock())
        await settle(again)
        assert [got.id for _at, got in broker.received] == [m.id]
        clock.advance(HELD_CANCEL_GRACE_MS)
        assert await again.cancel(m.id, due) == "already_dispatched"
        assert broker.cancels == [("s", [m.id])], "asked again after the grace"
    finally:
        await again.stop()
