"""The broker's flush round (every flush_interval_ms, busy or idle): under flush=sync the message
store's tick (dedup pruning only) runs once a second, and the pull log's tick and its end for
the slaves are one call on its thread, none when the pull log has nothing to flush (after the
first round, whose tick starts the flush interval); under
flush=async the store ticks every round."""

from __future__ import annotations

from typing import Any

import pytest

from realtime.broker import SYNC_STORE_TICK_INTERVAL_MS, Broker
from realtime.config import RealtimeConfig
from wire.message import Message, encode_message
from tests.rawclient import FakeClock

ROUND_MS = 100
# Rounds with a call after an action is recorded: the first round an interval after the last
# tick fsyncs it (the first round after an open ticks once, starting that interval).
ROUNDS_TO_FSYNC = 1
DEDUP_WINDOW_MS = 5_000


class Counted:
    """Wraps a broker's thread runner, counting the calls made through it."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self.calls = 0

    async def __call__(self, fn: Any, *args: Any) -> Any:
        self.calls += 1
        return await self.run(fn, *args)


class Slaves:
    """A master's replication seen from the flush round: it is told the pull log's end."""

    replicating = True

    def __init__(self) -> None:
        self.told: list[tuple[str, int]] = []

    def advanced(self, name: str, end: int) -> None:
        self.told.append((name, end))


async def open_broker(tmp_path: Any, flush: str) -> tuple[Broker, FakeClock, Counted, Counted]:
    clock = FakeClock()
    config = RealtimeConfig(data_dir=str(tmp_path / "rt"), port=0, flush=flush,
                            flush_interval_ms=ROUND_MS, dedup_window_ms=DEDUP_WINDOW_MS)
    broker = await Broker.open(config, clock)
    store_calls = broker.on_store_thread = Counted(broker.on_store_thread)
    pulllog_calls = broker.on_pulllog_thread = Counted(broker.on_pulllog_thread)
    return broker, clock, store_calls, pulllog_calls


async def rounds(broker: Broker, clock: FakeClock, count: int) -> None:
    for _ in range(count):
        await broker._flush_round()
        clock.advance(ROUND_MS)


@pytest.mark.parametrize("flush, store_ticks", [("sync", 2), ("async", 20)])
async def test_the_store_ticks_once_a_second_under_sync_and_every_round_under_async(
        tmp_path: Any, flush: str, store_ticks: int) -> None:
    broker, clock, store_calls, pulllog_calls = await open_broker(tmp_path, flush)
    try:
        await rounds(broker, clock, 2 * SYNC_STORE_TICK_INTERVAL_MS // ROUND_MS)
        assert store_calls.calls == store_ticks
        assert pulllog_calls.calls == 1, "the first round's tick alone: nothing to flush after"
    finally:
        await broker.stop()


async def test_a_master_tells_its_slaves_the_pull_logs_end_from_the_same_call_as_the_tick(
        tmp_path: Any) -> None:
    broker, clock, _store_calls, pulllog_calls = await open_broker(tmp_path, "sync")
    slaves = broker.replica = Slaves()  # type: ignore[assignment]
    try:
        await broker.on_pulllog_thread(broker.pulllog.ensure_group, "orders", "g", 0, clock())
        await rounds(broker, clock, 1)
        end = await broker.on_pulllog_thread(lambda: broker.pulllog.copy_bounds()[1])
        assert slaves.told == [("actions", end)]
        assert pulllog_calls.calls == 1 + 1 + 1, "the write, one round's call, the end read"
    finally:
        await broker.stop()


async def test_a_master_tells_its_slaves_the_pull_logs_end_with_no_call_when_idle(
        tmp_path: Any) -> None:
    broker, clock, _store_calls, pulllog_calls = await open_broker(tmp_path, "sync")
    slaves = broker.replica = Slaves()  # type: ignore[assignment]
    try:
        await rounds(broker, clock, 3)
        end = await broker.on_pulllog_thread(lambda: broker.pulllog.copy_bounds()[1])
        assert slaves.told == [("actions", end)] * 3
        assert pulllog_calls.calls == 1 + 1, "the first round's tick, then the end read alone"
    finally:
        await broker.stop()


async def test_actions_recorded_are_flushed_and_fsynced_by_the_rounds_then_they_make_no_call(
        tmp_path: Any) -> None:
    broker, clock, _store_calls, pulllog_calls = await open_broker(tmp_path, "sync")
    try:
        await rounds(broker, clock, 5)
        assert pulllog_calls.calls == 1, "an idle pull log: the first round's tick alone"
        await broker.on_pulllog_thread(broker.pulllog.ensure_group, "orders", "g", 0, clock())
        assert not broker.pulllog.tick_is_idle()
        await rounds(broker, clock, 5)
        assert broker.pulllog.tick_is_idle(), "every action durable"
        log = broker.pulllog._log
        assert log.durable_offset == log.end_offset > 0
        assert pulllog_calls.calls == 1 + 1 + ROUNDS_TO_FSYNC
    finally:
        await broker.stop()


async def test_an_action_recorded_after_idle_rounds_is_durable_one_interval_later(
        tmp_path: Any) -> None:
    # Review s17 rvb-2: idle rounds that skipped every tick left the flush interval unstarted,
    # and the first action after an open waited a second interval for its fsync.
    broker, clock, _store_calls, _pulllog_calls = await open_broker(tmp_path, "sync")
    try:
        await rounds(broker, clock, 3)  # an idle broker's rounds since it opened
        await broker.on_pulllog_thread(broker.pulllog.ensure_group, "orders", "g", 0, clock())
        log = broker.pulllog._log
        assert log.durable_offset < log.end_offset
        await rounds(broker, clock, 1)  # the round ROUND_MS after the last idle one
        assert log.durable_offset == log.end_offset, "fsynced one interval after the last tick"
    finally:
        await broker.stop()


async def test_ids_past_the_dedup_window_are_still_pruned_under_sync(tmp_path: Any) -> None:
    broker, clock, _store_calls, _pulllog_calls = await open_broker(tmp_path, "sync")
    try:
        payload = encode_message(Message.create("orders", b"x", now_ms=clock(), id="m-1"))
        await broker.send([payload])
        dedup = broker.store._dedup
        assert len(dedup) == 1
        await rounds(broker, clock, DEDUP_WINDOW_MS // ROUND_MS)
        assert len(dedup) == 1, "still within the window"
        await rounds(broker, clock, SYNC_STORE_TICK_INTERVAL_MS // ROUND_MS + 1)
        assert len(dedup) == 0
    finally:
        await broker.stop()
