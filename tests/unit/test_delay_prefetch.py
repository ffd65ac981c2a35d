"""Payloads read ahead of their due time (delayserver/prefetch.py): a hot slot's dispatch sends
at its due instant without reading, never early, a cancel still wins, the bytes held are
bounded and a failed read-ahead falls back to the dispatch's own read. The Scheduler alone, a
fake clock and a recording dispatch function (tests/unit/test_delay_scheduler_races.py's)."""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

from delayserver.config import DelayConfig
from delayserver.prefetch import PREFETCH_AHEAD_MS
from delayserver.scheduler import Scheduler
from delayserver.tracing import DelayTracer
from delayserver.wheel import TimingWheel
from tests.rawclient import FakeClock, message
from tests.unit.test_delay_scheduler_races import BUCKET_MS, Broker, Held, settle, started
from tracelog.writer import TraceWriter
from wire.message import encode_message


class CountedReads:
    """Counts the store's ``read_payloads`` calls and the entries they read."""

    def __init__(self, store) -> None:
        self.calls = self.entries = 0
        original = store.read_payloads

        def counted(entries):
            self.calls += 1
            self.entries += len(entries)
            return original(entries)

        store.read_payloads = counted


async def stored(scheduler: Scheduler, clock: FakeClock, due_ms: int, count: int,
                 body_bytes: int = 8) -> list:
    sent = [message("s", b"%0*d" % (body_bytes, i), clock, deliver_at_ms=due_ms)
            for i in range(count)]
    answers = await scheduler.schedule([encode_message(m) for m in sent])
    assert {a["status"] for a in answers} == {"stored"}
    return sent


def test_peek_between_returns_the_entries_due_in_the_span_and_leaves_them_held():
    wheel = TimingWheel(tick_ms=5)
    for name, at in [("a", 100), ("b", 103), ("c", 104), ("d", 250), ("e", 10_000)]:
        wheel.add(name, at)
    wheel.remove("c")
    assert wheel.peek_between(100, 300) == ["b", "d"]
    assert wheel.peek_between(0, 100) == ["a"]
    assert wheel.peek_between(300, 300) == []
    assert sorted(wheel.peek_between(0, 10**9)) == ["a", "b", "d", "e"]
    assert len(wheel) == 4 and wheel.advance(10_000) == ["a", "b", "d", "e"]


@asynccontextmanager
async def hot_slot(tmp_path, count: int, body_bytes: int = 8, **overrides):
    """A started scheduler with ``count`` messages stored due 1 s ahead of the fake clock:
    (clock, broker, scheduler, due_ms, sent); stopped on exit."""
    clock = FakeClock()
    broker = Broker(clock)
    scheduler = await started(tmp_path, clock, broker.dispatch, **overrides)
    try:
        due = clock() + 1_000
        yield clock, broker, scheduler, due, await stored(scheduler, clock, due, count,
                                                           body_bytes)
    finally:
        await scheduler.stop()


async def rest_before(scheduler: Scheduler, clock: FakeClock, due_ms: int,
                      held: int | None = None) -> None:
    """Move the clock to half the read-ahead before ``due_ms`` and let the timer read ahead
    (until ``held`` payloads are held, when given: the reads run on the I/O thread)."""
    clock.advance(due_ms - PREFETCH_AHEAD_MS // 2 - clock())
    await settle(scheduler)
    for _ in range(500):
        if held is None or len(scheduler.dispatcher.prefetch.held) == held:
            break
        await asyncio.sleep(0.01)


async def test_a_hot_slot_is_read_ahead_and_sent_at_its_due_instant_without_reading(tmp_path):
    async with hot_slot(tmp_path, 300) as (clock, broker, scheduler, due, sent):
        await rest_before(scheduler, clock, due, held=300)
        prefetch = scheduler.dispatcher.prefetch
        assert len(prefetch.held) == 300
        assert broker.received == [], "read ahead, never sent early"
        reads = CountedReads(scheduler.store)
        clock.advance(due - clock())
        await settle(scheduler)
        assert sorted(broker.bodies()) == sorted(m.body for m in sent)
        assert all(at >= m.deliver_at_ms for at, m in broker.received)
        assert reads.calls == 0, "nothing is read at the due instant"
        assert len(prefetch) == 0 and prefetch.held_bytes == 0


async def test_a_message_cancelled_after_its_payload_was_read_ahead_is_never_delivered(tmp_path):
    async with hot_slot(tmp_path, 2) as (clock, broker, scheduler, due, (doomed, kept)):
        await rest_before(scheduler, clock, due, held=2)
        assert await scheduler.cancel(doomed.id, due) == "cancelled"
        assert len(scheduler.dispatcher.prefetch) == 1, "the cancelled payload is forgotten"
        clock.advance(PREFETCH_AHEAD_MS)
        await settle(scheduler)
        assert broker.bodies() == [kept.body]


async def test_payloads_past_the_byte_bound_are_read_at_their_due_time_and_all_go_once(tmp_path):
    async with hot_slot(tmp_path, 100, body_bytes=100) as (clock, broker, scheduler, due, sent):
        prefetch = scheduler.dispatcher.prefetch
        prefetch.bytes_max = 2_000
        await rest_before(scheduler, clock, due)
        assert 0 < len(prefetch) < 100 and prefetch.held_bytes <= 2_000
        reads = CountedReads(scheduler.store)
        clock.advance(PREFETCH_AHEAD_MS)
        await settle(scheduler)
        assert sorted(broker.bodies()) == sorted(m.body for m in sent)
        assert len(broker.received) == 100 and reads.calls >= 1 and reads.entries < 100


async def test_a_failed_read_ahead_leaves_the_messages_to_the_dispatchs_own_read(tmp_path):
    async with hot_slot(tmp_path, 20) as (clock, broker, scheduler, due, sent):
        original = scheduler.store.read_payloads
        failures = []

        def fail_once(entries):
            if not failures:
                failures.append(len(entries))
                raise OSError("injected read failure")
            return original(entries)

        scheduler.store.read_payloads = fail_once
        await rest_before(scheduler, clock, due)
        for _ in range(500):
            if failures and len(scheduler.dispatcher.prefetch) == 0:
                break
            await asyncio.sleep(0.01)
        assert failures == [20] and len(scheduler.dispatcher.prefetch) == 0
        clock.advance(PREFETCH_AHEAD_MS)
        await settle(scheduler)
        assert sorted(broker.bodies()) == sorted(m.body for m in sent)


async def test_the_dispatch_waits_for_a_read_ahead_still_running_instead_of_reading_again(
        tmp_path):
    async with hot_slot(tmp_path, 10) as (clock, broker, scheduler, due, sent):
        reads = CountedReads(scheduler.store)
        held = Held(scheduler.store, "read_payloads")
        clock.advance(due - PREFETCH_AHEAD_MS // 2 - clock())
        scheduler.poke()
        await held.wait_entered()
        clock.advance(PREFETCH_AHEAD_MS)  # due while its payloads are still being read
        for _ in range(3):
            scheduler.poke()
            for _ in range(10):
                await asyncio.sleep(0)
        assert broker.received == []
        held.release()
        await settle(scheduler)
        assert sorted(broker.bodies()) == sorted(m.body for m in sent)
        assert reads.calls == 1, "one read: the dispatch took what the read ahead got"


async def test_dispatched_lines_built_ahead_are_the_lines_built_at_dispatch(tmp_path):
    lines = {}
    for ahead in (True, False):
        clock = FakeClock()
        broker = Broker(clock)
        config = DelayConfig(data_dir=str(tmp_path / f"d{ahead}"), port=0, bucket_ms=BUCKET_MS,
                             trace_dir=str(tmp_path / f"t{ahead}"))
        writer = TraceWriter(config.trace_directory, "delay:d1", clock_ms=clock,
                             background=False)
        scheduler = await Scheduler.open(config, clock, broker.dispatch,
                                         tracer=DelayTracer(writer))
        await scheduler.start()
        try:
            due = clock() + 1_000
            sent = await stored(scheduler, clock, due, 5)
            if ahead:
                await rest_before(scheduler, clock, due)
                assert scheduler.tracer._ready, "built ahead"
            clock.advance(due + 7 - clock())
            await settle(scheduler)
            assert sorted(broker.bodies()) == sorted(m.body for m in sent)
            assert scheduler.tracer.kept_count() == 0
        finally:
            await scheduler.stop()
            writer.close()
        lines[ahead] = sorted(
            line for path in (tmp_path / f"t{ahead}").glob("*/*.jsonl")
            for line in path.read_text().splitlines() if '"dispatched"' in line)
        assert [json.loads(line)["lateness_ms"] for line in lines[ahead]] == [7] * 5
    # The same text but for the message's own id and creation time.
    shapes = [[(list(json.loads(line)), json.loads(line) | {"msg_id": "", "created_at_ms": 0})
               for line in lines[ahead]] for ahead in (True, False)]
    assert shapes[0] == shapes[1]
