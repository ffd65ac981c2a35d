"""Client side of the data plane: one pipelined TCP connection per broker, and a pool of them.

A ``Connection`` says ``hello`` once, then any number of requests may be in flight on it at the
same time: each gets a fresh request id (``rid``) and a future, and the socket's protocol hands
every response to the future of its rid as it arrives (docs/PROTOCOL.md). A long-poll ``pull`` therefore never holds
up an ``ack`` or a ``send`` on the same connection.

Failure model:

* an error response ``{rid, error}`` raises the matching QmqError from ``request`` (with ``.rid``);
* the connection closing, a socket error or a frame we cannot decode fails every pending request
  with ConnectionLost; the connection is then dead for good and the pool opens a new one;
* no answer within ``timeout_ms`` raises RequestTimeout (a ConnectionLost). The connection stays
  up; a late answer is dropped. The request may still have been executed by the broker, which is
  why the producer resends with the same message id (the broker de-duplicates).

What this module does not do: retry, back off, or pick another broker. Callers decide that.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import ssl
from typing import Any, Callable, cast

from wire.errors import BadRequest, ConnectionLost, QmqError
from wire.limits import MAX_CLIENT_ID_CHARS, MAX_TOKEN_CHARS
from wire.protocol import PROTOCOL_VERSION, FrameDecoder, encode_frame, parse_response

log = logging.getLogger(__name__)

# How long connecting plus the hello round trip may take, in milliseconds.
CONNECT_TIMEOUT_MS_DEFAULT = 5_000

# How long ``close`` lets frames already queued drain to the broker before dropping them, in ms.
CLOSE_FLUSH_TIMEOUT_MS = 5_000

# Most bytes one read of a frame connection asks the socket for. asyncio's socket transport
# reads with recv(256 KiB): CPython allocates that much for each read and shrinks it to what
# came, and a buffer over glibc's mmap threshold (128 KiB) costs an mmap, an mremap and a munmap
# per read: recv of a 30-byte answer took 14.5 us against 1.6 us at 64 KiB, of a 10 kB send
# frame 28.1 against 4.1 us (docs/BENCHMARKS.md, "W1 send CPU"). A bigger frame takes more
# reads, each cheaper (100 kB: 98.6 us in one read of 256 KiB, less in two of 64 KiB).
READ_BYTES_MAX = 64 * 1024


def limit_reads(transport: asyncio.BaseTransport) -> None:
    """Make a socket transport read at most READ_BYTES_MAX per recv. asyncio's selector
    transport reads ``max_size`` bytes at a time; a transport without that field (TLS, another
    event loop's) is left as it is."""
    if isinstance(getattr(transport, "max_size", None), int):
        transport.max_size = READ_BYTES_MAX  # type: ignore[attr-defined]


class RequestTimeout(ConnectionLost):
    """Client side: no answer to a request within its timeout. Retriable: the request may or may
    not have been executed, so only idempotent requests (sends carry their id) are resent.

    Lives here rather than in wire/errors.py only until the codec owner adds it there."""

    code = "timeout"


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` -> (host, port); BadRequest for anything else."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise BadRequest(f"broker address {address!r} is not host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port_text)


class Connection:
    """One persistent, pipelined connection to a broker. Make it with ``await Connection.open``.

    The socket is driven by an ``asyncio.Protocol`` (no reader task, no StreamReader): answers
    are decoded as bytes arrive and handed to the future of their rid; the first request of an
    event-loop turn is written at once and the rest of that turn's requests in one write."""

    def __init__(self, address: str) -> None:
        self.address = address
        # What the broker said about itself in the hello answer: {kind, group, node}.
        self.server: dict[str, Any] = {}
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None  # set once connected
        self._decoder = FrameDecoder()
        self._rids = itertools.count(1)
        # rid -> the future of a pending request, or the (on_answer, on_error) of a
        # request_nowait
        self._pending: dict[int, _Pending] = {}
        # rid -> the on_answer callback of a pending request that gave one
        self._on_answer: dict[int, Callable[[dict[str, Any]], None]] = {}
        # rid -> (loop time it expires at, op name, timeout_ms) of a pending request with a
        # timeout, and the one timer that expires them (_expire_due): set for the earliest
        # deadline, it moves only for an earlier one, so a request answered in time (nearly
        # all) costs two dict operations, not a TimerHandle on the loop's heap and its cancel.
        self._deadlines: dict[int, tuple[float, Any, int]] = {}
        self._expiry: asyncio.TimerHandle | None = None
        self._expiry_at = math.inf  # when _expiry fires (inf: no timer)
        self._out: list[bytes] = []  # frames waiting for the end of this loop turn
        self._wrote_this_turn = False  # a request went out directly in this loop turn
        self._writable: asyncio.Future[None] | None = None  # set while the socket is full
        self._close_error: ConnectionLost | None = None
        # A rid-less error answer: the broker rejected a frame and is about to close on us.
        self._close_error_hint: QmqError | None = None
        self._closed_event = asyncio.Event()
        self._lost_event = asyncio.Event()  # the transport has closed

    @classmethod
    async def open(
        cls,
        address: str,
        *,
        client_id: str,
        app: str,
        token: str | None,
        connect_timeout_ms: int = CONNECT_TIMEOUT_MS_DEFAULT,
        ssl_context: ssl.SSLContext | None = None,
    ) -> Connection:
        """Connect to ``address`` (over TLS with ``ssl_context``) and say hello; ConnectionLost if
        the broker cannot be reached or its certificate is refused, the QmqError of the hello
        answer (Unauthorized, NotSupported, ...) if it refuses us."""
        host, port = parse_address(address)
        conn = cls(address)
        try:
            async with asyncio.timeout(connect_timeout_ms / 1000):
                await conn._loop.create_connection(lambda: _ConnectionProtocol(conn), host, port,
                                                   ssl=ssl_context)
        except (OSError, TimeoutError) as exc:  # ssl.SSLError is an OSError
            raise ConnectionLost(
                f"cannot connect to broker {address} within {connect_timeout_ms} ms: "
                f"{exc or type(exc).__name__}"
            ) from None
        try:
            answer = await conn.request(
                {
                    "op": "hello",
                    "client_id": client_id,
                    "app": app,
                    "token": token,
                    "protocol": PROTOCOL_VERSION,
                },
                connect_timeout_ms,
            )
        except BaseException:
            await conn.close()
            raise
        server = answer.get("server")
        conn.server = server if isinstance(server, dict) else {}
        return conn

    @property
    def closed(self) -> bool:
        """True once the connection is dead; it never comes back (the pool makes a new one)."""
        return self._close_error is not None

    @property
    def pending_count(self) -> int:
        """Requests sent and not yet answered."""
        return len(self._pending)

    async def wait_closed(self) -> None:
        """Return when the connection has closed, for whatever reason."""
        await self._closed_event.wait()

    async def request(self, op: dict[str, Any], timeout_ms: int | None,
                      on_answer: Callable[[dict[str, Any]], None] | None = None,
                      coalesce: bool = True) -> dict[str, Any]:
        """Send ``op`` (a request map without ``rid``) and return the answer without its rid.

        Raises the QmqError of an error answer, ConnectionLost if the connection is or goes down,
        RequestTimeout after ``timeout_ms`` (None: wait for ever), and BadRequest/TooLarge from
        the codec before anything is written if ``op`` cannot be framed.

        ``on_answer(answer)``, if given, is called with a successful answer as soon as it is
        read, before the caller resumes (a loop turn later): the producer lets a batch that
        lingers behind this one leave from there (``BatchingMixin._answered``; a consumer's
        pulls use ``request_nowait``). It must not raise or block; it is not called
        for an error answer, nor for an answer that comes after the request timed out or was
        cancelled.

        ``coalesce=False``: a request its caller sends alone in its loop turn (a consumer's
        pull or ack) is written at once without the end-of-turn callback that lets later
        requests of the same turn share its write (one loop iteration fewer per request);
        it still waits behind requests this turn has queued, so the order is kept.
        """
        loop = self._loop
        future: asyncio.Future[dict[str, Any]] = loop.create_future()
        rid, data = self._register(op, timeout_ms, future)
        if on_answer is not None:
            self._on_answer[rid] = on_answer
        try:
            # The first request of a loop turn leaves at once; more from the same turn (the
            # batches of one send_many) leave together when it ends.
            if not coalesce or self._out:
                self._write_alone(data)
            elif self._wrote_this_turn:
                self._out.append(data)
            elif self._transport is not None and not self._transport.is_closing():
                self._wrote_this_turn = True
                loop.call_soon(self._end_turn)
                self._transport.write(data)
            if self._writable is not None:  # the socket is full: wait, as drain() would
                await asyncio.wait((self._writable, future), return_when=asyncio.FIRST_COMPLETED)
            return await future
        finally:
            self._pending.pop(rid, None)
            if on_answer is not None:
                self._on_answer.pop(rid, None)
            if timeout_ms is not None:
                self._deadlines.pop(rid, None)

    def request_nowait(self, op: dict[str, Any], timeout_ms: int | None,
                       on_answer: Callable[[dict[str, Any]], None],
                       on_error: Callable[[BaseException], None]) -> int:
        """Send ``op`` alone (as ``request(..., coalesce=False)``) and return its rid; no
        coroutine and no future: ``on_answer(answer)`` is called with the answer (without its
        rid) as it is read, or ``on_error(exc)`` once with what ``request`` would raise
        (the error answer's QmqError, ConnectionLost, RequestTimeout). One of the two is
        called exactly once, unless ``forget(rid)`` comes first. A consumer's pull loop
        writes its next pull from there, with no task step per pull. Raises ConnectionLost
        (connection down) or the codec's BadRequest/TooLarge at once, calling neither. It does
        not wait while the socket is full (a pull is a small frame, one per answer)."""
        rid, data = self._register(op, timeout_ms, (on_answer, on_error))
        self._write_alone(data)
        return rid

    def forget(self, rid: int) -> None:
        """Drop the pending ``request_nowait`` ``rid``: neither callback will be called, and a
        late answer is dropped like that of a request that timed out."""
        self._pending.pop(rid, None)
        self._deadlines.pop(rid, None)

    async def close(self) -> None:
        """Close the connection; pending requests fail with ConnectionLost."""
        self._fail(ConnectionLost(f"connection to broker {self.address} was closed by the client"))
        if self._transport is not None:
            try:
                async with asyncio.timeout(CLOSE_FLUSH_TIMEOUT_MS / 1000):
                    await self._lost_event.wait()
            except TimeoutError:  # a broker that does not read what is queued for it
                self._transport.abort()
                await self._lost_event.wait()

    # -- internals ------------------------------------------------------------------------------

    def _register(self, op: dict[str, Any], timeout_ms: int | None,
                  pending: _Pending) -> tuple[int, bytes]:
        """Frame ``op`` with a fresh rid and note ``pending`` (and its deadline) under it."""
        if self._close_error is not None:
            raise ConnectionLost(str(self._close_error))
        rid = next(self._rids)
        data = encode_frame({**op, "rid": rid})
        self._pending[rid] = pending
        # A deadline rather than asyncio.timeout(): its expiry fails just this request, with
        # no context manager and no task cancellation (_expire_due).
        # The error is worded only if it expires: almost every request is answered first.
        if timeout_ms is not None:
            deadline = self._loop.time() + timeout_ms / 1000
            self._deadlines[rid] = (deadline, op.get("op"), timeout_ms)
            if deadline < self._expiry_at:
                self._expire_at(deadline)
        return rid, data

    def _write_alone(self, data: bytes) -> None:
        """Write a request now, with no end-of-turn callback, behind any this turn queued."""
        if self._out:
            self._out.append(data)
        elif self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)

    def _expire_at(self, when: float) -> None:
        """(Re)set the expiry timer to fire at loop time ``when``."""
        if self._expiry is not None:
            self._expiry.cancel()
        self._expiry = self._loop.call_at(when, self._expire_due)
        self._expiry_at = when

    def _expire_due(self) -> None:
        """Fail with RequestTimeout each pending request whose deadline has come (those up to
        the time this timer was set for, which the loop has reached), and set the timer for
        the earliest deadline left."""
        reached = self._expiry_at
        self._expiry, self._expiry_at = None, math.inf
        earliest = math.inf
        for rid, (deadline, op_name, timeout_ms) in list(self._deadlines.items()):
            if deadline > reached:
                earliest = min(earliest, deadline)
                continue
            del self._deadlines[rid]
            _fail_pending(self._pending.pop(rid, None), RequestTimeout(
                f"no answer from broker {self.address} to {op_name} (rid {rid}) within "
                f"{timeout_ms} ms"))
        if earliest < math.inf:
            self._expire_at(earliest)

    def _end_turn(self) -> None:
        self._wrote_this_turn = False
        self._flush()

    def _flush(self) -> None:
        out = self._out
        if not out:
            return
        transport = self._transport
        if transport is not None and not transport.is_closing():
            transport.write(out[0] if len(out) == 1 else b"".join(out))
        out.clear()

    def _received(self, data: bytes) -> None:
        if self._close_error is not None:
            return
        try:
            frames = self._decoder.feed(data)
        except QmqError as exc:
            self._fail(ConnectionLost(f"broker {self.address} sent an unreadable frame: {exc}"))
            return
        for frame in frames:
            self._dispatch(frame)

    def _dispatch(self, frame: dict[str, Any]) -> None:
        try:
            rid, answer = parse_response(frame)
        except QmqError as exc:
            future = self._pending.pop(exc.rid, None) if exc.rid is not None else None
            if future is not None:
                _fail_pending(future, exc)
            elif exc.rid is None and "error" in frame:
                # A connection-level error: the broker rejected a frame and will close on us.
                log.warning("broker %s reported %s: %s", self.address, exc.code, exc.message)
                self._close_error_hint = exc
            elif exc.rid is not None:
                # The late error answer of a request that timed out or was cancelled, like an
                # unknown rid's result below: its caller is gone (a consumer that stopped on the
                # same refusal from another pull), so it is no news to anyone.
                log.debug("broker %s answered request %d after its caller left: %s",
                          self.address, exc.rid, exc)
            else:
                log.warning("broker %s sent an answer we cannot use: %s", self.address, exc)
            return
        if rid is None:
            return  # an answer without a rid answers no request of ours
        # Popped here, not only by request()'s exit: a request_nowait has no exit.
        future = self._pending.pop(rid, None)
        if future is None:
            return  # the late answer of a request that timed out or was cancelled
        if self._deadlines:
            self._deadlines.pop(rid, None)
        if type(future) is tuple:  # a request_nowait: (on_answer, on_error)
            try:
                future[0](answer)
            except Exception as exc:  # noqa: BLE001 - its caller's error, not the socket's
                future[1](exc)
        elif not future.done():  # type: ignore[union-attr]  # (type() narrows only the if)
            on_answer = self._on_answer.pop(rid, None) if self._on_answer else None
            if on_answer is not None:
                try:
                    on_answer(answer)
                except Exception:  # a bug in the callback: the caller still gets its answer
                    log.exception("on_answer callback of request %d to broker %s raised",
                                  rid, self.address)
            future.set_result(answer)  # type: ignore[union-attr]

    def _lost(self, exc: Exception | None) -> None:
        if exc is None:
            self._fail(ConnectionLost(f"broker {self.address} closed the connection"))
        else:
            self._fail(ConnectionLost(f"connection to broker {self.address} failed: {exc}"))
        self._set_writable()
        self._lost_event.set()

    def _set_writable(self) -> None:
        if self._writable is not None:
            if not self._writable.done():
                self._writable.set_result(None)
            self._writable = None

    def _fail(self, error: ConnectionLost) -> None:
        if self._close_error is not None:
            return
        hint = self._close_error_hint
        if hint is not None:
            error = ConnectionLost(f"{error} (after it reported {hint.code}: {hint.message})")
        self._close_error = error
        for future in list(self._pending.values()):
            _fail_pending(future, ConnectionLost(str(error)))
        self._pending.clear()
        self._deadlines.clear()
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry, self._expiry_at = None, math.inf
        self._flush()  # what was already asked for still goes out before the close
        if self._transport is not None:
            self._transport.close()
        self._closed_event.set()


# A pending request: its future, or a request_nowait's (on_answer, on_error).
_Pending = asyncio.Future[dict[str, Any]] | tuple[Callable[[dict[str, Any]], None],
                                                  Callable[[BaseException], None]]


def _fail_pending(pending: _Pending | None, exc: BaseException) -> None:
    """Fail a pending request with ``exc`` (nothing if it is gone or already settled)."""
    if pending is None:
        return
    if isinstance(pending, tuple):
        pending[1](exc)
    elif not pending.done():
        pending.set_exception(exc)


class _ConnectionProtocol(asyncio.Protocol):
    """Hands a Connection the events of its socket."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport: asyncio's, or another loop's (uvloop's is no subclass of
        # asyncio.Transport but has its methods), so the type is stated, not checked.
        transport = cast(asyncio.Transport, transport)
        limit_reads(transport)
        self._connection._transport = transport

    def data_received(self, data: bytes) -> None:
        self._connection._received(data)

    def eof_received(self) -> bool:
        return False  # the broker is done with us: close

    def connection_lost(self, exc: Exception | None) -> None:
        self._connection._lost(exc)

    def pause_writing(self) -> None:
        connection = self._connection
        if connection._writable is None:
            connection._writable = connection._loop.create_future()

    def resume_writing(self) -> None:
        self._connection._set_writable()


def check_identity(client_id: str, app: str, token: str | None) -> None:
    """Raise BadRequest now for a client id, app name or token every broker would refuse at
    hello, so a misconfigured client fails when it is built rather than on its first send."""
    for name, value in (("client_id", client_id), ("app", app)):
        if not value:
            raise BadRequest(f"{name} must not be empty")
        if len(value) > MAX_CLIENT_ID_CHARS:
            raise BadRequest(f"{name} of {len(value)} characters exceeds "
                             f"MAX_CLIENT_ID_CHARS {MAX_CLIENT_ID_CHARS}")
    if token is not None and len(token) > MAX_TOKEN_CHARS:
        # The token itself is not quoted: it is a secret.
        raise BadRequest(f"token of {len(token)} characters exceeds MAX_TOKEN_CHARS "
                         f"{MAX_TOKEN_CHARS}")


class ConnectionPool:
    """At most one live Connection per broker address, opened on first use and reopened on demand
    after it dies. Concurrent ``get``s of the same address share one connect."""

    def __init__(
        self,
        *,
        client_id: str,
        app: str,
        token: str | None,
        connect_timeout_ms: int = CONNECT_TIMEOUT_MS_DEFAULT,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        check_identity(client_id, app, token)
        self.client_id = client_id
        self.app = app
        self.token = token
        self.connect_timeout_ms = connect_timeout_ms
        self.ssl_context = ssl_context  # None: plain TCP to every broker
        self._connections: dict[str, Connection] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._closed = False

    async def get(self, address: str) -> Connection:
        """The live connection to ``address``, connecting (and saying hello) if there is none."""
        conn = self._connections.get(address)
        if conn is not None and not conn.closed:
            return conn
        lock = self._locks.setdefault(address, asyncio.Lock())
        async with lock:
            if self._closed:
                raise ConnectionLost(f"connection pool is closed; not connecting to {address}")
            conn = self._connections.get(address)
            if conn is not None and not conn.closed:
                return conn
            conn = await Connection.open(
                address,
                client_id=self.client_id,
                app=self.app,
                token=self.token,
                connect_timeout_ms=self.connect_timeout_ms,
                ssl_context=self.ssl_context,
            )
            self._connections[address] = conn
            return conn

    async def request(
        self, address: str, op: dict[str, Any], timeout_ms: int | None,
        on_answer: Callable[[dict[str, Any]], None] | None = None, coalesce: bool = True,
    ) -> dict[str, Any]:
        """``get(address)`` then ``request`` (``on_answer``, ``coalesce``: see
        ``Connection.request``); a dead connection is dropped so the next call reconnects."""
        conn = self._connections.get(address)
        if conn is None or conn._close_error is not None:  # as get()'s first check, inline
            conn = await self.get(address)
        try:
            return await conn.request(op, timeout_ms, on_answer, coalesce)
        except ConnectionLost:
            if conn.closed:
                self._connections.pop(address, None)
            raise

    def addresses(self) -> list[str]:
        """Addresses with a live connection."""
        return [a for a, c in self._connections.items() if not c.closed]

    async def discard(self, address: str) -> None:
        """Close the connection to ``address`` (if any) so the next ``get`` reconnects."""
        conn = self._connections.pop(address, None)
        if conn is not None:
            await conn.close()

    async def close(self) -> None:
        """Close every connection; ``get`` fails afterwards."""
        self._closed = True
        connections, self._connections = list(self._connections.values()), {}
        await asyncio.gather(*(c.close() for c in connections), return_exceptions=True)


__all__ = [
    "CONNECT_TIMEOUT_MS_DEFAULT",
    "Connection",
    "ConnectionPool",
    "READ_BYTES_MAX",
    "RequestTimeout",
    "limit_reads",
    "parse_address",
]
