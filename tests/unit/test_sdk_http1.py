"""``sdk.http1``, the client's small HTTP/1.1 path to the MetaServer, against canned answers from
a loopback server on port 0: lengths, chunks, read-to-close, limits, refusals and timeouts."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from sdk import http1
from sdk.meta import MetaEndpoints, MetaUnavailable


@asynccontextmanager
async def canned(answer: bytes, seen: list[bytes] | None = None,
                 hold: bool = False) -> AsyncIterator[str]:
    """A server on 127.0.0.1:0 that reads one request, writes ``answer`` and closes (or, with
    ``hold``, says nothing); yields its URL. ``seen`` gets the request's bytes."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await reader.readuntil(b"\r\n\r\n")
        length = [int(line.split(b":")[1]) for line in request.split(b"\r\n")
                  if line.lower().startswith(b"content-length:")]
        if length:
            request += await reader.readexactly(length[0])
        if seen is not None:
            seen.append(request)
        if hold:
            await asyncio.sleep(30)
        writer.write(answer)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"


async def test_a_json_post_carries_its_body_headers_and_query_and_reads_a_sized_answer():
    seen: list[bytes] = []
    async with canned(OK + b"Content-Length: 12\r\n\r\n{\"ok\": true}", seen) as url:
        answer = await http1.request("POST", url + "/api/x", timeout_s=5, json={"a": 1},
                                     headers={"Authorization": "Bearer t"},
                                     params={"subject": "a b"})
    assert (answer.status, json.loads(answer.body)) == (200, {"ok": True})
    head, _, body = seen[0].partition(b"\r\n\r\n")
    assert head.startswith(b"POST /api/x?subject=a+b HTTP/1.1\r\n")
    assert b"\r\nAuthorization: Bearer t" in head and b"\r\nConnection: close" in head
    assert json.loads(body) == {"a": 1}


async def test_a_chunked_answer_and_one_read_to_the_close_are_read_whole():
    async with canned(OK + b"Transfer-Encoding: chunked\r\n\r\n"
                      b"4\r\n{\"a\"\r\n5;x=y\r\n: 1}\n\r\n0\r\nTrailer: t\r\n\r\n") as url:
        answer = await http1.request("GET", url, timeout_s=5)
    assert json.loads(answer.body) == {"a": 1}
    async with canned(OK + b"\r\n[1, 2]") as url:
        assert (await http1.request("GET", url, timeout_s=5)).body == b"[1, 2]"


async def test_an_answer_read_to_the_close_is_read_whole_whatever_its_pieces():
    big = b"[" + b"1, " * 100_000 + b"1]"  # far more than one read returns

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(OK + b"\r\n" + big[:10])
        await writer.drain()
        await asyncio.sleep(0.05)  # the client has read the head and a first piece by now
        writer.write(big[10:])
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        assert (await http1.request("GET", url, timeout_s=5)).body == big
    finally:
        server.close()


@pytest.mark.parametrize("answer, said", [
    (b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP/1.x status line"),
    (OK + b"Content-Length: x1\r\n\r\n", "bad Content-Length 'x1'"),
    (OK + b"Content-Length: %d\r\n\r\n" % (http1.ANSWER_BYTES_MAX + 1),
     f"exceeds ANSWER_BYTES_MAX {http1.ANSWER_BYTES_MAX}"),
    (OK + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n", "bad chunk size 'zz'"),
    (OK + b"X: y\r\n" * (http1.HEADERS_MAX + 1) + b"\r\n", f"HEADERS_MAX {http1.HEADERS_MAX}"),
])
async def test_an_answer_that_is_not_http_as_we_read_it_is_refused_naming_why(answer, said):
    async with canned(answer) as url:
        with pytest.raises(http1.HttpProtocolError, match=said):
            await http1.request("GET", url, timeout_s=5)


async def test_an_answer_cut_short_is_a_connection_reset():
    async with canned(OK + b"Content-Length: 50\r\n\r\n{\"short\"") as url:
        with pytest.raises(ConnectionResetError):
            await http1.request("GET", url, timeout_s=5)


async def test_the_metaserver_list_moves_on_from_a_silent_one_and_names_every_failure():
    async with canned(b"", hold=True) as silent, \
            canned(OK + b"Content-Length: 2\r\n\r\n{}") as good:
        endpoints = MetaEndpoints(f"{silent},{good}")
        answer = await endpoints.request(None, "GET", "/health", timeout_s=0.3)
        assert (answer.status, answer.data, answer.url) == (200, {}, good)
        with pytest.raises(MetaUnavailable) as failed:
            await MetaEndpoints(f"{silent},http://127.0.0.1:9").request(
                None, "GET", "/health", timeout_s=0.3)
    assert f"{silent} is unreachable: no answer in time (timeout)" in failed.value.message
    assert "http://127.0.0.1:9 is unreachable" in failed.value.message
