"""A realtime server answers an ack recorded on the event loop at once, with no coroutine and
no task (``Holdings.ack_now``), and leaves to a coroutine only an ack that must wait: the
pull-log thread busy, or a ``sync`` slave to wait for. Either way the same answer, the same
NotFound for a group that never pulled."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from tests.rawclient import FakeClock, RawClient, message
from tests.integration.realtime_fixtures import client, server  # noqa: F401 (fixtures)


@pytest.fixture
def recorded(server, monkeypatch) -> list[tuple[str, object]]:
    """Per ack recorded in the pull log: the thread it ran on and its task (None: no task)."""
    seen: list[tuple[str, object]] = []
    record_ack = server.broker.pulllog.record_ack

    def noted(*args: Any) -> int:
        thread = threading.current_thread()
        on_loop = thread is threading.main_thread()
        seen.append((thread.name, asyncio.current_task() if on_loop else None))
        return record_ack(*args)

    monkeypatch.setattr(server.broker.pulllog, "record_ack", noted)
    return seen


@pytest.fixture
def waited(server, monkeypatch) -> list[object]:
    """The acks that went on in ``RealtimeServer._acked`` (a coroutine)."""
    seen: list[object] = []
    acked = server._acked

    def noted(request: Any, acking: Any) -> Any:
        seen.append(request)
        return acked(request, acking)

    monkeypatch.setattr(server, "_acked", noted)
    return seen


async def _pulled_seq(client: RawClient) -> int:
    sent = await client.send(message("orders", b"one", FakeClock()))
    assert sent["results"][0]["status"] == "stored"
    pulled = await client.pull("orders", "g", "c1", start="earliest")
    return pulled["pull_seqs"][0]


async def test_an_ack_recorded_on_the_loop_is_answered_with_no_coroutine_and_no_task(
        server, client, recorded, waited):
    seq = await _pulled_seq(client)
    answer = await client.ack("orders", "g", "c1", [[seq, seq]])
    assert answer["acked"] == 1
    assert recorded == [(threading.main_thread().name, None)]  # on the loop, in no task
    assert waited == []  # failed before Holdings.ack_now: every ack went on in _acked
    again = await client.ack("orders", "g", "c1", [[seq, seq]])
    assert again["acked"] == 0 and waited == []


async def test_an_ack_while_the_pulllog_thread_is_busy_is_recorded_there_and_answered_the_same(
        server, client, recorded, waited, monkeypatch):
    seq = await _pulled_seq(client)
    monkeypatch.setattr(server.broker.holdings, "_pulllog_quick_now", lambda: False)
    answer = await client.ack("orders", "g", "c1", [[seq, seq]])
    assert answer["acked"] == 1
    assert [name for name, _task in recorded] == ["realtime-pulllog-io"]
    assert len(waited) == 1


async def test_an_ack_under_sync_replication_is_answered_only_once_the_slaves_have_it(
        server, client, recorded, waited, monkeypatch):
    seq = await _pulled_seq(client)
    slaves_have_it = asyncio.Event()
    ends: list[tuple[str, int]] = []

    async def wait_replicated(name: str, end: int) -> None:
        ends.append((name, end))
        await slaves_have_it.wait()

    replica = server.broker.replica  # the one the broker's parts ask
    monkeypatch.setattr(replica, "waits", lambda: True)
    monkeypatch.setattr(replica, "wait_replicated", wait_replicated)
    acking = asyncio.create_task(client.ack("orders", "g", "c1", [[seq, seq]]))
    async with asyncio.timeout(10):
        while not ends:
            await asyncio.sleep(0.001)
    assert ends[0][0] == "actions" and not acking.done()
    assert recorded == [(threading.main_thread().name, None)]  # recorded on the loop first
    slaves_have_it.set()
    async with asyncio.timeout(10):
        answer = await acking
    assert answer["acked"] == 1 and len(waited) == 1
    # An ack that acks nothing waits for no slave: answered at once.
    again = await client.ack("orders", "g", "c1", [[seq, seq]])
    assert again["acked"] == 0 and len(ends) == 1 and len(waited) == 1


@pytest.mark.parametrize("quick", [True, False])
async def test_an_ack_of_a_group_that_never_pulled_is_not_found_either_way(
        server, client, recorded, monkeypatch, quick):
    await client.send(message("orders", b"one", FakeClock()))
    if not quick:
        monkeypatch.setattr(server.broker.holdings, "_pulllog_quick_now", lambda: False)
    answer = await client.ack("orders", "never", "c1", [[0, 0]])
    assert answer["error"]["code"] == "not_found", answer
    assert "group never has never pulled subject orders" in answer["error"]["message"]
    late = await client.ack("orders", "never", "c1", [[0, 0]])  # the connection serves on
    assert late["error"]["code"] == "not_found"
