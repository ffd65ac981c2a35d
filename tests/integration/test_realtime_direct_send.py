"""A realtime server steps a send inline and answers it by callback when its commit ends, with no
task, and still only after the commit, only while the writable master, and under ``sync``
replication only once the slaves have it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.lease_lapse import lapse_after
from tests.rawclient import FakeClock, RawClient, message
from tests.integration.realtime_fixtures import client, server  # noqa: F401 (fixtures)
from wire.errors import NotMaster
from wire.message import encode_message


@pytest.fixture
def tasks(server, monkeypatch) -> list[object]:
    """The task each send was queued for its commit in (None: stepped inline, no task)."""
    seen: list[object] = []
    send_soon = server.broker.sends.send_soon  # what the server calls for a send

    def noted(payloads, compact, done):
        seen.append(asyncio.current_task())
        return send_soon(payloads, compact, done)

    monkeypatch.setattr(server.broker.sends, "send_soon", noted)
    return seen


async def test_a_send_is_answered_when_its_commit_ends_with_no_task(server, client, tasks):
    clock = FakeClock()
    sent = await client.send(message("orders", b"one", clock), message("orders", b"two", clock))
    assert [r["status"] for r in sent["results"]] == ["stored", "stored"]
    compact = await client.request({"op": "send", "compact": True, "messages": [
        encode_message(message("orders", b"three", clock))]})
    assert "error" not in compact and "results" not in compact  # the count: all stored
    assert tasks == [None, None]  # both stepped inline, answered by callback
    assert server.frames.requests_in_flight == 0
    pulled = await client.pull("orders", "g", "c1", start="earliest")
    assert len(pulled["payloads"]) == 3


async def test_a_send_whose_commit_outlived_the_lease_is_refused_not_master(
        server, client, monkeypatch):
    lapse_after(monkeypatch, server.role, server.broker.sends, "_append_and_commit_io")
    answer = await client.send(message("orders", b"one", FakeClock()))
    assert answer["error"]["code"] == "not_master"


async def test_a_send_to_a_read_only_server_is_refused_per_message_at_once(server, client):
    server.broker.sends.readonly = True
    answer = await client.send(message("orders", b"one", FakeClock()))
    assert answer["results"][0]["error"]["code"] == "readonly"


async def test_under_sync_replication_a_send_is_answered_only_once_its_slaves_have_it(
        server, client, monkeypatch):
    # The send waits parked in the replication (``park_replicated``: no coroutine, no task)
    # and is answered when its callback hears the slaves have it, or refused with its error.
    parked: list[tuple[str, int, Any]] = []

    # A replicated group whose slave in sync does not have the commit yet.
    replica = server.broker.replica
    monkeypatch.setattr(replica, "replicating", True)
    monkeypatch.setattr(replica, "replicated_now", lambda name, end: False)
    monkeypatch.setattr(replica, "park_replicated",
                        lambda name, end, done: parked.append((name, end, done)))
    for body, error, code in ((b"one", None, None),
                              (b"two", NotMaster("group g: stepping down; resend"),
                               "not_master")):
        parked.clear()
        sending = asyncio.create_task(client.send(message("orders", body, FakeClock())))
        async with asyncio.timeout(10):
            while not parked:
                await asyncio.sleep(0.001)
        name, end, done = parked[0]
        assert name == "message" and end > 0
        await asyncio.sleep(0.01)
        assert not sending.done()
        done(error)
        async with asyncio.timeout(10):
            answer = await sending
        if code is None:
            assert answer["results"][0]["status"] == "stored"
        else:
            assert answer["error"]["code"] == code


async def test_a_send_to_a_read_only_server_asks_the_metaserver_first_from_a_task(
        server, client, tasks):
    # Stepped inline a send has no task; asking the MetaServer (aiohttp, asyncio.timeout)
    # needs one, so the send hands itself to a task before it asks.
    asked: list[object] = []

    class Registration:
        async def refresh_state(self) -> None:
            asked.append(asyncio.current_task())
            async with asyncio.timeout(10):  # raises RuntimeError outside a task
                await asyncio.sleep(0)
            server.broker.sends.readonly = False  # the MetaServer says rw again

    server.broker.sends.readonly = True
    server.registration = Registration()  # type: ignore[assignment]
    try:
        answer = await client.send(message("orders", b"one", FakeClock()))
    finally:
        server.registration = None
    assert answer["results"][0]["status"] == "stored"
    assert asked[0] is not None and tasks == [asked[0]]


async def test_a_send_whose_server_was_demoted_while_it_asked_the_metaserver_writes_nothing(
        server, client, monkeypatch):
    from wire.errors import NotMaster

    demoted: list[str] = []

    def check_writable_now(group: str) -> None:
        if demoted:
            raise NotMaster(f"server me is not the leased master of group {group}: {demoted[0]}")

    class Registration:
        async def refresh_state(self) -> None:
            server.broker.sends.readonly = False  # the MetaServer's answer: writable again,
            demoted.append("a slave since the MetaServer's last answer")  # but lease lost

    monkeypatch.setattr(server.role, "writable_now", lambda: not demoted)
    monkeypatch.setattr(server.role, "check_writable_now", check_writable_now)
    server.broker.sends.readonly = True
    server.registration = Registration()  # type: ignore[assignment]
    try:
        answer = await client.send(message("orders", b"one", FakeClock()))
    finally:
        server.registration = None
        server.broker.sends.readonly = False
        demoted.clear()
    assert answer["error"]["code"] == "not_master", answer
    assert "a slave since" in answer["error"]["message"]
    pulled = await client.pull("orders", "g", "c1", start="earliest")
    assert pulled["payloads"] == [], "nothing was written to what became a copy"


async def test_a_send_and_the_long_poll_it_wakes_are_answered_with_no_end_of_turn_callback(
        server, client, monkeypatch):
    from serverkit.frame_server import _FrameConnection

    consumer = await RawClient.connect(server.port)
    try:
        await consumer.pull("orders", "g", "c1")  # the group, at "latest"
        waiting = asyncio.create_task(consumer.pull("orders", "g", "c1", wait_ms=30_000))
        async with asyncio.timeout(10):
            while server.broker.pulls.waiting_pulls < 1:
                await asyncio.sleep(0.001)
        turns: list[object] = []
        end_turn = _FrameConnection._end_turn
        monkeypatch.setattr(_FrameConnection, "_end_turn",
                            lambda self: (turns.append(self), end_turn(self))[1])
        sent = await client.send(message("orders", b"late", FakeClock()))
        async with asyncio.timeout(10):
            pulled = await waiting
        assert sent["results"][0]["status"] == "stored" and len(pulled["payloads"]) == 1
        assert turns == []  # both written as the commit's answers block ended
    finally:
        await consumer.close()


async def test_a_bug_answering_a_committed_send_is_answered_internal_and_leaves_nothing_in_flight(
        server, client, monkeypatch):
    def broken(name, end):
        raise RuntimeError("a bug while answering")

    # The first step of a committed send's answer: whether its slaves have it.
    monkeypatch.setattr(server.broker.replica, "replicating", True)
    monkeypatch.setattr(server.broker.replica, "replicated_now", broken)
    answer = await client.send(message("orders", b"one", FakeClock()))
    assert answer["error"]["code"] == "internal" and "a bug while answering" in answer[
        "error"]["message"]
    assert server.frames.requests_in_flight == 0
