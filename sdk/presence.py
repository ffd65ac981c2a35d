"""One heartbeat to the MetaServer per client process, for all of its consumers (issue 19).

A consumer tells the MetaServer it is alive every ``heartbeat_interval_ms`` (5 s), so that
``qmq admin groups`` and the console count it online. Sent one request per consumer, 1,000
consumers in one process made 200 HTTP requests a second (each on a new connection) and
saturated the MetaServer. Now the consumers of one event loop that talk to the same
MetaServers with the same token share one ``Presence``:

* every round, one ``POST /api/clients/heartbeats {clients, left}`` names all of its members
  (in chunks of at most ``CLIENTS_PER_HEARTBEAT_MAX``) and the consumers that closed since;
  the MetaServer notes the ones it already knows in memory and writes the rest, and the
  leaves, in one transaction;
* a round runs every ``interval`` (the shortest heartbeat interval of the members), and at
  once (on the loop's next turn, so a burst of changes goes in one round) when a consumer
  joins, subscribes to a subject or closes;
* a consumer that closes is named in ``left`` (offline at once, as ``/api/clients/leave``
  made it); a process that dies stops sending, and the MetaServer expires its consumers after
  ``client_expiry_ms`` as before: liveness stays per consumer, only the requests are shared.

A MetaServer from before this (it answers the path with 404 ``not_found``) gets one
``/api/clients/heartbeat`` or ``/api/clients/leave`` per consumer, as it did.

Owner: the event loop the consumers run on (every method).
"""

from __future__ import annotations

import asyncio
import json
import logging
import weakref
from collections.abc import Callable
from typing import Any

from sdk.routes import RouteCache
from wire.errors import QmqError

log = logging.getLogger(__name__)

# Most clients (alive or left) one batched heartbeat names; the MetaServer refuses more
# (metaserver.validation.CLIENTS_PER_HEARTBEAT_MAX).
CLIENTS_PER_HEARTBEAT_MAX = 1000
# A chunk is cut before its JSON passes this many bytes (a consumer of many subjects names
# them all), well below the MetaServer's 4 MiB body limit.
HEARTBEAT_BODY_BYTES_MAX = 1024 * 1024

PresenceKey = tuple[str, str | None, object]

_shared: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[PresenceKey, Presence]] = (
    weakref.WeakKeyDictionary())


class Presence:
    """The shared heartbeat of the consumers of one event loop towards one MetaServer list and
    token (see the module doc). Get it with ``Presence.joined``."""

    def __init__(self, key: PresenceKey, routes: RouteCache) -> None:
        self._key = key
        self._routes = routes  # used only to call the MetaServer (no route is cached in it)
        self._members: dict[str, tuple[dict[str, Any], int]] = {}  # id -> (fields, interval ms)
        self._left: list[str] = []
        self._wake = asyncio.Event()
        self._next_round: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._task: asyncio.Task[None] | None = None
        self._batched = True  # False once a MetaServer said it has no batched heartbeat

    @classmethod
    def joined(cls, key: PresenceKey, make_routes: Callable[[], RouteCache], client_id: str,
               fields: dict[str, Any], interval_ms: int) -> Presence:
        """The loop's Presence for ``key`` (made with ``make_routes()`` if there is none), with
        ``client_id`` a member announced at the next round."""
        shared = _shared.setdefault(asyncio.get_running_loop(), {})
        presence = shared.get(key)
        if presence is None:
            presence = shared[key] = cls(key, make_routes())
        presence.update(client_id, fields, interval_ms)
        return presence

    @property
    def members(self) -> int:
        """Clients this Presence speaks for now."""
        return len(self._members)

    def update(self, client_id: str, fields: dict[str, Any], interval_ms: int) -> None:
        """Set what the heartbeat says of ``client_id`` (its heartbeat body, ``client_id``
        included); a new member or a change goes out at once."""
        known = self._members.get(client_id)
        self._members[client_id] = (fields, interval_ms)
        if known is None or known[0] != fields:
            self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(),
                                                                name="qmq-presence")

    async def beat_now(self) -> None:
        """Run a round that starts after this call, and return when it is done."""
        self._wake.set()
        await asyncio.shield(self._next_round)

    async def leave(self, client_id: str) -> None:
        """``client_id`` closed: named as left in a round now, and no longer a member."""
        if self._members.pop(client_id, None) is None:
            return
        self._left.append(client_id)
        await self.beat_now()

    async def _run(self) -> None:
        """Rounds until no member is left and every leave is sent."""
        loop = asyncio.get_running_loop()
        try:
            while self._members or self._left:
                if not self._wake.is_set():
                    interval_ms = min(interval for _, interval in self._members.values()) \
                        if self._members else 0
                    try:
                        async with asyncio.timeout(interval_ms / 1000):
                            await self._wake.wait()
                    except TimeoutError:
                        pass
                await asyncio.sleep(0)  # one loop turn: changes made together share the round
                self._wake.clear()
                this_round, self._next_round = self._next_round, loop.create_future()
                try:
                    await self._round()
                finally:
                    if not this_round.done():
                        this_round.set_result(None)
        finally:
            if _shared.get(loop, {}).get(self._key) is self:
                del _shared[loop][self._key]
            if not self._next_round.done():
                self._next_round.set_result(None)

    async def _round(self) -> None:
        """One heartbeat for every member and leave; failures are warnings (the next round
        tries again; a lost leave only delays the consumer's going offline to its expiry)."""
        clients = [fields for fields, _ in self._members.values()]
        left, self._left = self._left, []
        if self._batched:
            try:
                for chunk_clients, chunk_left in chunks(clients, left):
                    await self._routes.client_heartbeats(clients=chunk_clients, left=chunk_left)
                return
            except QmqError as exc:
                if exc.code != "not_found":
                    log.warning("heartbeat of %d client(s) to the MetaServer failed: %s",
                                len(clients) + len(left), exc)
                    return
                log.info("the MetaServer has no batched heartbeat (%s); sending one per client",
                         exc.message)
                self._batched = False
        await asyncio.gather(*(self._one(fields) for fields in clients),
                             *(self._one_leave(client_id) for client_id in left))

    async def _one(self, fields: dict[str, Any]) -> None:
        try:
            await self._routes.client_heartbeat(**fields)
        except QmqError as exc:
            log.warning("heartbeat to the MetaServer failed: %s", exc)

    async def _one_leave(self, client_id: str) -> None:
        try:
            await self._routes.client_leave(client_id=client_id)
        except QmqError as exc:
            log.warning("leave to the MetaServer failed: %s", exc)


def chunks(clients: list[dict[str, Any]], left: list[str],
           ) -> list[tuple[list[dict[str, Any]], list[str]]]:
    """``clients`` and ``left`` cut into requests of at most CLIENTS_PER_HEARTBEAT_MAX names
    and about HEARTBEAT_BODY_BYTES_MAX bytes each (always at least one request)."""
    out: list[tuple[list[dict[str, Any]], list[str]]] = []
    batch: list[dict[str, Any]] = []
    size = 0
    for fields in clients:
        item_size = len(json.dumps(fields))
        if batch and (len(batch) >= CLIENTS_PER_HEARTBEAT_MAX
                      or size + item_size > HEARTBEAT_BODY_BYTES_MAX):
            out.append((batch, []))
            batch, size = [], 0
        batch.append(fields)
        size += item_size
    out.append((batch, []))
    for first in range(0, len(left), CLIENTS_PER_HEARTBEAT_MAX):
        gone = left[first:first + CLIENTS_PER_HEARTBEAT_MAX]
        last_clients, last_left = out[-1]
        if not last_left and len(last_clients) + len(gone) <= CLIENTS_PER_HEARTBEAT_MAX:
            out[-1] = (last_clients, gone)
        else:
            out.append(([], gone))
    return out


__all__ = ["CLIENTS_PER_HEARTBEAT_MAX", "HEARTBEAT_BODY_BYTES_MAX", "Presence", "chunks"]
