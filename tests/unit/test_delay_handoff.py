"""The delay server's hand-off ahead of the due time (the Scheduler alone, a fake clock, fake
broker functions): a message is handed off ``handoff_lead_ms`` before it is due with its due
time as ``visible_at_ms`` and recorded, never sent early with ``send``; a broker that does not
take it gets what is due at once and the rest at its due time; a cancel of a handed message
asks the broker and says what it answered."""

from __future__ import annotations

import pytest

from delayserver.config import DelayConfig
from delayserver.scheduler import Scheduler
from delayserver.tracing import DelayTracer
from tests.rawclient import FakeClock, message
from tests.unit.test_delay_scheduler_races import Broker, settle
from tracelog.events import TraceWriter, read_events
from wire.errors import NotSupported
from wire.message import decode_message, encode_message

BUCKET_MS = 1_000
LEAD_MS = 2_000


class HoldingBroker(Broker):
    """``Broker`` that also takes hand-offs (or refuses them, ``holds=False``) and cancels."""

    def __init__(self, clock: FakeClock, holds: bool = True) -> None:
        super().__init__(clock)
        self.holds = holds
        self.held: list[tuple[int, str, int]] = []  # (when, id, visible_at_ms)
        self.cancel_answers: dict[str, bool] = {}
        self.cancels: list[tuple[str, list[str]]] = []

    async def hold(self, subject: str, payloads: list[bytes], visible_at_ms: list[int]):
        if not self.holds:
            raise NotSupported("an older broker")
        ids = [decode_message(p).id for p in payloads]
        self.held += [(self.clock(), i, v) for i, v in zip(ids, visible_at_ms)]
        return "rt", [{"id": i, "status": "stored"} for i in ids]

    async def cancel_held(self, subject: str, ids: list[str]) -> list[bool]:
        self.cancels.append((subject, ids))
        return [self.cancel_answers.get(i, False) for i in ids]


async def started(tmp_path, clock, broker: HoldingBroker, tracer=None,
                  min_messages: int = 1) -> Scheduler:
    config = DelayConfig(data_dir=str(tmp_path / "delay"), port=0, bucket_ms=BUCKET_MS,
                         trace=False, handoff_lead_ms=LEAD_MS, handoff_min_messages=min_messages)
    scheduler = await Scheduler.open(config, clock, broker.dispatch, tracer=tracer,
                                     hold=broker.hold, cancel_held=broker.cancel_held)
    await scheduler.start()
    return scheduler


async def schedule(scheduler: Scheduler, clock: FakeClock, due_ms: int, *bodies: bytes):
    messages = [message("s", body, clock, deliver_at_ms=due_ms) for body in bodies]
    answers = await scheduler.schedule([encode_message(m) for m in messages])
    assert {a["status"] for a in answers} == {"stored"}
    return messages


def test_the_lead_is_checked_at_start():
    with pytest.raises(ValueError, match="handoff_lead_ms"):
        DelayConfig(data_dir="x", handoff_lead_ms=120_000)


async def test_a_message_is_handed_off_its_lead_ahead_and_never_sent_early(tmp_path):
    clock = FakeClock()
    broker = HoldingBroker(clock)
    writer = TraceWriter(tmp_path / "trace", "delay:d", clock_ms=clock, background=False)
    scheduler = await started(tmp_path, clock, broker, DelayTracer(writer))
    try:
        due = clock() + 10_000
        [m] = await schedule(scheduler, clock, due, b"a")
        clock.advance(10_000 - LEAD_MS - 1)
        await settle(scheduler)
        assert broker.held == [] and broker.received == []
        clock.advance(1)
        await settle(scheduler)
        assert broker.held == [(due - LEAD_MS, m.id, due)]
        assert broker.received == [], "nothing is sent with send before its due time"
        assert scheduler.stats.handed == 1 and scheduler.stats.early == 0
        clock.advance(LEAD_MS)
        await settle(scheduler)
        assert broker.received == [] and len(broker.held) == 1, "handed once, recorded"
        writer.flush()
        kinds = [e["event"] for e in read_events([tmp_path / "trace"])]
        assert "dispatched" not in kinds, "the broker traces the dispatch of a hand-off"
    finally:
        await scheduler.stop()


async def test_a_broker_that_does_not_hold_gets_each_message_at_its_due_time(tmp_path):
    clock = FakeClock()
    broker = HoldingBroker(clock, holds=False)
    scheduler = await started(tmp_path, clock, broker)
    try:
        due = clock() + 10_000
        await schedule(scheduler, clock, due, b"a", b"b")
        clock.advance(10_000 - LEAD_MS)
        await settle(scheduler)
        assert broker.received == [] and broker.held == []
        clock.advance(LEAD_MS - 1)
        await settle(scheduler)
        assert broker.received == []
        clock.advance(1)
        await settle(scheduler)
        assert [(at, m.body) for at, m in broker.received] == [(due, b"a"), (due, b"b")]
        assert scheduler.stats.early == 0
    finally:
        await scheduler.stop()


async def test_a_cancel_of_a_handed_message_says_what_the_broker_answered(tmp_path):
    clock = FakeClock()
    broker = HoldingBroker(clock)
    scheduler = await started(tmp_path, clock, broker)
    try:
        due = clock() + 10_000
        kept, dropped = await schedule(scheduler, clock, due, b"kept", b"dropped")
        clock.advance(10_000 - LEAD_MS)
        await settle(scheduler)
        assert len(broker.held) == 2
        broker.cancel_answers = {dropped.id: True}
        assert await scheduler.cancel(dropped.id, due) == "cancelled"
        assert await scheduler.cancel(dropped.id, due) == "already_cancelled"
        assert await scheduler.cancel(kept.id, due) == "already_dispatched"
        assert broker.cancels == [("s", [dropped.id]), ("s", [kept.id])]
    finally:
        await scheduler.stop()


async def test_a_step_with_fewer_messages_than_the_minimum_is_dispatched_at_its_due_time(
        tmp_path):
    clock = FakeClock()
    broker = HoldingBroker(clock)
    scheduler = await started(tmp_path, clock, broker, min_messages=3)
    try:
        due = clock() + 10_000
        await schedule(scheduler, clock, due, b"a", b"b")
        clock.advance(10_000 - LEAD_MS)
        await settle(scheduler)
        assert broker.held == [] and broker.received == []
        clock.advance(LEAD_MS)
        await settle(scheduler)
        assert [(at, m.body) for at, m in broker.received] == [(due, b"a"), (due, b"b")]
        assert broker.held == []
    finally:
        await scheduler.stop()
