"""The delay server's hand-off ahead of the due time (the Scheduler alone, a fake clock, fake
broker functions): a message is handed off ``handoff_lead_ms`` before it is due with its due
time as ``visible_at_ms`` and recorded, never sent early with ``send``; a broker that does not
take it gets what is due at once and the rest at its due time; a cancel of a handed message
asks the broker and says what it answered."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from delayserver.config import DelayConfig
from delayserver.handoff import HANDOFF_STEP_MS, NO_HOLD_PAUSE_MS, HandOff, step_ms, take_at_ms
from delayserver.metrics import DelayMetrics
from delayserver.scheduler import Scheduler
from delayserver.storage.store import ScheduleEntry
from delayserver.tracing import DelayTracer
from tests.rawclient import FakeClock, message
from tests.unit.test_delay_scheduler_races import Broker, settle
from tracelog.reading import read_events
from tracelog.writer import TraceWriter
from logstore.errors import DiskFull
from wire.errors import ConnectionLost, NotSupported, Overloaded, Unavailable
from wire.limits import HOLD_AHEAD_MS_MAX
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


def test_the_lead_is_checked_at_start():
    with pytest.raises(ValueError, match="handoff_lead_ms"):
        DelayConfig(data_dir="x", handoff_lead_ms=120_000)


@pytest.mark.parametrize("lead_ms", [0, 1, HOLD_AHEAD_MS_MAX // 2])
def test_a_lead_from_0_to_half_the_broker_s_hold_limit_is_taken(lead_ms):
    assert DelayConfig(data_dir="x", handoff_lead_ms=lead_ms).handoff_lead_ms == lead_ms


@pytest.mark.parametrize("lead_ms", [-1, HOLD_AHEAD_MS_MAX // 2 + 1, True, 1.5, "10"])
def test_a_lead_below_0_above_half_the_broker_s_hold_limit_or_not_an_int_is_refused(lead_ms):
    with pytest.raises(ValueError, match="handoff_lead_ms"):
        DelayConfig(data_dir="x", handoff_lead_ms=lead_ms)


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
        due, _ = await into_the_lead(scheduler, clock, b"a", b"b")
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



class _AnswerLostBroker(HoldingBroker):
    """Its first hold is stored, then the connection drops before the answer (the home's
    master died after its write); later holds are stored and answered."""

    async def hold(self, subject: str, payloads: list[bytes], visible_at_ms: list[int]):
        answer = await super().hold(subject, payloads, visible_at_ms)
        if len(self.held) == len(payloads):
            raise ConnectionLost("the broker closed the connection")
        return answer


async def test_a_hold_whose_answer_was_lost_is_never_held_again_but_sent_at_its_due_time(
        tmp_path):
    # reviewho2 N1: a retried hold could go to a second group (the route changed meanwhile).
    async with one_handed(tmp_path, _AnswerLostBroker) as (scheduler, clock, broker, due, m):
        for _ in range(LEAD_MS // 250 - 1):  # the retry backoffs of the old path pass
            clock.advance(250)
            await settle(scheduler)
        assert [i for _, i, _ in broker.held] == [m.id] and broker.received == []
        clock.advance(due - clock())
        await settle(scheduler)
        assert [(at, r.id) for at, r in broker.received] == [(due, m.id)]
        assert [i for _, i, _ in broker.held] == [m.id]


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


async def test_a_step_with_fewer_messages_than_the_minimum_is_dispatched_at_its_due_time(
        tmp_path):
    clock = FakeClock()
    broker = HoldingBroker(clock)
    scheduler = await started(tmp_path, clock, broker, min_messages=3)
    try:
        due, _ = await into_the_lead(scheduler, clock, b"a", b"b")
        assert broker.held == [] and broker.received == []
        clock.advance(LEAD_MS)
        await settle(scheduler)
        assert [(at, m.body) for at, m in broker.received] == [(due, b"a"), (due, b"b")]
        assert broker.held == []
    finally:
        await scheduler.stop()


class SlowOldBroker(HoldingBroker):
    """An older broker (no hold) whose hold refusal and send each take a turn of the loop and
    wait for ``gate``: two workers' batches overlap as on a real network."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock, holds=False)
        self.gate = asyncio.Event()

    async def hold(self, subject, payloads, visible_at_ms):
        await asyncio.sleep(0)
        raise NotSupported("an older broker")

    async def dispatch(self, subject, payloads):
        await self.gate.wait()
        return await super().dispatch(subject, payloads)


def _batch(clock: FakeClock, base: int, dues: list[int]):
    messages = [message("s", b"m%d" % i, clock, deliver_at_ms=due) for i, due in enumerate(dues)]
    entries = [ScheduleEntry(0, i, due, base + i, 2, 0) for i, due in enumerate(dues)]
    return entries, [encode_message(m) for m in messages]


async def _two_refused_batches(tmp_path, second_in_ms: list[int], stagger: bool = True):
    clock = FakeClock()
    broker = SlowOldBroker(clock)
    scheduler = await started(tmp_path, clock, broker)
    dispatcher = scheduler.dispatcher
    dispatcher._record_soon = lambda *args, **kwargs: None  # the recorder is not under test
    now = clock()
    # Two workers' batches of a hot step: the first holds one message due now.
    first = _batch(clock, 1_000, [now, now + 1_500])
    second = _batch(clock, 2_000, [now + ms for ms in second_in_ms])
    tasks = [asyncio.create_task(dispatcher._dispatch_batch("s", *first))]
    for _ in range(3 if stagger else 0):
        await asyncio.sleep(0)
    tasks.append(asyncio.create_task(dispatcher._dispatch_batch("s", *second)))
    for _ in range(10):
        await asyncio.sleep(0)
    broker.gate.set()
    await asyncio.wait(tasks, timeout=5)
    return clock, broker, scheduler


async def test_while_a_refused_hand_off_sends_what_is_due_another_batch_is_not_sent_early(
        tmp_path):
    clock, broker, scheduler = await _two_refused_batches(tmp_path, [1_500])
    try:
        early = [(at, m.deliver_at_ms) for at, m in broker.received if at < m.deliver_at_ms]
        assert early == [], "sent with send before their due time (delivered early)"
    finally:
        await scheduler.stop()


async def test_two_refused_hand_offs_at_once_leave_the_hand_off_on(tmp_path):
    clock, broker, scheduler = await _two_refused_batches(tmp_path,
                                                          [0, 900], stagger=False)
    try:
        assert scheduler.dispatcher.hold is not None, \
            "the dispatcher lost its hold function: after the pause every hot step is sent early"
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


async def test_a_step_below_the_minimum_is_not_handed_off_when_the_timer_wakes_late(tmp_path):
    """Two messages in two different 250 ms steps, minimum 2 per step: neither step is hot.
    A timer that wakes late (a busy loop) counts both steps as one and hands both off."""
    clock = FakeClock()
    broker = HoldingBroker(clock)
    scheduler = await started(tmp_path, clock, broker, min_messages=2)
    try:
        due = clock() + 10_000
        await schedule(scheduler, clock, due, b"a")
        await schedule(scheduler, clock, due + 1_000, b"b")
        clock.advance(10_000 - LEAD_MS + 1_000)  # past a's step time, before b's due
        await settle(scheduler)
        assert broker.held == [], "cold steps handed off"
    finally:
        await scheduler.stop()


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


class DroppingBroker(HoldingBroker):
    """Drops a held id once (True), then says it is not held (False), as a real broker does;
    each answer takes a turn of the loop (a network round trip)."""

    async def cancel_held(self, subject, ids):
        self.cancels.append((subject, ids))
        await asyncio.sleep(0)
        answers = [self.cancel_answers.get(i, False) for i in ids]
        for i in ids:
            self.cancel_answers[i] = False
        return answers


async def test_two_cancels_of_a_handed_message_at_once_never_say_already_dispatched(tmp_path):
    """A client resending its cancel (the first answer was slow) is told already_dispatched
    for a message that was cancelled and will never be delivered."""
    async with one_handed(tmp_path, DroppingBroker) as (scheduler, clock, broker, due, m):
        broker.cancel_answers = {m.id: True}
        answers = await asyncio.gather(scheduler.cancel(m.id, due), scheduler.cancel(m.id, due))
        assert sorted(answers) == ["already_cancelled", "cancelled"]


class RefusingEachBroker(HoldingBroker):
    """Refuses the hand-off of each message with ``code`` and takes plain sends:
    ``bad_request`` as a broker whose clock is behind ours by more than HOLD_AHEAD_MS_MAX
    minus the lead does, ``not_supported`` as PayloadSender answers for the part of an older
    home group beside newer ones."""

    def __init__(self, clock: FakeClock, code: str) -> None:
        super().__init__(clock)
        self.code = code

    async def hold(self, subject, payloads, visible_at_ms):
        return "rt", [{"id": decode_message(p).id,
                       "error": {"code": self.code, "message": "not held"}}
                      for p in payloads]


@pytest.mark.parametrize("code", ["bad_request", "not_supported"])
async def test_a_hand_off_refused_per_message_is_sent_at_its_due_time_not_given_up(tmp_path,
                                                                                    code):
    clock = FakeClock()
    broker = RefusingEachBroker(clock, code)
    writer = TraceWriter(tmp_path / "trace", "delay:d", clock_ms=clock, background=False)
    scheduler = await started(tmp_path, clock, broker, DelayTracer(writer))
    try:
        due, [m] = await into_the_lead(scheduler, clock, b"a")
        assert broker.received == []
        clock.advance(LEAD_MS)
        await settle(scheduler)
        assert [(at, got.id) for at, got in broker.received] == [(due, m.id)]
        writer.flush()
        reasons = [e.get("reason") for e in read_events([tmp_path / "trace"])]
        assert "dispatch_refused" not in reasons, "given up instead of sent at its due time"
    finally:
        await scheduler.stop()


async def test_an_older_broker_s_refusal_of_a_hand_off_is_not_counted_as_a_dispatch_failure():
    metrics = DelayMetrics("d")

    async def refuse(subject, payloads, visible_at_ms):
        raise NotSupported("an older broker")

    async def overloaded(subject, payloads):
        raise Overloaded("busy")

    async def refuse_one(subject, payloads, visible_at_ms):  # an older group's part
        return "rt", [{"id": "a", "status": "stored"},
                      {"id": "b", "error": {"code": "not_supported", "message": "older"}}]

    hold = metrics.observe_dispatch(refuse, uncounted=(NotSupported.code,))
    send = metrics.observe_dispatch(overloaded)
    for call in (hold("s", [b"x", b"y"], [1, 2]), send("s", [b"x"])):
        with pytest.raises((NotSupported, Overloaded)):
            await call
    await metrics.observe_dispatch(refuse_one, uncounted=(NotSupported.code,))(
        "s", [b"x", b"y"], [1, 2])
    assert {c: n for c, n in metrics.dispatch_failures.items() if n} == {"overloaded": 1}


@pytest.mark.parametrize("lead_ms, step", [(2 * HANDOFF_STEP_MS + 2, HANDOFF_STEP_MS),
                                           (2 * HANDOFF_STEP_MS, HANDOFF_STEP_MS),
                                           (2 * HANDOFF_STEP_MS - 2, HANDOFF_STEP_MS - 1),
                                           (1, 1)])
def test_the_hand_off_step_is_handoff_step_ms_at_most_half_the_lead(lead_ms, step):
    assert step_ms(lead_ms) == step


def test_an_entry_is_looked_at_when_its_step_comes_within_the_lead_then_at_its_due_time():
    due = 10_000 + 1  # in the step ending at 10,250
    assert take_at_ms(due, LEAD_MS, now_ms=0) == 10_250 - LEAD_MS
    assert take_at_ms(due, LEAD_MS, now_ms=10_250 - LEAD_MS) == due, "counted: at its due time"
    assert take_at_ms(due, 0, now_ms=0) == due


@pytest.mark.parametrize("lead_ms", [LEAD_MS, NO_HOLD_PAUSE_MS])
def test_after_a_refused_hand_off_none_is_made_for_the_pause_or_twice_the_lead(lead_ms):
    clock = FakeClock()
    config = DelayConfig(data_dir="x", handoff_lead_ms=min(lead_ms, HOLD_AHEAD_MS_MAX // 2))
    handoff = HandOff(config, clock, hold=object(), cancel_held=None,  # type: ignore[arg-type]
                      tracer=DelayTracer(None))
    lead = config.handoff_lead_ms
    assert handoff.lead_ms(clock()) == lead
    handoff.no_hold()
    pause = max(NO_HOLD_PAUSE_MS, 2 * lead)
    assert handoff.lead_ms(clock() + pause - 1) == 0
    assert handoff.lead_ms(clock() + pause) == lead


class UnreachableBroker(HoldingBroker):
    """Holds, but cannot be asked to cancel (every broker of the subject down)."""

    async def cancel_held(self, subject, ids):
        self.cancels.append((subject, ids))
        raise Overloaded("no broker answers")


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


async def test_a_hand_off_whose_record_cannot_be_written_is_sent_at_the_due_time(tmp_path):
    clock = FakeClock()
    broker = HoldingBroker(clock)
    scheduler = await started(tmp_path, clock, broker)
    try:
        async def full(until_ms):
            raise DiskFull("delay/donelog", 1)

        scheduler.handoff.record_handed = full
        due, [m] = await into_the_lead(scheduler, clock, b"a")
        assert broker.held == [] and broker.received == []
        clock.advance(LEAD_MS)
        await settle(scheduler)
        assert [(at, got.id) for at, got in broker.received] == [(due, m.id)]
    finally:
        await scheduler.stop()


async def test_the_timer_wakes_when_the_next_hand_off_step_comes_within_the_lead(tmp_path):
    """A cold message due before a hot step: after the cold one's step is counted the timer
    looked again only on the read-ahead's grid (every 100 ms) or at a bucket's start, so the hot
    step was counted, and handed off, up to that much later than its lead."""
    clock = FakeClock()
    broker = HoldingBroker(clock)
    scheduler = await started(tmp_path, clock, broker, min_messages=2)
    try:
        start = clock()
        await schedule(scheduler, clock, start + 4_100, b"cold")
        await schedule(scheduler, clock, start + 5_100, b"hot1", b"hot2")
        hot_step_at = start + 5_250 - LEAD_MS  # the end of its 250 ms step, less the lead
        clock.advance(hot_step_at - 50 - start)
        await settle(scheduler)
        assert broker.held == []
        assert scheduler._timer_wake_at_ms <= hot_step_at, "the hot step would be counted late"
        clock.advance(50)
        await settle(scheduler)
        assert sorted((at, visible) for at, _, visible in broker.held) == [
            (hot_step_at, start + 4_100), (hot_step_at, start + 5_100),
            (hot_step_at, start + 5_100)], "taken whole with what is due before it"
    finally:
        await scheduler.stop()


async def test_a_confirmed_hand_off_is_traced_handed_naming_the_broker_group_holding_it(
        tmp_path):
    """The audit names the holder of a message by its last event: without ``handed`` that was
    the delay server's ``scheduled``, for a message the broker group holds (or lost)."""
    clock = FakeClock()
    broker = HoldingBroker(clock)
    writer = TraceWriter(tmp_path / "trace", "delay:d", clock_ms=clock, background=False)
    scheduler = await started(tmp_path, clock, broker, DelayTracer(writer))
    try:
        due, (plain, tagged) = await into_the_lead(scheduler, clock, b"a", b"b")
        writer.flush()
        handed = [e for e in read_events([tmp_path / "trace"]) if e["event"] == "handed"]
        assert sorted((e["msg_id"], e["reason"], e["deliver_at_ms"], e["ts_ms"])
                      for e in handed) == sorted(
            (m.id, "realtime:rt", due, due - LEAD_MS) for m in (plain, tagged))
    finally:
        await scheduler.stop()


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
        return [False for _ in ids]

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
        answers = [i not in self.dropped for i in ids]
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
    due = clock() + 10_000
    try:
        [m] = await schedule(scheduler, clock, due, b"a")
        gate = asyncio.Event()
        record = scheduler.store.record_dispatched
        real_io = scheduler.dispatcher._io

        async def slow_io(fn, *args):
            if fn == record:
                await gate.wait()  # the dispatch record waits until the cancel is answered
            return await real_io(fn, *args)

        scheduler.dispatcher._io = slow_io
        clock.advance(10_000 - LEAD_MS)
        await settle(scheduler)
        assert [i for _, i, _ in broker.held] == [m.id]
        broker.cancel_answers = {m.id: True}
        assert await scheduler.cancel(m.id, due) == "cancelled"
        gate.set()
        await settle(scheduler)
    finally:
        await scheduler.stop()
    again = await restarted(tmp_path, clock, broker, LEAD_MS)
    try:
        assert await again.cancel(m.id, due) == "already_cancelled"
    finally:
        await again.stop()


class OlderUnreachableBroker(UnreachableBroker):
    """Refuses hand-offs (an older broker) and cannot be asked to cancel."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock, holds=False)


async def test_a_cancel_of_a_message_a_handed_record_covers_but_never_handed_does_not_ask_the_broker(
        tmp_path):
    # review s10 S1: the handed record is written before the hold; the broker refused it, so
    # the message waits for its due time, and its cancel failed while the broker was
    # unreachable although no broker held it.
    async with one_handed(tmp_path, OlderUnreachableBroker) as (scheduler, clock, broker, due, m):
        assert scheduler.handoff.handed_until_ms >= due and broker.held == []
        assert await scheduler.cancel(m.id, due) == "cancelled"
        assert broker.cancels == []
        clock.advance(LEAD_MS)
        await settle(scheduler)
        assert broker.received == []


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
        return [True for _ in ids]


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


async def test_a_drop_during_a_hold_whose_dispatch_record_a_full_disk_held_back_is_recorded_with_it(
        tmp_path):
    clock = FakeClock()
    broker = DroppingBroker(clock)
    scheduler = await started(tmp_path, clock, broker)
    due = clock() + 10_000
    try:
        [m] = await schedule(scheduler, clock, due, b"a")
        gate = asyncio.Event()
        store = scheduler.store
        real_record = store.record_dispatched
        real_io = scheduler.dispatcher._io
        full = [True]

        def record_or_full(*args):
            if full[0]:
                raise DiskFull("delay", 1)
            return real_record(*args)

        async def slow_io(fn, *args):
            if fn == record_or_full:
                await gate.wait()  # recorded after the cancel was answered, on a full disk
            return await real_io(fn, *args)

        store.record_dispatched = record_or_full
        scheduler.dispatcher._io = slow_io
        clock.advance(10_000 - LEAD_MS)
        await settle(scheduler)
        broker.cancel_answers = {m.id: True}
        assert await scheduler.cancel(m.id, due) == "cancelled"
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
