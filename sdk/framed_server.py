"""Serving the frame protocol over TCP: the transport the realtime and delay servers share.

It lives in ``sdk`` beside the codec because both servers speak the same protocol and neither may
import the other; it imports no server code. A ``FrameServer`` decodes frames, parses requests
and calls the server's ``handle(session, request)`` coroutine, one task per request so a long
poll never blocks the requests pipelined behind it on the same connection.

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
from typing import Any, Awaitable, Callable

from sdk.errors import BadRequest, Internal, QmqError
from sdk.limits import MAX_FRAME_BYTES
from sdk.protocol import (
    FrameDecoder,
    Hello,
    Request,
    encode_frame,
    error_response,
    parse_request,
    request_rid,
)

log = logging.getLogger(__name__)

_READ_CHUNK_BYTES = 256 * 1024
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


Handler = Callable[[Session, Request], Awaitable[dict[str, Any]]]


class FrameServer:
    """A TCP server for the frame protocol; ``handler`` answers each parsed request.

    The handler returns the response map without ``rid`` and raises ``QmqError`` for an error
    response. ``hello`` must be the first request on a connection; the handler sees it too.
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
    ) -> None:
        assert partial_frame_timeout_ms > 0, partial_frame_timeout_ms
        self._handler = handler
        self._partial_frame_timeout_s = partial_frame_timeout_ms / 1000
        self._host = host
        self._port = port
        self._max_frame_bytes = max_frame_bytes
        self._on_disconnect = on_disconnect
        self._on_error = on_error
        self._ssl = ssl_context  # None: plain TCP; else every connection is TLS
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()  # of the open connections
        self._requests: set[asyncio.Task[None]] = set()
        self._stopping = False  # stop() began: frames still arriving are not served
        self.port: int | None = None

    @property
    def open_connections(self) -> int:
        """Client connections being served now."""
        return len(self._connections)

    @property
    def requests_in_flight(self) -> int:
        """Requests being answered now (a waiting long poll counts)."""
        return len(self._requests)

    async def start(self) -> int:
        """Start listening; returns the bound port (useful with port 0)."""
        self._server = await asyncio.start_server(self._serve, self._host, self._port,
                                                  ssl=self._ssl)
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
        for writer in self._writers:
            transport = writer.transport
            if not transport.is_closing():
                transport.pause_reading()
        if self._requests:
            await asyncio.wait(set(self._requests), timeout=grace_ms / 1000)
        for task in list(self._requests) + list(self._connections):
            task.cancel()
        await asyncio.gather(*self._requests, *self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        self._writers.add(writer)
        peername = writer.get_extra_info("peername")
        session = Session(peer=f"{peername[0]}:{peername[1]}" if peername else "?")
        decoder = FrameDecoder(self._max_frame_bytes)
        try:
            while True:
                if decoder.buffered_bytes:
                    try:
                        data = await asyncio.wait_for(reader.read(_READ_CHUNK_BYTES),
                                                      self._partial_frame_timeout_s)
                    except TimeoutError:
                        log.info("closing %s: %d bytes of a frame, then nothing for %d ms",
                                 session.peer, decoder.buffered_bytes,
                                 self._partial_frame_timeout_s * 1000)
                        break
                else:
                    data = await reader.read(_READ_CHUNK_BYTES)
                if not data:
                    break
                try:
                    frames = decoder.feed(data)
                except QmqError as exc:
                    log.info("closing %s after a bad frame: %s", session.peer, exc)
                    writer.write(encode_frame(self._error_response(None, exc)))
                    await writer.drain()
                    break
                for frame in frames:
                    self._dispatch(session, frame, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            pass
        finally:
            session.closed = True
            self._connections.discard(task)
            self._writers.discard(writer)
            writer.close()
            if self._on_disconnect is not None:
                self._on_disconnect(session)

    def _dispatch(self, session: Session, frame: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        if self._stopping:  # already buffered when reading paused: left unanswered, see stop()
            return
        try:
            request = parse_request(frame)
        except QmqError as exc:
            self._write(writer, self._error_response(request_rid(frame), exc))
            return
        if not session.greeted and not isinstance(request, Hello):
            exc = BadRequest(f"{request.op} before hello: hello must be the first request")
            self._write(writer, self._error_response(request.rid, exc))
            return
        if isinstance(request, Hello):
            # Recorded before the handler runs so requests pipelined right behind hello pass.
            session.client_id, session.app, session.token = (
                request.client_id, request.app, request.token,
            )
        task = asyncio.create_task(self._answer(session, request, writer))
        self._requests.add(task)
        task.add_done_callback(self._requests.discard)

    async def _answer(self, session: Session, request: Request, writer: asyncio.StreamWriter) -> None:
        try:
            response = await self._handler(session, request)
            response["rid"] = request.rid
        except QmqError as exc:
            response = self._error_response(request.rid, exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a server bug: answer, log it, keep serving others
            log.exception("internal error answering %s from %s", request.op, session.peer)
            response = self._error_response(request.rid,
                                            Internal(f"{type(exc).__name__}: {exc}"))
        if writer.is_closing():
            return
        self._write(writer, response)
        try:
            await writer.drain()
        except ConnectionError:
            pass

    def _error_response(self, rid: int | None, exc: QmqError) -> dict[str, Any]:
        """The error response for ``exc``, counted by ``on_error`` first."""
        if self._on_error is not None:
            self._on_error(exc.code)
        return error_response(rid, exc)

    @staticmethod
    def _write(writer: asyncio.StreamWriter, response: dict[str, Any]) -> None:
        if not writer.is_closing():
            writer.write(encode_frame(response))
