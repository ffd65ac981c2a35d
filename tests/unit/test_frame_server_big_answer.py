"""A big answer (a pull of large messages: up to ~6 MiB) is packed once by the frame server, its
grown Packer renewed as ``encode_frame`` would, and one past MAX_FRAME_BYTES (a server bug)
still becomes its request's ``internal`` error (review rv22-M1: packed a second time by
``encode_frame`` while the first copy lived, such an answer cost twice the loop's CPU)."""

from __future__ import annotations

import asyncio
from typing import Any

import serverkit.frame_server as frame_server
from serverkit.frame_server import FrameServer, Session
from tests.unit.test_framed_server import _heartbeat, _read_answers, _said_hello
from wire.limits import MAX_FRAME_BYTES
from wire.packing import PACKER_KEEP_BYTES_MAX, packers
from wire.protocol import Request

BIG_BYTES = 2 * PACKER_KEEP_BYTES_MAX  # over the Packer's keep size, under the frame limit


class CountingPackers:
    """The frame server's ``packers``, counting its packs and renewals."""

    def __init__(self) -> None:
        self.packs = 0
        self.renewals = 0

    def pack(self, obj: Any) -> bytes:
        self.packs += 1
        return packers.pack(obj)

    def renew(self) -> None:
        self.renewals += 1
        packers.renew()


async def test_a_big_answer_is_packed_once_and_one_past_the_frame_limit_is_an_internal_error(
        monkeypatch):
    counting = CountingPackers()
    encoded: list[Any] = []
    encode_frame = frame_server.encode_frame

    def counted_encode_frame(obj: Any) -> bytes:
        encoded.append(obj)
        return encode_frame(obj)

    async def answer(session: Session, request: Request) -> dict[str, Any]:
        if request.rid == 2:
            return {"blob": b"x" * BIG_BYTES}
        if request.rid == 3:
            return {"blob": b"x" * (MAX_FRAME_BYTES + 1)}
        return {"ok": True}

    server = FrameServer(answer)
    await server.start()
    try:
        reader, writer = await _said_hello(server)
        monkeypatch.setattr(frame_server, "packers", counting)
        monkeypatch.setattr(frame_server, "encode_frame", counted_encode_frame)
        writer.write(_heartbeat(2))
        await writer.drain()
        [big] = await _read_answers(reader, 1)
        assert big == {"rid": 2, "blob": b"x" * BIG_BYTES}
        assert (counting.packs, counting.renewals, encoded) == (1, 1, [])
        writer.write(_heartbeat(3))
        await writer.drain()
        [refused] = await _read_answers(reader, 1)
        assert refused["rid"] == 3 and refused["error"]["code"] == "internal", refused
        assert "MAX_FRAME_BYTES" in refused["error"]["message"], refused
        writer.write(_heartbeat(4))
        await writer.drain()
        assert await _read_answers(reader, 1) == [{"rid": 4, "ok": True}]
        writer.close()
    finally:
        await server.stop()
