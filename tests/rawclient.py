"""A minimal protocol client for tests: raw frames over one connection, no SDK logic."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from wire.message import Message, encode_message
from wire.protocol import FrameDecoder, encode_frame


class FakeClock:
    """A clock the test moves by hand (milliseconds)."""

    def __init__(self, now_ms: int = 1_700_000_000_000) -> None:
        self.now_ms = now_ms

    def __call__(self) -> int:
        return self.now_ms

    def advance(self, delta_ms: int) -> None:
        """Move time forward by ``delta_ms``."""
        self.now_ms += delta_ms


class RawClient:
    """Sends request maps and returns response maps (errors are returned, not raised)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.decoder = FrameDecoder()
        self.rids = itertools.count(1)
        self.pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.unmatched: list[dict[str, Any]] = []
        self.closed = asyncio.Event()
        self._reader_task = asyncio.create_task(self._read())

    @classmethod
    async def connect(cls, port: int, hello: bool = True,
                      host: str = "127.0.0.1") -> "RawClient":
        """Connect to host:port (loopback by default) and (by default) say hello."""
        reader, writer = await asyncio.open_connection(host, port)
        client = cls(reader, writer)
        if hello:
            response = await client.request({"op": "hello", "client_id": "test", "app": "tests",
                                             "protocol": 1})
            assert response.get("ok"), response
        return client

    async def _read(self) -> None:
        try:
            while True:
                data = await self.reader.read(65536)
                if not data:
                    break
                for frame in self.decoder.feed(data):
                    future = self.pending.pop(frame.get("rid"), None)
                    if future is not None:
                        future.set_result(frame)
                    else:
                        self.unmatched.append(frame)
        finally:
            self.closed.set()
            for future in self.pending.values():
                if not future.done():
                    future.set_exception(ConnectionError("closed"))

    async def request(self, frame: dict[str, Any], timeout_s: float = 10) -> dict[str, Any]:
        """Send one request and wait for its response."""
        rid = next(self.rids)
        frame = {**frame, "rid": rid}
        future = asyncio.get_running_loop().create_future()
        self.pending[rid] = future
        self.writer.write(encode_frame(frame))
        await self.writer.drain()
        async with asyncio.timeout(timeout_s):
            return await future

    async def send(self, *messages: Message) -> dict[str, Any]:
        """A send op with these messages."""
        return await self.request({"op": "send", "messages": [encode_message(m) for m in messages]})

    async def pull(self, subject: str, group: str, consumer: str, **fields: Any) -> dict[str, Any]:
        """A pull op (max_count 100, no wait unless given)."""
        frame = {"op": "pull", "subject": subject, "group": group, "consumer_id": consumer,
                 "max_count": 100, "wait_ms": 0, **fields}
        return await self.request(frame, timeout_s=fields.get("wait_ms", 0) / 1000 + 10)

    async def ack(self, subject: str, group: str, consumer: str, ranges: list[list[int]]) -> dict[str, Any]:
        """An ack op for inclusive pull-seq ranges."""
        return await self.request({"op": "ack", "subject": subject, "group": group,
                                   "consumer_id": consumer, "ranges": ranges})

    async def close(self) -> None:
        """Close the connection."""
        self.writer.close()
        self._reader_task.cancel()
        await asyncio.gather(self._reader_task, return_exceptions=True)


def message(subject: str, body: bytes, clock: FakeClock, **fields: Any) -> Message:
    """A message created at the fake clock's time."""
    return Message.create(subject, body, now_ms=clock(), **fields)
