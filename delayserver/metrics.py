"""Prometheus metrics of one delay server (docs/OPERATIONS.md lists every one).

Dispatch counts and the lateness histogram are the scheduler's own ``DispatchStats``, turned
into metric families at scrape time; pending messages by how far ahead they are due (a fixed set
of horizons, so the series never grow with time) come from the store's pending counts per hour
(``Scheduler.report``) at scrape time, through the store's I/O thread. Times are in seconds, as
Prometheus has them; the process collectors add CPU, memory, descriptors and the Python version. What the server
counts directly is counted per request, per dispatch batch or per result: scheduled and refused
messages, cancels by outcome, dispatch failures by code, fsync latency.

Every delay server has its own ``CollectorRegistry``, so servers in one process never share
figures.
"""

from __future__ import annotations

from itertools import repeat
from typing import TYPE_CHECKING, Any, Iterator

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, PlatformCollector,
                               ProcessCollector)
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from delayserver.stats import LATENESS_BOUNDS_MS
from delayserver.storage import CANCEL_OUTCOMES  # one list: a new outcome gets its own label
from serverkit.request_counts import RequestCounts
from wire.errors import WIRE_ERRORS, QmqError

if TYPE_CHECKING:
    from delayserver.scheduler import Dispatch, Scheduler
    from delayserver.stats import DispatchStats

HOUR_MS = 3_600_000
# The ``due_in`` horizons of the pending gauge: (label, bound in ms ahead of now). The store
# counts pending messages per UTC hour, so an hour's messages go to the first horizon that its
# start is within (the current hour, and overdue ones, to "1h"); past the last: "later".
PENDING_HORIZONS_MS = (("1h", HOUR_MS), ("6h", 6 * HOUR_MS), ("1d", 24 * HOUR_MS),
                       ("7d", 7 * 24 * HOUR_MS), ("30d", 30 * 24 * HOUR_MS),
                       ("365d", 365 * 24 * HOUR_MS))
LATER = "later"

FSYNC_BUCKETS_S = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0,
                   2.5)
REQUEST_OPS = ("hello", "send", "cancel", "other")


def pending_by_horizon(per_hour: dict[int, int], now_ms: int) -> dict[str, int]:
    """Pending counts per hour start as counts per ``due_in`` horizon (every label, 0 too)."""
    counts = {label: 0 for label, _ in PENDING_HORIZONS_MS} | {LATER: 0}
    for hour_start_ms, count in per_hour.items():
        ahead_ms = hour_start_ms - now_ms
        label = next((name for name, bound_ms in PENDING_HORIZONS_MS if ahead_ms < bound_ms),
                     LATER)
        counts[label] += count
    return counts


class DelayMetrics(RequestCounts):
    """The registry of one delay server and the metrics its server updates directly.

    Threads: ``fsync_seconds`` is observed on the store's delay-io thread (a prometheus_client
    metric takes its own lock); every other field is written on the event loop, and scrapes
    run there too.
    """

    def __init__(self, group: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._scheduler: Scheduler | None = None
        # Plain ints written on the event loop, turned into families at scrape time
        # (``_RequestCountsCollector``): a prometheus_client Counter's inc() was four Python
        # calls and a lock per request, twice per send request.
        self.request_counts: dict[str, int] = dict.fromkeys(REQUEST_OPS, 0)
        self.scheduled = 0  # delayed messages answered stored
        self.registry.register(_RequestCountsCollector(self))
        cancels = Counter("qmq_delay_cancels", "Cancel requests for one message, by outcome.",
                          ["outcome"], registry=self.registry)
        self._cancels = {outcome: cancels.labels(outcome) for outcome in CANCEL_OUTCOMES}
        self.fsync_seconds = Histogram(
            "qmq_delay_fsync_seconds", "Time one group commit spent in fsync of the delay log.",
            buckets=FSYNC_BUCKETS_S, registry=self.registry)
        self.pending = Gauge(
            "qmq_delay_pending_messages", "Messages waiting for their time, by how far ahead "
            "they are due (due_in: 1h, 6h, 1d, 7d, 30d, 365d, later; by the hour they are due "
            "in), at scrape time.", ["due_in"], registry=self.registry)
        self.window = Gauge("qmq_delay_window_messages", "Messages of the preload window held "
                            "in memory (the timing wheel), at scrape time.",
                            registry=self.registry)
        info = Gauge("qmq_delay_info", "Always 1; labels name this delay server.", ["group"],
                     registry=self.registry)
        info.labels(group).set(1)
        # process_* (CPU seconds, resident memory, open descriptors) and python_info.
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        # Written on the event loop only; collected with the scheduler's figures.
        self.request_errors: dict[str, int] = {code: 0 for code in WIRE_ERRORS}
        self.message_errors: dict[str, int] = {code: 0 for code in WIRE_ERRORS}
        self.dispatch_failures: dict[str, int] = {code: 0 for code in WIRE_ERRORS}

    def watch(self, scheduler: "Scheduler") -> None:
        """Collect ``scheduler``'s dispatch figures and pending counts from now on."""
        self._scheduler = scheduler
        self.registry.register(_DispatchCollector(scheduler.stats, self))

    def count_schedule_results(self, results: list[dict[str, Any]]) -> None:
        """Count the answers to one send: stored ones, and refused ones by code."""
        # Usually none failed: counted by C-level passes, with no Python step per message.
        errors = list(map(dict.get, results, repeat("error")))
        stored = errors.count(None)
        if stored < len(errors):
            for error in errors:
                if error is not None:
                    code = error.get("code", "internal")
                    self.message_errors[code] = self.message_errors.get(code, 0) + 1
        self.scheduled += stored

    def count_cancel(self, outcome: str) -> None:
        """Count one cancel by its outcome."""
        counter = self._cancels.get(outcome)
        if counter is not None:
            counter.inc()

    def observe_dispatch(self, dispatch: "Dispatch", uncounted: tuple[str, ...] = ()
                         ) -> "Dispatch":
        """``dispatch`` counting what fails: a whole batch the realtime side did not take, or
        single messages it refused, by error code; a batch failing with a code of
        ``uncounted`` is not counted (an older broker's ``not_supported`` of a hand-off: the
        normal fallback to sending at the due time, not a failure to alert on)."""
        failures = self.dispatch_failures

        async def counted(subject: str, payloads: list[bytes], *more: Any
                          ) -> tuple[str, list[dict[str, Any]]]:
            try:
                group, results = await dispatch(subject, payloads, *more)  # type: ignore
            except QmqError as exc:
                if exc.code not in uncounted:
                    failures[exc.code] = failures.get(exc.code, 0) + len(payloads)
                raise
            for result in results:
                error = result.get("error")
                if error is not None:
                    code = error.get("code", "internal")
                    if code not in uncounted:
                        failures[code] = failures.get(code, 0) + 1
            return group, results

        return counted

    async def refresh(self) -> None:
        """Scrape time: pending by horizon and the window size, from the scheduler's report."""
        if self._scheduler is None:
            return
        report = await self._scheduler.report()
        per_hour = {int(hour): count for hour, count in report["pending_per_hour"].items()}
        for label, count in pending_by_horizon(per_hour, self._scheduler.clock()).items():
            self.pending.labels(label).set(count)
        self.window.set(report["in_memory"])


class _RequestCountsCollector(Collector):
    """The requests by op and the messages scheduled, from ``DelayMetrics``' plain ints."""

    def __init__(self, metrics: DelayMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> list:
        """Nothing to pre-declare (names are checked for clashes at collect time)."""
        return []

    def collect(self) -> Iterator:
        """The counts as they are now (written on the event loop, like this read)."""
        metrics = self._metrics
        requests = CounterMetricFamily("qmq_delay_requests", "Requests answered, by op.",
                                       labels=["op"])
        for op, count in metrics.request_counts.items():
            requests.add_metric([op], count)
        yield requests
        yield CounterMetricFamily("qmq_delay_messages_scheduled", "Delayed messages stored "
                                  "(answered stored).", value=metrics.scheduled)


class _DispatchCollector(Collector):
    """Families built at scrape time from ``DispatchStats`` and the server's plain counters."""

    def __init__(self, stats: "DispatchStats", metrics: DelayMetrics) -> None:
        self._stats = stats
        self._metrics = metrics

    def describe(self) -> list:
        """Nothing to pre-declare (names are checked for clashes at collect time)."""
        return []

    def collect(self) -> Iterator:
        """The figures as they are now (all written on the event loop, like this read)."""
        stats = self._stats
        yield CounterMetricFamily("qmq_delay_messages_dispatched", "Messages a realtime broker "
                                  "confirmed (or refused for good).", value=stats.dispatched)
        yield CounterMetricFamily("qmq_delay_messages_handed_off", "Messages a realtime broker "
                                  "took ahead of their due time (hold): it makes them visible "
                                  "then, and its trace has their lateness.", value=stats.handed)
        yield CounterMetricFamily("qmq_delay_kinds_refused", "Handed or dropped records not "
                                  "written because a slave of the group does not read their "
                                  "kind (an older server): the hand-off paused and the "
                                  "messages went at their due time.", value=stats.kind_refusals.count)
        yield CounterMetricFamily("qmq_delay_early_dispatches", "Messages dispatched before "
                                  "their time (a bug if ever above 0).", value=stats.early)
        buckets, cumulative = [], 0
        for bound_ms, count in zip(LATENESS_BOUNDS_MS, stats.histogram):
            cumulative += count
            buckets.append((floatToGoString(bound_ms / 1000), cumulative))  # "0.2", as Histogram
        buckets.append(("+Inf", cumulative + stats.histogram[-1]))
        lateness = HistogramMetricFamily(
            "qmq_delay_dispatch_lateness_seconds", "Dispatch time minus due time, in seconds.")
        lateness.add_metric([], buckets, sum_value=stats.lateness_ms_sum / 1000)
        yield lateness
        metrics = self._metrics
        failures = CounterMetricFamily(
            "qmq_delay_dispatch_failures", "Messages whose dispatch failed, by error code: "
            "bad_request, too_large and forbidden are dropped for good, the rest retried.",
            labels=["code"])
        for code, count in sorted(metrics.dispatch_failures.items()):
            failures.add_metric([code], count)
        yield failures
        given_up = CounterMetricFamily(
            "qmq_delay_messages_given_up", "Messages the scheduler gave up on, by reason "
            "(each also traced as gave_up, docs/AUDIT.md).", labels=["reason"])
        scheduler = metrics._scheduler
        if scheduler is not None:
            for reason, count in sorted(scheduler.tracer.gave_up_counts.items()):
                given_up.add_metric([reason], count)
        yield given_up
        yield CounterMetricFamily(
            "qmq_delay_commit_publish_failures", "Stored group commits whose publishing raised "
            "(a bug): their sends were answered internal and later commits went on.",
            value=scheduler._commits.publish_failures if scheduler is not None else 0)
        errors = CounterMetricFamily(
            "qmq_delay_errors", "Errors answered, by wire code; scope=request: a whole request "
            "refused, scope=message: one message of a send batch refused.",
            labels=["code", "scope"])
        for scope, counts in (("request", metrics.request_errors),
                              ("message", metrics.message_errors)):
            for code, count in sorted(counts.items()):
                errors.add_metric([code, scope], count)
        yield errors


__all__ = ["DelayMetrics", "LATER", "PENDING_HORIZONS_MS", "pending_by_horizon"]
