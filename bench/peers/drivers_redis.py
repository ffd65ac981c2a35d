"""Redis Streams' driver for the peers benchmark (redis-py asyncio, RESP over TCP loopback).

- send: ``XADD <subject> * body <body>``; batch: one non-transactional pipeline of XADDs.
- consume: a consumer group (``XGROUP CREATE <subject> peers 0 MKSTREAM``), ``XREADGROUP``
  with ``COUNT 256 BLOCK 1000``, then one ``XACK`` naming every id of that read.
- delayed: Redis has no delayed delivery; the usual pattern is a sorted set scored by due time
  plus a mover. ``send_at`` is ``ZADD <subject>:due <due_ms> <body>`` (the body is the member:
  it is unique, as it carries its sequence number). The mover (``run_mover``, a client process
  of its own, as a scheduler service would be) runs a Lua script that atomically takes up to
  MOVE_BATCH members with score <= now, XADDs each to the stream and ZREMs them; when it moved
  a full batch it runs again at once, otherwise it sleeps until the earliest due time, at most
  MOVER_POLL_MS (a message added meanwhile with an earlier due time waits at most that long).
  The mover's CPU is a client's, not the server's; the orchestrator reports it apart.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

GROUP = "peers"
BODY_FIELD = "body"  # the stream entry's one field (the mover's script spells it too)
CONSUMER = "c1"
READ_COUNT = 256
READ_BLOCK_MS = 1_000
MOVE_BATCH = 512
MOVER_POLL_MS = 10
POOL_CONNECTIONS_MAX = 64  # connections, one per command in flight (32 delayed sends, 4 pipelines)

# KEYS[1] the due set, KEYS[2] the stream; ARGV[1] now (epoch ms), ARGV[2] batch size.
MOVE_SCRIPT = """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, ARGV[2])
for _, body in ipairs(due) do
    redis.call('XADD', KEYS[2], '*', 'body', body)
end
if #due > 0 then
    redis.call('ZREM', KEYS[1], unpack(due))
end
return #due
"""


def due_key(subject: str) -> str:
    """The sorted set holding ``subject``'s delayed messages."""
    return f"{subject}:due"


class RedisDriver:
    """See the module docstring; ``url`` is ``redis://host:port``."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._redis: Any = None
        self._pool: Any = None

    async def open(self) -> None:
        import redis.asyncio as redis

        # A command holds a connection until its reply (redis-py does not pipeline concurrent
        # calls on one), so concurrent sends beyond the pool wait for a free connection.
        pool = redis.BlockingConnectionPool.from_url(self.url, max_connections=POOL_CONNECTIONS_MAX,
                                                     timeout=None)
        self._pool = pool
        self._redis = redis.Redis(connection_pool=pool)
        await self._redis.ping()

    async def close(self) -> None:
        await self._redis.aclose()
        await self._pool.disconnect()

    async def prepare_consumer(self, subject: str, delayed: bool) -> None:
        from redis.exceptions import ResponseError

        try:
            await self._redis.xgroup_create(subject, GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def consume(self, subject: str, on_message: Callable[[bytes], None],
                      stop: asyncio.Event) -> None:
        while not stop.is_set():
            reply = await self._redis.xreadgroup(GROUP, CONSUMER, {subject: ">"},
                                                 count=READ_COUNT, block=READ_BLOCK_MS)
            for _stream, entries in reply or ():
                ids = []
                for entry_id, fields in entries:
                    on_message(fields[BODY_FIELD.encode()])
                    ids.append(entry_id)
                if ids:
                    await self._redis.xack(subject, GROUP, *ids)

    async def send(self, subject: str, body: bytes) -> None:
        await self._redis.xadd(subject, {BODY_FIELD: body})

    async def send_many(self, subject: str, bodies: list[bytes]) -> None:
        async with self._redis.pipeline(transaction=False) as pipe:
            for body in bodies:
                pipe.xadd(subject, {BODY_FIELD: body})
            await pipe.execute()

    async def send_at(self, subject: str, body: bytes, due_ms: int) -> None:
        await self._redis.zadd(due_key(subject), {body: due_ms})

    async def run_mover(self, subject: str, count: int, timeout_s: float,
                        ready: Callable[[], None]) -> dict[str, Any]:
        """Move due messages of ``subject`` to its stream until ``count`` were moved or
        ``timeout_s`` passed (see the module docstring)."""
        move = self._redis.register_script(MOVE_SCRIPT)
        key = due_key(subject)
        moved, calls = 0, 0
        ready()
        cpu_start_s, deadline = time.process_time(), time.monotonic() + timeout_s
        while moved < count and time.monotonic() < deadline:
            now_ms = time.time_ns() // 1_000_000
            batch = await move(keys=[key, subject], args=[now_ms, MOVE_BATCH])
            moved, calls = moved + batch, calls + 1
            if batch == MOVE_BATCH:
                continue
            head = await self._redis.zrange(key, 0, 0, withscores=True)
            wait_ms = MOVER_POLL_MS if not head else max(0, min(MOVER_POLL_MS,
                                                                 head[0][1] - now_ms))
            await asyncio.sleep(wait_ms / 1000)
        return {"moved": moved, "calls": calls, "cpu_s": time.process_time() - cpu_start_s}
