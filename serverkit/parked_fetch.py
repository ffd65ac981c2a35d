"""``ParkedFetch``: a slave's fetch waiting at the end of a master's log, parked with no task
until the log advances or its ``wait_ms`` passes (docs/REPLICATION.md 8.3). It is the fetch's
``serverkit.frame_server.Later``: ``ReplicaSource.fetch`` returns it, and the master answers it
directly from ``ReplicaSource.advanced`` (the commit's hand-back), as a parked pull is answered
(``realtime.parked_pull``): no task woken, no ``asyncio.Event``, no timer of its own.
``ParkedFetches`` keeps them per log, with one timer for every deadline (issue 18: a waiting
fetch cost ~11 ``call_soon`` and ~8 loop turns per message with one sync slave).

Event loop only."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Callable, Iterable

from serverkit.frame_server import Later
from wire.replication import Fetch

if TYPE_CHECKING:
    from serverkit.replica_log import ReplicatedLog


class ParkedFetch(Later):
    """One fetch parked at a log's end: the request, its log, and when its wait ends (in the
    source's clock, ms). Answered once (``Later.answer``) by ``ReplicaSource._resume``."""

    __slots__ = ("request", "log", "deadline_ms")

    def __init__(self, request: Fetch, log_: ReplicatedLog, deadline_ms: int) -> None:
        # The Later's own fields, unbound and not answered (as ``Later.__init__`` sets them),
        # set here: no second __init__ call per fetch.
        self._server = self._connection = self._request = self._outcome = None
        self._given_once = False
        self.request = request
        self.log = log_
        self.deadline_ms = deadline_ms


class ParkedFetches:
    """The parked fetches of each log (``by_log``, read by ``ReplicaSource.advanced``), and one
    loop timer set for the earliest deadline: a fetch woken by a commit leaves the timer as it
    is (it fires, finds nothing due, and is set again for the next deadline, if any).
    ``resume`` is called once for each fetch woken or past its deadline."""

    def __init__(self, names: Iterable[str], clock_ms: Callable[[], int],
                 resume: Callable[[ParkedFetch], None]) -> None:
        self.by_log: dict[str, list[ParkedFetch]] = {name: [] for name in names}
        self._clock_ms = clock_ms
        self._resume = resume
        self._timer: asyncio.TimerHandle | None = None
        self._timer_ms = 0  # the deadline the timer is set for

    def park(self, parked: ParkedFetch, now_ms: int) -> None:
        """Keep ``parked`` until its log advances or its deadline passes."""
        self.by_log[parked.log.name].append(parked)
        if self._timer is None or parked.deadline_ms < self._timer_ms:
            self._arm(parked.deadline_ms, now_ms)

    def wake(self, name: str) -> None:
        """Log ``name`` advanced: every fetch parked on it is resumed now."""
        parked = self.by_log[name]
        if parked:
            self.by_log[name] = []
            for item in parked:
                self._resume(item)

    def wake_all(self) -> None:
        """Every parked fetch is resumed now (the master started, or stopped)."""
        for name in list(self.by_log):
            self.wake(name)

    def _arm(self, due_ms: int, now_ms: int) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_ms = due_ms
        self._timer = asyncio.get_running_loop().call_later(
            max(0, due_ms - now_ms) / 1000, self._due)

    def _due(self) -> None:
        """The timer: resume every fetch past its deadline; set it again for the next one."""
        self._timer = None
        now_ms = self._clock_ms()
        for name, parked in list(self.by_log.items()):
            if parked and any(item.deadline_ms <= now_ms for item in parked):
                self.by_log[name] = [item for item in parked if item.deadline_ms > now_ms]
                for item in parked:
                    if item.deadline_ms <= now_ms:
                        self._resume(item)
        waiting = [item.deadline_ms for parked in self.by_log.values() for item in parked]
        if waiting and self._timer is None:
            self._arm(min(waiting), now_ms)


__all__ = ["ParkedFetch", "ParkedFetches"]
