"""Serving the frame protocol over TCP: the transport the realtime and delay servers share.

It lives in ``sdk`` beside the codec because both servers speak the same protocol and neither may
import the other; it imports no server code. A ``FrameServer`` decodes frames, parses requests
and calls the server's ``handle(session, request)`` coroutine. A request of one of the server's
``inline_ops`` is started at once as it is read, through the server's synchronous entry
``handle_now`` when it has one (no coroutine at all for a request answered at once), and needs
a task only if it suspends; every other request gets a task of its own, so a long poll never
blocks the requests pipelined behind it on the same connection. A handler may also return a
``Later`` and answer through it afterwards, with no task left waiting (a long poll parked until
a commit wakes it).

Each connection is an ``asyncio.Protocol``: frames are decoded in ``data_received`` as bytes
arrive, with no reader task and no StreamReader between the socket and the decoder. The answers
made while one read is handled (inline requests, errors) leave together in one write at its
end; of the answers finished later, the first in an event-loop turn is written at once and any
more from the same turn leave together in one write when it ends (one system call for many
answers under load, no added latency for a lone one); answers written inside
``answers_together()`` leave as it ends, one write per connection. A client that does not read
its answers is not read from until it does.

A frame over the size limit, or bytes that are not a frame, get one error response (rid nil) and
the connection is closed; everyone else is unaffected. A valid frame whose fields are wrong gets
an error response and the connection stays open. ``on_error(code)``, if given, is told the code
of every error response (the servers count them in their metrics).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from dataclasses import dataclass, field
from types import CoroutineType
from typing import Any, Awaitable, Callable, Collection, cast

from sdk.connection import limit_reads
from serverkit.later import _LATER_TYPES, Later, LaterAnsweredTwice
from serverkit.resumed import Resumed
from wire.errors import BadRequest, Internal, QmqError
from wire.framing import FRAME_HEADER
from wire.limits import MAX_FRAME_BYTES
from wire.packing import PACKER_KEEP_BYTES_MAX, packers
from wire.protocol import (
    FrameDecoder,
    Hello,
    Request,
    encode_frame,
    error_response,
    parse_request,
    request_rid,
)

log = logging.getLogger(__name__)

# ``_FrameConnection.send``'s inline encoding: this thread's Packer and the frame header, as
# ``encode_frame`` uses them (with its rules: a Packer that packed more than
# PACKER_KEEP_BYTES_MAX renewed, a frame over MAX_FRAME_BYTES refused).
_pack_header = FRAME_HEADER.pack

# Longest silence allowed in the middle of a frame, in milliseconds. A client that sent part of a
# frame and then nothing for this long is stuck or hostile (slowloris); its connection, and the
# partial frame buffered for it, are dropped. Silence between frames is fine (idle producers).
PARTIAL_FRAME_TIMEOUT_MS = 30_000


@dataclass
class Session:
    """What a server knows about one client connection."""

    peer: str  # "host:port" of the client
    client_id: str | None = None  # from hello
    app: str | None = None  # from hello
    token: str | None = None  # from hello
    extra: dict[str, Any] = field(default_factory=dict)  # per-server state for this connection
    # Set once the connection has ended, so a request still running for it (a long poll) can
    # stop instead of handing out work nobody will receive.
    closed: bool = False

    @property
    def greeted(self) -> bool:
        """True once the client sent hello."""
        return self.client_id is not None


Handler = Callable[[Session, Request], Awaitable["dict[str, Any] | Later"]]
# A handler's synchronous entry: the answer, a ``Later``, or, when the request must wait for
# something (an uncached grant, a lapsed lease, a store thread), the awaitable that goes on
# with it and gives the answer or a ``Later``.
HandlerNow = Callable[[Session, Request],
                      "dict[str, Any] | Later | Awaitable[dict[str, Any] | Later]"]


class FrameServer:
    """A TCP server for the frame protocol; ``handler`` answers each parsed request.

    The handler returns the response map without ``rid`` and raises ``QmqError`` for an error
    response. ``hello`` must be the first request on a connection; the handler sees it too.
    ``handler_now``, if given, is the same handler's synchronous entry (``HandlerNow``), called
    in place of ``handler``: what it returns or raises is answered as ``handler``'s would be.
    """

    def __init__(
        self,
        handler: Handler,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        on_disconnect: Callable[[Session], None] | None = None,
        on_error: Callable[[str], None] | None = None,
        ssl_context: ssl.SSLContext | None = None,
        partial_frame_timeout_ms: int = PARTIAL_FRAME_TIMEOUT_MS,
        inline_ops: Collection[str] = (),
        handler_now: HandlerNow | None = None,
    ) -> None:
        assert partial_frame_timeout_ms > 0, partial_frame_timeout_ms
        self._handler = handler
        self._handler_now = handler_now  # in place of handler: see _dispatch and _answer
        # Ops whose handler starts at once, inside ``data_received`` (see ``_dispatch``).
        self._inline_ops = frozenset(inline_ops)
        self._partial_frame_timeout_s = partial_frame_timeout_ms / 1000
        self._host = host
        self._port = port
        self._max_frame_bytes = max_frame_bytes
        self._on_disconnect = on_disconnect
        self._on_error = on_error
        self._ssl = ssl_context  # None: plain TCP; else every connection is TLS
        self._server: asyncio.AbstractServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # set by start()
        self._connections: set[_FrameConnection] = set()  # open client connections
        self._requests: set[asyncio.Task[None]] = set()
        self._laters: set[Later] = set()  # answers a handler gives later, without a task
        self._laters_ended: asyncio.Future[None] | None = None  # stop() waits on it
        self._stopping = False  # stop() began: frames still arriving are not served
        self._together = 0  # inside answers_together(): answers wait for its exit
        self._together_block = _Together(self)
        self._held: list[_FrameConnection] = []  # connections with answers held by it
        self.port: int | None = None

    @property
    def open_connections(self) -> int:
        """Client connections being served now."""
        return len(self._connections)

    @property
    def requests_in_flight(self) -> int:
        """Requests being answered now (a waiting long poll counts)."""
        return len(self._requests) + len(self._laters)

    def answers_together(self) -> _Together:
        """Answers written inside this ``with`` block leave at its exit, one write per
        connection (a group commit answering its sends), with no end-of-turn callback. The
        server's one block, re-entrant: a caller may keep it and enter it again."""
        return self._together_block

    async def start(self) -> int:
        """Start listening; returns the bound port (useful with port 0)."""
        loop = self._loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _FrameConnection(self), self._host,
                                                self._port, ssl=self._ssl)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self, grace_ms: int = 5000) -> None:
        """Stop accepting connections and reading requests, let in-flight requests finish for up
        to ``grace_ms``, then close every connection.

        A request read before the stop gets its answer (or, past the grace, a closed
        connection); one sent after it is never started, so its client sees the connection
        close and resends elsewhere or later, which the message ids make safe."""
        self._stopping = True
        if self._server is not None:
            self._server.close()
        for connection in self._connections:
            connection.pause_reading()
        waiting: set[asyncio.Future[Any]] = set(self._requests)
        if self._laters:
            self._laters_ended = self._loop.create_future()  # type: ignore[union-attr]
            waiting.add(self._laters_ended)
        if waiting:
            await asyncio.wait(waiting, timeout=grace_ms / 1000)
        for task in list(self._requests):
            task.cancel()
        await asyncio.gather(*self._requests, return_exceptions=True)
        self._requests.clear()  # a task cancelled before its first step never left it
        for connection in list(self._connections):
            connection.close()  # answers already written still go out first
        if self._server is not None:
            await self._server.wait_closed()

    def _dispatch(self, connection: _FrameConnection, frame: dict[str, Any]) -> None:
        """Check one decoded frame and start answering it; runs inside ``data_received``.

        A request of an ``inline_ops`` op, when no request read before it in this
        ``data_received`` still waits for its task's first step, is stepped at once, right
        here: most such handlers finish without suspending (a heartbeat, an ack recorded on
        the loop), and then no task is made and no loop turn passes before the answer, which
        leaves with the other answers of this read in one write at its end. With a
        ``handler_now`` it is called instead of the coroutine: its answer or ``Later`` is
        taken as it returns, and only the awaitable it may leave the request to is stepped
        here. One that suspends goes on in a task (``Resumed``, serverkit/resumed.py). Every other request gets a
        task, so a long poll never holds up the requests pipelined behind it; requests start
        in the order they were read either way. A handler started inline runs its first step
        outside any task: it must not need ``asyncio.current_task()`` before its first
        suspension (``asyncio.timeout``, a ``TaskGroup``): hence a list of ops, chosen by the
        server. A request cancelled in its first step goes unanswered, inline as in a task,
        and the connection serves on."""
        if self._stopping:  # already buffered when reading paused: left unanswered, see stop()
            return
        session = connection.session
        try:
            request = parse_request(frame)
        except QmqError as exc:
            connection.send(self._error_response(request_rid(frame), exc))
            return
        if type(request) is Hello:
            # Recorded before the handler runs so requests pipelined right behind hello pass.
            session.client_id, session.app, session.token = (
                request.client_id, request.app, request.token,
            )
        elif session.client_id is None:
            exc = BadRequest(f"{request.op} before hello: hello must be the first request")
            connection.send(self._error_response(request.rid, exc))
            return
        if request.op in self._inline_ops and not connection.task_started_in_read:
            handler_now = self._handler_now
            if handler_now is None:
                answer = self._answer(connection, request)
            else:
                # The synchronous entry: a request answered at once, or parked as a Later,
                # makes no coroutine, no first send() and no StopIteration (issue 18).
                try:
                    response = handler_now(session, request)
                except QmqError as exc:
                    connection.send(self._error_response(request.rid, exc), request)
                    return
                except asyncio.CancelledError:
                    return  # unanswered, the connection serving on (as in _answer, inline)
                except Exception as exc:  # a server bug: answered and logged, as in _answer
                    self._internal(connection, request, exc)
                    return
                if type(response) is dict:  # the usual answer first, told by its exact type
                    response["rid"] = request.rid
                    connection.send(response, request)
                    return
                if type(response) in _LATER_TYPES:
                    # Bound here, as _answer binds a Later its handler returns.
                    later = response
                    later._server, later._connection, later._request = self, connection, request
                    self._laters.add(later)
                    outcome = later._outcome
                    if outcome is not None:  # given before it was returned: written now
                        later._outcome = None
                        later._given_once = False
                        later.answer(outcome)
                    return
                if type(response) is not CoroutineType and isinstance(response, dict):
                    # a map of a subclass of dict
                    response["rid"] = request.rid
                    connection.send(response, request)
                    return
                # The handler goes on in this awaitable: stepped now, as a handler is below.
                answer = self._answer(connection, request, response)
            try:
                waits_on = answer.send(None)
            except StopIteration:
                return  # answered: the answer is queued for the end of this read
            except asyncio.CancelledError:
                # As a task cancelled in its first step ends: unanswered, the connection
                # serving on (escaping data_received, it made asyncio close the connection
                # and drop the other answers of this read; review s14 rva).
                return
            # It suspended: a task goes on from where it stopped.
            task = self._loop.create_task(Resumed(answer, waits_on))  # type: ignore[arg-type]
        else:
            # It leaves ``_requests`` itself as it ends (no done callback: one loop callback
            # less per request); one cancelled before its first step is dropped by stop().
            task = self._loop.create_task(self._answer(connection, request))
            connection.task_started_in_read = True
        self._requests.add(task)

    async def _answer(self, connection: _FrameConnection, request: Request,
                      going_on: Awaitable[dict[str, Any] | Later] | None = None) -> None:
        """Answer ``request`` with what the handler gives, or with what ``going_on`` (the
        awaitable ``handler_now`` left the request to) gives. In a task, ``handler_now`` is
        called here when there is one: no coroutine of the handler's own around the
        awaitable it may leave the request to."""
        try:
            if going_on is not None:
                response = await going_on
            elif self._handler_now is None:
                response = await self._handler(connection.session, request)
            else:
                response = self._handler_now(connection.session, request)
                if type(response) is CoroutineType or (
                        type(response) is not dict and type(response) not in _LATER_TYPES
                        and not isinstance(response, dict)):
                    response = await response
            # Answered when the handler says: bound to it here. (Told apart by exact type,
            # with no call; a handler may return a subclass of Later: _LATER_TYPES has them.)
            if type(response) in _LATER_TYPES:
                later = response
                later._server, later._connection, later._request = self, connection, request
                self._laters.add(later)
                outcome = later._outcome
                if outcome is not None:  # given before the handler returned: written now
                    later._outcome = None
                    later._given_once = False  # given once, before it was bound: given now
                    later.answer(outcome)
                return
            response["rid"] = request.rid
        except QmqError as exc:
            response = self._error_response(request.rid, exc)
        except Exception as exc:  # a server bug: answer, log it, keep serving others
            self._internal(connection, request, exc)
            return
        finally:
            # The request ends (answered, bound to its Later, or cancelled): its task, if it
            # has one, leaves ``_requests``. With none there (most requests are answered
            # inline) ``current_task`` is not asked: in 3.11 each ask is a getpid system call.
            requests = self._requests
            if requests:  # outside a task there is nothing to discard: None is not in it
                requests.discard(asyncio.current_task())  # type: ignore[arg-type]
        connection.send(response, request)

    def _internal(self, connection: _FrameConnection, request: Request,
                  exc: Exception) -> None:
        """A server bug answering ``request``: logged, and answered ``internal``."""
        log.exception("internal error answering %s from %s", request.op,
                      connection.session.peer, exc_info=exc)
        connection.send(self._error_response(request.rid,
                                             Internal(f"{type(exc).__name__}: {exc}")), request)

    def _error_response(self, rid: int | None, exc: QmqError) -> dict[str, Any]:
        """The error response for ``exc``, counted by ``on_error`` first."""
        if self._on_error is not None:
            self._on_error(exc.code)
        return error_response(rid, exc)


class _Together:
    """``FrameServer.answers_together()``'s block (one per server, re-entrant)."""

    __slots__ = ("_server",)

    def __init__(self, server: FrameServer) -> None:
        self._server = server

    def __enter__(self) -> None:
        self._server._together += 1

    def __exit__(self, *exc_info: object) -> None:
        server = self._server
        server._together -= 1
        if not server._together and server._held:
            held, server._held = server._held, []
            for connection in held:
                # Written now, unless a read or a turn of this connection already queued its
                # answers behind, to leave at their end.
                if not connection._reading and not connection._wrote_this_turn:
                    connection._flush()


class _FrameConnection(asyncio.Protocol):
    """One client connection of a FrameServer: frames are decoded as bytes arrive (no reader
    task, no StreamReader); the first answer of a loop turn is written at once, the rest of
    that turn's answers in one write at its end.

    Backpressure: while the client does not read its answers (the transport's write buffer is
    over its high-water mark) no more requests are read from it."""

    def __init__(self, server: FrameServer) -> None:
        self._server = server
        self._loop = server._loop
        self._decoder = FrameDecoder(server._max_frame_bytes)
        self._transport: asyncio.Transport | None = None
        self.session = Session(peer="?")
        self._out: list[bytes] = []  # encoded answers waiting for the end of this read or turn
        self._wrote_this_turn = False  # an answer went out directly in this loop turn
        self._reading = False  # inside data_received: answers wait for its end
        # A request of the read now in progress got a task whose first step has not run yet:
        # the requests read after it get tasks too, so they start in the order they came.
        self.task_started_in_read = False
        self._closing = False
        self._reading_paused = False  # by stop() or by backpressure
        self._write_paused = False
        self._last_data_s = 0.0  # loop time of the latest bytes received
        self._stall_timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport: asyncio's, or another loop's (uvloop's is no subclass of
        # asyncio.Transport but has its methods), so the type is stated, not checked.
        transport = cast(asyncio.Transport, transport)
        limit_reads(transport)  # recv(256 KiB) costs an mmap and a munmap per read
        self._transport = transport
        peername = transport.get_extra_info("peername")
        self.session.peer = f"{peername[0]}:{peername[1]}" if peername else "?"
        self._server._connections.add(self)
        if self._server._stopping:
            self.pause_reading()

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        decoder = self._decoder
        try:
            frames = decoder.feed(data)
        except QmqError as exc:
            log.info("closing %s after a bad frame: %s", self.session.peer, exc)
            self.send(self._server._error_response(None, exc))
            self.close()
            return
        dispatch = self._server._dispatch
        self._reading = True
        try:
            for frame in frames:
                dispatch(self, frame)
        finally:
            self._reading = False
            self.task_started_in_read = False
        out = self._out
        if out and not self._wrote_this_turn:
            # The answers made during this read (inline), in one write: _flush's work, done
            # here (one Python call fewer a read that answered).
            transport = self._transport
            if transport is not None and not transport.is_closing():
                transport.write(out[0] if len(out) == 1 else b"".join(out))
            out.clear()
        if decoder.buffered_bytes:
            self._last_data_s = self._loop.time()
            if self._stall_timer is None:
                self._stall_timer = self._loop.call_later(
                    self._server._partial_frame_timeout_s, self._check_stalled)

    def eof_received(self) -> bool:
        return False  # the client is done: close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self.session.closed = True
        self._out.clear()
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        server = self._server
        if self in server._connections:
            server._connections.discard(self)
            if server._on_disconnect is not None:
                server._on_disconnect(self.session)

    def pause_writing(self) -> None:
        self._write_paused = True
        if self._transport is not None and not self._reading_paused:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._transport is not None and not self._reading_paused and not self._closing:
            self._transport.resume_reading()

    # -- for the server -------------------------------------------------------------------------

    def send(self, response: dict[str, Any], request: Request | None = None) -> None:
        """Write one answer: one made while a read is decoded leaves with the others of that
        read in one write at its end; otherwise the first of a loop turn at once (no added
        latency), any more finished in the same turn together, in one write when it ends.

        The answer to ``request`` that cannot be encoded (a server bug) is logged and becomes
        its ``internal`` error response, the same in a task or inline."""
        if self._closing:
            return
        data = None
        if type(response) is dict:
            # ``encode_frame``'s work inline for an answer map (one Python call fewer an
            # answer, issue 18), its Packer rule included: one that packed more than
            # PACKER_KEEP_BYTES_MAX is renewed. Packed once: a big answer (a pull of large
            # messages) packed again by ``encode_frame`` while this copy lived cost twice the
            # loop's CPU (review rv22-M1). One that fails to pack, or packs past the frame
            # limit (a server bug), goes through ``encode_frame``, with its checks and errors.
            try:
                payload = packers.pack(response)
            except Exception:
                pass
            else:
                size = len(payload)
                if size <= MAX_FRAME_BYTES:
                    if size > PACKER_KEEP_BYTES_MAX:
                        packers.renew()  # not kept with its grown buffer
                    data = _pack_header(size) + payload
                del payload  # (past the limit: not kept while ``encode_frame`` refuses it)
        if data is None:
            try:
                data = encode_frame(response)
            except Exception as exc:
                if request is None:
                    raise
                log.exception("answer to %s from %s not sent", request.op, self.session.peer)
                data = encode_frame(self._server._error_response(
                    request.rid, Internal(f"answer not encodable: {type(exc).__name__}: {exc}")))
        if self._reading or self._wrote_this_turn:
            self._out.append(data)
            return
        server = self._server
        if server._together:  # inside answers_together(): written at its exit
            if not self._out:
                server._held.append(self)
            self._out.append(data)
            return
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        self._wrote_this_turn = True
        self._loop.call_soon(self._end_turn)
        transport.write(data)

    def _end_turn(self) -> None:
        self._wrote_this_turn = False
        self._flush()

    def pause_reading(self) -> None:
        """Read no more requests from this client (the server is stopping)."""
        self._reading_paused = True
        transport = self._transport
        if transport is not None and not transport.is_closing() and not self._write_paused:
            transport.pause_reading()

    def close(self) -> None:
        """Write what is queued, then close; the session counts as closed from now on."""
        if self._closing:
            return
        self._flush()
        self._closing = True
        self.session.closed = True
        if self._transport is not None:
            self._transport.close()

    def _flush(self) -> None:
        out = self._out
        if not out or self._transport is None or self._transport.is_closing():
            out.clear()
            return
        self._transport.write(out[0] if len(out) == 1 else b"".join(out))
        out.clear()

    def _check_stalled(self) -> None:
        """Drop a client that sent part of a frame and then nothing for the partial-frame
        timeout (silence while we are not reading is ours, not the client's)."""
        self._stall_timer = None
        if self._closing or not self._decoder.buffered_bytes:
            return
        timeout_s = self._server._partial_frame_timeout_s
        silent_s = self._loop.time() - self._last_data_s
        if silent_s < timeout_s or self._reading_paused or self._write_paused:
            self._stall_timer = self._loop.call_later(max(timeout_s - silent_s, 0.001),
                                                      self._check_stalled)
            return
        log.info("closing %s: %d bytes of a frame, then nothing for %d ms", self.session.peer,
                 self._decoder.buffered_bytes, timeout_s * 1000)
        self.close()


# Later and LaterAnsweredTwice live in serverkit.later and are re-exported here.
__all__ = ["FrameServer", "Later", "LaterAnsweredTwice", "PARTIAL_FRAME_TIMEOUT_MS", "Session"]
