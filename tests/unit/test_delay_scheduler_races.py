"""The delay scheduler's window and dispatch path against races with loads, cancels and bad
records: the Scheduler alone, a fake clock, a recording dispatch function, no sleeping for time
(only event-loop turns and waits on the scheduler's own tasks)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Awaitable
from typing import Any, TypeVar

from delayserver.config import DelayConfig
from delayserver.scheduler import Scheduler
from delayserver.tracing import DelayTracer
from tracelog.writer import TraceWriter
from wire.message import decode_message, encode_message
from tests.rawclient import FakeClock, message

BUCKET_MS = 1_000
T = TypeVar("T")


class Broker:
    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.received: list[tuple[int, Any]] = []

    async def dispatch(self, subject: str, payloads: list[bytes]):
        for payload in payloads:
            self.received.append((self.clock(), decode_message(payload)))
        return "rt", [{"id": decode_message(p).id, "status": "stored"} for p in payloads]

    def bodies(self) -> list[bytes]:
        return [m.body for _, m in self.received]


async def started(tmp_path, clock, dispatch, **overrides) -> Scheduler:
    config = DelayConfig(data_dir=str(tmp_path / "delay"), port=0, bucket_ms=BUCKET_MS,
                         trace=False, **overrides)
    scheduler = await Scheduler.open(config, clock, dispatch)
    await scheduler.start()
    return scheduler


class Held:
    """Holds every call of one store method on the I/O thread until ``release()`` (10 s at
    most): before the call runs, or after it returned with ``after=True``."""

    def __init__(self, store, name: str, *, after: bool = False) -> None:
        self.entered, self.go = threading.Event(), threading.Event()
        original = getattr(store, name)

        def held(*args):
            result = original(*args) if after else None
            self.entered.set()
            self.go.wait(10)
            return result if after else original(*args)

        setattr(store, name, held)

    async def wait_entered(self) -> None:
        """Return once a call has reached the hold (event-loop turns only, no sleeping)."""
        while not self.entered.is_set():
            await asyncio.sleep(0)

    def release(self) -> None:
        self.go.set()

    async def release_after(self, operation: Awaitable[T]) -> T:
        """Start ``operation`` while the call is held, give it event-loop turns to reach what
        the held call blocks (a lock, the I/O thread's queue), then release and return its
        result."""
        task = asyncio.ensure_future(operation)
        for _ in range(10):
            await asyncio.sleep(0)
        self.release()
        return await task


async def settle(scheduler: Scheduler) -> None:
    """Let the dispatcher look at the (fake) time and finish what it started."""
    for _ in range(5):
        scheduler.poke()
        for _ in range(10):
            await asyncio.sleep(0)
        if scheduler._preload_task is not None:
            await asyncio.wait({scheduler._preload_task}, timeout=5)
        tasks = set(scheduler.dispatcher.tasks)
        if tasks:
            await asyncio.wait(tasks, timeout=5)


@contextlib.asynccontextmanager
async def scheduling(tmp_path):
    """A started scheduler over a fake clock and a recording broker: (clock, broker,
    scheduler), stopped at the end."""
    clock = FakeClock()
    broker = Broker(clock)
    scheduler = await started(tmp_path, clock, broker.dispatch)
    try:
        yield clock, broker, scheduler
    finally:
        await scheduler.stop()


async def test_a_message_cancelled_while_its_bucket_is_being_loaded_is_never_delivered(
        tmp_path):
    clock = FakeClock()
    broker = Broker(clock)
    scheduler = await started(tmp_path, clock, broker.dispatch, preload_buckets=1)
    try:
        due = scheduler.bucket_of(clock()) + 5 * BUCKET_MS + 500  # beyond the window: disk only
        doomed = message("s", b"doomed", clock, deliver_at_ms=due)
        kept = message("s", b"kept", clock, deliver_at_ms=due)
        answers = await scheduler.schedule([encode_message(doomed), encode_message(kept)])
        assert {a["status"] for a in answers} == {"stored"}
        assert len(scheduler.window.tracked) == 0

        # Hold the bucket's load on the I/O thread until the cancel has queued its work.
        load = Held(scheduler.store, "load_bucket_slice")
        clock.advance(5 * BUCKET_MS)  # the bucket enters the window: the dispatcher loads it
        scheduler.poke()
        await load.wait_entered()
        assert await load.release_after(scheduler.cancel(doomed.id, due)) == "cancelled"
        await settle(scheduler)
        clock.advance(BUCKET_MS)
        await settle(scheduler)
        assert broker.bodies() == [b"kept"], "a cancelled message is never delivered"
    finally:
        await scheduler.stop()


async def test_a_message_for_an_empty_bucket_stored_while_a_later_bucket_loads_is_delivered(
        tmp_path):
    clock = FakeClock()
    broker = Broker(clock)
    scheduler = await started(tmp_path, clock, broker.dispatch, preload_buckets=3)
    try:
        now_bucket = scheduler.bucket_of(clock())
        later = message("s", b"later", clock, deliver_at_ms=now_bucket + 5 * BUCKET_MS + 10)
        assert (await scheduler.schedule([encode_message(later)]))[0]["status"] == "stored"
        await settle(scheduler)
        assert len(scheduler.window.tracked) == 0, "beyond the window: on disk only"

        listing = Held(scheduler.store, "buckets_with_pending", after=True)
        clock.advance(2 * BUCKET_MS)  # the later message's bucket enters the window
        scheduler.poke()
        await listing.wait_entered()
        # Meanwhile a message for the bucket before it, which had nothing when the loader
        # listed the buckets to load (its commit reaches the I/O thread before the load).
        sooner = message("s", b"sooner", clock, deliver_at_ms=now_bucket + 4 * BUCKET_MS + 10)
        answers = await listing.release_after(scheduler.schedule([encode_message(sooner)]))
        assert answers[0]["status"] == "stored"
        await settle(scheduler)
        clock.advance(4 * BUCKET_MS)
        await settle(scheduler)
        assert broker.bodies() == [b"sooner", b"later"]
        assert all(at >= m.deliver_at_ms for at, m in broker.received)
    finally:
        await scheduler.stop()


async def test_a_corrupt_record_is_reported_and_does_not_hold_back_the_messages_read_with_it(
        tmp_path):
    import os

    from logstore.faults import flip_bit

    clock = FakeClock()
    broker = Broker(clock)
    scheduler = await started(tmp_path, clock, broker.dispatch)
    try:
        due = clock() + 100
        sent = [message("s", b"m%d" % i, clock, deliver_at_ms=due) for i in range(5)]
        answers = await scheduler.schedule([encode_message(m) for m in sent])
        assert {a["status"] for a in answers} == {"stored"}
        await asyncio.sleep(0)  # the window takes a commit's entries a turn after its answers
        bad = sorted(scheduler.window.tracked.values(), key=lambda e: e.delay_log_offset)[2]
        segment_dir = scheduler.store.layout.delaylog_dir
        [segment] = [os.path.join(segment_dir, name) for name in os.listdir(segment_dir)
                     if name.endswith(".log")]
        flip_bit(segment, bad.delay_log_offset + 12 + bad.size_bytes - 1)  # its last body byte
        clock.advance(100)
        await settle(scheduler)
        clock.advance(60_000)  # time for any retries
        await settle(scheduler)
        assert sorted(broker.bodies()) == [b"m0", b"m1", b"m3", b"m4"]
        assert bad.delay_log_offset in scheduler.window.tracked, "kept, not dropped silently"
    finally:
        await scheduler.stop()


async def test_dispatches_confirmed_but_not_yet_recorded_when_the_grace_time_ends_are_not_sent_again_after_a_restart(  # noqa: E501
        tmp_path):
    clock = FakeClock()
    broker = Broker(clock)
    later_confirmed = asyncio.Event()
    plain_dispatch = broker.dispatch

    async def dispatch(subject, payloads):
        if decode_message(payloads[0]).body == b"later":
            await later_confirmed.wait()
        return await plain_dispatch(subject, payloads)

    scheduler = await started(tmp_path, clock, dispatch, dispatch_batch_max=1,
                              shutdown_grace_ms=0)
    due = clock() + 100
    sent = [message("s", body, clock, deliver_at_ms=due) for body in (b"first", b"later")]
    answers = await scheduler.schedule([encode_message(m) for m in sent])
    assert {a["status"] for a in answers} == {"stored"}

    # Hold the first batch's dispatch record on the I/O thread; the second batch is confirmed
    # meanwhile and waits in the recorder's queue when stop() runs out of grace time.
    record = Held(scheduler.store, "record_dispatched")
    clock.advance(100)
    scheduler.poke()
    await record.wait_entered()
    later_confirmed.set()
    while len(broker.received) < 2:
        await asyncio.sleep(0)
    await record.release_after(scheduler.stop())

    again = Broker(clock)
    restarted = await started(tmp_path, clock, again.dispatch)
    try:
        clock.advance(60_000)
        await settle(restarted)
        assert sorted(broker.bodies()) == [b"first", b"later"]
        assert again.bodies() == [], "a confirmed dispatch is never sent again after a restart"
    finally:
        await restarted.stop()


async def test_fields_kept_for_the_dispatched_line_leave_with_the_dispatch_or_the_cancel(tmp_path):
    clock = FakeClock()
    broker = Broker(clock)
    config = DelayConfig(data_dir=str(tmp_path / "delay"), port=0, bucket_ms=BUCKET_MS,
                         trace_dir=str(tmp_path / "trace"))
    writer = TraceWriter(config.trace_directory, "delay:d1", clock_ms=clock, background=False)
    scheduler = await Scheduler.open(config, clock, broker.dispatch, tracer=DelayTracer(writer))
    await scheduler.start()
    try:
        due = clock() + 500  # in a loaded bucket: committed straight into the window
        doomed = message("s", b"doomed", clock, deliver_at_ms=due)
        sent = message("s", b"sent", clock, deliver_at_ms=due)
        await scheduler.schedule([encode_message(doomed), encode_message(sent)])
        # Kept as the window takes them, a loop turn after the answers: a cancel made before
        # that turn places them first, so it finds and drops its message's fields.
        assert scheduler.tracer.kept_count() == 0
        assert await scheduler.cancel(doomed.id, due) == "cancelled"
        assert scheduler.tracer.kept_count() == 1
        clock.advance(1_000)
        await settle(scheduler)
        assert broker.bodies() == [b"sent"]
        assert scheduler.tracer.kept_count() == 0
    finally:
        await scheduler.stop()
        writer.close()
    lines = [json.loads(line) for path in (tmp_path / "trace").glob("*/*.jsonl")
             for line in path.read_text().splitlines()]
    dispatched = [line for line in lines if line["event"] == "dispatched"]
    assert [(line["msg_id"], line["lateness_ms"]) for line in dispatched] == [(sent.id, 500)]


async def test_a_commits_answer_is_released_before_the_window_takes_its_entries(tmp_path):
    async with scheduling(tmp_path) as (clock, broker, scheduler):
        m = message("s", b"a", clock, deliver_at_ms=clock() + 500)  # a loaded bucket
        [answer] = await scheduler.schedule([encode_message(m)])
        assert answer["status"] == "stored"
        assert len(scheduler.window) == 0, "the answer waited for the window"
        await asyncio.sleep(0)
        assert len(scheduler.window) == 1
        clock.advance(500)
        await settle(scheduler)
        assert broker.bodies() == [b"a"]


async def test_a_commits_scheduled_lines_are_built_after_its_answer_in_the_turn_the_window_takes_it(
        tmp_path):
    clock = FakeClock()
    config = DelayConfig(data_dir=str(tmp_path / "delay"), port=0, bucket_ms=BUCKET_MS,
                         trace_dir=str(tmp_path / "trace"))
    writer = TraceWriter(config.trace_directory, "delay:d1", clock_ms=clock, background=False)
    scheduler = await Scheduler.open(config, clock, Broker(clock).dispatch,
                                     tracer=DelayTracer(writer))
    await scheduler.start()
    try:
        m = message("s", b"a", clock, deliver_at_ms=clock() + 500)  # a loaded bucket
        [answer] = await scheduler.schedule([encode_message(m)])
        assert answer["status"] == "stored"
        assert len(scheduler.window) == 0 and len(scheduler.tracer._deferred) == 1, (
            "the answer waited for the window or the trace line")
        await asyncio.sleep(0)  # one turn: the placement builds the line too
        assert len(scheduler.window) == 1 and scheduler.tracer._deferred == []
        writer.flush()
        lines = [json.loads(line) for path in (tmp_path / "trace").glob("*/*.jsonl")
                 for line in path.read_text().splitlines()]
        assert [(line["event"], line["msg_id"]) for line in lines] == [("scheduled", m.id)]
    finally:
        await scheduler.stop()
        writer.close()


async def cancelled_during_a_commit(scheduler, clock, sent, cancel_id: str, due: int) -> str:
    """Send ``sent`` and, while its commit is held on the I/O thread, cancel ``cancel_id``
    (its store work queues behind the commit); then past ``due``: the cancel's answer."""
    commit = Held(scheduler.store, "commit")
    send = asyncio.ensure_future(scheduler.schedule([encode_message(sent)]))
    await commit.wait_entered()
    answer = await commit.release_after(scheduler.cancel(cancel_id, due))
    assert (await send)[0]["status"] == "stored"
    await settle(scheduler)
    clock.advance(BUCKET_MS)
    await settle(scheduler)
    return answer


async def test_a_cancel_that_begins_while_its_own_send_is_being_committed_answers_unknown_and_the_message_is_delivered(  # noqa: E501
        tmp_path):
    # A client that chose the message id may cancel before its send is answered. The cancel's
    # store work queues behind the commit on the I/O thread and would find the message stored;
    # the commit's entry enters the window after the cancel looked there. The cancel takes
    # effect when it begins, before that send: "unknown", and the message is delivered (it
    # was answered "cancelled" and delivered all the same before).
    async with scheduling(tmp_path) as (clock, broker, scheduler):
        due = clock() + 500  # a loaded bucket: the commit places the entry in the window
        early = message("s", b"early", clock, deliver_at_ms=due)
        answer = await cancelled_during_a_commit(scheduler, clock, early, early.id, due)
        assert answer == "unknown"
        assert broker.bodies() == [b"early"], "not cancelled: delivered, once"


async def test_a_cancel_after_its_sends_answer_is_never_delivered_even_before_the_window_took_it(
        tmp_path):
    async with scheduling(tmp_path) as (clock, broker, scheduler):
        due = clock() + 500
        doomed = message("s", b"doomed", clock, deliver_at_ms=due)
        kept = message("s", b"kept", clock, deliver_at_ms=due)
        answers = await scheduler.schedule([encode_message(doomed), encode_message(kept)])
        assert [a["status"] for a in answers] == ["stored", "stored"]
        # A cancel whose store work waits behind another send's commit still covers it.
        other = message("s", b"other", clock, deliver_at_ms=due)
        answer = await cancelled_during_a_commit(scheduler, clock, other, doomed.id, due)
        assert answer == "cancelled"
        assert sorted(broker.bodies()) == [b"kept", b"other"]
