"""Fakes and helpers shared by the delay hand-off tests (tests/unit/test_delay_handoff*.py):
a broker that holds and cancels (``HoldingBroker``) and its variants, a scheduler started with
the hand-off on over a fake clock, and a restart of its store."""

from __future__ import annotations

import asyncio
import contextlib

from delayserver.config import DelayConfig
from delayserver.scheduler import Scheduler
from tests.rawclient import FakeClock, message
from tests.unit.test_delay_scheduler_races import Broker, settle
from serverkit.payload_sender import HELD_DROPPED
from wire.errors import ConnectionLost, NotSupported, Overloaded
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

    async def cancel_held(self, subject: str, ids: list[str]) -> list[str]:
        """PayloadSender.cancel_held_answers: "dropped" for an id ``cancel_answers`` says True."""
        self.cancels.append((subject, ids))
        return [HELD_DROPPED if self.cancel_answers.get(i) else "" for i in ids]


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


async def into_the_lead(scheduler: Scheduler, clock: FakeClock, *bodies: bytes):
    """``bodies`` scheduled due 10 s from now, then the clock moved to where their hand-off
    step comes within the lead and the scheduler settled: (the due time, the messages)."""
    due = clock() + 10_000
    messages = await schedule(scheduler, clock, due, *bodies)
    clock.advance(10_000 - LEAD_MS)
    await settle(scheduler)
    return due, messages


@contextlib.asynccontextmanager
async def one_handed(tmp_path, broker_class: type[HoldingBroker], *broker_args):
    """A started scheduler whose broker is ``broker_class(clock, *broker_args)``, with one
    message (body b"a") handed off by ``into_the_lead``: yields (scheduler, clock, broker, its
    due time, the message) and stops the scheduler at the end."""
    clock = FakeClock()
    broker = broker_class(clock, *broker_args)
    scheduler = await started(tmp_path, clock, broker)
    try:
        due, [m] = await into_the_lead(scheduler, clock, b"a")
        yield scheduler, clock, broker, due, m
    finally:
        await scheduler.stop()


async def restarted(tmp_path, clock, broker: HoldingBroker, lead_ms: int) -> Scheduler:
    """The scheduler of ``started``'s store opened again 100 ms later, hand-off lead
    ``lead_ms`` (a restart, or a slave promoted with the same store)."""
    clock.advance(100)
    config = DelayConfig(data_dir=str(tmp_path / "delay"), port=0, bucket_ms=BUCKET_MS,
                         trace=False, handoff_lead_ms=lead_ms)
    again = await Scheduler.open(config, clock, broker.dispatch, hold=broker.hold,
                                 cancel_held=broker.cancel_held)
    await again.start()
    return again


class _AnswerLostBroker(HoldingBroker):
    """Its first hold is stored, then the connection drops before the answer (the home's
    master died after its write); later holds are stored and answered."""

    async def hold(self, subject: str, payloads: list[bytes], visible_at_ms: list[int]):
        answer = await super().hold(subject, payloads, visible_at_ms)
        if len(self.held) == len(payloads):
            raise ConnectionLost("the broker closed the connection")
        return answer


class DroppingBroker(HoldingBroker):
    """Drops a held id once (True), then says it is not held (False), as a real broker does;
    each answer takes a turn of the loop (a network round trip)."""

    async def cancel_held(self, subject, ids):
        self.cancels.append((subject, ids))
        await asyncio.sleep(0)
        answers = [HELD_DROPPED if self.cancel_answers.get(i) else "" for i in ids]
        for i in ids:
            self.cancel_answers[i] = False
        return answers


class UnreachableBroker(HoldingBroker):
    """Holds, but cannot be asked to cancel (every broker of the subject down)."""

    async def cancel_held(self, subject, ids):
        self.cancels.append((subject, ids))
        raise Overloaded("no broker answers")


class OlderUnreachableBroker(UnreachableBroker):
    """Refuses hand-offs (an older broker) and cannot be asked to cancel."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock, holds=False)


class DropThenLoseHoldAnswer(HoldingBroker):
    """Holds, but the hold's answer is lost (after a cancel dropped the message); cancels
    answer True once."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.answer = asyncio.Event()

    async def hold(self, subject, payloads, visible_at_ms):
        await super().hold(subject, payloads, visible_at_ms)
        await self.answer.wait()
        raise ConnectionLost("the hold's answer was lost")

    async def cancel_held(self, subject, ids):
        self.cancels.append((subject, ids))
        return [HELD_DROPPED for _ in ids]


def held_back_io(scheduler: Scheduler, fn) -> asyncio.Event:
    """The dispatcher's calls of ``fn`` on the delay-io thread wait until the returned event
    is set (say, a dispatch record held back until a cancel is answered)."""
    gate = asyncio.Event()
    real_io = scheduler.dispatcher._io

    async def slow_io(called, *args):
        if called == fn:
            await gate.wait()
        return await real_io(called, *args)

    scheduler.dispatcher._io = slow_io
    return gate


async def dropped_before_its_record(scheduler: Scheduler, clock: FakeClock,
                                    broker: HoldingBroker, record=None):
    """A message (body b"a") due 10 s from now, handed off to ``broker``, whose dispatch record
    (the dispatcher's call of ``record``: the store's ``record_dispatched`` unless given)
    waits for the returned event, and a cancel meanwhile that the broker answers by dropping
    it ("cancelled"): (its due time, it, the event)."""
    due = clock() + 10_000
    [m] = await schedule(scheduler, clock, due, b"a")
    gate = held_back_io(scheduler, record or scheduler.store.record_dispatched)
    clock.advance(10_000 - LEAD_MS)
    await settle(scheduler)
    assert [i for _, i, _ in broker.held] == [m.id]
    broker.cancel_answers = {m.id: True}
    assert await scheduler.cancel(m.id, due) == "cancelled"
    return due, m, gate
