"""sdk.acks.AckBatcher: acks refused while a broker group switches its master reach the new one."""

from __future__ import annotations

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
