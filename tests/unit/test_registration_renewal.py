"""A master whose lease alone ran out asks the MetaServer at once (``Registration.renew_lease``):
one heartbeat however many requests wait for it, none when a heartbeat already renewed it, and
after one that did not renew none for a heartbeat interval (no storm against MetaServers that
fail at once). docs/REPLICATION.md 5."""

from __future__ import annotations

import asyncio
from typing import Any

from sdk.meta import MetaUnavailable
from serverkit.registration import Registration
from serverkit.role import RoleGrant, ServerRole

LEASE_MS = 3_000


class Clock:
    """A boottime clock the test moves."""

    def __init__(self) -> None:
        self.now_ms = 1_000_000

    def __call__(self) -> int:
        return self.now_ms


async def _noop() -> list[Any]:
    return []


def _master_answer() -> dict[str, Any]:
    return {"state": "rw", "role": "master", "epoch": 1, "lease_ms": LEASE_MS,
            "lease_required": True, "master": {"server_id": "me", "address": "127.0.0.1:2"}}


def lapsed_master(clock: Clock) -> tuple[Registration, ServerRole]:
    """A registered, active master whose lease ran out by the clock (a stall past it)."""
    role = ServerRole("me")
    role.on_answer(clock.now_ms, RoleGrant.from_answer(_master_answer()),  # type: ignore[arg-type]
                   proposed_slaves=True)
    assert role.activate(1)
    reg = Registration("http://127.0.0.1:1", group="g", kind="realtime",
                       address="127.0.0.1:2", heartbeat_interval_ms=750, report=_noop,
                       on_state=lambda s: None, role=role, clock_ms=clock)
    reg.registered = True
    clock.now_ms += LEASE_MS  # stalled past the lease
    assert role.only_lease_ran_out(clock.now_ms)
    return reg, role


async def test_requests_meeting_a_lapsed_lease_share_one_heartbeat_that_renews_it():
    clock = Clock()
    reg, role = lapsed_master(clock)
    posted: list[str] = []
    answer = asyncio.Event()

    async def post(path: str, body: dict[str, Any], *, patient: bool = False):
        posted.append(path)
        await answer.wait()
        return 200, _master_answer()

    reg._post = post  # type: ignore[method-assign]
    waiting = [asyncio.create_task(reg.renew_lease()) for _ in range(5)]
    while not posted:
        await asyncio.sleep(0)
    answer.set()
    await asyncio.gather(*waiting)
    assert posted == ["/api/brokers/heartbeat"]  # one renewal for the five
    assert role.may_write(clock.now_ms)  # renewed from when that heartbeat was sent
    await reg.renew_lease()  # renewed: nothing more to ask
    assert posted == ["/api/brokers/heartbeat"]


async def test_after_a_renewal_that_failed_the_next_waits_a_heartbeat_interval():
    # MetaServers failing at once under traffic: one heartbeat (and one log line) per interval
    # beyond the loop's, not one per request (review rvc-L3: 20/s with a 50 ms gap).
    clock = Clock()
    reg, role = lapsed_master(clock)
    posted: list[str] = []

    async def post(path: str, body: dict[str, Any], *, patient: bool = False):
        posted.append(path)
        clock.now_ms += 1  # it took a moment
        raise MetaUnavailable("no MetaServer answered (test)")

    reg._post = post  # type: ignore[method-assign]
    await reg.renew_lease()
    for _ in range(20):  # requests within the interval: refused, nothing asked
        clock.now_ms += 10
        await reg.renew_lease()
    assert posted == ["/api/brokers/heartbeat"]
    assert role.only_lease_ran_out(clock.now_ms)  # still refusing: no renewal, no write
    clock.now_ms += reg.heartbeat_interval_ms
    await reg.renew_lease()  # an interval on: asked again
    assert posted == ["/api/brokers/heartbeat"] * 2
