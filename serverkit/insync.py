"""``InSyncTracker``: what a master knows of its slaves' copies, and whom a ``sync`` write waits
for (docs/REPLICATION.md 7 and 8.3). A pure state machine told the time: no clock, no I/O.

* A fetch at offset O of log L acknowledges [0, O) of L (Kafka's follower fetch). The slave is
  *caught up* on L at that moment when O reached the master's end of L as the fetch found it,
  and *was* caught up at the time of its previous fetch of L when O reached the end that fetch
  found (Kafka's lastCaughtUpTime): under a steady stream of writes a slave's fetch rarely
  finds the end still where it was, yet a slave that keeps having everything its previous
  fetch saw is not lagging.
* Only fetches from the group's registered slaves count (``members``, as the MetaServer's last
  answer named them): any holder of an admin token may fetch, but a server of another group,
  or a tool, must not make the master believe that a write is on a slave of this group.
* A slave is in sync when it has been caught up on every replicated log within the last
  ``insync_lag_max_ms``; the master proposes exactly these slaves in its heartbeats.
* A ``sync`` write waits for every slave the master proposes *and* every slave the database
  still counts as in sync: the database's set only shrinks after a heartbeat proposing the
  smaller set was answered, so it is always a subset of the slaves a write waited for, which is
  what makes promoting one of them safe. A slave the database counts that this master has not
  heard from yet (a new master after a promotion) gets ``insync_lag_max_ms`` from the moment
  this tracker started to show up before it is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SlaveProgress:
    """One slave as the master sees it through its fetches."""

    acked: dict[str, int] = field(default_factory=dict)  # log -> offset acknowledged
    caught_up_ms: dict[str, int] = field(default_factory=dict)  # log -> last time at the end
    last_fetch_ms: int = 0  # the newest fetch of any log
    # log -> (the master's end as the previous fetch found it, when that fetch came)
    previous: dict[str, tuple[int, int]] = field(default_factory=dict)


class InSyncTracker:
    """The slaves' progress, the in-sync proposal and the sync-write rule (module docstring).
    Told the time in ms (any monotonic clock: only differences are used)."""

    def __init__(self, logs: tuple[str, ...], insync_lag_max_ms: int, now_ms: int) -> None:
        assert logs and insync_lag_max_ms > 0, (logs, insync_lag_max_ms)
        self.logs = logs
        self.insync_lag_max_ms = insync_lag_max_ms
        self.started_ms = now_ms
        self.slaves: dict[str, SlaveProgress] = {}
        self.confirmed: tuple[str, ...] = ()  # the database's in-sync set, from the last answer
        self.members: frozenset[str] = frozenset()  # the group's registered slaves, ditto
        # The last (proposal, waiting set) judged, true until _judged_until_ms: every commit
        # and fetch asks, and the sets change only when a slave not in sync fetches, when a
        # slave in sync falls silent for insync_lag_max_ms, or with the members, the
        # database's set or a slave forgotten (each of which drops this).
        self._judged: tuple[tuple[str, ...], tuple[str, ...]] | None = None
        self._judged_until_ms = 0

    def on_fetch(self, slave: str, log: str, offset: int, log_end: int, now_ms: int) -> bool:
        """A fetch of ``log`` at ``offset`` from ``slave`` found the master's end at
        ``log_end``: the slave has [0, offset); it is caught up when offset >= log_end.
        False (and nothing is noted) when ``slave`` is not a registered slave of the group."""
        progress = self._progress_of_member(slave, log)
        if progress is None:
            return False
        if self._judged is not None and slave not in self._judged[0]:
            self._judged = None  # it may be in sync now; one in sync stays so, a fetch later
        if offset >= progress.acked.get(log, 0):
            progress.acked[log] = offset
        previous = progress.previous.get(log)
        if offset >= log_end:
            progress.caught_up_ms[log] = now_ms
        elif previous is not None and offset >= previous[0]:
            progress.caught_up_ms[log] = max(progress.caught_up_ms.get(log, 0), previous[1])
        progress.previous[log] = (log_end, now_ms)
        progress.last_fetch_ms = max(progress.last_fetch_ms, now_ms)
        return True

    def acknowledge(self, slave: str, log: str, offset: int) -> bool:
        """``slave`` has [0, ``offset``) of ``log`` (a fetch of it at ``offset`` that the master
        knows to continue what it shipped that slave): raise what it acknowledged, and nothing
        else (``on_fetch`` judges caught-up when the fetch is answered). True when that raised
        its acknowledged offset; False when ``slave`` is not a registered slave of the group."""
        progress = self._progress_of_member(slave, log)
        if progress is None or offset <= progress.acked.get(log, 0):
            return False
        progress.acked[log] = offset
        return True

    def _progress_of_member(self, slave: str, log: str) -> SlaveProgress | None:
        """``slave``'s progress (made on its first fetch); None when it is not a registered
        slave of the group, whose fetches are never counted."""
        assert log in self.logs, log
        if slave not in self.members:
            return None
        progress = self.slaves.get(slave)
        if progress is None:
            progress = self.slaves[slave] = SlaveProgress()
        return progress

    def set_members(self, members: tuple[str, ...]) -> None:
        """The group's registered slaves, as the last answer named them; the progress of any
        other server is forgotten."""
        self.members = frozenset(members)
        for slave in [s for s in self.slaves if s not in self.members]:
            del self.slaves[slave]
        self._judged = None

    def set_confirmed(self, insync: tuple[str, ...]) -> None:
        """The database's in-sync set, as the last heartbeat answer told it."""
        self.confirmed = tuple(insync)
        self._judged = None

    def _caught_up_ms(self, slave: str, log: str) -> int | None:
        progress = self.slaves.get(slave)
        seen = progress.caught_up_ms.get(log) if progress is not None else None
        if seen is None and slave in self.confirmed:
            return self.started_ms  # not heard from yet: the grace of a new master
        return seen

    def in_sync(self, slave: str, now_ms: int) -> bool:
        """Caught up on every log within ``insync_lag_max_ms`` of ``now_ms``."""
        for log in self.logs:
            seen = self._caught_up_ms(slave, log)
            if seen is None or now_ms - seen > self.insync_lag_max_ms:
                return False
        return True

    def proposal(self, now_ms: int) -> tuple[str, ...]:
        """The slaves in sync now, sorted: what the next heartbeat proposes."""
        return self._judge(now_ms)[0]

    def waiting_set(self, now_ms: int) -> tuple[str, ...]:
        """Whom a ``sync`` write must wait for: the proposal and the database's set."""
        if not self.slaves and not self.confirmed:
            # No slave fetched and none in the database's set (a group without slaves): every
            # write asks this, so skip building and sorting two empty sets.
            return ()
        return self._judge(now_ms)[1]

    def _judge(self, now_ms: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(proposal, waiting set) at ``now_ms``: the last judgement while it holds, else a
        new one, which holds until the first slave in sync would fall out of it (a slave not
        in sync never comes back by time alone: only by a fetch, which drops the judgement).
        ``now_ms`` must not go back (the tracker's clock is monotonic)."""
        if self._judged is not None and now_ms <= self._judged_until_ms:
            return self._judged
        candidates = set(self.slaves) | set(self.confirmed)
        proposal = tuple(sorted(s for s in candidates if self.in_sync(s, now_ms)))
        until_ms = min((self._caught_up_ms(slave, log) for slave in proposal  # type: ignore
                        for log in self.logs), default=now_ms) + self.insync_lag_max_ms
        self._judged = (proposal, tuple(sorted(set(proposal) | set(self.confirmed))))
        self._judged_until_ms = until_ms
        return self._judged

    def acked(self, slave: str, log: str) -> int:
        """The offset of ``log`` that ``slave`` acknowledged (0 when never heard from)."""
        progress = self.slaves.get(slave)
        return progress.acked.get(log, 0) if progress is not None else 0

    def replicated(self, log: str, now_ms: int) -> int | None:
        """The offset of ``log`` that every slave a write waits for has acknowledged; None when
        it waits for nobody (no slave in sync: degraded, or refused by ``min_insync``)."""
        # ``waiting_set`` and ``acked``, written out for the judgement that still holds:
        # every commit and fetch asks (three Python calls fewer each).
        judged = self._judged
        if judged is None or now_ms > self._judged_until_ms:
            waiting = self.waiting_set(now_ms)
        else:
            waiting = judged[1]
        if not waiting:
            return None
        if len(waiting) == 1:  # one sync slave: no generator
            progress = self.slaves.get(waiting[0])
            return progress.acked.get(log, 0) if progress is not None else 0
        return min(self.acked(slave, log) for slave in waiting)

    def caught_up_to(self, slave: str, ends: dict[str, int]) -> bool:
        """True when ``slave`` acknowledged every log up to the master's ``ends`` (a switchover
        target that has everything)."""
        return all(self.acked(slave, log) >= end for log, end in ends.items())

    def forget(self, slave: str) -> None:
        """Drop a slave's progress (it became the master, or another group's server)."""
        self.slaves.pop(slave, None)
        self._judged = None


__all__ = ["InSyncTracker", "SlaveProgress"]
