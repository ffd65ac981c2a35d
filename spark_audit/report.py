"""report.md: the audit's results as Markdown tables and ASCII bar charts (no Spark here).

Markdown reads the same in a terminal, a CI log, a code review and a browser (GitHub renders
it), diffs well between two runs, and needs no viewer. The charts are text bars on a
power-of-two millisecond scale inside fenced blocks, so they survive any renderer. report.html
(``spark_audit.html_report``) shows the same results with real charts.
"""

from __future__ import annotations

import json

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

Row = Mapping[str, Any]
BAR_WIDTH_CHARS = 40

DELIVERY_COLUMNS = ("subject", "group", "produced", "delivered", "acked", "lost", "overdue",
                    "in_flight", "duplicated", "latency_p50_ms", "latency_p99_ms")
DELAY_COLUMNS = ("subject", "scheduled", "dispatched", "cancelled", "lateness_p50_ms",
                 "lateness_p99_ms", "lateness_max_ms", "early")
RETRY_SUMMARY_COLUMNS = ("subject", "group", "messages", "retried", "dead",
                         "succeeded_after_retries", "max_retries")
RETRY_COLUMNS = ("subject", "group", "retries", "messages", "acked", "dead")
GAVE_UP_COLUMNS = ("subject", "group", "reason", "server", "messages")
ANOMALY_KINDS = ("lost", "overdue", "early", "duplicate", "dead")


@dataclass(frozen=True)
class AuditResults:
    """Everything the report shows, collected on the driver (all small)."""

    trace_dirs: Sequence[str]
    since_ms: int | None
    until_ms: int | None
    deadline_ms: int
    events: int
    delivery: Sequence[Row]
    delay: Sequence[Row]
    retry_summary: Sequence[Row]
    retries: Sequence[Row]
    anomaly_counts: Mapping[str, int]  # kind -> rows
    anomaly_samples: Sequence[Row]  # the first few anomaly rows, history included
    latency_histogram: Sequence[Row]  # lo_ms, hi_ms, count (all subjects and groups)
    lateness_histogram: Sequence[Row]
    gave_up: Sequence[Row] = ()  # subject, group, reason, server, messages
    timeline: Sequence[Row] = ()  # start_ms, event, count
    timeline_bucket_ms: int = 60_000
    allow_lost: bool = False  # lost messages do not fail the gate
    allow_overdue: bool = False  # overdue messages do not fail the gate
    generated_at_ms: int = 0
    notes: Sequence[str] = field(default_factory=tuple)

    @property
    def lost(self) -> int:
        """Messages lost, all groups."""
        return sum(row["lost"] for row in self.delivery)

    @property
    def overdue(self) -> int:
        """Messages overdue (held past their deadline, or settled late), all groups."""
        return sum(row.get("overdue", 0) for row in self.delivery)

    @property
    def early(self) -> int:
        """Messages dispatched or pulled before their deliver time."""
        return sum(row["early"] for row in self.delay)

    @property
    def passed(self) -> bool:
        """The gate: nothing early, and nothing lost or overdue unless allowed."""
        return (self.early == 0 and (self.allow_lost or self.lost == 0)
                and (self.allow_overdue or self.overdue == 0))

    def verdict(self) -> str:
        """One line: PASS or FAIL and the counts (``qmq audit``'s first line of output)."""
        counts = f"{self.lost:,} lost, {self.overdue:,} overdue, {self.early:,} early"
        allowed = [kind for kind, allow in (("lost", self.allow_lost),
                                            ("overdue", self.allow_overdue)) if allow]
        note = f"; allowed: {', '.join(allowed)}" if allowed else ""
        return f"{'PASS' if self.passed else 'FAIL'}: {counts}{note}"


def iso_ms(ms: int | None) -> str:
    """``2026-01-01T00:00:00.000Z`` for epoch ms; "-" for None."""
    if ms is None:
        return "-"
    moment = datetime.fromtimestamp(ms / 1000, tz=timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{ms % 1000:03d}Z"


def duration_label(ms: int) -> str:
    """A compact duration: 750 ms, 1.5 s, 2 min, 3 h."""
    if abs(ms) < 1_000:
        return f"{ms} ms"
    if abs(ms) < 60_000:
        return f"{ms / 1000:g} s"
    if abs(ms) < 3_600_000:
        return f"{ms / 60_000:.3g} min"
    return f"{ms / 3_600_000:.3g} h"


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value).replace("|", "\\|")


def table(columns: Sequence[str], rows: Iterable[Row]) -> str:
    """A Markdown table; None shows as "-", integers with thousands separators."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def bars(histogram: Sequence[Row]) -> str:
    """Text bars for (lo_ms, hi_ms, count) rows, in bucket order, with counts and shares."""
    if not histogram:
        return "(no values)"
    ordered = sorted(histogram, key=lambda r: -1 if r["lo_ms"] is None else r["lo_ms"])
    total = sum(r["count"] for r in ordered)
    peak = max(r["count"] for r in ordered)
    labels = []
    for r in ordered:
        if r["lo_ms"] is None:
            labels.append("< 0 ms (early)")
        elif r["lo_ms"] == 0:
            labels.append("0 ms")
        else:
            labels.append(f"{duration_label(r['lo_ms'])} - <{duration_label(r['hi_ms'])}")
    width = max(len(label) for label in labels)
    lines = []
    for label, r in zip(labels, ordered):
        bar = "#" * max(1, round(BAR_WIDTH_CHARS * r["count"] / peak))
        lines.append(f"{label:>{width}} | {bar:<{BAR_WIDTH_CHARS}} {r['count']:>12,} "
                     f"{100 * r['count'] / total:5.1f}%")
    return "\n".join(lines)


def history_entry(e: Row) -> str:
    """One event of a history: ``00:00:00.010Z pulled billing/c1 r1 (reason) @realtime:rt-1``."""
    return (f"{iso_ms(e['ts_ms'])[11:]} {e['event']}"
            + (f" {e['group']}" if e["group"] else "")
            + (f"/{e['consumer']}" if e["consumer"] else "")
            + (f" r{e['retries']}" if e["retries"] else "")
            + (f" ({e['reason']})" if e.get("reason") else "")
            + f" @{e['server']}")


def _history(entries: Sequence[Row] | None) -> str:
    if not entries:
        return "-"
    return "; ".join(map(history_entry, entries))


def why(row: Row) -> str:
    """What an anomaly row says beyond its kind: the reason, the holder, how long held."""
    parts = []
    if row.get("reason"):
        parts.append(row["reason"])
    if row.get("holder"):
        consumer = f" (last handed to {row['holder_consumer']})" if row.get(
            "holder_consumer") else ""
        parts.append(f"at {row['holder']}{consumer}")
    if row.get("held_ms") is not None:
        parts.append(f"for {duration_label(row['held_ms'])}")
    return " ".join(parts) or "-"


def summary(results: AuditResults) -> str:
    """The verdict and the delivery and delay tables (what ``qmq audit`` prints)."""
    parts = [f"{results.verdict()} ({results.events:,} events)", "",
             "Delivery per (subject, group):", table(DELIVERY_COLUMNS, results.delivery), "",
             "Delay per subject:", table(DELAY_COLUMNS, results.delay)]
    return "\n".join(parts)


def summary_json(results: AuditResults, exit_code: int) -> str:
    """The verdict and the counts as one JSON document (``qmq audit --json``): ``passed``,
    ``verdict`` (the text line), ``exit_code``, ``lost``/``overdue``/``early`` (the gate's
    counts), ``allowed`` (the kinds ``--allow-*`` let pass), ``events``, ``anomalies`` (rows
    per kind), ``gave_up`` (give-ups per reason), and the ``delivery`` and ``delay`` rows."""
    gave_up: dict[str, int] = {}
    for row in results.gave_up:
        gave_up[row["reason"]] = gave_up.get(row["reason"], 0) + row["messages"]
    document = {
        "passed": results.passed, "verdict": results.verdict(), "exit_code": exit_code,
        "lost": results.lost, "overdue": results.overdue, "early": results.early,
        "allowed": [kind for kind, allow in (("lost", results.allow_lost),
                                             ("overdue", results.allow_overdue)) if allow],
        "events": results.events, "deadline_ms": results.deadline_ms,
        "since_ms": results.since_ms, "until_ms": results.until_ms,
        "anomalies": {kind: results.anomaly_counts.get(kind, 0) for kind in ANOMALY_KINDS},
        "gave_up": gave_up,
        "delivery": [dict(row) for row in results.delivery],
        "delay": [dict(row) for row in results.delay],
        "notes": list(results.notes),
    }
    return json.dumps(document, sort_keys=False, default=str)


def render(results: AuditResults) -> str:
    """The whole report.md."""
    counts = results.anomaly_counts
    lines = [
        "# qmq audit report",
        "",
        f"- Verdict: **{'PASS' if results.passed else 'FAIL'}** "
        f"({results.verdict().split(': ', 1)[1]})",
        f"- Trace: {', '.join(f'`{d}`' for d in results.trace_dirs)}",
        f"- Window: {iso_ms(results.since_ms)} to {iso_ms(results.until_ms)} "
        f"(events with since <= ts_ms < until)",
        f"- Events read: {results.events:,}",
        f"- Deadline: {duration_label(results.deadline_ms)} after a message (or its latest retry "
        "copy) became deliverable",
        f"- Generated: {iso_ms(results.generated_at_ms)}",
        *[f"- Note: {note}" for note in results.notes],
        "",
        "## Delivery per (subject, group)",
        "",
        "`produced` counts the messages the group was expected to receive (its subscriptions "
        "select them); `lost` ones a server gave up on; `overdue` ones were still held past "
        "their deadline or settled late; `in_flight` ones are not due yet at the end of the "
        "trace. Latency: first pull minus deliverable time (percentile_approx).",
        "",
        table(DELIVERY_COLUMNS, results.delivery),
        "",
        "### First-pull latency, all groups",
        "",
        "```text",
        bars(results.latency_histogram),
        "```",
        "",
        "## Delay per subject",
        "",
        "Lateness: dispatch time minus deliver time (percentile_approx). `early` must be 0.",
        "",
        table(DELAY_COLUMNS, results.delay),
        "",
        "### Dispatch lateness, all subjects",
        "",
        "```text",
        bars(results.lateness_histogram),
        "```",
        "",
        "## Retries",
        "",
        table(RETRY_SUMMARY_COLUMNS, results.retry_summary),
        "",
        "Messages per number of retries reached:",
        "",
        table(RETRY_COLUMNS, results.retries),
        "",
        "## Give-ups",
        "",
        "Every `gave_up` event: a server dropped, skipped or gave up on a message "
        "(docs/AUDIT.md lists the reasons).",
        "",
        table(GAVE_UP_COLUMNS, results.gave_up) if results.gave_up else "(none)",
        "",
        "## Anomalies",
        "",
        table(("kind", "rows"), [{"kind": k, "rows": counts.get(k, 0)} for k in ANOMALY_KINDS]),
        "",
    ]
    if results.anomaly_samples:
        shown = len(results.anomaly_samples)
        lines += [f"{shown} of {sum(counts.values()):,}, the first of each kind (all in "
                  "`anomalies/`, Parquet):",
                  "",
                  table(("kind", "subject", "group", "msg_id", "why", "history"), [
                      {**row, "why": why(row), "history": _history(row["history"])}
                      for row in results.anomaly_samples]),
                  ""]
    return "\n".join(lines)
