"""The seam between a server's write path and replication: ``WriteReplication``, what the write
path asks (``serverkit.replica_source.ReplicaSource`` implements it on a master), and
``NoWriteReplication``, a server nobody copies. Event loop only, but ``wrote_io`` (the log's
owner thread)."""

from __future__ import annotations

import asyncio
from typing import Callable, Protocol


class WriteReplication(Protocol):
    """What a server's write path asks of replication (``ReplicaSource`` implements it)."""

    replicating: bool  # False: nothing to tell or wait for (skip computing log ends)

    def check_writable(self) -> None:
        """Raise NotEnoughReplicas when writes are refused (``min_insync``)."""

    def waits(self) -> bool:
        """True when a write now would wait for a slave (``sync`` with a slave in sync): a
        write path may skip work (a flush of the pull log) that only a wait needs."""

    def advanced(self, name: str, end: int) -> None:
        """Log ``name`` was committed (or flushed) up to ``end``."""

    def wrote_io(self, name: str) -> None:
        """Owner thread of log ``name``, right after a commit: keep its bytes for the slaves
        tailing the log, whose fetches then ship them from memory."""

    def replicated_now(self, name: str, end: int) -> bool:
        """True when a write of ``name`` up to ``end`` waits for no slave now (then
        ``wait_replicated`` would return at once; a caller may skip it)."""

    async def wait_replicated(self, name: str, end: int) -> None:
        """Return once the slaves a ``sync`` write waits for have ``name`` up to ``end``."""

    def park_replicated(self, name: str, end: int,
                        done: Callable[[BaseException | None], None]) -> None:
        """``wait_replicated`` with no coroutine or task, right after ``replicated_now(name,
        end)`` said False: later, ``done(None)`` once the slaves have it, or ``done(error)``
        (NotMaster) when the write is refused meanwhile."""

    def kind_refusal(self, name: str, kind: int) -> str | None:
        """None when a record of gated ``kind`` may be written to log ``name`` now (every
        slave counted reads it); else why not. Ask right before the write, never cache it."""


class NoWriteReplication:
    """A server nobody copies (no MetaServer): nothing to check, tell or wait for."""

    replicating = False

    def check_writable(self) -> None:
        """Writes are never refused for want of slaves."""

    def waits(self) -> bool:
        """Nobody to wait for."""
        return False

    def advanced(self, name: str, end: int) -> None:
        """Nobody is told."""

    def wrote_io(self, name: str) -> None:
        """Nobody tails."""

    def replicated_now(self, name: str, end: int) -> bool:
        """Nobody to wait for."""
        return True

    async def wait_replicated(self, name: str, end: int) -> None:
        """Nothing to wait for."""

    def park_replicated(self, name: str, end: int,
                        done: Callable[[BaseException | None], None]) -> None:
        """Nothing to wait for: ``done(None)`` in the next loop turn."""
        asyncio.get_running_loop().call_soon(done, None)

    def kind_refusal(self, name: str, kind: int) -> str | None:
        """Nobody copies the log: every kind may be written."""
        return None
