"""A follower's step that must wait for another log's copy (``FetchAnswer.requires``: a done
record refers to delay records) goes on once that copy's end reaches what it needs, not
before; a waiting step cancelled meanwhile keeps no other step from waking
(serverkit.follower ``_wait_end``/``_moved_to``)."""

from __future__ import annotations

import asyncio
from typing import Any

from logstore.epoch_history import EpochHistory
from serverkit.follower import Follower, Scrub
from serverkit.replica_log import ReplicatedLog

TURNS = 20  # loop turns a step gets to (wrongly) go on in


async def run(fn: Any, *args: Any) -> Any:
    return fn(*args)


def follower(tmp_path: Any) -> Follower:
    logs = [ReplicatedLog(name, None, EpochHistory(str(tmp_path / f"{name}.epochs")), run)
            for name in ("delay", "done")]
    return Follower("d1", "slave", logs, connect=None,  # type: ignore[arg-type]
                    clock_ms=lambda: 0, on_trouble=lambda: None, scrub=Scrub(0, 0))


async def turns() -> None:
    for _ in range(TURNS):
        await asyncio.sleep(0)


async def test_a_step_waits_until_the_other_copy_reaches_its_end(tmp_path):
    copy = follower(tmp_path)
    waiting = asyncio.create_task(copy._wait_end("delay", 100))
    await turns()
    copy._moved_to("done", 500)  # another log's move: looked at, not enough
    copy._moved_to("delay", 99)
    await turns()
    assert not waiting.done()
    copy._moved_to("delay", 100)
    await turns()
    assert waiting.done() and waiting.result() is None


async def test_a_cancelled_waiting_step_keeps_no_other_from_going_on(tmp_path):
    copy = follower(tmp_path)
    cancelled = asyncio.create_task(copy._wait_end("delay", 50))
    waiting = asyncio.create_task(copy._wait_end("delay", 50))
    await turns()
    cancelled.cancel()
    await turns()
    copy._moved_to("delay", 60)
    await turns()
    assert cancelled.cancelled() and waiting.done() and waiting.result() is None
    await copy._wait_end("delay", 60)  # reached already: returns without waiting
