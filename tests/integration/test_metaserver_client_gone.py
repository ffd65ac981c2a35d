"""A client that closes its connection in the middle of a request (it timed out, stalled or
exited) is a departed client, logged at INFO by its address, not an ERROR "internal error" with
a traceback (seen after every process stall, review s18 slave); a reset of another connection
while the client still waits is still an internal error."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from metaserver import MetaConfig, sqlite_url, start_metaserver
from metaserver.handlers import error_middleware
from tests.harness import wait_for


async def test_a_client_that_closes_mid_body_is_logged_as_gone_not_as_an_internal_error(
        tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="metaserver")
    config = MetaConfig(db_url=sqlite_url(tmp_path / "m.db"), port=0)
    async with start_metaserver(config) as meta:
        host, port = meta.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /api/clients/heartbeats HTTP/1.1\r\nHost: x\r\n"
                     b"User-Agent: stalled-client/1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"clients\": [")  # the body never ends
        await writer.drain()
        writer.close()  # the client gives up before its body is sent
        await writer.wait_closed()

        def gone() -> bool:
            return any("closed its connection during POST /api/clients/heartbeats" in r.message
                       for r in caplog.records)

        await wait_for(gone, 30, "the departed client's log line")
    said = [r for r in caplog.records if "closed its connection" in r.message]
    assert said[0].levelno == logging.INFO and "stalled-client/1" in said[0].message
    assert "127.0.0.1" in said[0].message
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


async def test_a_reset_of_another_connection_while_the_client_waits_is_an_internal_error(
        caplog):
    async def handler(request: web.Request) -> web.Response:
        raise ConnectionResetError("a broker's connection was reset")  # not the client's

    app = web.Application(middlewares=[error_middleware])
    app.router.add_get("/x", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        await writer.drain()
        status_line = await reader.readline()
        writer.close()
        await writer.wait_closed()
    finally:
        await runner.cleanup()
    assert b" 500 " in status_line, status_line
    assert any(r.levelno == logging.ERROR and "internal error on GET /x" in r.message
               for r in caplog.records)
