"""Prometheus metrics of one realtime broker (docs/OPERATIONS.md lists every one).

Cheap on the hot path by construction: the broker already keeps plain counters (``stats``,
``sent_by_subject``, ``message_errors``, the nack handler's ``stats``), and a collector turns them
into counter families at scrape time, so a message costs no metric call at all. What the event
loop counts per request (requests by op) or per group commit (messages per commit) goes into
plain ints too (``request_counts``, ``PlainHistogram``), turned into families at scrape time: a
prometheus_client child takes a lock and checks its state on every call, ~3-5 us a request at
2,000 msg/s on this 2-core machine (issue 18 item 2). The fsync latency, observed on the store
thread once per group commit, is a ``PlainHistogram`` too (its one writer is that thread; the
scrape reads it on the event loop). Backlog per (subject, group) is a gauge computed at scrape
time from the pull log, on its I/O thread.

Every broker has its own ``CollectorRegistry``, so brokers in one process never share figures.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import TYPE_CHECKING, Iterator

from prometheus_client import CollectorRegistry, Gauge, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString
from prometheus_client.registry import Collector

from serverkit.request_counts import RequestCounts
from wire.errors import WIRE_ERRORS
from wire.protocol import OPS

if TYPE_CHECKING:
    from realtime.broker import Broker
    from realtime.nacks import NackHandler

# Subjects with their own label on the per-subject send counters, in the order the broker first
# stored them; later subjects are summed under OTHER_SUBJECTS so a client inventing subjects
# cannot blow up the scrape. Counters stay monotonic: a subject never changes label.
SUBJECT_LABELS_MAX = 200
OTHER_SUBJECTS = "%other"

# fsync latency buckets, in seconds (Prometheus' base unit): SSDs answer in under a ms, a busy
# disk or a cloud volume in tens of ms.
FSYNC_BUCKETS_S = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5)
# Messages per group commit: 1 at low load, hundreds when many producers share one fsync.
COMMIT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)

# Every op a realtime broker can be asked (anything else is counted as "other").
REQUEST_OPS = ("hello", "send", "pull", "ack", "nack", "heartbeat", "leave", "cancel", "subjects",
               "browse", "purge", "hold", "cancel_held", "other")


class RealtimeMetrics(RequestCounts):
    """The registry of one broker and the few metrics its server updates directly."""

    def __init__(self, group: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # process_* (CPU seconds, resident memory, open descriptors) and python_info.
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self._broker: Broker | None = None  # set by watch()
        # Requests answered, by op; written on the event loop only (``count_request``, or the
        # server's handler straight into the dict: every op a parsed request can have is a
        # key, so counting one is an increment, no call). Ops not in REQUEST_OPS are scraped
        # as "other".
        self.request_counts: dict[str, int] = dict.fromkeys((*REQUEST_OPS, *OPS), 0)
        # Messages per group commit; observed on the event loop only (the broker's on_commit).
        self.commit_batch_messages = PlainHistogram(
            "qmq_realtime_commit_batch_messages", "Messages appended per group commit.",
            COMMIT_BATCH_BUCKETS)
        # Seconds in fsync per group commit; observed on the store thread only (its one
        # writer), read by the scrape on the event loop.
        self.fsync_seconds = PlainHistogram(
            "qmq_realtime_fsync_seconds", "Time one group commit spent in fsync of the message "
            "log.", FSYNC_BUCKETS_S)
        self.registry.register(_LoopCountsCollector(
            self.request_counts, (self.commit_batch_messages, self.fsync_seconds)))
        self.backlog = Gauge(
            "qmq_realtime_backlog_messages", "Messages of the subject the group has not acked "
            "(not pulled yet, held unacked, or waiting for redelivery), at scrape time.",
            ["subject", "group"], registry=self.registry)
        self.consumers = Gauge(
            "qmq_realtime_consumers", "Consumers the broker knows on the (subject, group) "
            "(as qmq admin groups counts them).",
            ["subject", "group"], registry=self.registry)
        info = Gauge("qmq_realtime_info", "Always 1; labels name this broker.", ["group"],
                     registry=self.registry)
        info.labels(group).set(1)
        # Error responses to whole requests, by code; written on the event loop only.
        self.request_errors: dict[str, int] = {code: 0 for code in WIRE_ERRORS}

    def watch(self, broker: "Broker", nacks: "NackHandler") -> None:
        """Collect ``broker``'s and ``nacks``' figures from now on."""
        self._broker = broker
        self.registry.register(_BrokerCollector(broker, nacks, self.request_errors))

    async def refresh(self) -> None:
        """Scrape time: recompute backlog and consumers per (subject, group) from the pull log.

        Broadcast consumers have a pull-log group each; their rows are summed under the group,
        as ``qmq admin groups`` sums them."""
        if self._broker is None:
            return  # not watching a broker yet: nothing to count
        lag: dict[tuple[str, str], int] = {}
        consumers: dict[tuple[str, str], int] = {}
        for row in await self._broker.backlog():
            key = (row["subject"], row["group"])
            lag[key] = lag.get(key, 0) + row["lag"]
            consumers[key] = consumers.get(key, 0) + row["consumers"]
        # No await between clear and set: a scrape on this loop never sees a half-filled gauge.
        self.backlog.clear()
        self.consumers.clear()
        for key, value in lag.items():
            self.backlog.labels(*key).set(value)
            self.consumers.labels(*key).set(consumers[key])


class PlainHistogram:
    """A histogram in plain ints (``observe`` is a bisect and two additions), exported at scrape
    time as a Prometheus histogram family named ``name`` with the buckets prometheus_client's
    ``Histogram`` would write. One writer thread (the event loop, or the store thread for the
    fsync latency), no lock: a scrape on another thread that races an observation may see
    its bucket counted and the sum not yet added (the next scrape has both); ``_count`` is
    the buckets' total, so it always equals the ``+Inf`` bucket."""

    def __init__(self, name: str, documentation: str, bounds: tuple[float, ...]) -> None:
        assert list(bounds) == sorted(set(bounds)), bounds
        self.name = name
        self.documentation = documentation
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum: float = 0

    def observe(self, value: float) -> None:
        """The writer thread: count one observation of ``value`` (a bound is inclusive)."""
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def family(self) -> HistogramMetricFamily:
        """The histogram as a Prometheus family (cumulative buckets, as Histogram writes)."""
        buckets = []
        total = 0
        for bound, count in zip((*map(float, self.bounds), float("inf")), list(self.counts)):
            total += count
            buckets.append((floatToGoString(bound), total))
        return HistogramMetricFamily(self.name, self.documentation, buckets=buckets,
                                     sum_value=self.sum)


class _LoopCountsCollector(Collector):
    """The request counts by op and the plain histograms, as families at scrape time."""

    def __init__(self, request_counts: dict[str, int],
                 histograms: tuple[PlainHistogram, ...]) -> None:
        self._request_counts = request_counts
        self._histograms = histograms

    def describe(self) -> list:
        """Nothing to pre-declare (names are checked for clashes at collect time)."""
        return []

    def collect(self) -> Iterator:
        """The figures as they are now (the scrape runs on the event loop, the writer of all
        but the fsync latency: see ``PlainHistogram``)."""
        requests = CounterMetricFamily("qmq_realtime_requests", "Requests answered, by op "
                                       "(each send or pull request counts once, whatever its "
                                       "batch size).", labels=["op"])
        counts = dict.fromkeys(REQUEST_OPS, 0)
        for op, count in self._request_counts.items():
            counts[op if op in counts else "other"] += count
        for op, count in counts.items():
            requests.add_metric([op], count)
        yield requests
        for histogram in self._histograms:
            yield histogram.family()


class _BrokerCollector(Collector):
    """Counter families built at scrape time from the broker's plain counters."""

    def __init__(self, broker: "Broker", nacks: "NackHandler",
                 request_errors: dict[str, int]) -> None:
        self._broker = broker
        self._nacks = nacks
        self._request_errors = request_errors

    def describe(self) -> list:
        """Nothing to pre-declare (names are checked for clashes at collect time)."""
        return []

    def collect(self) -> Iterator:
        """The counters as they are now (reads dicts written by the broker's threads; each key
        has one writer and a read of an int is atomic)."""
        broker = self._broker
        stats = broker.stats
        for name, key, doc in (
            ("qmq_realtime_duplicates", "duplicates", "Sent messages refused as duplicates of an "
             "id stored within the dedup window."),
            ("qmq_realtime_messages_pulled", "pulled", "Messages handed to consumers (including "
             "redeliveries)."),
            ("qmq_realtime_messages_acked", "acked", "Pulled messages acked."),
            ("qmq_realtime_messages_redelivered", "redelivered", "Messages handed out again "
             "after an ack timeout or a consumer expiry."),
        ):
            yield CounterMetricFamily(name, doc, value=stats[key])
        for name, key, doc in (
            ("qmq_realtime_messages_nacked", "nacked", "Messages nacked by consumers."),
            ("qmq_realtime_retries", "retried", "Retry copies handed to a delay server."),
            ("qmq_realtime_dead_letters", "dead", "Messages moved to their dead-letter subject."),
        ):
            yield CounterMetricFamily(name, doc, value=self._nacks.stats[key])
        messages = CounterMetricFamily("qmq_realtime_messages_sent", "Messages stored, by "
                                       "subject.", labels=["subject"])
        sent_bytes = CounterMetricFamily("qmq_realtime_sent_bytes", "Payload bytes stored, by "
                                         "subject.", labels=["subject"])
        other = [0, 0]
        for index, (subject, (count, size)) in enumerate(list(broker.sent_by_subject.items())):
            if index < SUBJECT_LABELS_MAX:
                messages.add_metric([subject], count)
                sent_bytes.add_metric([subject], size)
            else:
                other[0] += count
                other[1] += size
        if len(broker.sent_by_subject) > SUBJECT_LABELS_MAX:
            messages.add_metric([OTHER_SUBJECTS], other[0])
            sent_bytes.add_metric([OTHER_SUBJECTS], other[1])
        yield messages
        yield sent_bytes
        errors = CounterMetricFamily(
            "qmq_realtime_errors", "Errors answered, by wire code; scope=request: a whole "
            "request refused, scope=message: one message of a send batch refused.",
            labels=["code", "scope"])
        for code, count in sorted(self._request_errors.items()):
            errors.add_metric([code, "request"], count)
        message_errors = dict.fromkeys(WIRE_ERRORS, 0)
        message_errors.update(broker.message_errors)
        for code, count in sorted(message_errors.items()):
            errors.add_metric([code, "message"], count)
        yield errors
        yield GaugeMetricFamily("qmq_realtime_long_polls_waiting", "Pulls waiting for "
                                "messages now (long polling).", value=broker.waiting_pulls)
        given_up = CounterMetricFamily(
            "qmq_realtime_messages_given_up", "Messages the broker gave up on, by reason (each "
            "also traced as gave_up, docs/AUDIT.md).", labels=["reason"])
        for reason, count in sorted(list(broker.tracer.gave_up_counts.items())):
            given_up.add_metric([reason], count)
        yield given_up
        yield CounterMetricFamily(
            "qmq_realtime_held_visibility_failures", "Rounds making held messages visible "
            "that failed to write: a full disk or no file descriptor is tried again a second "
            "later; any other write failure stops making them visible and leaves the broker "
            "read-only until restarted (recovery holds them again).",
            value=broker.handoffs.visibility_failures)
        yield CounterMetricFamily(
            "qmq_realtime_held_rounds_refused", "Rounds making held messages visible put off "
            "because the broker could not write (not the leased master, or too few in-sync "
            "slaves): the messages waited and were looked at again 100 ms later.",
            value=broker.handoffs.rounds_refused)
        yield CounterMetricFamily(
            "qmq_realtime_holds_refused_full", "Hand-offs (hold) refused too_large because the "
            "broker held held_messages_max messages already: the delay server sends them at "
            "their due time.", value=broker.handoffs.holds_refused_full)
        yield CounterMetricFamily(
            "qmq_realtime_holds_refused_kinds", "hold and cancel_held requests refused before "
            "any write because a slave of the group does not read the held-message record "
            "kinds (an older server): the delay server sends those messages at their due "
            "time.", value=broker.handoffs.kind_refusals.count)
        yield CounterMetricFamily(
            "qmq_realtime_commit_publish_failures", "Stored group commits whose publishing "
            "raised (a bug): their sends were answered internal (a resend is a duplicate) and "
            "later commits went on.", value=broker.sends.commits.publish_failures)


__all__ = ["OTHER_SUBJECTS", "PlainHistogram", "RealtimeMetrics", "SUBJECT_LABELS_MAX"]
