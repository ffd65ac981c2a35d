"""The record-kind gate of replication (docs/REPLICATION.md 8.2, "Record kinds a slave reads").

A log's *gated* kinds are record kinds newer than the replication protocol's ``reads`` field
(the realtime message log's held records, the delay done journal's handed and dropped
records, and any kind added later): a server older than a kind cannot read it. Each slave says
in every fetch which gated kinds of that log it reads (``reads``; absent: none, a slave older
than the field). The master then

* serves a slave no record of a gated kind it did not say it reads: a fetch answer ends before
  the first such record, and a fetch AT one is answered ``unreadable_record`` with nothing, so
  the slave's copy stays whole and readable (``first_unread``);
* writes a gated kind only while every slave it counts reads it (``KindReads.refusal``).

Who counts (``KindReads.counted``): the slaves the MetaServer's last answer lists for the group
(``slaves``, registered whether up or down), the database's in-sync set, and every server that
fetched the log within ``RECENT_FETCH_MS``. A slave that fetched this term counts with what it
last said. A listed slave this master has not heard from this term reads nothing for
``UNHEARD_GRACE_MS`` after it was first listed (a slave that is up fetches within that, so an
older one is heard saying nothing before any gated record is written); past that it is taken to
be down and does not count. It must not: a crashed slave stays registered, and after a master
restart or a failover it kept every gated kind unwritten (holds refused, cancels of held
messages refused) for its whole outage (review rvdelay-2). Nothing is lost by not counting it:
if it comes back older, the fetch rule stops its copy, whole, before the first record it cannot
read, until it is upgraded (as for a slave the MetaServer forgot, expired or deregistered).

Pure state told the time; no I/O. Event loop only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterable, NoReturn

from logstore.record import HEADER_SIZE_BYTES

# A server that fetched a log within this long counts for the gate of that log's kinds even
# when the MetaServer does not list it (a new slave before the master's next answer names it,
# one the MetaServer expired while it restarts), in ms.
RECENT_FETCH_MS = 600_000

# A listed slave not heard from this term counts (as reading nothing) for this long after it
# was first listed, in ms; then it is taken to be down. A slave that is up fetches from a new
# master well within it: it learns the term from its next MetaServer heartbeat (750 ms with
# the MetaServer's defaults), retries with its backoff (at most 2 s), and a fetch left waiting
# on a dead master ends within FETCH_WAIT_MS + REQUEST_TIMEOUT_MS (10.5 s, serverkit/follower.py).
UNHEARD_GRACE_MS = 15_000

# Past this many (server, log) entries, those not heard from within RECENT_FETCH_MS are
# forgotten (fetchers that come and go: tools, replaced slaves); a listed slave's is learnt again
# from its next fetch.
ANNOUNCED_MAX = 256

# (a record's body, where it starts in the chunk) -> its gated kind, or None (not gated).
KindOf = Callable[[bytes, int], "int | None"]


@dataclass(frozen=True)
class RecordKinds:
    """One log's gated record kinds, as this server's code knows them: ``reads`` (the kinds it
    reads, and the only gated kinds it may write) and ``kind_of`` (the gated kind of a record
    body at a position of a chunk of whole records, or None)."""

    reads: frozenset[int]
    kind_of: KindOf


def first_unread(data: bytes, reads: frozenset[int], kind_of: KindOf) -> tuple[int, int] | None:
    """The position in ``data`` (whole logstore records, as stored) of the first record whose
    gated kind is not in ``reads``, and that kind; None when there is none. Reads the 4-byte
    length of each header and the kind bytes only (the CRC is the slave's to check)."""
    position, end = 0, len(data)
    while position + HEADER_SIZE_BYTES <= end:
        body_at = position + HEADER_SIZE_BYTES
        kind = kind_of(data, body_at)
        if kind is not None and kind not in reads:
            return position, kind
        position = body_at + int.from_bytes(data[position:position + 4], "big")
    return None


@dataclass
class _Announced:
    """What one server last said it reads of one log, and when (ms)."""

    reads: frozenset[int]
    at_ms: int


class KindReads:
    """Per (server, log): the gated kinds its last fetch said it reads. A master's view; it
    starts empty when a server becomes master (what a slave reads is learnt again from its
    fetches: it may have been upgraded or downgraded meanwhile)."""

    def __init__(self, kinds: dict[str, RecordKinds]) -> None:
        self.kinds = kinds  # log -> its gated kinds, as this server knows them
        self._announced: dict[tuple[str, str], _Announced] = {}
        # Listed slaves not heard from this term -> when the gate first saw them listed (ms).
        self._unheard_since: dict[str, int] = {}
        # Fetches answered short of, or refused at, a record the slave does not read
        # (qmq_replication_unreadable_fetches_total), and the last one per (server, log).
        self.unreadable_fetches = 0
        self.stopped_at: dict[tuple[str, str], tuple[int, int]] = {}  # -> (offset, kind)

    def clear(self) -> None:
        """A new term as master: nothing is known of any slave."""
        self._announced.clear()
        self._unheard_since.clear()
        self.stopped_at.clear()

    def listed(self, servers: Iterable[str], now_ms: int) -> None:
        """The MetaServer's answer lists ``servers`` (slaves, in-sync set): the grace of those
        not listed in the previous answer starts now (``UNHEARD_GRACE_MS``); one no longer
        listed is forgotten, so a slave registered again later gets a whole grace."""
        since = self._unheard_since
        if since.keys() != set(servers):
            self._unheard_since = {server: since.get(server, now_ms) for server in servers}

    def announced(self, server: str, log: str, reads: frozenset[int], now_ms: int) -> None:
        """``server`` fetched ``log`` saying it reads ``reads`` (every fetch: no allocation
        when nothing changed)."""
        found = self._announced.get((server, log))
        if found is not None and found.reads == reads:
            found.at_ms = now_ms
            return
        self._announced[(server, log)] = _Announced(reads, now_ms)
        if len(self._announced) > ANNOUNCED_MAX:
            for key in [k for k, v in self._announced.items()
                        if now_ms - v.at_ms > RECENT_FETCH_MS]:
                del self._announced[key]

    def reads(self, server: str, log: str) -> frozenset[int] | None:
        """The kinds ``server`` last said it reads of ``log``; None when it never fetched it."""
        found = self._announced.get((server, log))
        return None if found is None else found.reads

    def counted(self, log: str, listed: Iterable[str], now_ms: int) -> list[str]:
        """The servers the gate of ``log`` asks: ``listed`` (the MetaServer's slaves and the
        database's in-sync set) and every server that fetched ``log`` recently, sorted."""
        servers = set(listed)
        servers.update(server for (server, name), found in self._announced.items()
                       if name == log and now_ms - found.at_ms <= RECENT_FETCH_MS)
        return sorted(servers)

    def refusal(self, log: str, kind: int, listed: Iterable[str], now_ms: int) -> str | None:
        """None when every counted slave reads ``kind`` of ``log``; else why not. A slave
        not heard from this term counts only within ``UNHEARD_GRACE_MS`` of being listed."""
        missing = []
        for server in self.counted(log, listed, now_ms):
            reads = self.reads(server, log)
            if reads is None:
                since = self._unheard_since.setdefault(server, now_ms)
                if now_ms - since >= UNHEARD_GRACE_MS:
                    continue  # taken to be down: the fetch rule stops it if it returns older
            if kind not in (reads or ()):
                missing.append(server)
        if not missing:
            return None
        return (f"slave(s) {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} "
                f"did not say they read record kind {kind} of the {log} log (an older server, "
                f"or not heard from since this master started, for less than "
                f"{UNHEARD_GRACE_MS} ms): kind {kind} is not written until every slave of the "
                f"group reads it")

    def stopped(self, server: str, log: str, offset: int, kind: int) -> bool:
        """A fetch of ``server`` was served short of (or refused at) ``offset``, a record of
        ``kind`` it does not read; True the first time for that place (log it then)."""
        self.unreadable_fetches += 1
        place = (offset, kind)
        if self.stopped_at.get((server, log)) == place:
            return False
        self.stopped_at[(server, log)] = place
        return True

    def view(self, listed: Iterable[str], now_ms: int) -> dict[str, dict[str, object]]:
        """For the admin view and metrics: per counted server, per log with gated kinds, what
        it reads (None: never fetched since this server became master) and where a fetch of it
        last stopped at a record it does not read."""
        out: dict[str, dict[str, object]] = {}
        listed = tuple(listed)
        for log in self.kinds:
            for server in self.counted(log, listed, now_ms):
                reads = self.reads(server, log)
                entry = out.setdefault(server, {})
                entry[log] = {"reads": None if reads is None else sorted(reads),
                              "stopped_at": self.stopped_at.get((server, log))}
        return out


class KindRefusals:
    """A server's refusals to write a gated kind (a realtime broker's ``hold`` and
    ``cancel_held``, a delay server's handed-entries and dropped records): each is counted
    (``count``, a metric) and raised, and logged at warning once per new reason (``why``: the
    last one; ``allowed`` forgets it once a gated write passes, so a reason that comes back is
    logged again). Event loop only."""

    def __init__(self, logger: logging.Logger) -> None:
        self.count = 0
        self.why: str | None = None
        self._log = logger

    def allowed(self) -> None:
        """A gated write passed the gate: the next refusal is logged whatever its reason."""
        self.why = None

    def refuse(self, why: str, error: type[Exception], message: str) -> NoReturn:
        """Count the refusal, log ``message`` if ``why`` is new, raise ``error(message)``."""
        self.count += 1
        if why != self.why:
            self._log.warning("%s", message)
            self.why = why
        raise error(message)


__all__ = ["ANNOUNCED_MAX", "KindOf", "KindReads", "KindRefusals", "RECENT_FETCH_MS",
           "RecordKinds", "UNHEARD_GRACE_MS", "first_unread"]
