"""A delay server answers a send from its commit's hand-back (``DelayServer._schedule_ended``)
and still refuses it ``not_master`` when the server stopped being the writable master while the
commit ran, or when its sync slaves cannot be waited for (docs/REPLICATION.md 5): the message
was stored, but the producer is not told so, and resends (review rv22-L1)."""

from __future__ import annotations

import asyncio
from typing import Any

from tests.integration.test_delay_server import client, clock, realtime, server  # noqa: F401
from tests.lease_lapse import lapse_after
from tests.rawclient import FakeClock, RawClient, message
from wire.errors import NotMaster
from wire.message import Message, encode_message


def _due_in_a_minute(clock: FakeClock) -> list[Message]:
    due = clock() + 60_000
    return [message("orders", body, clock, deliver_at_ms=due) for body in (b"plain", b"compact")]


def _send(sent: Message, compact: bool) -> dict[str, Any]:
    return {"op": "send", "compact": compact, "messages": [encode_message(sent)]}


def _code(answer: dict[str, Any]) -> str:
    if "error" in answer:
        return answer["error"]["code"]
    return answer["results"][0]["error"]["code"] if "results" in answer else "stored"


async def _cancelled(client: RawClient, sent: list[Message]) -> list[str]:
    """Each message's cancel status: ``cancelled`` only for one the server stored."""
    answer = await client.request({"op": "cancel", "ids": [m.id for m in sent],
                                   "deliver_at_ms": [m.deliver_at_ms for m in sent]})
    return [result["status"] for result in answer["results"]]


async def test_a_delayed_send_whose_commit_outlived_the_lease_is_refused_not_master(
        server, client, clock, monkeypatch):
    refusing = lapse_after(monkeypatch, server.role, server.scheduler, "_append_and_commit")
    sent = _due_in_a_minute(clock)
    for one, compact in zip(sent, (False, True)):
        refusing.clear()
        assert _code(await client.request(_send(one, compact))) == "not_master"
    refusing.clear()  # the lease renewed: the refused sends were stored all the same
    assert await _cancelled(client, sent) == ["cancelled", "cancelled"]


async def test_a_delayed_send_whose_sync_slaves_cannot_be_waited_for_is_refused_not_master(
        server, client, clock, monkeypatch):
    # A master that stopped serving while the commit ran cannot wait for its slaves.
    replica = server.scheduler.replica

    def stopped(name: str, end: int) -> bool:
        raise NotMaster("group g: this master stopped; resend")

    monkeypatch.setattr(replica, "replicating", True)
    monkeypatch.setattr(replica, "advanced", lambda name, end: None)
    monkeypatch.setattr(replica, "wrote_io", lambda name: None)
    monkeypatch.setattr(replica, "replicated_now", stopped)
    for one, compact in zip(_due_in_a_minute(clock), (False, True)):
        assert _code(await client.request(_send(one, compact))) == "not_master"


async def test_a_delayed_send_is_answered_only_after_its_slaves_and_refused_if_their_wait_is(
        server, client, clock, monkeypatch):
    replica = server.scheduler.replica
    parked: list[Any] = []
    monkeypatch.setattr(replica, "replicating", True)
    monkeypatch.setattr(replica, "advanced", lambda name, end: None)
    monkeypatch.setattr(replica, "wrote_io", lambda name: None)
    monkeypatch.setattr(replica, "replicated_now", lambda name, end: False)
    monkeypatch.setattr(replica, "park_replicated", lambda name, end, done: parked.append(done))
    for one, compact in zip(_due_in_a_minute(clock), (False, True)):
        pending = asyncio.ensure_future(client.request(_send(one, compact)))
        for _ in range(2_000):  # the commit's answers parked for the slaves (20 s at most)
            if parked:
                break
            await asyncio.sleep(0.01)
        assert parked, "the commit's answers were never parked for the slaves"
        await asyncio.sleep(0.05)
        assert not pending.done()  # not answered before the slaves have it
        parked.pop()(NotMaster("group g: stepping down; resend"))
        assert _code(await pending) == "not_master"
