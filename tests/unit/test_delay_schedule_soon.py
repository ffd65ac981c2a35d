"""``AcceptingMixin.schedule_soon``: a delayed send queued with no task, its commit's store call
made with no future (``IoThread.submit_then``) and the call told in the hand-back
(``on_done``): told only after its commit (and, under ``sync`` replication, after the slaves
have it: docs/REPLICATION.md 5, one parked wait per commit), refused as ``schedule`` refuses,
in the order the calls were queued, and the messages stored and placed as ``schedule``'s."""

from __future__ import annotations

import asyncio
from typing import Any

from logstore.errors import DiskFull
from tests.rawclient import FakeClock, message
from tests.unit.delay_handoff_support import HoldingBroker, started
from tests.unit.test_delay_sync_wait import SlaveBehind
from wire.errors import NotMaster
from wire.message import encode_message


def payloads(clock: FakeClock, *bodies: bytes) -> list[bytes]:
    """Payloads of messages due an hour ahead."""
    return [encode_message(message("s", body, clock, deliver_at_ms=clock() + 3_600_000))
            for body in bodies]


async def told(calls: list[Any], count: int) -> None:
    """Until ``count`` calls were told (generous limit, no timing asserted)."""
    for _ in range(10_000):
        if len(calls) >= count:
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"{len(calls)} of {count} calls told")


async def test_a_soon_send_is_told_its_results_after_its_commit_and_its_messages_are_stored(
        tmp_path):
    clock = FakeClock()
    scheduler = await started(tmp_path, clock, HoldingBroker(clock))
    ended: list[Any] = []
    try:
        sent = payloads(clock, b"a", b"b")
        call = scheduler.schedule_soon(sent, False, None, ended.append)
        assert ended == []  # queued: told only once its commit ended
        await told(ended, 1)
        assert ended == [call] and call.error is None and call.delay_end == 0
        assert [r["status"] for r in call.results] == ["stored", "stored"]
        assert scheduler.answered_delay_end > 0
        compact = scheduler.schedule_soon(payloads(clock, b"c"), True, None, ended.append)
        await told(ended, 2)
        assert ended[1] is compact and compact.compact and len(compact.ids) == 1
    finally:
        await scheduler.stop()
    again = await started(tmp_path, clock, HoldingBroker(clock))
    try:
        assert again.store.delay_end() == scheduler.answered_delay_end  # all three stored
    finally:
        await again.stop()


async def test_soon_and_awaited_sends_of_one_commit_are_told_in_the_order_they_came(tmp_path):
    clock = FakeClock()
    scheduler = await started(tmp_path, clock, HoldingBroker(clock))
    order: list[str] = []
    try:
        first = scheduler.schedule_soon(payloads(clock, b"1"), False, None,
                                        lambda call: order.append("soon 1"))
        # Queued while the first commit runs: these share the next commit.
        awaited = asyncio.create_task(scheduler.schedule(payloads(clock, b"2")))
        await asyncio.sleep(0)
        second = scheduler.schedule_soon(payloads(clock, b"3"), False, None,
                                         lambda call: order.append("soon 3"))
        await told(order, 2)
        assert [a["status"] for a in await awaited] == ["stored"]
        assert order == ["soon 1", "soon 3"]
        assert first.results[0]["status"] == second.results[0]["status"] == "stored"
    finally:
        await scheduler.stop()


async def test_a_soon_send_whose_store_call_failed_is_told_the_error(tmp_path):
    clock = FakeClock()
    scheduler = await started(tmp_path, clock, HoldingBroker(clock))
    ended: list[Any] = []

    def full(*_args):
        raise DiskFull("delay/delaylog", 1)

    try:
        scheduler.store.append_many = full  # type: ignore[method-assign]
        call = scheduler.schedule_soon(payloads(clock, b"a"), True, None, ended.append)
        await told(ended, 1)
        assert not call.compact  # refused: a result per message, naming the error
        assert call.results[0]["error"]["code"] == "overloaded"
        assert not scheduler.readonly  # a full disk refuses, it does not go read-only
    finally:
        await scheduler.stop()


async def test_a_soon_send_under_sync_is_told_only_once_its_slaves_have_the_commit(tmp_path):
    for error in (None, NotMaster("group d: stepping down; resend")):
        clock = FakeClock()
        scheduler = await started(tmp_path / str(error is None), clock, HoldingBroker(clock))
        replica = SlaveBehind()
        scheduler.replica = replica  # type: ignore[assignment]
        ended: list[Any] = []
        try:
            scheduler.schedule_soon(payloads(clock, b"a"), False, None, ended.append)
            scheduler.schedule_soon(payloads(clock, b"b"), False, None, ended.append)
            for _ in range(10_000):
                if len(replica.parked) == 2:  # the first commit's, then the second's
                    break
                await asyncio.sleep(0.001)
            for _ in range(20):
                await asyncio.sleep(0)
            assert len(replica.parked) == 2  # one parked wait per commit, none per send
            assert ended == []  # committed, not told: the slave lacks them
            for name, end, done in replica.parked:
                assert name == "delay" and end > 0
                done(error)
            await told(ended, 2)
            for call in ended:
                assert call.error is error and call.delay_end == 0
        finally:
            await scheduler.stop()


async def test_a_soon_send_committed_by_a_master_that_stopped_keeps_its_delay_end(tmp_path):
    clock = FakeClock()
    scheduler = await started(tmp_path, clock, HoldingBroker(clock))
    scheduler.replica = SlaveBehind(now=NotMaster("stopped"))  # type: ignore[assignment]
    ended: list[Any] = []
    try:
        call = scheduler.schedule_soon(payloads(clock, b"a"), False, None, ended.append)
        await told(ended, 1)
        # Told with the end still to wait for: its server's replicated_now raises NotMaster.
        assert call.delay_end > 0 and call.error is None
    finally:
        await scheduler.stop()


async def test_a_soon_send_with_nothing_valid_gets_its_results_at_once(tmp_path):
    clock = FakeClock()
    scheduler = await started(tmp_path, clock, HoldingBroker(clock))
    try:
        far = encode_message(message("s", b"a", clock,
                                     deliver_at_ms=clock() + scheduler.config.max_delay_ms
                                     + 60_000))
        results = scheduler.schedule_soon([far], False, None, lambda call: None)
        assert type(results) is list
        assert results[0]["error"]["code"] == "delay_out_of_range"
    finally:
        await scheduler.stop()
