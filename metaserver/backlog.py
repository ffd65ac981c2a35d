"""A broker's backlog as the MetaServer keeps it: replaced whole, or changed by a heartbeat's
changes against a version (``serverkit.backlog.BacklogSync`` is the broker's side).

The backlog is kept in the broker row's ``stats`` JSON: ``{"backlog": [rows], "stats": ...,
"backlog_version": n}``. ``apply_heartbeat_backlog`` says what a heartbeat makes of it:

- ``backlog`` given (a list of rows, or a delay server's stats object): it replaces what is
  held, under a new version when it is a list;
- ``backlog_base`` given: the changes and removals apply when the base is the version held
  (a new version if anything changed; the stats are not rewritten when nothing did), and are
  refused with version None when it is not (the MetaServer lost it, or another heartbeat came
  between): the broker then sends the whole backlog again;
- neither: a heartbeat that only says the broker is alive; nothing held changes.

Pure: no database, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BacklogOutcome:
    """What a heartbeat makes of the broker's stats: the stats to store (None: keep them as
    they are) and the ``backlog_version`` to answer (None: send the whole backlog again, or no
    version because none was asked for)."""

    stats: dict[str, Any] | None
    version: int | None


def apply_heartbeat_backlog(held: dict[str, Any] | None, *, backlog: Any, base: int | None,
                            changes: list[dict[str, Any]], removed: list[list[str]],
                            stats: dict[str, Any] | None) -> BacklogOutcome:
    """The outcome of one heartbeat's backlog fields over ``held`` (the broker row's stats)."""
    held = held or {}
    held_version = held.get("backlog_version")
    next_version = (held_version if type(held_version) is int else 0) + 1
    if backlog is not None:
        if isinstance(backlog, list):
            return BacklogOutcome({"backlog": backlog, "stats": stats,
                                   "backlog_version": next_version}, next_version)
        return BacklogOutcome({"backlog": backlog, "stats": stats}, None)
    stats_changed = stats is not None and stats != held.get("stats")
    kept_stats = stats if stats is not None else held.get("stats")
    if base is None:
        return BacklogOutcome({**held, "stats": kept_stats} if stats_changed else None, None)
    rows = held.get("backlog")
    if base != held_version or not isinstance(rows, list):
        return BacklogOutcome({**held, "stats": kept_stats} if stats_changed else None, None)
    if not changes and not removed:
        return BacklogOutcome({**held, "stats": kept_stats} if stats_changed else None, base)
    by_key = {(row["subject"], row["group"]): row for row in rows}
    for subject, group in removed:
        by_key.pop((subject, group), None)
    for row in changes:
        by_key[(row["subject"], row["group"])] = row
    return BacklogOutcome({"backlog": list(by_key.values()), "stats": kept_stats,
                           "backlog_version": next_version}, next_version)


__all__ = ["BacklogOutcome", "apply_heartbeat_backlog"]
