"""``BacklogSync``: a broker's backlog sent to the MetaServer as changes, not whole every time.

A realtime broker reports one row per (subject, group): ``{"subject", "group", "lag",
"consumers"}`` and, when not 0, ``"redelivered"``, ``"retried"`` and ``"dead"``. Sent whole with every heartbeat, that is 285 KB every few seconds at 3,000
groups, and past the MetaServer's ``BACKLOG_ENTRIES_MAX`` (10,000) rows the heartbeat is refused
and the broker expires. So the rows go as changes against what the MetaServer acknowledged, as
Kafka's incremental fetch sessions do:

- ``fields(rows)`` gives the backlog fields of the next heartbeat. With nothing acknowledged
  (the first heartbeat, or after a refusal or a re-registration) they are ``backlog``: a
  full list that replaces what the MetaServer holds. Afterwards they are ``backlog_base`` (the
  version the MetaServer last answered), ``backlog_changes`` (rows new or changed since) and
  ``backlog_removed`` (``[subject, group]`` pairs gone since). An idle broker sends an empty
  change list: its heartbeat no longer grows with its groups.
- At most ``BACKLOG_ROWS_PER_HEARTBEAT_MAX`` rows (changes and removals together) go in one
  heartbeat; the rest go in the next ones, so the first heartbeats of a broker with 30,000
  groups bring the MetaServer's view up to date in a few intervals, each well under the limit.
- ``acknowledged(version)``: the MetaServer took the heartbeat and answered ``backlog_version``;
  what was sent is what it holds now. A version of None (a MetaServer that had lost the base,
  or an older one that knows no versions) means: send the whole backlog again.
- ``reset()``: the MetaServer's copy is unknown (a refused or unanswered heartbeat, a
  re-registration): the next heartbeat sends the whole backlog again.

Rows of one (subject, group) are merged (a broadcast group has one pull-log key per consumer):
their counts (``COUNTS``: lag, consumers, and since the broker started the entries redelivered
and the nacked copies retried or dead) are summed. A count of 0 other than lag and consumers is
left out of the row sent, so a quiet group's row stays as short as before.

A stats object (a delay server's backlog is a dict) is passed through whole: it does not grow.

Not thread-safe: the event loop's registration task owns it.
"""

from __future__ import annotations

from typing import Any, Iterable

# Rows (changes and removals together) one heartbeat carries at most; well below the
# MetaServer's BACKLOG_ENTRIES_MAX (10,000; serverkit may not import metaserver, a test pairs
# the two), so a heartbeat stays small enough (~70 KB) to be answered within its timeout (twice
# the heartbeat interval) on a loaded MetaServer: 10,000 groups reach it in 10 heartbeats.
BACKLOG_ROWS_PER_HEARTBEAT_MAX = 1_000

# The counts of a backlog row, in a Row's order; all but lag are optional in a row (0 if absent).
COUNTS = ("lag", "consumers", "redelivered", "retried", "dead")
# Counts sent even when 0 (the MetaServer's BACKLOG_ENTRY requires lag).
_COUNTS_ALWAYS_SENT = ("lag", "consumers")

Key = tuple[str, str]  # (subject, group)
Row = tuple[int, ...]  # one int per name of COUNTS


def merge_rows(rows: Iterable[dict[str, Any]]) -> dict[Key, Row]:
    """Backlog rows by (subject, group), the counts (``COUNTS``) of one pair summed."""
    merged: dict[Key, Row] = {}
    zero = (0,) * len(COUNTS)
    for row in rows:
        key = (row["subject"], row["group"])
        held = merged.get(key, zero)
        merged[key] = tuple(total + row.get(name, 0) for total, name in zip(held, COUNTS))
    return merged


def _row(key: Key, value: Row) -> dict[str, Any]:
    row: dict[str, Any] = {"subject": key[0], "group": key[1]}
    row.update((name, count) for name, count in zip(COUNTS, value)
               if count or name in _COUNTS_ALWAYS_SENT)
    return row


class BacklogSync:
    """The backlog the MetaServer acknowledged, and what the next heartbeat must add to it.

    Owner: the event loop (the registration's heartbeats, sent one at a time).
    """

    def __init__(self, rows_max: int = BACKLOG_ROWS_PER_HEARTBEAT_MAX) -> None:
        if rows_max < 1:
            raise ValueError(f"rows_max {rows_max} must be at least 1")
        self.rows_max = rows_max
        self.version: int | None = None  # the MetaServer's version of what ``_acked`` holds
        self._acked: dict[Key, Row] = {}  # what the MetaServer holds (as far as we know)
        self._sent: dict[Key, Row | None] = {}  # the last heartbeat's rows (None: a removal)
        self._sent_full = False  # the last heartbeat replaced the MetaServer's backlog

    def reset(self) -> None:
        """The MetaServer's copy is unknown: the next heartbeat sends the whole backlog."""
        self.version = None
        self._acked = {}
        self._sent = {}
        self._sent_full = False

    def fields(self, backlog: list[dict[str, Any]] | dict[str, Any]) -> dict[str, Any]:
        """The backlog fields of the next heartbeat (see the module docstring)."""
        if isinstance(backlog, dict):
            self._sent, self._sent_full = {}, False
            return {"backlog": backlog}
        now = merge_rows(backlog)
        if self.version is None:
            keys = sorted(now)[: self.rows_max]
            self._sent = {key: now[key] for key in keys}
            self._sent_full = True
            return {"backlog": [_row(key, now[key]) for key in keys]}
        acked = self._acked
        changed = [key for key, value in now.items() if acked.get(key) != value]
        removed = [key for key in acked if key not in now]
        changed.sort()
        removed.sort()
        removed = removed[: self.rows_max]
        changed = changed[: self.rows_max - len(removed)]
        self._sent = {key: now[key] for key in changed}
        self._sent.update((key, None) for key in removed)
        self._sent_full = False
        return {"backlog_base": self.version,
                "backlog_changes": [_row(key, now[key]) for key in changed],
                "backlog_removed": [list(key) for key in removed]}

    def acknowledged(self, version: Any) -> None:
        """The heartbeat of the last ``fields`` was answered with ``backlog_version``
        ``version``: the MetaServer holds what it sent (None or not an int: send it whole)."""
        if type(version) is not int:
            self.reset()
            return
        if self._sent_full:
            self._acked = {}
        for key, value in self._sent.items():
            if value is None:
                self._acked.pop(key, None)
            else:
                self._acked[key] = value
        self._sent, self._sent_full = {}, False
        self.version = version

    @property
    def acked_rows(self) -> int:
        """Rows the MetaServer holds, as far as this broker knows."""
        return len(self._acked)


__all__ = ["BACKLOG_ROWS_PER_HEARTBEAT_MAX", "COUNTS", "BacklogSync", "merge_rows"]
