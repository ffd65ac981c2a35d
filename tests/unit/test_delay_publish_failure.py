"""A delay server whose publishing of a stored commit raised (a bug path, serverkit/committer.py;
review s11 rvho-2), or whose placing of it in the schedule window raised (that comes a loop turn
after the answers): the stored copy is dispatched once at its due time all the same, the done
watermark passes its bucket, and a restart later does not dispatch it again."""

from __future__ import annotations

import delayserver.accepting
from tests.rawclient import FakeClock, message
from tests.unit.test_delay_scheduler_races import Broker, settle, started
from wire.message import encode_message


async def _dispatched_once_and_not_again(tmp_path, clock, broker, scheduler, m) -> None:
    """Run the fake clock past ``m``'s due time; check it was dispatched once, its bucket
    left behind by the done watermark, and not dispatched again after a restart."""
    try:
        for _ in range(6):
            clock.advance(1_000)
            await settle(scheduler)
            await scheduler.advance_done()
        assert [r.id for _, r in broker.received] == [m.id]
        assert scheduler.done_before_ms > m.deliver_at_ms, "its bucket holds the watermark back"
    finally:
        await scheduler.stop()
    clock.advance(3_600_000)  # an hour later: past the realtime broker's de-duplication
    again = await started(tmp_path, clock, broker.dispatch)
    try:
        await settle(again)
        await settle(again)
        assert [r.id for _, r in broker.received] == [m.id], "dispatched again after a restart"
    finally:
        await again.stop()


async def one_due_soon(tmp_path):
    """A started scheduler over a fake clock and a recording broker, and a message due 1.5 s
    ahead (a loaded bucket) not yet sent: (clock, broker, scheduler, message)."""
    clock = FakeClock()
    broker = Broker(clock)
    scheduler = await started(tmp_path, clock, broker.dispatch)
    return clock, broker, scheduler, message("s", b"a", clock, deliver_at_ms=clock() + 1_500)


async def test_a_send_whose_publishing_failed_is_dispatched_once_and_the_done_watermark_passes_it(
        tmp_path, monkeypatch):
    clock, broker, scheduler, m = await one_due_soon(tmp_path)
    answer_of = delayserver.accepting.delayed_send_result

    def raising(*args):
        raise RuntimeError("injected publish bug")

    monkeypatch.setattr(delayserver.accepting, "delayed_send_result", raising)
    try:
        [answer] = await scheduler.schedule([encode_message(m)])
    finally:
        monkeypatch.setattr(delayserver.accepting, "delayed_send_result", answer_of)
    assert answer["error"]["code"] == "internal"
    assert "scheduled all the same" in answer["error"]["message"]
    await _dispatched_once_and_not_again(tmp_path, clock, broker, scheduler, m)


async def test_a_send_the_window_failed_to_take_is_read_from_the_store_and_dispatched_once(
        tmp_path, caplog):
    clock, broker, scheduler, m = await one_due_soon(tmp_path)
    place = scheduler.window.place_committed
    calls: list[int] = []

    def raising_once(entries):
        calls.append(len(entries))
        if len(calls) == 1:
            raise RuntimeError("injected window bug")
        return place(entries)

    scheduler.window.place_committed = raising_once  # type: ignore[method-assign]
    [answer] = await scheduler.schedule([encode_message(m)])
    assert answer["status"] == "stored", "answered before the window takes it"
    await settle(scheduler)
    assert calls == [1]
    assert "could not place 1 committed messages in its window; they are read from the " \
        "store instead" in caplog.text
    await _dispatched_once_and_not_again(tmp_path, clock, broker, scheduler, m)
