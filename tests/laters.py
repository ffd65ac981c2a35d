"""A ``serverkit.frame_server.Later`` answered to a test, not to a connection: ``answer_of``
waits for the answer a handler gave as a Later (a parked fetch, ``serverkit.parked_fetch``),
and ``fetched`` is a master's fetch answer however it was given."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from serverkit.frame_server import _LATER_TYPES


class _StandIn:
    """The parts of a frame server and of its connection that a Later's answer goes through:
    the answer (or the refusal, as ``{"raised": exc}``) resolves ``future``."""

    def __init__(self, future: asyncio.Future[dict[str, Any]]) -> None:
        self._laters: set[Any] = set()
        self._laters_ended = None
        self._future = future

    def _error_response(self, _rid: int, exc: BaseException) -> dict[str, Any]:
        return {"raised": exc}

    def send(self, response: dict[str, Any], _request: Any = None) -> None:
        assert not self._future.done(), f"a second answer: {response!r}"
        self._future.set_result(response)


async def answer_of(out: Any) -> Any:
    """``out`` itself when it is an answer; a Later's answer once it is given (a refusal is
    raised), bound as the frame server binds it."""
    if type(out) not in _LATER_TYPES:
        return out
    future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
    stand_in = _StandIn(future)
    out._server = out._connection = stand_in
    out._request = SimpleNamespace(op="fetch", rid=0)
    if out._outcome is not None:  # given before it was bound: given now
        outcome, out._outcome, out._given_once = out._outcome, None, False
        out.answer(outcome)
    response = await future
    if "raised" in response:
        raise response["raised"]
    del response["rid"]
    return response


async def fetched(source: Any, request: Any) -> dict[str, Any]:
    """``source.fetch(request)``'s answer (a ``ReplicaSource``), parked or not."""
    return await answer_of(await source.fetch(request))
