"""Pull-log calls made on the event loop (issue 18, low-rate CPU): a pull served from the tail
and an ack skip the hop to the pull-log thread while that thread is idle and the pull log's next
write does no I/O; otherwise they go to the thread, in order, as before."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

from logstore.segment_log import SegmentedLog
from pulllog import PullLogConfig, PullLogStore
from pulllog.store import IN_MEMORY_ACTIONS_MAX
from realtime.broker import Broker
from realtime.config import RealtimeConfig
from serverkit.io_thread import IoThread
from tests.rawclient import FakeClock
from wire.message import Message, encode_message
from wire.protocol import Ack, Pull

S, G = "orders", "billing"


async def test_an_io_thread_is_idle_only_while_no_call_is_queued_or_running():
    io = IoThread("test-idle")
    try:
        assert io.idle()
        release = threading.Event()
        running = asyncio.ensure_future(io.call(release.wait, 30))
        queued = asyncio.ensure_future(io.call(lambda: "second"))
        await asyncio.sleep(0)
        assert not io.idle()
        release.set()
        assert await running is True
        assert await queued == "second"
        assert io.idle()
        with pytest.raises(ZeroDivisionError):
            await io.call(lambda: 1 // 0)
        assert io.idle(), "a call that raised is finished too"
    finally:
        io.close()


def test_a_segment_logs_buffered_room_shrinks_with_appends_and_is_zero_once_closed(tmp_path):
    log = SegmentedLog(str(tmp_path / "log"))
    room = log.buffered_room_bytes
    assert room > 0
    log.append(b"x" * 100)
    assert log.buffered_room_bytes < room
    log.close()
    assert log.buffered_room_bytes == 0


def test_a_pull_logs_writes_stay_in_memory_only_in_async_mode_away_from_a_checkpoint(tmp_path):
    every = IN_MEMORY_ACTIONS_MAX + 3
    store = PullLogStore(str(tmp_path / "async"), PullLogConfig(checkpoint_every_actions=every))
    store.ensure_group(S, G, 0, now_ms=0)  # one action
    assert store.writes_stay_in_memory()
    for seq in range(2):
        store.record_pull(S, G, "c1", [seq], seq + 1, now_ms=1)
    assert not store.writes_stay_in_memory(), "a checkpoint is due within a few actions"
    store.close()
    synced = PullLogStore(str(tmp_path / "sync"), PullLogConfig(flush_mode="sync"))
    assert not synced.writes_stay_in_memory(), "sync mode fsyncs every write"
    synced.close()
    follower = PullLogStore(str(tmp_path / "follower"), PullLogConfig(), follower=True)
    assert not follower.writes_stay_in_memory()
    follower.close()


@pytest.fixture
async def broker(tmp_path):
    broker = await Broker.open(RealtimeConfig(data_dir=str(tmp_path / "rt"), port=0), FakeClock())
    yield broker
    await broker.stop()


def record_threads(broker: Broker) -> list[tuple[str, int]]:
    """(kind, thread id) of each pull and ack the pull log records from now on (a pull from
    the tail through ``record_tail_pull``, a planned one through ``record_pull``)."""
    calls: list[tuple[str, int]] = []
    pulllog = broker.pulllog
    record_pull, record_ack = pulllog.record_pull, pulllog.record_ack
    record_tail_pull = pulllog.record_tail_pull

    def pull(*args, **kwargs):
        calls.append(("pull", threading.get_ident()))
        return record_pull(*args, **kwargs)

    def tail_pull(*args, **kwargs):
        calls.append(("pull", threading.get_ident()))
        return record_tail_pull(*args, **kwargs)

    def ack(*args, **kwargs):
        calls.append(("ack", threading.get_ident()))
        return record_ack(*args, **kwargs)

    pulllog.record_pull, pulllog.record_ack = pull, ack  # type: ignore[method-assign]
    pulllog.record_tail_pull = tail_pull  # type: ignore[method-assign]
    return calls


async def send(broker: Broker, message_id: str) -> None:
    message = Message.create(S, b"body", now_ms=FakeClock()(), id=message_id)
    await broker.send([encode_message(message)])


def pull_request(rid: int) -> Pull:
    return Pull(rid, S, G, "c1", 100, 0, [], "earliest", False)


async def test_a_tail_pull_and_its_ack_are_recorded_on_the_event_loop_while_the_thread_is_idle(
        broker):
    await send(broker, "m1")
    first = await broker.pull(pull_request(1))  # the group's first pull: planned
    calls = record_threads(broker)
    await send(broker, "m2")
    second = await broker.pull(pull_request(2))  # from the tail, at the known cursor
    assert len(second.payloads) == 1
    acked = await broker.ack(Ack(3, S, G, "c1", [(first.pull_seqs[0], second.pull_seqs[0])]))
    assert acked == 2
    loop_thread = threading.get_ident()
    assert calls == [("pull", loop_thread), ("ack", loop_thread)]
    assert broker.stats["pulled"] == 2 and broker.stats["acked"] == 2


async def test_a_pull_waits_for_a_call_running_on_the_pull_log_thread_and_goes_there_after_it(
        broker):
    await send(broker, "m1")
    await broker.pull(pull_request(1))
    calls = record_threads(broker)
    await send(broker, "m2")
    release = threading.Event()
    order: list[str] = []

    def busy() -> None:
        release.wait(30)
        order.append(f"busy, then {len(calls)} recorded")

    pulllog_thread = broker._pulllog_thread
    submitted = pulllog_thread._submitted
    blocker = asyncio.ensure_future(broker.on_pulllog_thread(busy))
    pulling = asyncio.ensure_future(broker.pull(pull_request(2)))
    for _ in range(1000):  # until the pull's record is queued behind the busy call
        if pulllog_thread._submitted == submitted + 2:
            break
        await asyncio.sleep(0.001)
    assert pulllog_thread._submitted == submitted + 2, "the pull went to the busy thread's queue"
    release.set()
    pulled = await pulling
    await blocker
    assert len(pulled.payloads) == 1
    assert order == ["busy, then 0 recorded"], "nothing ran beside the busy call"
    assert [kind for kind, _ in calls] == ["pull"]
    assert calls[0][1] != threading.get_ident(), "recorded on the pull-log thread"


async def test_a_pull_that_finds_a_whole_batch_unreadable_acks_it_in_one_action_off_the_loop(
        broker):
    # A pull recorded on the loop may write at most IN_MEMORY_ACTIONS_MAX actions; one ack per
    # unreadable redelivery would pass that and run the pull log's checkpoint (an fsync, a file
    # write and a rename) on the event loop.
    count = IN_MEMORY_ACTIONS_MAX + 4
    pulllog = broker.pulllog

    def leave_redeliveries() -> None:
        pulllog.ensure_group(S, G, 0, 1)
        pulllog.record_pull(S, G, "gone", list(range(count)), count, 1)
        pulllog.remove_consumer(S, G, "gone", 2)
    await broker.on_pulllog_thread(leave_redeliveries)
    assert pulllog.redelivery_count(S, G) == count
    pulllog.config = dataclasses.replace(  # a checkpoint due just past the quick call's bound
        pulllog.config,
        checkpoint_every_actions=pulllog._actions_since_checkpoint + IN_MEMORY_ACTIONS_MAX + 1)
    assert pulllog.writes_stay_in_memory()
    checkpoint_threads: list[int] = []
    checkpoint = pulllog.checkpoint

    def spied_checkpoint() -> None:
        checkpoint_threads.append(threading.get_ident())
        checkpoint()
    pulllog.checkpoint = spied_checkpoint  # type: ignore[method-assign]
    unreadable = {seq: b"" for seq in range(count)}  # what a read gives for records gone
    await broker.on_pulllog_quick(broker.pulls._record_pull_io, pull_request(1), G,
                                  list(range(count)), count, unreadable, 3, None)
    assert threading.get_ident() not in checkpoint_threads, "a checkpoint ran on the event loop"
    assert pulllog.redelivery_count(S, G) == 0
    assert pulllog.unacked(S, G, "c1") == [], "the unreadable entries were acked"
