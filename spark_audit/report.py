"""report.md: the audit's results as Markdown tables and ASCII bar charts (no Spark here).

Markdown rather than HTML: it reads the same in a terminal, a CI log, a code review and a browser
(GitHub renders it), diffs well between two runs, and needs no viewer. The charts are text bars
on a power-of-two millisecond scale inside fenced blocks, so they survive any renderer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

Row = Mapping[str, Any]
BAR_WIDTH_CHARS = 40

DELIVERY_COLUMNS = ("subject", "group", "produced", "delivered", "acked", "lost", "in_flight",
                    "duplicated", "latency_p50_ms", "latency_p99_ms")
DELAY_COLUMNS = ("subject", "scheduled", "dispatched", "cancelled", "lateness_p50_ms",
                 "lateness_p99_ms", "lateness_max_ms", "early")
RETRY_SUMMARY_COLUMNS = ("subject", "group", "messages", "retried", "dead",
                         "succeeded_after_retries", "max_retries")
RETRY_COLUMNS = ("subject", "group", "retries", "messages", "acked", "dead")


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
    generated_at_ms: int = 0
    notes: Sequence[str] = field(default_factory=tuple)

    @property
    def lost(self) -> int:
        return sum(row["lost"] for row in self.delivery)

    @property
    def early(self) -> int:
        return sum(row["early"] for row in self.delay)

    @property
    def passed(self) -> bool:
        """The gate: no lost message and no early delivery."""
        return self.lost == 0 and self.early == 0


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


def _history(entries: Sequence[Row] | None) -> str:
    if not entries:
        return "-"
    return "; ".join(
        f"{iso_ms(e['ts_ms'])[11:]} {e['event']}"
        + (f" {e['group']}" if e["group"] else "")
        + (f"/{e['consumer']}" if e["consumer"] else "")
        + (f" r{e['retries']}" if e["retries"] else "")
        + f" @{e['server']}"
        for e in entries)


def summary(results: AuditResults) -> str:
    """The verdict and the delivery and delay tables (what ``qmq audit`` prints)."""
    if results.passed:
        verdict = "PASS: no lost message, no early delivery"
    else:
        verdict = f"FAIL: {results.lost:,} lost, {results.early:,} early"
    parts = [f"{verdict} ({results.events:,} events)", "",
             "Delivery per (subject, group):", table(DELIVERY_COLUMNS, results.delivery), "",
             "Delay per subject:", table(DELAY_COLUMNS, results.delay)]
    return "\n".join(parts)


def render(results: AuditResults) -> str:
    """The whole report.md."""
    counts = results.anomaly_counts
    lines = [
        "# qmq audit report",
        "",
        f"- Verdict: **{'PASS' if results.passed else 'FAIL'}** "
        f"({results.lost:,} lost, {results.early:,} early)",
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
        "`produced` counts the messages the group was expected to receive; `in_flight` ones are "
        "not due yet at the end of the trace. Latency: first pull minus deliverable time "
        "(percentile_approx).",
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
        "## Anomalies",
        "",
        table(("kind", "rows"), [{"kind": k, "rows": counts.get(k, 0)}
                                 for k in ("lost", "duplicate", "early", "dead")]),
        "",
    ]
    if results.anomaly_samples:
        shown = len(results.anomaly_samples)
        lines += [f"First {shown} of {sum(counts.values()):,} (all in `anomalies/`, Parquet):",
                  "",
                  table(("kind", "subject", "group", "msg_id", "history"), [
                      {**row, "history": _history(row["history"])}
                      for row in results.anomaly_samples]),
                  ""]
    return "\n".join(lines)
