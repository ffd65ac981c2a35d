"""``RunFence``: what a master's run shipped each fetcher, past the end it began with
(docs/REPLICATION.md 8.3). A fetch past both holds records of this epoch that the master
does not have: it wrote them and a slave copied them, and they were lost before their fsync
(a power loss, then a restart as master of the same epoch: the pull log's actions are copied
once written to the OS, and so is everything under ``--flush async``). At the same offsets
this run writes other records, in the same epoch, so the epoch history alone cannot tell the
two tails apart; ``ReplicaSource`` answers such a fetch ``diverging`` at the fence, and the
slave cuts there.

Event loop only (``ReplicaSource``'s).
"""

from __future__ import annotations


class RunFence:
    """Per log the end this run began with; per (fetcher, log) how far this run took it."""

    def __init__(self) -> None:
        self._fences: dict[str, int] = {}
        self._passed: dict[tuple[str, str], int] = {}
        self.fenced = 0  # fetches found past the fence (figures)

    def begin(self, ends: dict[str, int]) -> None:
        """A run as master begins with the logs ending at ``ends`` (sealed)."""
        self._fences = dict(ends)
        self._passed.clear()

    def end(self) -> None:
        """The run is over: nothing it shipped counts for the next one."""
        self._passed.clear()

    def mark(self, fetcher: str, log: str, end: int) -> None:
        """This run gave ``fetcher`` log ``log`` up to ``end``: records, a start there (a
        reset at the log start), or a checkpoint covering it."""
        key = (fetcher, log)
        if end > self._passed.get(key, -1):
            self._passed[key] = end

    def crossed(self, fetcher: str, log: str, offset: int) -> int | None:
        """The fence when a fetch at ``offset`` lies past it and past what this run took the
        fetcher to (it holds records this run never shipped); else None."""
        fence = self._fences.get(log)
        if fence is None or offset <= fence or offset <= self._passed.get((fetcher, log), -1):
            return None
        self.fenced += 1
        return fence


__all__ = ["RunFence"]
