"""The frame server's synchronous entry (``handler_now``): what it returns or raises is answered
as the coroutine handler's would be, inline or in a task, with no coroutine for a request it
answers at once."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable

import pytest

from serverkit.frame_server import FrameServer, Later, Session
from tests.unit.test_framed_server import WAIT_S, _heartbeat, _read_answers, _said_hello
from wire.errors import BadRequest
from wire.protocol import Request


async def _never(session: Session, request: Request) -> dict[str, Any]:
    raise AssertionError("the coroutine handler is not called when there is a handler_now")


class _Answer(dict):  # type: ignore[type-arg]
    """An answer map of a subclass of dict."""


@pytest.mark.parametrize("inline_ops", [("heartbeat",), ()], ids=["inline", "task"])
async def test_what_handler_now_returns_or_raises_is_answered_and_the_connection_serves_on(
        inline_ops, caplog):
    release = asyncio.Event()
    tasks: dict[int, object] = {}

    async def going_on() -> dict[str, Any]:
        await release.wait()
        return {"went_on": True}

    async def not_suspending() -> dict[str, Any]:
        return {"stepped": True}

    def now(session: Session, request: Request
            ) -> dict[str, Any] | Later | Awaitable[dict[str, Any] | Later]:
        tasks[request.rid] = asyncio.current_task()
        rid = request.rid
        if rid == 2:
            raise BadRequest("refused at rid 2")
        if rid == 3:
            raise RuntimeError("a bug at rid 3")
        if rid == 4:
            return _Answer(sub=True)
        if rid == 5:
            return not_suspending()
        if rid == 6:
            return going_on()
        return {"ok": True}

    server = FrameServer(_never, inline_ops=inline_ops, handler_now=now)
    await server.start()
    try:
        reader, writer = await _said_hello(server)
        writer.write(b"".join(_heartbeat(rid) for rid in (2, 3, 4, 5, 6, 7)))
        await writer.drain()
        answers = {a["rid"]: a for a in await _read_answers(reader, 5)}
        assert answers[2]["error"]["code"] == BadRequest.code
        assert "refused at rid 2" in answers[2]["error"]["message"]
        assert answers[3]["error"]["code"] == "internal", answers[3]
        assert "a bug at rid 3" in caplog.text, "the bug is not logged"
        assert answers[4] == {"rid": 4, "sub": True}
        assert answers[5] == {"rid": 5, "stepped": True}
        assert answers[7] == {"rid": 7, "ok": True}
        assert 6 not in answers and server.requests_in_flight == 1
        release.set()
        [answer] = await _read_answers(reader, 1)
        assert answer == {"rid": 6, "went_on": True}
        assert server.open_connections == 1 and server.requests_in_flight == 0
        # Inline: called inside data_received, outside any task; else inside its task.
        assert (tasks[2] is None) == bool(inline_ops)
        assert tasks[1] is not None  # hello is no inline op here
        writer.close()
    finally:
        await server.stop()


@pytest.mark.parametrize("inline_ops", [("heartbeat",), ()], ids=["inline", "task"])
async def test_a_later_handler_now_returns_is_answered_through_it_even_if_given_before(
        inline_ops):
    laters: dict[int, Later] = {}

    def now(session: Session, request: Request) -> dict[str, Any] | Later:
        if request.op == "hello":
            return {"server": {"kind": "test"}}
        later = laters[request.rid] = Later()
        if request.rid == 3:
            later.answer({"early": True})  # given before the frame server took it over
        return later

    server = FrameServer(_never, inline_ops=inline_ops, handler_now=now)
    await server.start()
    try:
        reader, writer = await _said_hello(server)
        writer.write(_heartbeat(2) + _heartbeat(3))
        await writer.drain()
        assert await _read_answers(reader, 1) == [{"rid": 3, "early": True}]
        assert server.requests_in_flight == 1
        laters[2].answer({"late": True})
        assert await _read_answers(reader, 1) == [{"rid": 2, "late": True}]
        assert server.requests_in_flight == 0
        writer.close()
    finally:
        await server.stop()


async def test_stop_waits_for_an_awaitable_handler_now_left_and_cancels_it_after_the_grace():
    cancelled = asyncio.Event()
    entered = asyncio.Event()

    async def forever() -> dict[str, Any]:
        entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return {}

    def now(session: Session, request: Request) -> Any:
        return forever() if request.op == "heartbeat" else {"ok": True}

    server = FrameServer(_never, inline_ops=("heartbeat",), handler_now=now)
    await server.start()
    reader, writer = await _said_hello(server)
    writer.write(_heartbeat(2))
    await writer.drain()
    async with asyncio.timeout(WAIT_S):
        await entered.wait()
    assert server.requests_in_flight == 1
    await server.stop(grace_ms=10)
    assert cancelled.is_set() and server.requests_in_flight == 0
    writer.close()
