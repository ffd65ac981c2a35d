"""What the console's pages show, computed from the registry's lists: pure functions, no I/O.

Each takes what ``Registry`` (or the dead-letter and schedule modules) returned and gives the
rows a template prints, so the figures are tested without a browser or a server.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tracelog.events import HOUR_MS
from wire.message import parse_internal_subject

# Rows per page of the long lists (subjects, groups): a page of 1,000 subjects stays fast to
# render and to read.
PAGE_ROWS = 100
# Hours the delay chart shows from the current hour, by default and at most.
CHART_HOURS_DEFAULT = 48
CHART_HOURS_MAX = 168


@dataclass
class Page:
    """One page of a long list."""

    rows: list[Any]
    number: int  # 1-based
    count: int  # pages in all (at least 1)
    total: int  # rows in all

    @property
    def first_row(self) -> int:
        """1-based index of the first row shown (0 when there is none)."""
        return 0 if not self.total else (self.number - 1) * PAGE_ROWS + 1


def paginate(rows: list[Any], number: int, per_page: int = PAGE_ROWS) -> Page:
    """Page ``number`` (clamped to the pages there are) of ``rows``."""
    count = max(1, math.ceil(len(rows) / per_page))
    number = min(max(1, number), count)
    start = (number - 1) * per_page
    return Page(rows[start:start + per_page], number, count, len(rows))


def _role(broker: dict[str, Any]) -> str:
    """The broker's replication role; a MetaServer without replication knows none."""
    return str(broker.get("role") or "-")


def _replication_lag(broker: dict[str, Any]) -> str:
    """How far a slave is behind its master, as the registry reports it."""
    lag_ms, lag_bytes = broker.get("lag_ms"), broker.get("lag_bytes")
    parts = []
    if lag_ms is not None:
        parts.append(f"{lag_ms:,} ms")
    if lag_bytes is not None:
        parts.append(f"{lag_bytes:,} B")
    return " / ".join(parts) or "-"


def _stopped_at(broker: dict[str, Any]) -> tuple[str | None, str]:
    """Where a slave's copy is stopped at a record it cannot decode (``LOG@OFFSET vVERSION``,
    as ``qmq admin brokers`` shows it; None: it is not) and why."""
    at = broker.get("undecodable_at")
    if not isinstance(at, dict):
        return None, ""
    return f"{at.get('log')}@{at.get('offset')} v{at.get('version')}", str(at.get("reason", ""))


def _delay_stats(broker: dict[str, Any]) -> dict[str, Any]:
    raw = broker.get("stats") or {}
    stats = raw.get("backlog") if isinstance(raw.get("backlog"), dict) else raw.get("stats")
    return stats if isinstance(stats, dict) else {}


def _backlog_total(broker: dict[str, Any]) -> tuple[int, int]:
    """(messages not acked, (subject, group) rows) of a realtime broker: the registry's
    ``backlog_total`` when it listed no rows, else summed from the rows."""
    raw = broker.get("stats") or {}
    total = raw.get("backlog_total")
    if isinstance(total, dict):
        return int(total.get("lag", 0)), int(total.get("pairs", 0))
    backlog = raw.get("backlog")
    rows = backlog if isinstance(backlog, list) else []
    return sum(entry.get("lag", 0) for entry in rows), len(rows)


@dataclass
class Overview:
    """The overview page: every broker and delay server, and totals."""

    realtime: list[dict[str, Any]] = field(default_factory=list)
    delay: list[dict[str, Any]] = field(default_factory=list)
    online: int = 0
    offline: int = 0
    backlog: int = 0  # messages not acked, over online realtime masters
    pending: int = 0  # delayed messages waiting, over online delay masters


def _counted(broker: dict[str, Any]) -> bool:
    """Whether the broker's backlog or pending count goes into the totals: online, and the
    master of its group (a slave holds a copy of the same messages; without replication
    every broker is its group's only one)."""
    return broker["state"] != "offline" and broker.get("role") in (None, "master")


def overview(brokers: list[dict[str, Any]]) -> Overview:
    """Rows for the overview from ``Registry.list_brokers()``: online brokers first."""
    out = Overview()
    for b in sorted(brokers, key=lambda b: (b["state"] == "offline", b["group"], b["address"])):
        online = b["state"] != "offline"
        out.online += online
        out.offline += not online
        row = {"group": b["group"], "address": b["address"], "state": b["state"],
               "role": _role(b), "epoch": b.get("epoch"), "in_sync": b.get("in_sync"),
               "heartbeat_age_ms": b["heartbeat_age_ms"], "lag": _replication_lag(b),
               "readonly": b.get("group_readonly", False), "online": online}
        row["stopped_at"], row["stopped_why"] = _stopped_at(b)
        if b["kind"] == "delay":
            stats = _delay_stats(b)
            row.update(pending=stats.get("pending_total"),
                       dispatch_rate=stats.get("dispatch_rate_per_s"),
                       lateness_p99=stats.get("lateness_ms_p99_le"))
            if _counted(b) and isinstance(row["pending"], int):
                out.pending += row["pending"]
            out.delay.append(row)
        else:
            backlog, pairs = _backlog_total(b)
            row.update(backlog=backlog, pairs=pairs)
            if _counted(b):
                out.backlog += backlog
            out.realtime.append(row)
    return out


def group_rows(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (subject, consumer group) from ``Registry.list_consumer_groups()``: a
    group's ``%retry%<subject>%<group>`` pair is folded into its row as the retry backlog."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    retry_lag: dict[tuple[str, str], int] = {}
    for g in groups:
        internal = parse_internal_subject(g["subject"]) if g["subject"].startswith("%") else None
        if internal is not None:
            if internal.kind == "retry":
                key = (internal.subject, internal.group)
                retry_lag[key] = retry_lag.get(key, 0) + g["lag"]
            continue
        rows[(g["subject"], g["group"])] = {
            "subject": g["subject"], "group": g["group"], "backlog": g["lag"],
            "online_clients": g["online_clients"], "broker_consumers": g["broker_consumers"],
            "brokers": g["brokers"], "redelivered": g.get("redelivered", 0),
            "retried": g.get("retried", 0), "dead": g.get("dead", 0), "retry_backlog": 0}
    for key, lag in retry_lag.items():
        row = rows.get(key)
        if row is not None:
            row["retry_backlog"] = lag
    return [rows[key] for key in sorted(rows)]


def subject_rows(subjects: list[dict[str, Any]],
                 groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per routed subject: its route and the totals of its consumer groups."""
    by_subject: dict[str, list[dict[str, Any]]] = {}
    for row in groups:
        by_subject.setdefault(row["subject"], []).append(row)
    out = []
    for s in subjects:
        mine = by_subject.get(s["subject"], [])
        out.append({"subject": s["subject"], "version": s["version"],
                    "routed": [g["group"] for g in s["groups"] if g["active"]],
                    "drained": [g["group"] for g in s["groups"] if not g["active"]],
                    "groups": len(mine), "backlog": sum(r["backlog"] for r in mine),
                    "online_clients": sum(r["online_clients"] for r in mine)})
    return out


def matching(rows: list[dict[str, Any]], text: str, *keys: str) -> list[dict[str, Any]]:
    """The rows whose ``keys`` contain ``text`` (case-insensitive); all rows for no text."""
    needle = text.strip().lower()
    if not needle:
        return rows
    return [r for r in rows if any(needle in str(r[k]).lower() for k in keys)]


@dataclass
class DelayHours:
    """Pending delayed messages per hour over the delay servers, for the chart."""

    hours: list[tuple[int, int]]  # (hour start ms, pending) from the current hour, every hour
    overdue: int  # pending in hours before the current one (being dispatched, or late)
    later: int  # pending after the last hour shown
    total: int


def delay_hours(delay: list[dict[str, Any]], now_ms: int,
                hours: int = CHART_HOURS_DEFAULT) -> DelayHours:
    """Sum ``pending_per_hour`` of every delay server of ``dead_letters.delay_stats`` and cut it
    into the ``hours`` hours from the current one (empty hours included, as zeros)."""
    merged: dict[int, int] = {}
    for server in delay:
        for hour, count in (server["stats"].get("pending_per_hour") or {}).items():
            start = int(hour)
            merged[start] = merged.get(start, 0) + int(count)
    first = now_ms - now_ms % HOUR_MS
    end = first + hours * HOUR_MS
    shown = [(start, merged.get(start, 0)) for start in range(first, end, HOUR_MS)]
    overdue = sum(c for start, c in merged.items() if start < first)
    later = sum(c for start, c in merged.items() if start >= end)
    return DelayHours(shown, overdue, later, sum(merged.values()))


def delay_subjects(delay: list[dict[str, Any]], limit: int = 20) -> list[tuple[str, int]]:
    """The subjects with the most pending delayed messages, summed over delay servers."""
    merged: dict[str, int] = {}
    for server in delay:
        for subject, count in (server["stats"].get("pending_per_subject") or {}).items():
            merged[subject] = merged.get(subject, 0) + int(count)
    return sorted(merged.items(), key=lambda item: (-item[1], item[0]))[:limit]


def dead_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Dead letters per (subject, group): how many, and the oldest and newest creation time."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:
        key = (r["subject"], r["group"])
        item = out.setdefault(key, {"subject": r["subject"], "group": r["group"], "count": 0,
                                    "first_ms": r["created_at_ms"],
                                    "last_ms": r["created_at_ms"]})
        item["count"] += 1
        item["first_ms"] = min(item["first_ms"], r["created_at_ms"])
        item["last_ms"] = max(item["last_ms"], r["created_at_ms"])
    return [out[key] for key in sorted(out)]
