"""A small HTTP/1.1 client on asyncio streams, for the client's requests to the MetaServer.

The SDK asks the MetaServer little: a route now and then (cached for 30 s), a consumer's
heartbeat, the schedule API, the CLI's admin calls. Importing aiohttp for that cost a one-shot
``qmq send`` a quarter of a second (0.25 s of its 0.57 s), so the client speaks just enough
HTTP/1.1 itself: one request per connection (``Connection: close``), a JSON or empty body,
``Content-Length``, chunked or read-to-close answers, TLS through the ``ssl.SSLContext`` the
caller built (``wire.tls``), and one deadline over connect, send and answer.

It does NOT: keep connections alive, follow redirects, decompress, or speak HTTP/2. The servers
(registration, access checks) keep their aiohttp sessions, which do.
"""

from __future__ import annotations

import asyncio
import json as json_module
import ssl as ssl_module
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode, urlsplit

# Largest answer read from the MetaServer, in bytes: the biggest admin listings (dead letters,
# a thousand schedules) are a few MiB; past this the answer is refused as broken.
ANSWER_BYTES_MAX = 64 * 1024 * 1024

# Longest status or header line, in bytes (asyncio's stream limit is 64 KiB; ours is tighter).
HEADER_LINE_BYTES_MAX = 16 * 1024

# Most header lines in one answer.
HEADERS_MAX = 100

# Bytes asked for per read of a body that runs to the close.
READ_CHUNK_BYTES = 64 * 1024


class HttpProtocolError(Exception):
    """The peer's answer is not HTTP/1.x as we read it (a bad status line, a bad length, too
    big); the message names what and the limit."""


@dataclass(frozen=True)
class HttpAnswer:
    """An HTTP answer: its status code, its headers (names lower-cased) and its body bytes."""

    status: int
    headers: dict[str, str]
    body: bytes


async def request(method: str, url: str, *, timeout_s: float,
                  headers: dict[str, str] | None = None,
                  ssl: ssl_module.SSLContext | bool = True, json: Any = None,
                  params: dict[str, str] | None = None) -> HttpAnswer:
    """``method url`` with an optional JSON body and query ``params``; the whole exchange within
    ``timeout_s``. ``ssl`` is the context for https URLs (True: the default verification).
    Raises OSError (refused, reset, TLS), TimeoutError, or HttpProtocolError."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"URL {url!r} must be http:// or https:// with a host")
    tls = parts.scheme == "https"
    port = parts.port or (443 if tls else 80)
    context: ssl_module.SSLContext | None = None
    if tls:
        context = ssl if isinstance(ssl, ssl_module.SSLContext) else ssl_module.create_default_context()
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    if params:
        target += ("&" if parts.query else "?") + urlencode(params)
    payload = b"" if json is None else json_module.dumps(json).encode("utf-8")
    lines = [f"{method} {target} HTTP/1.1", f"Host: {parts.netloc}", "Connection: close",
             "Accept: application/json", "User-Agent: pyqmq-sdk"]
    if json is not None or method in ("POST", "PUT", "PATCH"):
        lines += ["Content-Type: application/json", f"Content-Length: {len(payload)}"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    async with asyncio.timeout(timeout_s):
        reader, writer = await asyncio.open_connection(
            parts.hostname, port, ssl=context, server_hostname=parts.hostname if tls else None,
            limit=HEADER_LINE_BYTES_MAX)
        try:
            writer.write(head + payload)
            await writer.drain()
            return await _read_answer(reader, method)
        except asyncio.IncompleteReadError:
            raise ConnectionResetError("the server closed the connection mid-answer") from None
        finally:
            writer.close()
            # Not awaiting wait_closed(): the answer is read, and a TLS close_notify exchange
            # would only add a round trip before a one-shot command can exit.


async def _read_answer(reader: asyncio.StreamReader, method: str) -> HttpAnswer:
    """Read a status line, headers and the body (by length, chunks, or up to the close)."""
    status_line = await _line(reader)
    version, _, rest = status_line.partition(" ")
    code = rest[:3]
    if not version.startswith("HTTP/1.") or not code.isdigit():
        raise HttpProtocolError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
    headers: dict[str, str] = {}
    for _ in range(HEADERS_MAX + 1):
        line = await _line(reader)
        if not line:
            break
        name, sep, value = line.partition(":")
        if not sep:
            raise HttpProtocolError(f"bad header line {line[:80]!r}")
        headers[name.strip().lower()] = value.strip()
    else:
        raise HttpProtocolError(f"answer has more than HEADERS_MAX {HEADERS_MAX} headers")
    status = int(code)
    if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
        return HttpAnswer(status, headers, b"")
    if "chunked" in headers.get("transfer-encoding", "").lower():
        body = await _read_chunked(reader)
    elif "content-length" in headers:
        length_text = headers["content-length"]
        if not length_text.isdigit():
            raise HttpProtocolError(f"bad Content-Length {length_text!r}")
        length = int(length_text)
        _check_size(length)
        body = await reader.readexactly(length)
    else:  # neither: the body runs to the close (Connection: close)
        body = await _read_to_close(reader)
    return HttpAnswer(status, headers, body)


async def _read_to_close(reader: asyncio.StreamReader) -> bytes:
    """Everything up to the server's close (``read`` returns what has come so far, so loop)."""
    body = bytearray()
    while chunk := await reader.read(READ_CHUNK_BYTES):
        body += chunk
        _check_size(len(body))
    return bytes(body)


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    """A chunked body: size lines in hex, each chunk, then a zero chunk and the trailers."""
    body = bytearray()
    while True:
        size_text = (await _line(reader)).partition(";")[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise HttpProtocolError(f"bad chunk size {size_text[:40]!r}") from None
        if size == 0:
            while await _line(reader):  # trailers, up to the empty line
                pass
            return bytes(body)
        _check_size(len(body) + size)
        body += await reader.readexactly(size)
        await reader.readexactly(2)  # the CRLF after a chunk


async def _line(reader: asyncio.StreamReader) -> str:
    """One CRLF-terminated line without its end; EOF before it is a ConnectionResetError."""
    try:
        raw = await reader.readuntil(b"\n")
    except asyncio.IncompleteReadError:
        raise ConnectionResetError("the server closed the connection mid-answer") from None
    except asyncio.LimitOverrunError:
        raise HttpProtocolError(
            f"answer line exceeds HEADER_LINE_BYTES_MAX {HEADER_LINE_BYTES_MAX}") from None
    return raw.rstrip(b"\r\n").decode("latin-1")


def _check_size(size_bytes: int) -> None:
    if size_bytes > ANSWER_BYTES_MAX:
        raise HttpProtocolError(
            f"answer of {size_bytes} bytes exceeds ANSWER_BYTES_MAX {ANSWER_BYTES_MAX}")


__all__ = ["ANSWER_BYTES_MAX", "HEADERS_MAX", "HEADER_LINE_BYTES_MAX", "HttpAnswer",
           "HttpProtocolError", "request"]
