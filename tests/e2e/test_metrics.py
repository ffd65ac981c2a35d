"""``qmq up`` prints where each of its servers serves /metrics, and each answers Prometheus."""

from __future__ import annotations

import re
import urllib.request

import pytest

from tests.harness import run_qmq
from tests.metricsclient import SCRAPE_TIMEOUT_S, Scrape

_METRICS_LINE = re.compile(r"(http://127\.0\.0\.1:\d+/metrics)\s+\((metaserver|realtime|delay)\)")


def scrape_now(url: str) -> Scrape:
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as response:
        assert response.status == 200
        return Scrape(response.read().decode("utf-8"))


@pytest.mark.timeout(120)
def test_qmq_up_prints_three_metrics_addresses_that_count_a_message_sent(cluster):
    up = cluster.start_up()
    urls = {m.group(2): m.group(1) for m in map(_METRICS_LINE.search, list(up.output)) if m}
    assert set(urls) == {"metaserver", "realtime", "delay"}, up.text()
    assert urls["metaserver"] == f"{up.meta_url}/metrics"
    assert len(set(urls.values())) == 3

    sent = run_qmq("send", "demo.metrics", "hello", "--meta", up.meta_url)
    assert sent.returncode == 0, sent.stderr
    realtime = scrape_now(urls["realtime"])
    assert realtime["qmq_realtime_messages_sent_total", {"subject": "demo.metrics"}] == 1
    assert realtime["qmq_realtime_info", {"group": "realtime-1"}] == 1
    delay = scrape_now(urls["delay"])
    assert delay["qmq_delay_info", {"group": "delay-1"}] == 1
    meta = scrape_now(urls["metaserver"])
    assert meta["qmq_meta_brokers", {"kind": "realtime", "state": "rw"}] == 1
    assert meta["qmq_meta_brokers", {"kind": "delay", "state": "rw"}] == 1
    assert up.terminate() == 0
