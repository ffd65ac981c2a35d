"""report.html: the audit's results as one self-contained page with real charts (no Spark here).

The charts are drawn with matplotlib on the driver and inlined as SVG: the file fetches
nothing (no script, no font, no stylesheet from anywhere), opens offline, prints, and needs no
JavaScript at all. Text in the SVGs is drawn as paths (``svg.fonttype = path``), so it looks
the same without the fonts of the machine that made it. Why matplotlib and not a JavaScript
charting library: the data is already on the driver in Python, the charts are static, and a
library built into the page would have to be shipped in our wheel and kept up to date; matplotlib
is the standard, well-kept plotting library of the Python world, needed only by the ``audit``
extra (beside PySpark).

The page holds the verdict, the per-group and per-subject tables, the first-pull latency and
dispatch lateness histograms, a timeline of deliveries, redeliveries and retries, the retry and
give-up tables, and the anomalies with their histories.
"""

from __future__ import annotations

import html
import io
from dataclasses import dataclass
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from typing import Any

from spark_audit.report import (ANOMALY_KINDS, DELAY_COLUMNS, DELIVERY_COLUMNS, GAVE_UP_COLUMNS,
                                RETRY_SUMMARY_COLUMNS, AuditResults, Row, duration_label,
                                history_entry, iso_ms, why)

CHART_WIDTH_IN, CHART_HEIGHT_IN = 8.0, 3.2
# Series of the timeline: event kind -> (label, colour).
TIMELINE_SERIES = {"pulled": ("deliveries (pulls)", "#2b6cb0"),
                   "redelivered": ("redeliveries", "#dd6b20"),
                   "retried": ("retries", "#c53030")}
STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto;
       max-width: 1100px; color: #1a202c; padding: 0 1em; }
h1 { font-size: 1.6em; } h2 { margin-top: 2em; border-bottom: 1px solid #cbd5e0; }
table { border-collapse: collapse; margin: .5em 0 1em; font-size: 13px; }
th, td { border: 1px solid #cbd5e0; padding: 3px 8px; text-align: left; vertical-align: top; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
tr.bad td { background: #fff5f5; }
.verdict { font-size: 1.3em; padding: .6em 1em; border-radius: 6px; display: inline-block; }
.pass { background: #c6f6d5; color: #22543d; } .fail { background: #fed7d7; color: #742a2a; }
figure { margin: 1em 0; } figcaption { color: #4a5568; font-size: 13px; }
figure svg { max-width: 100%; height: auto; }
details summary { cursor: pointer; } ol.history { margin: .3em 0; font-size: 12px; }
.meta { color: #4a5568; }
"""


def _escape(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return html.escape(str(value))


def table(columns: Sequence[str], rows: Iterable[Row], bad: Sequence[str] = ()) -> str:
    """An HTML table; numbers right-aligned, rows with a non-zero ``bad`` column highlighted."""
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = []
    for row in rows:
        flagged = any(row.get(c) for c in bad)
        cells = "".join(
            f'<td class="n">{_escape(row[c])}</td>' if isinstance(row[c], int)
            else f"<td>{_escape(row[c])}</td>" for c in columns)
        body.append(f'<tr{" class=bad" if flagged else ""}>{cells}</tr>')
    if not body:
        body.append(f'<tr><td colspan="{len(columns)}">(none)</td></tr>')
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def warm_up() -> None:
    """Import what drawing needs (about a second of CPU): ``main.run`` calls it on a thread
    while the JVM starts, when the driver's Python only waits."""
    import matplotlib.backends.backend_svg  # noqa: F401  (savefig(format="svg"))
    import matplotlib.dates  # noqa: F401
    import matplotlib.figure  # noqa: F401


def _figure() -> Any:
    from matplotlib.figure import Figure  # the OO API: no pyplot, no global state

    figure = Figure(figsize=(CHART_WIDTH_IN, CHART_HEIGHT_IN), layout="constrained")
    return figure, figure.subplots()


def _svg(figure: Any) -> str:
    import matplotlib

    buffer = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "path", "svg.hashsalt": "qmq-audit"}):
        figure.savefig(buffer, format="svg", metadata={"Date": None})
    text = buffer.getvalue()
    return text[text.index("<svg"):]  # drop the XML prolog and doctype: inline SVG


def _bucket_label(row: Row) -> str:
    if row["lo_ms"] is None:
        return "< 0 (early)"
    if row["lo_ms"] == 0:
        return "0"
    return f"\u2265 {duration_label(row['lo_ms'])}"  # [lo, 2 lo): "from lo"


def histogram_svg(rows: Sequence[Row], title: str, colour: str) -> str | None:
    """A bar chart of power-of-two buckets (lo_ms, hi_ms, count); None when there are none."""
    if not rows:
        return None
    ordered = sorted(rows, key=lambda r: -1 if r["lo_ms"] is None else r["lo_ms"])
    figure, axes = _figure()
    positions = range(len(ordered))
    axes.bar(positions, [r["count"] for r in ordered], color=colour, width=0.85)
    axes.set_xticks(list(positions), [_bucket_label(r) for r in ordered], rotation=45,
                    ha="right", fontsize=8)
    axes.set_ylabel("messages")
    axes.set_xlabel("power-of-two buckets, by their start")
    axes.set_title(title, fontsize=11)
    axes.grid(axis="y", alpha=0.3)
    return _svg(figure)


def timeline_svg(rows: Sequence[Row], bucket_ms: int) -> str | None:
    """Deliveries, redeliveries and retries per bucket over time; None when there are none."""
    if not rows:
        return None
    from matplotlib.dates import AutoDateLocator, ConciseDateFormatter

    starts = sorted({r["start_ms"] for r in rows})
    counts = {(r["start_ms"], r["event"]): r["count"] for r in rows}
    times = [datetime.fromtimestamp(ms / 1000, tz=timezone.utc) for ms in starts]
    figure, axes = _figure()
    for kind, (label, colour) in TIMELINE_SERIES.items():
        values = [counts.get((start, kind), 0) for start in starts]
        if any(values):
            axes.step(times, values, where="post", label=label, color=colour)
    locator = AutoDateLocator()
    axes.xaxis.set_major_locator(locator)
    axes.xaxis.set_major_formatter(ConciseDateFormatter(locator, tz=timezone.utc))
    axes.set_ylabel(f"events per {duration_label(bucket_ms)}")
    axes.set_xlabel("time (UTC)")
    axes.set_title("Deliveries, redeliveries and retries over time", fontsize=11)
    axes.grid(alpha=0.3)
    axes.legend(loc="upper right", fontsize=8)
    return _svg(figure)


@dataclass(frozen=True)
class Charts:
    """The report's charts as SVG (None: no values to draw), from ``draw_charts``."""

    latency: str | None
    lateness: str | None
    timeline: str | None


def draw_charts(latency_histogram: Sequence[Row], lateness_histogram: Sequence[Row],
                timeline: Sequence[Row], timeline_bucket_ms: int) -> Charts:
    """Draw the report's charts (most of ``render``'s time); ``spark_audit.main`` draws them on
    a thread while the anomalies are collected."""
    return Charts(
        latency=histogram_svg(latency_histogram, "First-pull latency, all groups", "#2b6cb0"),
        lateness=histogram_svg(lateness_histogram, "Dispatch lateness, all subjects", "#805ad5"),
        timeline=timeline_svg(timeline, timeline_bucket_ms))


def _chart(chart_id: str, svg: str | None, caption: str) -> str:
    body = svg if svg is not None else "<p>(no values)</p>"
    return (f'<figure id="{chart_id}" class="chart" data-drawn="{str(svg is not None).lower()}">'
            f"{body}<figcaption>{html.escape(caption)}</figcaption></figure>")


def _anomalies(results: AuditResults) -> str:
    counts = results.anomaly_counts
    parts = [table(("kind", "rows"), [{"kind": k, "rows": counts.get(k, 0)}
                                      for k in ANOMALY_KINDS], bad=())]
    if results.anomaly_samples:
        parts.append(f"<p>{len(results.anomaly_samples):,} of {sum(counts.values()):,}, the "
                     "first of each kind (all of them are in <code>anomalies/</code>, "
                     "Parquet).</p>")
    for row in results.anomaly_samples:
        events = "".join(f"<li>{html.escape(history_entry(e))}</li>"
                         for e in row.get("history") or ())
        group = f" group <b>{html.escape(row['group'])}</b>" if row.get("group") else ""
        parts.append(
            f'<details class="anomaly" data-kind="{html.escape(row["kind"])}"><summary>'
            f'<b>{html.escape(row["kind"])}</b> {html.escape(row["msg_id"])} '
            f"({html.escape(row['subject'])}{group}): {html.escape(why(row))}</summary>"
            f'<ol class="history">{events}</ol></details>')
    return "\n".join(parts)


def _verdict(results: AuditResults) -> str:
    css = "pass" if results.passed else "fail"
    return f'<p id="verdict" class="verdict {css}">{html.escape(results.verdict())}</p>'


def render(results: AuditResults, charts: Charts | None = None) -> str:
    """The whole report.html (one self-contained file), with ``charts`` if they are drawn
    already (``draw_charts`` of the same results), else drawing them."""
    if charts is None:
        charts = draw_charts(results.latency_histogram, results.lateness_histogram,
                             results.timeline, results.timeline_bucket_ms)
    window = f"{iso_ms(results.since_ms)} to {iso_ms(results.until_ms)}"
    sections = [
        "<h1>qmq audit report</h1>",
        _verdict(results),
        '<ul class="meta">'
        f"<li>Trace: {html.escape(', '.join(results.trace_dirs))}</li>"
        f"<li>Window: {html.escape(window)} (events with since &lt;= ts_ms &lt; until)</li>"
        f"<li>Events read: {results.events:,}</li>"
        f"<li>Deadline: {html.escape(duration_label(results.deadline_ms))} after a message (or "
        "its latest retry copy) became deliverable</li>"
        f"<li>Generated: {html.escape(iso_ms(results.generated_at_ms))}</li>"
        + "".join(f"<li>Note: {html.escape(n)}</li>" for n in results.notes) + "</ul>",
        "<h2>Delivery per (subject, group)</h2>",
        "<p><code>produced</code>: messages the group was expected to receive (its "
        "subscriptions select them). <code>lost</code>: a server gave up on them. "
        "<code>overdue</code>: held past their deadline, or settled late. "
        "<code>in_flight</code>: not due yet at the end of the trace.</p>",
        table(DELIVERY_COLUMNS, results.delivery, bad=("lost", "overdue")),
        _chart("latency-chart", charts.latency,
               "First pull minus deliverable time, per power-of-two bucket."),
        "<h2>Delay per subject</h2>",
        table(DELAY_COLUMNS, results.delay, bad=("early",)),
        _chart("lateness-chart", charts.lateness,
               "Dispatch time minus deliver time, per power-of-two bucket."),
        "<h2>Timeline</h2>",
        _chart("timeline-chart", charts.timeline,
               f"Events per {duration_label(results.timeline_bucket_ms)} bucket."),
        "<h2>Retries</h2>",
        table(RETRY_SUMMARY_COLUMNS, results.retry_summary),
        "<h2>Give-ups</h2>",
        table(GAVE_UP_COLUMNS, results.gave_up, bad=("messages",)),
        "<h2>Anomalies</h2>",
        _anomalies(results),
    ]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<title>qmq audit report</title>"
            f"<style>{STYLE}</style></head><body>\n" + "\n".join(sections)
            + "\n</body></html>\n")
