"""A slow consumer does not block the others in its group: while its handler is stuck on a
message, the other consumers get and ack everything else at speed, and what the slow one holds
unacked reaches them after the ack timeout."""

from __future__ import annotations

import asyncio
import time

import pytest

import qmq
from tests.e2e.support import FAST, Ledger, RunningConsumer, close_all, send_all
from tests.harness import wait_for, wait_registered

ACK_TIMEOUT_MS = 3_000
BROKER_FLAGS = ("--ack-timeout-ms", str(ACK_TIMEOUT_MS), "--consumer-expiry-ms", "10000")
PULL_BATCH = 8  # the slow consumer's pull batch, also its prefetch capacity
# What a stuck consumer can hold: the message in its handler and a full prefetch queue (a pull
# asks only for what fits). Everything else must go to the others at once.
HELD_MAX = 1 + PULL_BATCH
STUCK_BOUND_S = 90  # the slow handler is released at the end of the test, at the latest then
FRESH = 300  # messages sent while the slow consumer is stuck


@pytest.mark.timeout(180)
async def test_a_stuck_consumer_does_not_hold_up_its_group_and_its_messages_move_on(cluster):
    cluster.start_meta()
    cluster.start_broker("rt1", *BROKER_FLAGS)
    await asyncio.to_thread(wait_registered, cluster.meta_url, {("realtime", "rt1"): "rw"})
    subject, group = "reports.render", "renderers"
    release = asyncio.Event()
    slow_got: list[str] = []

    slow = qmq.Consumer(cluster.meta_url, group=group, consumer_id="slow", pull_batch=PULL_BATCH,
                        start="earliest", **FAST)
    await slow.__aenter__()

    async def stuck_handler() -> None:
        async for msg in slow.subscribe(subject):
            slow_got.append(msg.id)
            async with asyncio.timeout(STUCK_BOUND_S):
                await release.wait()  # blocks, long but bounded
            await msg.ack()

    slow_task = asyncio.create_task(stuck_handler())
    ledger = Ledger()
    fast: list[RunningConsumer] = []
    try:
        async with qmq.Producer(cluster.meta_url) as producer:
            held = [f"held-{n:02d}" for n in range(8)]
            await send_all(producer, subject, held)
            await wait_for(lambda: slow_got, 30, "the slow consumer to take a message")
            fast = [await RunningConsumer(cluster.meta_url, group, subject, ledger,
                                          name=f"fast-{n}", start="earliest").start()
                    for n in range(2)]
            started = time.monotonic()
            fresh = [f"fresh-{n:03d}" for n in range(FRESH)]
            await send_all(producer, subject, fresh)
            await wait_for(lambda: ledger.ids >= set(fresh), 60,
                           "the fast consumers to get everything sent meanwhile")
            fresh_s = time.monotonic() - started
            await wait_for(lambda: ledger.ids >= set(held), ACK_TIMEOUT_MS / 1000 + 30,
                           "what the stuck consumer holds to reach the others")
            moved_s = time.monotonic() - started
        assert not release.is_set() and not slow_task.done(), "it was stuck all along"
        stuck_on = list(slow_got)  # (once released it takes more before it closes)
    finally:
        release.set()
        await close_all(fast)
        await slow.close()
        async with asyncio.timeout(30):
            await slow_task

    assert ledger.duplicates() == {}
    # Which fast consumer got what is the broker's choice (one may take it all while the other
    # is still starting); the point is that the stuck one held up none of it.
    assert {d.consumer for d in ledger.deliveries} <= {"fast-0", "fast-1"}
    assert len(stuck_on) == 1, f"the handler must have been stuck on one message: {stuck_on}"
    moved = ledger.of(stuck_on[0])
    assert len(moved) == 1 and moved[0].redelivered >= 1, \
        "the message the stuck one held came back through the ack timeout"
    came_back = {d.id for d in ledger.deliveries if d.redelivered >= 1}
    assert len(came_back) <= HELD_MAX, \
        f"{len(came_back)} messages waited for the ack timeout; a stuck consumer holds {HELD_MAX}"
    print(f"{FRESH} messages to the fast consumers in {fresh_s:.2f} s while one was stuck; "
          f"the {len(came_back)} it held moved on after {moved_s:.2f} s "
          f"(ack timeout {ACK_TIMEOUT_MS} ms)")
