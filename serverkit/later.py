"""``Later``: an answer a server's handler gives after it has returned, with no task waiting
for it (a long poll parked until a commit wakes it, a send answered by its commit). The frame
server (``serverkit.frame_server``) binds it to its request and connection when the handler
returns it; ``answer`` writes through them. Split from ``serverkit.frame_server``, which
re-exports these names, to keep that module to the connections."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from wire.errors import Internal, QmqError

if TYPE_CHECKING:
    from serverkit.frame_server import FrameServer, _FrameConnection
    from wire.protocol import Request

log = logging.getLogger("serverkit.frame_server")  # the frame server's log, as before the split


class LaterAnsweredTwice(RuntimeError):
    """A ``Later`` was given a second outcome (a server bug): its request has one answer, the
    first, and the client is not sent a second one with the same rid."""


# ``Later`` and every subclass of it (``Later.__init_subclass__`` adds each): a handler's answer
# is told apart by its exact type being here, with no isinstance call per answer (issue 18).
_LATER_TYPES: set[type] = set()


class Later:
    """An answer a handler gives after it has returned, with no task waiting for it: the
    handler returns the ``Later`` and then calls ``answer(response)`` (the map, without
    ``rid``) or ``fail(exc)`` once (a second call raises ``LaterAnsweredTwice``), from a later
    step of the loop (a long poll woken by a commit). A ``QmqError`` becomes its error
    response, anything else ``internal`` (logged).
    Until it is answered the request counts in ``requests_in_flight`` and ``stop`` waits for it
    as for a task; an answer to a closed connection goes nowhere. A server may subclass it, so
    that the state it keeps until it answers is the ``Later`` itself (the realtime server's
    parked pull: ``realtime.parked_pull.ParkedPull``)."""

    __slots__ = ("_server", "_connection", "_request", "_outcome", "_given_once")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass (a server's own Later) is answered as a Later is."""
        super().__init_subclass__(**kwargs)
        _LATER_TYPES.add(cls)

    def __init__(self) -> None:
        self._server: FrameServer | None = None
        self._connection: _FrameConnection | None = None
        self._request: Request | None = None
        # Given before the frame server took it over (in ``FrameServer._answer``).
        self._outcome: dict[str, Any] | BaseException | None = None
        self._given_once = False  # answer or fail was called: a second call is refused

    def answer(self, outcome: dict[str, Any] | BaseException) -> None:
        """The request's answer (a map), or the exception it ends with (``fail``): written
        now if the frame server has taken the ``Later`` over, else when it does. (Written
        here, not through a server method: one call per answer, issue 18.)"""
        if self._given_once:
            request = self._request
            raise LaterAnsweredTwice(
                f"a second outcome for {request.op if request else 'an unbound'} request"
                f" (rid {request.rid if request else None}): {outcome!r:.200}")
        self._given_once = True
        server = self._server
        if server is None:
            self._outcome = outcome
            return
        request: Request = self._request  # type: ignore[assignment]
        connection: _FrameConnection = self._connection  # type: ignore[assignment]
        server._laters.discard(self)
        if type(outcome) is dict:  # the usual outcome first: no isinstance for it
            response = outcome
            response["rid"] = request.rid
        elif isinstance(outcome, QmqError):
            response = server._error_response(request.rid, outcome)
        elif isinstance(outcome, BaseException):  # a server bug, as in FrameServer._answer
            log.error("internal error answering %s from %s", request.op,
                      connection.session.peer, exc_info=outcome)
            response = server._error_response(
                request.rid, Internal(f"{type(outcome).__name__}: {outcome}"))
        else:  # a map of a subclass of dict
            response = outcome
            response["rid"] = request.rid
        connection.send(response, request)
        ended = server._laters_ended
        if ended is not None and not server._laters and not ended.done():
            ended.set_result(None)

    # The request ends with an error: the same step as an answer (one call, not two, per
    # outcome), ``answer`` tells them apart.
    fail = answer


_LATER_TYPES.add(Later)


__all__ = ["Later", "LaterAnsweredTwice"]
