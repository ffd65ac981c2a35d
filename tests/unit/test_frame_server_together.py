"""The frame server's ``answers_together()``: answers written inside it (a group commit
answering its sends) leave as it ends, one write per connection, with no end-of-turn
callback."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from serverkit.frame_server import FrameServer, Later, Session
from tests.unit.test_framed_server import _read_answers
from wire.protocol import Request, encode_frame

WAIT_S = 10  # longest the test waits for the server to act, in seconds


def _frame(op: str, rid: int) -> bytes:
    if op == "hello":
        return encode_frame({"op": "hello", "rid": rid, "client_id": "c1", "app": "test",
                             "protocol": 1})
    return encode_frame({"op": "heartbeat", "rid": rid, "consumer_id": "c1",
                         "subscriptions": [["orders", "g"]]})


@pytest.mark.asyncio_internals  # wraps or reads asyncio transport attributes uvloop lacks
async def test_answers_written_together_leave_in_one_write_per_connection_at_the_blocks_end():
    laters: list[Later] = []

    async def later_heartbeats(session: Session, request: Request) -> dict[str, Any] | Later:
        if request.op == "heartbeat":
            laters.append(Later())
            return laters[-1]
        return {"ok": True}

    server = FrameServer(later_heartbeats, inline_ops=("heartbeat",))
    await server.start()
    writers = []
    try:
        clients = []
        for _ in range(2):
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writers.append(writer)
            writer.write(_frame("hello", 1))
            await writer.drain()
            await _read_answers(reader, 1)
            clients.append(reader)
        for rid, writer in ((2, writers[0]), (3, writers[0]), (4, writers[1])):
            writer.write(_frame("heartbeat", rid))  # each a read of its own
            await writer.drain()
            async with asyncio.timeout(WAIT_S):
                while len(laters) < rid - 1:
                    await asyncio.sleep(0.001)
        writes: list[bytes] = []
        for connection in server._connections:
            transport = connection._transport
            transport.write = (lambda write: lambda data: (writes.append(data), write(data))[1]
                               )(transport.write)  # type: ignore[union-attr]
        with server.answers_together():
            for later in laters:
                later.answer({"ok": "later"})
            assert writes == []  # held until the block ends
        assert len(writes) == 2  # one per connection, the first one's two answers together
        assert [a["rid"] for a in await _read_answers(clients[0], 2)] == [2, 3]
        assert [a["rid"] for a in await _read_answers(clients[1], 1)] == [4]
        # Outside a block the first answer of a turn is written at once, as before.
        writers[1].write(_frame("heartbeat", 5))
        await writers[1].drain()
        async with asyncio.timeout(WAIT_S):
            while len(laters) < 4:
                await asyncio.sleep(0.001)
        laters[-1].answer({"ok": "alone"})
        assert len(writes) == 3
        assert (await _read_answers(clients[1], 1))[0]["rid"] == 5
    finally:
        for writer in writers:
            writer.close()
        await server.stop(grace_ms=10)


async def test_the_block_is_the_servers_one_and_may_be_kept_and_entered_again_nested():
    # The broker keeps the block and enters it for every commit (no call to get it each time).
    server = FrameServer(lambda session, request: None)  # type: ignore[arg-type,return-value]
    block = server.answers_together()
    assert server.answers_together() is block
    with block:
        with block:
            assert server._together == 2
        assert server._together == 1, "the inner exit does not end the outer block"
    assert server._together == 0
    with block:
        assert server._together == 1
    assert server._together == 0
