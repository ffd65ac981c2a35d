"""``BrokerContext``: what the realtime broker's parts (``Sends``, ``Pulls``, ``Holdings``)
share, handed to each when the broker builds them over its opened stores."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from logstore import DiskFull
from pulllog import PullLogStore
from realtime.committed import Committed
from realtime.config import RealtimeConfig
from realtime.consumers import ConsumerBook
from realtime.storage import MessageStore
from realtime.tracing import BrokerTracer
from serverkit.write_replication import WriteReplication

Runner = Callable[..., Awaitable[Any]]  # ``await run(fn, *args)``: fn(*args) on one I/O thread


@dataclass(frozen=True)
class BrokerContext:
    """The broker's stores, the runners of their threads and the state its parts share. The
    references never change; whose thread owns what they point to is said where it is kept
    (``Broker``'s docstring sums it up)."""

    config: RealtimeConfig
    clock: Callable[[], int]  # the broker's clock, ms
    store: MessageStore  # called on the store thread only (through on_store_thread)
    # Called only through on_pulllog_thread or on_pulllog_quick, or on the event loop right
    # where the test on_pulllog_quick makes holds (``Holdings.ack_now``, the pulls' quick path).
    pulllog: PullLogStore
    on_store_thread: Runner
    on_pulllog_thread: Runner
    # A pull-log call that records in memory only (a pull, an ack): on the event loop when the
    # pull-log thread is idle and the pull log's next write does no I/O, else on the thread.
    on_pulllog_quick: Runner
    committed: Committed  # event loop
    book: ConsumerBook  # event loop
    tracer: BrokerTracer
    stats: dict[str, int]  # one writer per key: the store thread or the pull log's calls (Broker)
    redelivered_by_group: dict[tuple[str, str], int]  # the pull log's calls (see Broker)
    replica: WriteReplication  # event loop: min_insync checks, sync waits (docs/REPLICATION.md 7)
    # ``fn(*args)`` on the store thread, as a future a cancel does not cancel
    # (``IoThread.submit``): the group commit's call, published even if its task is cancelled.
    submit_to_store: Callable[..., "asyncio.Future[Any]"] | None = None
    # ``then(result, error)`` once ``fn(*args)`` ran on the store thread, with no future
    # (``IoThread.submit_then``): a ``commit_soon`` group commit's call.
    submit_then_to_store: Callable[..., None] | None = None

    async def actions_replicated(self) -> None:
        """After a write to the pull log that a client is told of (an ack, a nack, a leave):
        flush it and wait until the slaves a ``sync`` write waits for have it."""
        if self.replica.waits():
            end = await self.on_pulllog_thread(_flush_io, self.pulllog)
            await self.replica.wait_replicated("actions", end)

    async def actions_flushed(self) -> None:
        """Flush the pull log (what is buffered goes to the OS, where fetches read) and tell
        the data plane its end (a master handing over)."""
        if self.replica.replicating and not self.pulllog.follower:
            self.replica.advanced("actions", await self.on_pulllog_thread(_flush_io,
                                                                          self.pulllog))


def _flush_io(pulllog: PullLogStore) -> int:
    """Pull-log thread: write what is buffered to the OS; the end a copy may read. A full disk
    keeps the pull log's changes in memory only (``PullLogStore.unlogged``): what was logged
    before is all a slave can have, and a failover then redelivers, never loses."""
    try:
        pulllog.flush()
    except DiskFull:
        pass
    return pulllog.copy_bounds()[1]


__all__ = ["BrokerContext", "Runner"]
