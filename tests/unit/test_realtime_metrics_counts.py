"""The realtime broker's per-request and per-commit figures are plain ints (on the event loop,
the fsync latency on the store thread), exported at scrape time with the names, labels and
buckets a prometheus_client metric had."""

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from realtime.metrics import PlainHistogram, RealtimeMetrics


def _samples(metrics: RealtimeMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics.registry).decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_requests_are_counted_by_op_in_plain_ints_and_scraped_as_a_counter():
    metrics = RealtimeMetrics("g")
    for op in ("send", "send", "pull", "no-such-op"):
        metrics.count_request(op)
    assert metrics.request_counts["send"] == 2
    samples = _samples(metrics)
    assert samples["qmq_realtime_requests_total", (("op", "send"),)] == 2
    assert samples["qmq_realtime_requests_total", (("op", "pull"),)] == 1
    assert samples["qmq_realtime_requests_total", (("op", "other"),)] == 1
    assert samples["qmq_realtime_requests_total", (("op", "ack"),)] == 0


def test_commit_sizes_fill_cumulative_buckets_as_a_prometheus_histogram_would():
    metrics = RealtimeMetrics("g")
    assert isinstance(metrics.commit_batch_messages, PlainHistogram)
    for messages in (1, 2, 3, 4096, 5000):
        metrics.commit_batch_messages.observe(messages)
    samples = _samples(metrics)
    bucket = "qmq_realtime_commit_batch_messages_bucket"
    assert samples[bucket, (("le", "1.0"),)] == 1
    assert samples[bucket, (("le", "2.0"),)] == 2  # a bound is inclusive (le)
    assert samples[bucket, (("le", "4.0"),)] == 3
    assert samples[bucket, (("le", "4096.0"),)] == 4
    assert samples[bucket, (("le", "+Inf"),)] == 5
    assert samples["qmq_realtime_commit_batch_messages_count", ()] == 5
    assert samples["qmq_realtime_commit_batch_messages_sum", ()] == 1 + 2 + 3 + 4096 + 5000


def test_fsync_seconds_are_a_plain_histogram_scraped_with_the_buckets_histogram_had():
    metrics = RealtimeMetrics("g")
    assert isinstance(metrics.fsync_seconds, PlainHistogram)  # no lock per commit
    for seconds in (0.0001, 0.0002, 0.003, 7.0):
        metrics.fsync_seconds.observe(seconds)
    samples = _samples(metrics)
    bucket = "qmq_realtime_fsync_seconds_bucket"
    assert samples[bucket, (("le", "0.0002"),)] == 2  # a bound is inclusive (le)
    assert samples[bucket, (("le", "0.002"),)] == 2
    assert samples[bucket, (("le", "0.005"),)] == 3
    assert samples[bucket, (("le", "2.5"),)] == 3
    assert samples[bucket, (("le", "+Inf"),)] == 4
    assert samples["qmq_realtime_fsync_seconds_count", ()] == 4
    assert abs(samples["qmq_realtime_fsync_seconds_sum", ()] - 7.0033) < 1e-9
