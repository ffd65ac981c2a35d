"""The delay server's hand-off when a hold's answer says nothing sure (review s11 rvho-3): a
hold answered NotMaster may be held by its group (the answer can come after the write), so it
is never held again and is sent at its due time."""

from __future__ import annotations

from tests.rawclient import FakeClock
from tests.unit.test_delay_handoff import (
    LEAD_MS, HoldingBroker, into_the_lead, settle, started)
from wire.errors import NotMaster


class _HeldThenNotMaster(HoldingBroker):
    """Stores its first hold, then answers NotMaster (its master was demoted while waiting
    for its slaves: the promoted slave may hold it); later holds are refused NotMaster with
    nothing written (the group is failing over)."""

    async def hold(self, subject, payloads, visible_at_ms):
        if not self.held:
            await super().hold(subject, payloads, visible_at_ms)
        raise NotMaster("group rt: demoted; refresh the route and resend")


async def test_a_hold_answered_not_master_is_never_held_again_but_sent_at_its_due_time(tmp_path):
    clock = FakeClock()
    broker = _HeldThenNotMaster(clock)
    scheduler = await started(tmp_path, clock, broker)
    try:
        due, [m] = await into_the_lead(scheduler, clock, b"a")
        for _ in range(LEAD_MS // 250 - 1):  # the retry backoffs of a refusal pass
            clock.advance(250)
            await settle(scheduler)
        assert [i for _, i, _ in broker.held] == [m.id] and broker.received == []
        clock.advance(due - clock())
        await settle(scheduler)
        assert [(at, r.id) for at, r in broker.received] == [(due, m.id)]
    finally:
        await scheduler.stop()
