"""sdk.acks.AckBatcher: acks refused while a broker group switches its master reach the new one."""

from __future__ import annotations

import asyncio
from typing import Any

from sdk.acks import ACK_ATTEMPTS_MAX, ACK_RETRY_MS, AckBatcher
from wire.errors import Forbidden, NotMaster

KEY = ("10.0.0.1:20881", "rt1", "orders")


class Clock:
    """A monotonic clock in ms that only moves when told."""

    def __init__(self) -> None:
        self.now_ms = 0.0

    def __call__(self) -> float:
        return self.now_ms


async def test_acks_refused_as_not_master_for_a_whole_switchover_reach_the_new_master() -> None:
    clock, sent, refusals = Clock(), [], [0]

    async def send(address: str, op: dict[str, Any]) -> dict[str, Any]:
        if clock.now_ms < 6_000:  # the group hands over for 6 s: acks are refused meanwhile
            refusals[0] += 1
            raise NotMaster("server a is handing the group over to b")
        sent.append((address, op["ranges"]))
        return {"acked": 3}

    batcher = AckBatcher(send, interval_ms=100, pending_max=1_000,
                         resolve=lambda key: "10.0.0.2:20881", monotonic_ms=clock)
    for seq in (1, 2, 3):
        batcher.add(KEY, seq)
    while not sent:
        await batcher.flush()
        clock.now_ms += 100  # one flush interval
    assert refusals[0] > ACK_ATTEMPTS_MAX  # more tries than the count alone allowed
    assert sent == [("10.0.0.2:20881", [[1, 3]])]  # to the group's current master


async def test_acks_are_given_up_after_the_retry_window_or_at_once_when_refused_for_good() -> None:
    clock, tries = Clock(), {"not_master": 0, "forbidden": 0}

    async def send(address: str, op: dict[str, Any]) -> dict[str, Any]:
        if op["subject"] == "orders":
            tries["not_master"] += 1
            raise NotMaster("no master serves the group")
        tries["forbidden"] += 1
        raise Forbidden("app shop may not consume payments")

    batcher = AckBatcher(send, interval_ms=100, pending_max=1_000, monotonic_ms=clock)
    batcher.add(KEY, 1)
    batcher.add(("10.0.0.1:20881", "rt1", "payments"), 1)
    for _ in range(int(ACK_RETRY_MS / 100) + 10):
        await batcher.flush()
        clock.now_ms += 100
    assert tries["forbidden"] == 1  # not retriable: given up at once
    assert ACK_RETRY_MS / 100 - 2 <= tries["not_master"] <= ACK_RETRY_MS / 100 + 2


class Sent:
    """The ack ops a batcher sends, and an event per op seen."""

    def __init__(self) -> None:
        self.ops: list[list[list[int]]] = []
        self.changed = asyncio.Event()

    async def __call__(self, address: str, op: dict[str, Any]) -> dict[str, Any]:
        self.ops.append(op["ranges"])
        self.changed.set()
        return {"acked": 1}

    async def until(self, count: int) -> None:
        async with asyncio.timeout(30):  # generous: only a hang fails it
            while len(self.ops) < count:
                self.changed.clear()
                await self.changed.wait()


async def test_a_few_acks_go_after_the_interval_and_the_batcher_keeps_flushing() -> None:
    sent = Sent()
    batcher = AckBatcher(sent, interval_ms=5, pending_max=1_000)
    batcher.start()
    try:
        batcher.add(KEY, 1)
        await sent.until(1)
        batcher.add(KEY, 2)
        batcher.add(KEY, 3)
        await sent.until(2)
        assert sent.ops == [[[1, 1]], [[2, 3]]]
    finally:
        await batcher.close()


async def test_pending_max_acks_go_at_once_and_close_sends_the_rest_without_waiting_the_interval(
        ) -> None:
    sent = Sent()
    batcher = AckBatcher(sent, interval_ms=3_600_000, pending_max=3)  # an hour: never reached
    batcher.start()
    for seq in (1, 2, 3):
        batcher.add(KEY, seq)
    await sent.until(1)
    batcher.add(KEY, 4)
    await asyncio.sleep(0)
    assert sent.ops == [[[1, 3]]]  # one ack waits for the interval
    async with asyncio.timeout(30):
        await batcher.close()
    assert sent.ops == [[[1, 3]], [[4, 4]]]


async def test_acks_of_two_broker_groups_go_in_one_flush() -> None:
    sent = Sent()
    batcher = AckBatcher(sent, interval_ms=3_600_000, pending_max=1_000)
    batcher.add(KEY, 7)
    batcher.add(("10.0.0.2:20881", "rt2", "orders"), 8)
    await batcher.flush()
    assert sorted(sent.ops) == [[[7, 7]], [[8, 8]]]
