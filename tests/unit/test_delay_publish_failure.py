"""A delay server whose publishing of a stored commit raised (a bug path, serverkit/committer.py;
review s11 rvho-2): the stored copy is put into the schedule window all the same, so it is
dispatched once at its due time, the done watermark passes its bucket, and a restart later
does not dispatch it again; the answer says it is scheduled."""

from __future__ import annotations

from tests.rawclient import FakeClock, message
from tests.unit.test_delay_scheduler_races import Broker, settle, started
from wire.message import encode_message


async def test_a_send_whose_publishing_failed_is_dispatched_once_and_the_done_watermark_passes_it(
        tmp_path):
    clock = FakeClock()
    broker = Broker(clock)
    scheduler = await started(tmp_path, clock, broker.dispatch)
    m = message("s", b"a", clock, deliver_at_ms=clock() + 1_500)
    try:
        place = scheduler.window.place_committed
        calls: list[int] = []

        def raising_once(entries):
            calls.append(len(entries))
            if len(calls) == 1:
                raise RuntimeError("injected publish bug")
            return place(entries)

        scheduler.window.place_committed = raising_once  # type: ignore[method-assign]
        [answer] = await scheduler.schedule([encode_message(m)])
        assert answer["error"]["code"] == "internal"
        assert "scheduled all the same" in answer["error"]["message"]
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
