"""The handed-entries record (done journal kind 6, review s11 rvho-7): before a hold is sent
its entries are named durably, so after a restart or failover only the messages an earlier run
actually handed make a cancel ask the broker; a message the handed record merely covered (its
step was not hot, or nothing was handed at all) is cancelled in the store. While some slave
does not read kind 6 (the replication gate) nothing is handed off and no record of either
kind is written (review s12 rvdelay-3: a handed record, kind 4, was written instead)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from delayserver.storage import DelayStore, DelayStoreConfig
from tests.rawclient import FakeClock
from tests.unit.delay_handoff_support import (
    BUCKET_MS, LEAD_MS, HoldingBroker, UnreachableBroker, into_the_lead, restarted, schedule,
    started)
from tests.unit.test_delay_scheduler_races import settle
from wire.errors import Overloaded

NOW_MS = 1_700_000_000_000


class SendRefusingBroker(HoldingBroker):
    """Takes hand-offs but refuses every plain send (overloaded): what is sent at its due
    time waits, retried, in a backlog."""

    async def dispatch(self, subject, payloads):
        raise Overloaded("realtime overloaded")


class DownBroker(SendRefusingBroker, UnreachableBroker):
    """Refuses plain sends and cannot be asked to cancel (the realtime side in an outage)."""


async def _a_backlog_and_a_hot_step(tmp_path, clock, broker):
    """A scheduler (``handoff_min_messages`` 2) whose broker refuses plain sends: a hot step of
    two handed off, then the hand-off paused (as after a hold answered not_master) and one
    message due within the handed span scheduled, sent at its due time and refused: a backlog;
    stopped. Returns (the backlog message's due time, it, the hot due time, the hot
    messages)."""
    scheduler = await started(tmp_path, clock, broker, min_messages=2)
    try:
        hot_due = clock() + 10_000
        hot = await schedule(scheduler, clock, hot_due, b"h1", b"h2")
        clock.advance(10_000 - LEAD_MS)
        await settle(scheduler)
        assert sorted(i for _, i, _ in broker.held) == sorted(m.id for m in hot)
        scheduler.handoff.no_hold()
        cold_due = hot_due - 200
        [cold] = await schedule(scheduler, clock, cold_due, b"cold")
        clock.advance(LEAD_MS)
        await settle(scheduler)
        assert cold.id not in {i for _, i, _ in broker.held}
        assert broker.received == [] and scheduler.window.tracked, "the backlog waits"
    finally:
        await scheduler.stop()
    return cold_due, cold, hot_due, hot


async def test_after_a_restart_a_cancel_of_an_overdue_message_never_handed_is_answered_by_the_store(
        tmp_path):
    # review s11 rvho-7: every pending message due by the earlier run's handed record failed
    # its cancel (unavailable, or the broker could not be asked) until dispatched.
    clock = FakeClock()
    broker = SendRefusingBroker(clock)
    cold_due, cold, _hot_due, _hot = await _a_backlog_and_a_hot_step(tmp_path, clock, broker)
    clock.advance(60_000)  # down for a minute: the backlog is overdue
    unreachable = DownBroker(clock)
    again = await restarted(tmp_path, clock, unreachable, 0)  # the hand-off off now, too
    try:
        await settle(again)  # its send refused again: waiting to be retried
        assert await again.cancel(cold.id, cold_due) == "cancelled"
        assert unreachable.cancels == [], "asked a broker about a message never handed"
        unreachable.dispatch = HoldingBroker(clock).dispatch  # the outage ends
        await settle(again)
        clock.advance(60_000)
        await settle(again)
        assert unreachable.received == [], "a cancelled message was sent"
    finally:
        await again.stop()


async def test_after_a_restart_a_cancel_of_a_message_the_record_names_still_asks_the_broker(
        tmp_path):
    clock = FakeClock()
    broker = SendRefusingBroker(clock)
    _cold_due, _cold, hot_due, hot = await _a_backlog_and_a_hot_step(tmp_path, clock, broker)
    broker.cancel_answers = {hot[0].id: True}
    again = await restarted(tmp_path, clock, broker, LEAD_MS)
    try:
        assert await again.cancel(hot[0].id, hot_due) == "cancelled"
        assert broker.cancels == [("s", [hot[0].id])]
    finally:
        await again.stop()


async def test_while_a_slave_does_not_read_handed_entries_nothing_is_handed_nor_recorded(
        tmp_path):
    clock = FakeClock()
    broker = HoldingBroker(clock)
    scheduler = await started(tmp_path, clock, broker)
    scheduler.replica.kind_refusal = (  # type: ignore[method-assign]
        lambda log, kind: "slave d2 does not read done kind 6" if kind == 6 else None)
    try:
        due, [m] = await into_the_lead(scheduler, clock, b"a")
        assert broker.held == [], "handed off with no record naming it"
        assert scheduler.handoff.lead_ms(clock()) == 0, "the hand-off pauses"
        assert scheduler.stats.kind_refusals.count == 1
        clock.advance(due - clock())
        await settle(scheduler)
        assert [got.id for _at, got in broker.received] == [m.id], "sent at its due time"
    finally:
        await scheduler.stop()
    store = DelayStore(str(tmp_path / "delay"), DelayStoreConfig(bucket_ms=BUCKET_MS),
                       now_ms=clock())
    try:
        assert (store.handed_until_ms(), store.handed_ids_until_ms()) == (0, 0)
    finally:
        store.close()


def _store(path) -> DelayStore:
    return DelayStore(str(path), DelayStoreConfig(bucket_ms=BUCKET_MS,
                                                  segment_size_bytes_max=4096), now_ms=NOW_MS)


def test_a_handed_entries_record_names_its_entries_after_a_reopen_and_on_a_copy(tmp_path):
    master, slave = _store(tmp_path / "master"), _store(tmp_path / "slave")
    try:
        for i in range(3):
            master.append(f"m-{i}", "s", NOW_MS + 10_000, b"payload")
        entries = master.commit()
        master.record_handed_entries([(NOW_MS + 10_000, entries[:2])])
        assert master.handed_ids_until_ms() == NOW_MS + 10_000
        assert master.handed_until_ms() == 0  # it is not a handed record
        named = [master.handed_state(f"m-{i}", NOW_MS + 10_000) for i in range(3)]
        assert named == [("s", "pending", True), ("s", "pending", True),
                         ("s", "pending", False)]
        for source, target in ((master.delay_copy, slave.delay_copy),
                               (master.done_copy, slave.done_copy)):
            offset = target.copy_bounds()[1]
            while data := source.read_copy(offset, 600):
                offset = target.append_copy(offset, data)
        assert [slave.handed_state(f"m-{i}", NOW_MS + 10_000) for i in range(3)] == named
        assert slave.handed_ids_until_ms() == NOW_MS + 10_000
        master.close()
        master = _store(tmp_path / "master")
        assert [master.handed_state(f"m-{i}", NOW_MS + 10_000) for i in range(3)] == named
    finally:
        master.close()
        slave.close()


async def test_a_stop_that_cancels_the_handed_entries_write_writes_nothing_else():
    """The task writing handed-entries records is cancelled (a stop) while a hand-off waits
    for it: the hand-off is cancelled too (it was told NotSupported, and a handed record,
    kind 4, was written then), and nothing else is written."""
    from delayserver.config import DelayConfig
    from delayserver.handoff import HandOff
    from delayserver.tracing import DelayTracer

    started_write, writes = asyncio.Event(), []

    async def slow_names(hand_offs):
        writes.append(hand_offs)
        started_write.set()
        await asyncio.Event().wait()  # the write under way when the stop comes

    handoff = HandOff(DelayConfig(data_dir="x", handoff_lead_ms=LEAD_MS), FakeClock(),
                      hold=object(), cancel_held=None,  # type: ignore[arg-type]
                      tracer=DelayTracer(None), record_handed_ids=slow_names)
    waiter = asyncio.create_task(handoff.recorded(NOW_MS, []))
    await started_write.wait()
    assert handoff._namer is not None
    handoff._namer.cancel()
    with pytest.raises(asyncio.CancelledError):  # not NotSupported: no fallback is tried
        await waiter
    assert len(writes) == 1, "a stop must not end in another write"


async def test_a_stop_ends_a_handed_entries_write_that_never_returns(tmp_path):
    """The task writing handed-entries records was left running by a stop (its waiters gone),
    to write or wait on a store being closed: the stop now cancels it and waits for it."""

    clock = FakeClock()
    broker = HoldingBroker(clock)
    scheduler = await started(tmp_path, clock, broker)
    scheduler.config = dataclasses.replace(scheduler.config, shutdown_grace_ms=10)
    writing = asyncio.Event()

    async def never_written(_hand_offs):
        writing.set()  # as a write whose slaves never confirm it
        await asyncio.Event().wait()

    scheduler.handoff.record_handed_ids = never_written
    try:
        await schedule(scheduler, clock, clock() + 10_000, b"a")
        clock.advance(10_000 - LEAD_MS)
        scheduler.poke()
        async with asyncio.timeout(30):
            await writing.wait()
        namer = scheduler.handoff._namer
        assert namer is not None and not namer.done()
    finally:
        await scheduler.stop()
    assert namer.done(), "the stop left the namer running"
    assert broker.held == [], "held with no record naming it"


async def _turns_of_the_loop(n=50):
    for _ in range(n):
        await asyncio.sleep(0)


async def _until_true(cond, what):
    for _ in range(1000):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(what)


async def test_a_stop_writes_no_handed_entries_record_for_hand_offs_it_cancelled(tmp_path):
    """Review s13 rvmends-2: a stop while the first record waits for the sync slaves must not
    write the queued hand-off's record once it began (its hold is never sent)."""
    clock = FakeClock()
    broker = HoldingBroker(clock)
    scheduler = await started(tmp_path, clock, broker)
    scheduler.config = dataclasses.replace(scheduler.config, shutdown_grace_ms=50)
    replicated = asyncio.Event()  # the first record's wait for the sync slaves
    real = scheduler.handoff.record_handed_ids
    writes = []

    async def slow_first(hand_offs):
        await real(hand_offs)
        writes.append([e.id_hash for _u, es in hand_offs for e in es])
        if len(writes) == 1:
            await replicated.wait()

    scheduler.handoff.record_handed_ids = slow_first
    due = clock() + 10_000
    [first] = await schedule(scheduler, clock, due, b"first")
    [second] = await schedule(scheduler, clock, due + 1_000, b"second")
    clock.advance(10_000 - LEAD_MS)
    scheduler.poke()
    await _until_true(lambda: len(writes) == 1, "the first record is written, its sync wait pending")
    clock.advance(1_000)
    scheduler.poke()
    await _until_true(lambda: scheduler.handoff._naming, "the second hand-off waits")
    assert len(writes) == 1
    real_unrecorded = scheduler.record_unrecorded

    async def after_the_grace():  # the sync slaves answer once the dispatch tasks are cancelled
        replicated.set()
        await _until_true(lambda: len(writes) == 2 or not scheduler.handoff._naming, "namer")
        await _turns_of_the_loop()
        return await real_unrecorded()

    scheduler.record_unrecorded = after_the_grace
    await scheduler.stop()
    assert broker.held == [], "no hold was sent"
    assert len(writes) == 1, "a record was written after the stop began (for a cancelled hand-off)"
