"""pyqmq's driver for the peers benchmark: the SDK as an application uses it, default options.

- send: ``Producer.send``; batch: ``Producer.send_many``; delayed: ``send(deliver_at=ms)``
  (the delay server holds it, then dispatches it to the realtime broker).
- consume: one ``Consumer`` (``start="earliest"``), ``async for`` over ``subscribe`` and
  ``await msg.ack()`` for each message (the SDK sends acks in batches).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

GROUP = "peers"


class PyqmqDriver:
    """See the module docstring; ``url`` is the MetaServer URL that ``qmq up`` printed."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._producer: Any = None
        self._consumer: Any = None

    async def open(self) -> None:
        from sdk import Producer

        self._producer = Producer(self.url)

    async def close(self) -> None:
        if self._consumer is not None:
            await self._consumer.close()
        await self._producer.close()

    async def prepare_consumer(self, subject: str, delayed: bool) -> None:
        from sdk import Consumer
        from sdk.routes import RouteCache

        # The subject gets its route when first asked for by a producer; asking here means the
        # consumer finds it at once instead of waiting for its next route refresh.
        routes = RouteCache(self.url)
        try:
            await routes.get(subject, "producer")
        finally:
            await routes.close()
        self._consumer = Consumer(self.url, group=GROUP, start="earliest")

    async def consume(self, subject: str, on_message: Callable[[bytes], None],
                      stop: asyncio.Event) -> None:
        async def receive() -> None:
            async for msg in self._consumer.subscribe(subject):
                on_message(msg.body)
                await msg.ack()

        receiving = asyncio.create_task(receive())
        stopping = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait((receiving, stopping), return_when=asyncio.FIRST_COMPLETED)
            if receiving.done():
                receiving.result()  # the subscription failed: raise its error
        finally:
            for task in (receiving, stopping):
                task.cancel()
            await asyncio.gather(receiving, stopping, return_exceptions=True)

    async def send(self, subject: str, body: bytes) -> None:
        await self._producer.send(subject, body)

    async def send_many(self, subject: str, bodies: list[bytes]) -> None:
        await self._producer.send_many(subject, bodies)

    async def send_at(self, subject: str, body: bytes, due_ms: int) -> None:
        await self._producer.send(subject, body, deliver_at=due_ms)
