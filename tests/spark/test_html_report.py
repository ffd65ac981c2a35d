"""report.html opened in a real browser (headless Chromium): it renders offline with no console
error, its three charts are drawn, and a screenshot is kept as a test artifact.

The results are written by hand (``spark_audit.html_report`` needs no Spark); test_cli checks
that a real audit writes report.html beside report.md.
"""

from __future__ import annotations

import dataclasses
import json

from spark_audit import html_report
from spark_audit.report import AuditResults, summary_json
from tests.browser import artifact_path, open_page

T = 1_767_225_600_000


def results() -> AuditResults:
    def delivery(group, produced, lost, overdue):
        return {"subject": "orders", "group": group, "produced": produced,
                "delivered": produced - lost - overdue, "acked": produced - lost - overdue,
                "lost": lost, "overdue": overdue, "in_flight": 0, "duplicated": 1,
                "latency_p50_ms": 3, "latency_p99_ms": 40}

    def entry(dt, event, server="realtime:rt-1", group=None, consumer=None, reason=None):
        return {"ts_ms": T + dt, "event": event, "server": server, "group": group,
                "consumer": consumer, "retries": 0, "reason": reason}

    buckets = [(None, 0, 2), (0, 1, 10), (1, 2, 40), (2, 4, 120), (4, 8, 60), (8, 16, 9),
               (1024, 2048, 1)]
    return AuditResults(
        trace_dirs=("/data/rt-1/trace", "/data/delay-1/trace"), since_ms=None, until_ms=None,
        deadline_ms=300_000, events=1_234,
        delivery=[delivery("billing", 120, 1, 1), delivery("search#s1", 80, 0, 0)],
        delay=[{"subject": "orders", "scheduled": 30, "dispatched": 29, "cancelled": 1,
                "lateness_p50_ms": 2, "lateness_p99_ms": 9, "lateness_max_ms": 12, "early": 0}],
        retry_summary=[{"subject": "orders", "group": "billing", "messages": 120, "retried": 3,
                        "dead": 1, "succeeded_after_retries": 2, "max_retries": 2}],
        retries=[], anomaly_counts={"lost": 1, "overdue": 1, "duplicate": 2},
        anomaly_samples=[
            {"kind": "lost", "subject": "orders", "group": "billing", "msg_id": "o-17",
             "origin_id": "o-17", "reason": "dispatch_refused", "holder": "delay:d-1",
             "holder_consumer": None, "held_ms": None,
             "history": [entry(0, "produced", "delay:d-1"), entry(1, "scheduled", "delay:d-1"),
                         entry(900, "gave_up", "delay:d-1", reason="dispatch_refused")]},
            {"kind": "overdue", "subject": "orders", "group": "billing", "msg_id": "o-<42>",
             "origin_id": "o-<42>", "reason": "held", "holder": "realtime:rt-1",
             "holder_consumer": "c1", "held_ms": 400_000,
             "history": [entry(0, "produced"), entry(1, "stored"),
                         entry(5, "pulled", group="billing", consumer="c1")]}],
        latency_histogram=[{"lo_ms": lo, "hi_ms": hi, "count": n} for lo, hi, n in buckets],
        lateness_histogram=[{"lo_ms": lo, "hi_ms": hi, "count": n} for lo, hi, n in buckets[1:5]],
        gave_up=[{"subject": "orders", "group": None, "reason": "dispatch_refused",
                  "server": "delay:d-1", "messages": 1}],
        timeline=[{"start_ms": T + i * 10_000, "event": kind, "count": count}
                  for i in range(30) for kind, count in (("pulled", 40 + i % 7),
                                                         ("redelivered", i % 3),
                                                         ("retried", 1 if i % 10 == 0 else 0))
                  if count],
        timeline_bucket_ms=10_000, generated_at_ms=T + 400_000)


def test_the_html_report_renders_offline_with_its_charts_drawn_and_no_console_error(tmp_path):
    path = tmp_path / "report.html"
    path.write_text(html_report.render(results()), encoding="utf-8")
    requested = []
    with open_page() as (page, errors):
        page.on("request", lambda request: requested.append(request.url))
        page.goto(path.as_uri())
        page.wait_for_load_state("load")
        charts = page.eval_on_selector_all("figure.chart", """figures => figures.map(f => {
            const svg = f.querySelector('svg');
            const box = svg ? svg.getBoundingClientRect() : {width: 0, height: 0};
            return {id: f.id, width: box.width, height: box.height,
                    shapes: svg ? svg.querySelectorAll('path, rect, use').length : 0};
        })""")
        verdict = page.inner_text("#verdict")
        anomalies = page.eval_on_selector_all("details.anomaly", "ds => ds.map(d => d.dataset.kind)")
        page.click("details.anomaly[data-kind=overdue] summary")
        history = page.inner_text("details.anomaly[data-kind=overdue] ol")
        page.screenshot(path=str(artifact_path("audit-report.png")), full_page=True)
    assert errors == []
    assert requested == [path.as_uri()], "the page fetched something besides itself"
    assert [c["id"] for c in charts] == ["latency-chart", "lateness-chart", "timeline-chart"]
    for chart in charts:
        assert chart["width"] > 300 and chart["height"] > 100 and chart["shapes"] > 20, chart
    assert verdict == "FAIL: 1 lost, 1 overdue, 0 early"
    assert anomalies == ["lost", "overdue"]
    assert "pulled billing/c1" in history


def test_the_json_summary_gives_the_verdict_counts_and_what_the_options_allowed():
    # The same results as the page above (no Spark): 1 lost, 1 overdue, nothing early.
    failed = json.loads(summary_json(results(), 1))
    assert (failed["passed"], failed["exit_code"], failed["lost"], failed["overdue"],
            failed["early"], failed["allowed"]) == (False, 1, 1, 1, 0, [])
    assert failed["verdict"] == "FAIL: 1 lost, 1 overdue, 0 early"
    assert failed["anomalies"] == {"lost": 1, "overdue": 1, "early": 0, "duplicate": 2,
                                   "dead": 0}
    assert failed["gave_up"] == {"dispatch_refused": 1}
    assert [row["group"] for row in failed["delivery"]] == ["billing", "search#s1"]
    allowed = json.loads(summary_json(
        dataclasses.replace(results(), allow_lost=True, allow_overdue=True), 0))
    assert (allowed["passed"], allowed["allowed"]) == (True, ["lost", "overdue"])


def test_charts_drawn_beforehand_give_the_same_report_as_drawing_them_in_render():
    made = results()
    charts = html_report.draw_charts(made.latency_histogram, made.lateness_histogram,
                                     made.timeline, made.timeline_bucket_ms)
    assert charts.latency and charts.lateness and charts.timeline
    assert html_report.render(made, charts) == html_report.render(made)
