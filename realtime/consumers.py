"""``ConsumerBook``: the realtime broker's book of its consumers, a pure state machine told the
time. It never reads a clock, never waits and does no I/O; the broker calls it on the event
loop and hands the pull-log thread only frozen copies of what it needs (``OfflineView``).

What it keeps, per (subject, pull-log group) (a broadcast consumer's pull-log group is
``group#consumer``, see ``group_key``):

- **presence**: each consumer's last pull, ack or heartbeat, in ms on the broker's clock. A
  consumer silent for ``consumer_expiry_ms`` is offline: the broker releases what it holds to
  the group's other consumers. A consumer the book has not seen since the broker started counts
  as seen at the start (it gets a full expiry from then to come back).
- **parked polls**: a consumer with a long poll parked here is present however long the poll
  waits (``park``/``unpark``): an idle consumer need send nothing while it waits, and its
  polls may be long (issue 19: what an idle consumer costs is its polls per second).
- **leaves**: consumers that closed (op ``leave``). A long poll notes ``leaves`` (the count so
  far) when it starts; ``left_since`` then says whether its consumer left after that, so a poll that began
  before the leave ends empty instead of taking entries for a consumer that is gone. Leaves are
  forgotten once no pull can be that old (``MAX_PULL_WAIT_MS``).
- **known cursors**: a group's cursor after its last pull, kept while its redelivery queue is
  known to be empty, so the next pull can take from the in-memory tail in one trip to the
  pull-log thread, or answer at once when the group is caught up. Any release (ack timeout,
  expiry, leave) counts a release round and drops the known cursors of the groups it touched;
  a pull that saw a round pass while it ran does not trust the cursor it got.

Every time is passed in: ``now_ms`` on the broker's clock for presence, ``monotonic_ms`` (a
clock that never goes back; the broker passes the event loop's) for leaves.
"""

from __future__ import annotations

from typing import Iterable

from wire.limits import MAX_PULL_WAIT_MS

Group = tuple[str, str]  # (subject, pull-log group)
ConsumerKey = tuple[str, str, str]  # (subject, pull-log group, consumer id)


def group_key(group: str, consumer_id: str, broadcast: bool) -> str:
    """The pull-log group a consumer reads: broadcast consumers each get their own cursor.

    ``#`` cannot occur in a group name, so ``group#consumer`` never collides with a real group.
    """
    return f"{group}#{consumer_id}" if broadcast else group


class OfflineView:
    """Which consumers are offline at one moment: a copy of the book's last-seen times, made on
    the event loop and then only read (by the pull-log thread's expiry round)."""

    def __init__(self, last_seen: dict[Group, dict[str, int]], started_ms: int,
                 seen_before_ms: int) -> None:
        self._last_seen = last_seen  # a copy nobody else holds
        self._started_ms = started_ms
        self._seen_before_ms = seen_before_ms  # seen last before this: offline

    def last_seen_ms(self, subject: str, key: str, consumer_id: str) -> int:
        """When the consumer was last seen (the broker's start if not since)."""
        return self._last_seen.get((subject, key), {}).get(consumer_id, self._started_ms)

    def offline(self, subject: str, key: str, consumer_id: str) -> bool:
        """Silent for longer than the consumer expiry."""
        return self.last_seen_ms(subject, key, consumer_id) < self._seen_before_ms


class ConsumerBook:
    """Presence, leaves and known cursors of a broker's consumers (see the module docstring).

    Owner: the event loop, for every field. Nothing here is shared with another thread: the
    pull-log thread gets ``OfflineView`` copies, and its answers come back to the loop.
    """

    def __init__(self, started_ms: int, consumer_expiry_ms: int) -> None:
        assert consumer_expiry_ms > 0, consumer_expiry_ms
        self._started_ms = started_ms
        self._consumer_expiry_ms = consumer_expiry_ms
        # (subject, pull-log group) -> consumer id -> last pull, ack or heartbeat, in ms
        self._last_seen: dict[Group, dict[str, int]] = {}
        # Leaves recorded so far: a pull notes this number as it begins (its mark, read as an
        # attribute: no call per pull), and while it is unchanged nobody left since.
        self.leaves = 0
        # consumer -> (the number of its last leave, monotonic ms of it)
        self._left: dict[ConsumerKey, tuple[int, float]] = {}
        # (subject, pull-log group) -> its known cursor (``remember_cursor``): read directly by
        # the direct pull (``Pulls._pull_once_now``), as ``leaves``: no call per pull.
        self.known_cursors: dict[Group, int] = {}
        # consumer -> its long polls parked now (present while any is)
        self._parked: dict[ConsumerKey, int] = {}
        # Releases that put entries back in some redelivery queue: a pull notes this number
        # before it asks the pull log (read as an attribute by the direct pull: no call).
        self.release_rounds = 0

    def restart(self, started_ms: int) -> None:
        """A copy became the master at ``started_ms``: nobody has been seen yet, so every
        consumer gets a full expiry from now to come back (as after a restart)."""
        self.__init__(started_ms, self._consumer_expiry_ms)  # type: ignore[misc]

    # ------------------------------------------------------------------ presence

    def seen(self, subject: str, key: str, consumer_id: str, now_ms: int) -> None:
        """The consumer pulled, acked or sent a heartbeat at ``now_ms``."""
        self._last_seen.setdefault((subject, key), {})[consumer_id] = now_ms

    def keys_for(self, subject: str, group: str, consumer_id: str) -> list[str]:
        """The pull-log groups an ack, nack or heartbeat of ``group`` may mean: the group, and
        the consumer's own broadcast group if it has pulled as a broadcast consumer."""
        broadcast_key = group_key(group, consumer_id, True)
        if (subject, broadcast_key) in self._last_seen:
            return [group, broadcast_key]
        return [group]

    def last_seen(self) -> dict[Group, dict[str, int]]:
        """(subject, pull-log group) -> consumer id -> last seen, in ms: the book's own dict,
        for a reader on the event loop that does not keep it (the tracer's subscriptions)."""
        return self._last_seen

    def consumer_counts(self) -> dict[Group, int]:
        """Consumers the book knows per (subject, pull-log group) (``qmq admin groups``)."""
        return {group: len(seen) for group, seen in self._last_seen.items()}

    def park(self, consumer: ConsumerKey, seen_ms: int | None = None) -> None:
        """A long poll of ``consumer`` parks: it is present until the poll ends. ``seen_ms``:
        also ``seen`` then, in the same call (a pull that parks at once)."""
        self._parked[consumer] = self._parked.get(consumer, 0) + 1
        if seen_ms is not None:
            subject, key, consumer_id = consumer
            self._last_seen.setdefault((subject, key), {})[consumer_id] = seen_ms

    def unpark(self, consumer: ConsumerKey, now_ms: int) -> bool:
        """A parked long poll of ``consumer`` ended at ``now_ms``: seen then (unless it left
        or was forgotten meanwhile: a poll's end does not bring it back). True when it was
        marked seen (a woken poll then need not call ``seen`` for the same ``now_ms``)."""
        count = self._parked.get(consumer, 0) - 1
        if count > 0:
            self._parked[consumer] = count
        else:
            self._parked.pop(consumer, None)
        subject, key, consumer_id = consumer
        seen = self._last_seen.get((subject, key))
        if seen is not None and consumer_id in seen:
            seen[consumer_id] = now_ms
            return True
        return False

    def forget(self, consumers: Iterable[ConsumerKey]) -> None:
        """The consumers left: they are no longer counted as present."""
        for subject, key, consumer_id in consumers:
            seen = self._last_seen.get((subject, key))
            if seen is not None:
                seen.pop(consumer_id, None)

    def offline_view(self, now_ms: int) -> OfflineView:
        """Who is offline at ``now_ms``, as a copy the pull-log thread may read."""
        copy = {group: dict(seen) for group, seen in self._last_seen.items()}
        for subject, key, consumer_id in self._parked:  # waiting here: present now
            copy.setdefault((subject, key), {})[consumer_id] = now_ms
        return OfflineView(copy, self._started_ms, now_ms - self._consumer_expiry_ms)

    def forget_offline(self, removed: Iterable[tuple[str, str, str, int]]) -> None:
        """Consumers the expiry round removed as offline, each with the last-seen time it
        judged by: forgotten, unless seen again since (a pull that came meanwhile)."""
        for subject, key, consumer_id, last_seen_ms in removed:
            seen = self._last_seen.get((subject, key))
            if seen is not None and seen.get(consumer_id, self._started_ms) <= last_seen_ms:
                seen.pop(consumer_id, None)

    # ------------------------------------------------------------------ leaves

    def left(self, consumers: Iterable[ConsumerKey], monotonic_ms: float) -> None:
        """The consumers closed at ``monotonic_ms``; leaves no pull can predate are dropped."""
        old_ms = monotonic_ms - MAX_PULL_WAIT_MS
        left = self._left
        for consumer in [c for c, (_, at_ms) in left.items() if at_ms < old_ms]:
            del left[consumer]  # no pull that began before it can still be waiting
        self.leaves += 1
        for consumer in consumers:
            left[consumer] = (self.leaves, monotonic_ms)

    def left_since(self, consumer: ConsumerKey, mark: int) -> bool:
        """Whether the consumer left after the pull that noted ``mark`` (``leaves``) began
        (never while ``leaves`` is still ``mark``: a caller may look at that first)."""
        entry = self._left.get(consumer)
        return entry is not None and entry[0] > mark

    # ------------------------------------------------------------------ known cursors

    def caught_up(self, group: Group, end: int) -> bool:
        """The group's known cursor is at ``end`` (the committed end): nothing to pull and
        nothing to redeliver, so the pull log need not be asked."""
        return self.known_cursors.get(group, -1) >= end

    def take_cursor(self, group: Group) -> tuple[int | None, int]:
        """The group's known cursor, which the pull about to run will move (None: unknown),
        and the count of release rounds so far, for ``remember_cursor`` (one call where the
        pull asked two: issue 18)."""
        return self.known_cursors.pop(group, None), self.release_rounds

    def release_round(self) -> int:
        """The count of release rounds so far: a pull notes it before it asks the pull log."""
        return self.release_rounds

    def remember_cursor(self, group: Group, cursor: int, release_round: int) -> None:
        """After a pull that drained the group's redelivery queue: its cursor is known, unless
        a release round passed since ``release_round`` (entries may be back in the queue)."""
        if release_round == self.release_rounds:
            self.known_cursors[group] = cursor

    def released(self, groups: Iterable[Group]) -> None:
        """Entries went back to these groups' redelivery queues: their next pulls must ask the
        pull log."""
        groups = list(groups)
        if groups:
            self.release_rounds += 1
        for group in groups:
            self.known_cursors.pop(group, None)


__all__ = ["ConsumerBook", "ConsumerKey", "Group", "OfflineView", "group_key"]
