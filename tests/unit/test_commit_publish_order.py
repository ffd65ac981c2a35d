"""A send's commit published in the store thread's hand-back (``IoThread`` ``Submitted.then``,
3fb873b) never overtakes a visibility round handed back just before it in the same bunch: the
broker's tail keeps both runs, so a consumer reading from the tail misses neither (the hazard
that reverted c049321 in f9aa07c, here at the broker level; review s17 rvb-4)."""

from __future__ import annotations

import threading
import time

from realtime.sends import SendRequest
from tests.harness import wait_for
from tests.unit.test_broker_hold import DUE_IN_MS, hold, opened, payload  # noqa: F401


def block_loop_until(condition, limit_s: float = 30.0) -> None:
    """Hold the event loop (on purpose: its results then come back in one bunch) until
    ``condition`` holds."""
    end = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.001)


async def test_a_commit_handed_back_in_the_bunch_after_a_visibility_round_keeps_both_in_the_tail(
        opened):  # noqa: F811
    broker, clock, _ = opened
    assert await hold(broker, clock, "orders", ["h1"]) == ["stored"]
    io = broker._store_thread
    gate = threading.Event()
    io.submit(gate.wait, 30)  # holds the store thread: what follows queues behind it
    clock.advance(DUE_IN_MS)
    busy = io._submitted - io._finished
    broker.handoffs.poke()
    await wait_for(lambda: io._submitted - io._finished == busy + 1, 10,
                   "the visibility round's store call to queue")
    sent = []
    assert type(broker.send_soon([payload("orders", "r1", clock, None)], False,
                           sent.append)) is SendRequest
    assert io._submitted - io._finished == busy + 2
    gate.set()
    block_loop_until(io.idle)  # all three results now come back in one bunch
    await wait_for(lambda: sent and broker.handoffs.made_visible == 1, 10, "both published")
    run = broker.committed.tail._subjects["orders"]
    assert (run.start + run.evicted, run.start + len(run.payloads)) == (0, 2), (
        run.start, run.evicted, len(run.payloads))
    assert broker.committed.ends["orders"] == 2
