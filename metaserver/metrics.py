"""Prometheus metrics of the MetaServer, served at ``GET /metrics`` on its HTTP port.

HTTP requests are counted by route (the route's pattern, never the raw path, so a scanner
cannot grow the label set), method and status by an outermost middleware, which also counts
error answers by their JSON ``code``. Brokers, subjects and consumer groups are gauges read from
the database at scrape time. Each app has its own ``CollectorRegistry``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Iterator

from aiohttp import web
from prometheus_client import (CollectorRegistry, Counter, Gauge, PlatformCollector,
                               ProcessCollector)
from prometheus_client.core import CounterMetricFamily, Metric

from metaserver.registry import Registry
from metaserver.replication import PROMOTION_REASONS

log = logging.getLogger(__name__)

BROKER_KINDS = ("realtime", "delay")
BROKER_STATES = ("rw", "readonly", "offline")
UNMATCHED_ROUTE = "unmatched"  # the route label of a request no route matched (404, 405)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class MetaMetrics:
    """The registry of one MetaServer app: request counters and scrape-time gauges."""

    def __init__(self, registry: Registry) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        # process_* (CPU seconds, resident memory, open descriptors) and python_info.
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self._meta = registry
        self.requests = Counter("qmq_meta_http_requests", "HTTP requests answered, by route "
                                "pattern, method and status.", ["route", "method", "status"],
                                registry=self.registry)
        self.request_bytes = Counter("qmq_meta_http_request_bytes", "Bytes of request bodies "
                                     "answered, by route pattern (what brokers' heartbeats and "
                                     "backlog reports cost on the wire).", ["route"],
                                     registry=self.registry)
        self.errors = Counter("qmq_meta_errors", "Error answers, by their JSON error code.",
                              ["code"], registry=self.registry)
        self.brokers = Gauge("qmq_meta_brokers", "Registered brokers by kind and state (as the "
                             "MetaServer decides it), at scrape time.", ["kind", "state"],
                             registry=self.registry)
        self.subjects = Gauge("qmq_meta_subjects", "Subjects with a route, at scrape time.",
                              registry=self.registry)
        self.consumer_groups = Gauge("qmq_meta_consumer_groups", "Distinct consumer groups "
                                     "known (registered or reported in a broker's backlog), at "
                                     "scrape time.", registry=self.registry)
        self.write_transactions = Counter(
            "qmq_meta_write_transactions", "Database write transactions committed by this "
            "MetaServer (counted at scrape time).", registry=self.registry)
        self._writes_counted = 0
        self.schedule_occurrences = Counter(
            "qmq_meta_schedule_occurrences", "Occurrences of recurring schedules by what became "
            "of them: sent (handed to a delay server), skipped (missed, dropped by the misfire "
            "policy), failed (a hand-over or cancel that will be retried).", ["what"],
            registry=self.registry)
        self.group_epoch = Gauge("qmq_meta_group_epoch", "Each broker group's epoch (it goes "
                                 "up by one per change of master), at scrape time.", ["group"],
                                 registry=self.registry)
        self.group_insync = Gauge("qmq_meta_group_insync_slaves", "Slaves each broker group's "
                                  "database row counts as in sync, at scrape time.", ["group"],
                                  registry=self.registry)
        self.registry.register(_Failovers(registry))

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Count the request once it is answered (put outermost, after errors became JSON)."""
        response = await handler(request)
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else UNMATCHED_ROUTE
        self.requests.labels(route, request.method, str(response.status)).inc()
        if request.content_length:
            self.request_bytes.labels(route).inc(request.content_length)
        if response.status >= 400:
            self.errors.labels(_error_code(response)).inc()
        return response

    async def refresh(self) -> None:
        """Scrape time: brokers by kind and state, subjects and consumer groups, from the DB."""
        counts = {(kind, state): 0 for kind in BROKER_KINDS for state in BROKER_STATES}
        for broker in await self._meta.list_brokers(backlog_rows=False):
            key = (broker["kind"], broker["state"])
            counts[key] = counts.get(key, 0) + 1
        subjects = len(await self._meta.list_subjects())
        groups = {row["group"] for row in await self._meta.list_consumer_groups()}
        replication = await self._meta.replication.list_groups()
        for (kind, state), count in counts.items():
            self.brokers.labels(kind, state).set(count)
        for row in replication:
            self.group_epoch.labels(row["group"]).set(row["epoch"])
            self.group_insync.labels(row["group"]).set(len(row["insync"]))
        self.subjects.set(subjects)
        self.consumer_groups.set(len(groups))
        writes = self._meta.write_transactions
        self.write_transactions.inc(writes - self._writes_counted)
        self._writes_counted = writes


class _Failovers:
    """``qmq_meta_failovers_total{reason}``: promotions this MetaServer made, read at scrape."""

    def __init__(self, registry: Registry) -> None:
        self._stats = registry.replication.stats

    def collect(self) -> Iterator[Metric]:
        """The counter family, every reason present (0 until it happens)."""
        family = CounterMetricFamily("qmq_meta_failovers", "Changes of a group's master this "
                                     "MetaServer made, by reason.", labels=["reason"])
        for reason in PROMOTION_REASONS:
            family.add_metric([reason], self._stats.promotions.get(reason, 0))
        yield family


def _error_code(response: web.StreamResponse) -> str:
    """The ``error.code`` of a JSON error answer; "unknown" for any other body (the error
    middleware answers every error as JSON, so that means a bug or a raw aiohttp answer)."""
    body = getattr(response, "body", None)
    if isinstance(body, bytes):
        try:
            code = json.loads(body)["error"]["code"]
        except (ValueError, KeyError, TypeError):
            return "unknown"
        if isinstance(code, str):
            return code
    return "unknown"


__all__ = ["MetaMetrics", "UNMATCHED_ROUTE"]
