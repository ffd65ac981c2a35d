"""The figures the console's pages share, read from the registry at most every
``SNAPSHOT_TTL_MS`` and reused by every request meanwhile.

With 1,000 subjects and 100 brokers, reading the registry's lists and folding them into rows
costs far more than rendering a page of 100 rows, and the figures change only with heartbeats
(every 5 s by default) anyway. So pages are served from the last snapshot, and a request that
finds it older than the TTL starts one refresh in the background (stale-while-revalidate): no
request waits for the lists except the very first. Pages say how old their figures are.
Everything here runs on the event loop, so the fields need no lock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from metaserver import dead_letters as dead
from metaserver.console import model
from metaserver.registry import Registry

log = logging.getLogger(__name__)

# How old a snapshot may be before a request starts a new one, in milliseconds: the brokers'
# heartbeat interval under the default broker expiry (15 s / 3), since figures change with them.
SNAPSHOT_TTL_MS = 5_000


@dataclass(frozen=True)
class Snapshot:
    """The registry's figures at ``taken_ms`` (the registry's clock), folded for the pages."""

    taken_ms: int
    overview: model.Overview
    delay: list[dict[str, Any]]  # dead_letters.delay_stats: online delay servers
    groups: list[dict[str, Any]]  # model.group_rows
    subjects: list[dict[str, Any]]  # model.subject_rows of user subjects
    internal_subjects: int  # routed %retry% subjects, folded into their groups' rows


async def take(registry: Registry) -> Snapshot:
    """Read the registry's lists once and fold them for the pages."""
    brokers, listed, raw_groups = await asyncio.gather(
        registry.list_brokers(backlog_rows=False), registry.list_subjects(),
        registry.list_consumer_groups())
    groups = model.group_rows(raw_groups)
    user = [s for s in listed if not s["subject"].startswith("%")]
    return Snapshot(taken_ms=registry.clock(), overview=model.overview(brokers),
                    delay=dead.delay_stats(brokers), groups=groups,
                    subjects=model.subject_rows(user, groups),
                    internal_subjects=len(listed) - len(user))


class Snapshots:
    """The current snapshot and the refresh that replaces it."""

    def __init__(self, registry: Registry, ttl_ms: int = SNAPSHOT_TTL_MS,
                 monotonic_ms: Callable[[], float] = lambda: time.monotonic() * 1000,
                 taker: Callable[[Registry], Awaitable[Snapshot]] = take) -> None:
        self.registry = registry
        self.ttl_ms = ttl_ms
        self._taker = taker
        self._monotonic_ms = monotonic_ms
        self._current: Snapshot | None = None
        self._taken_at = 0.0  # monotonic ms when _current was taken
        self._refresh: asyncio.Task[Snapshot] | None = None

    async def get(self) -> Snapshot:
        """The current snapshot; the first call waits for one, later ones never do."""
        if self._current is None:
            return await self._refreshing()
        if self._monotonic_ms() - self._taken_at >= self.ttl_ms:
            self._refreshing()  # in the background; this request takes the current one
        return self._current

    def _refreshing(self) -> asyncio.Task[Snapshot]:
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.get_running_loop().create_task(self._take())
        return self._refresh

    async def _take(self) -> Snapshot:
        started = self._monotonic_ms()
        try:
            snapshot = await self._taker(self.registry)
        except Exception:
            if self._current is None:
                raise
            log.exception("console snapshot failed; the pages keep the previous one")
            return self._current
        self._current, self._taken_at = snapshot, started
        return snapshot

    async def close(self) -> None:
        """Wait out a refresh in progress (the app is stopping)."""
        if self._refresh is not None and not self._refresh.done():
            self._refresh.cancel()
            await asyncio.gather(self._refresh, return_exceptions=True)
