"""A hand-off split over two broker groups, one of which refuses its part (review s13
rvmends-4): the delay server (the Scheduler alone, a fake clock) hands off through a real
``PayloadSender`` over fake brokers; what the other group held stays known as held, so a
cancel of it asks that group, and only the refused part is handed again."""

from __future__ import annotations

from collections import Counter

from delayserver.config import DelayConfig
from delayserver.scheduler import Scheduler
from serverkit.payload_sender import home_group
from tests.rawclient import FakeClock
from tests.unit.delay_handoff_support import BUCKET_MS, LEAD_MS, into_the_lead
from tests.unit.test_delay_scheduler_races import settle
from tests.unit.test_payload_sender_hold import (_G0, _G1, _RefreshSaysNoRoute, _Routes,
                                                 _SecondGroupAnswersGarbage,
                                                 _SecondGroupRefuses, _sender_over)
from wire.errors import ReadOnly
from wire.message import encode_message, peek_message_id


async def _scheduler_over_two_groups(tmp_path, clock: FakeClock, brokers) -> Scheduler:
    """A started Scheduler handing off (lead LEAD_MS, from one message) through a real
    PayloadSender over ``brokers``, routed to groups g0 and g1."""
    sender = _sender_over(_Routes([_G0, _G1], [_G0, _G1]), brokers)
    config = DelayConfig(data_dir=str(tmp_path / "delay"), port=0, bucket_ms=BUCKET_MS,
                         trace=False, handoff_lead_ms=LEAD_MS, handoff_min_messages=1)
    scheduler = await Scheduler.open(config, clock, sender.send, hold=sender.send,
                                     cancel_held=sender.cancel_held_answers)
    await scheduler.start()
    return scheduler


def _by_home_group(messages) -> dict[int, list]:
    """``messages`` by the group (0 or 1) that their hand-off goes to; both get some."""
    by_home: dict[int, list] = {0: [], 1: []}
    for m in messages:
        by_home[home_group(encode_message(m), 2)].append(m)
    assert by_home[0] and by_home[1], "the messages go to both groups"
    return by_home


class _CancelsNoted(_SecondGroupRefuses):
    """``_SecondGroupRefuses`` (g1 read-only) noting every ``cancel_held``'s ids."""

    def __init__(self) -> None:
        super().__init__(ReadOnly("broker group g1 is read-only; send elsewhere"),
                         per_message=True)
        self.asked: list[str] = []

    async def request(self, address, request, timeout_ms):
        if request["op"] == "cancel_held":
            self.asked += request["ids"]  # each group is asked
        return await super().request(address, request, timeout_ms)


async def test_a_cancel_of_a_message_one_group_held_while_the_other_refused_asks_the_broker(
        tmp_path):
    clock = FakeClock()
    brokers = _CancelsNoted()
    scheduler = await _scheduler_over_two_groups(tmp_path, clock, brokers)
    try:
        due, messages = await into_the_lead(scheduler, clock,
                                            *[b"m%d" % n for n in range(20)])
        by_home = _by_home_group(messages)
        held = by_home[0][0]
        assert held.id in brokers.held["a:1"]
        assert await scheduler.cancel(held.id, due) == "cancelled"
        assert set(brokers.asked) == {held.id}, "answered without asking the group holding it"
        assert held.id not in brokers.held["a:1"], "g0 still holds it: it delivers it when due"
        holds = Counter(brokers.hold_ids)
        assert {holds[("a:1", m.id)] for m in by_home[0]} == {1}, "g0's part handed again"
        assert {holds[("b:1", m.id)] > 1 for m in by_home[1]} == {True}, "g1's not retried"
    finally:
        await scheduler.stop()


async def test_a_cancel_of_a_message_one_group_held_asks_it_when_the_route_refresh_failed(
        tmp_path):
    # review s14 rva-1; the retry backoff is long, so the cancel comes while the refused part
    # waits for its next try.
    clock = FakeClock()
    brokers = _CancelsNoted()
    sender = _sender_over(_RefreshSaysNoRoute(failures=1), brokers)
    config = DelayConfig(data_dir=str(tmp_path / "delay"), port=0, bucket_ms=BUCKET_MS,
                         trace=False, handoff_lead_ms=LEAD_MS, handoff_min_messages=1,
                         dispatch_retry_ms_min=60_000, dispatch_retry_ms_max=60_000)
    scheduler = await Scheduler.open(config, clock, sender.send, hold=sender.send,
                                     cancel_held=sender.cancel_held_answers)
    await scheduler.start()
    try:
        due, messages = await into_the_lead(scheduler, clock,
                                            *[b"m%d" % n for n in range(20)])
        held = next(m for m in messages if home_group(encode_message(m), 2) == 0)
        assert held.id in brokers.held["a:1"], "g0 holds it"
        assert await scheduler.cancel(held.id, due) == "cancelled"
        assert held.id in brokers.asked, "answered without asking g0, which holds it"
        assert held.id not in brokers.held["a:1"], "g0 still holds it: it delivers it when due"
    finally:
        await scheduler.stop()


class _GarbageNoted(_SecondGroupAnswersGarbage):
    """``_SecondGroupAnswersGarbage`` (g1 stores, then its answer raises) noting every
    ``cancel_held``'s ids, and every send (not hold) by group address."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[str] = []
        self.sent: list[tuple[str, str]] = []

    async def request(self, address, request, timeout_ms):
        if request["op"] == "cancel_held":
            self.asked += request["ids"]
        if request["op"] == "send":
            self.sent += [(address, peek_message_id(p)) for p in request["messages"]]
        return await super().request(address, request, timeout_ms)


async def test_a_hold_one_part_of_which_raised_is_never_held_again_and_a_cancel_asks_both(
        tmp_path):
    # review s14 rva: a part's non-QmqError was raised alone: the dispatcher retried the whole
    # hold, handing g0's held part again and g1's part (which g1 may hold) again, so after a
    # route change a second group could hold it too.
    clock = FakeClock()
    brokers = _GarbageNoted()
    scheduler = await _scheduler_over_two_groups(tmp_path, clock, brokers)
    try:
        due, messages = await into_the_lead(scheduler, clock,
                                            *[b"m%d" % n for n in range(20)])
        by_home = _by_home_group(messages)
        for _ in range(LEAD_MS // 250 - 1):  # the retry backoffs of a refusal pass
            clock.advance(250)
            await settle(scheduler)
        holds = Counter(brokers.hold_ids)
        assert {holds[("a:1", m.id)] for m in by_home[0]} == {1}, "g0's part handed again"
        assert brokers.holds_to.count("b:1") == 1, "g1's part, which g1 may hold, held again"
        for held in (by_home[0][0], by_home[1][0]):
            assert await scheduler.cancel(held.id, due) == "cancelled"
            assert held.id in brokers.asked, "answered without asking the groups"
            assert held.id not in brokers.held["a:1"] | brokers.held["b:1"], "still held"
        clock.advance(due - clock())
        await settle(scheduler)
        homes = {(f"{'ab'[h]}:1", m.id) for h, ms in by_home.items() for m in ms}
        assert brokers.sent and set(brokers.sent) <= homes, "sent to another group"
    finally:
        await scheduler.stop()
