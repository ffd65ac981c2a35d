"""Prometheus metrics of a server's role and replication, the same for realtime and delay
servers (docs/OPERATIONS.md#metrics): computed at scrape time from ``ServerRole`` and the data
plane's last ``ReplicaReport``, plus a counter of role changes."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from serverkit.replication import ReplicationStatus
from serverkit.role import ROLES, RoleView, ServerRole, boottime_ms


class RoleMetrics:
    """A collector registered on a server's own registry. Event-loop thread (scrapes run there)."""

    def __init__(self, role: ServerRole, replication: ReplicationStatus,
                 registry: CollectorRegistry) -> None:
        self._role = role
        self._replication = replication
        self.role_changes = 0
        registry.register(self)

    def changed(self, view: RoleView) -> None:
        """Count one change of role, epoch, master or switchover (a Registration callback)."""
        self.role_changes += 1

    def describe(self) -> Iterator[Metric]:
        """The families without values, so registering reads neither the role nor the report."""
        yield GaugeMetricFamily("qmq_replication_role", "", labels=["role"])
        for name in ("epoch", "active", "lease_remaining_ms", "insync_slaves", "lag_bytes",
                     "lag_ms"):
            yield GaugeMetricFamily(f"qmq_replication_{name}", "")
        yield CounterMetricFamily("qmq_replication_role_changes", "")
        for name in ("crc_errors", "scrub_repairs", "unreadable_records",
                     "undecodable_records", "unreadable_fetches"):
            yield CounterMetricFamily(f"qmq_replication_{name}", "")
        yield GaugeMetricFamily("qmq_replication_slave_reads_kind", "",
                                labels=["slave", "log", "kind"])
        yield GaugeMetricFamily("qmq_replication_kind_writable", "", labels=["log", "kind"])

    def collect(self) -> Iterator[Metric]:
        """The metric families, read now."""
        view = self._role.view()
        role = GaugeMetricFamily("qmq_replication_role", "1 for this server's role in its group "
                                 "(master, slave, or unknown until a MetaServer answers).",
                                 labels=["role"])
        for name in ROLES:
            role.add_metric([name], 1.0 if view.role == name else 0.0)
        yield role
        yield GaugeMetricFamily("qmq_replication_epoch", "The group's epoch as this server "
                                "knows it.", value=view.epoch)
        yield GaugeMetricFamily("qmq_replication_active", "1 while this server accepts writes "
                                "(a leased, active master), else 0.",
                                value=1.0 if self._role.may_write(boottime_ms()) else 0.0)
        remaining = self._role.lease_remaining_ms(boottime_ms())
        yield GaugeMetricFamily("qmq_replication_lease_remaining_ms", "Milliseconds of lease "
                                "left; -1 when no lease applies (a slave, a solo master).",
                                value=-1 if remaining is None else remaining)
        yield GaugeMetricFamily("qmq_replication_insync_slaves", "Slaves of the group the "
                                "MetaServer counts as in sync.", value=len(view.insync))
        report = self._replication.report()
        yield GaugeMetricFamily("qmq_replication_lag_bytes", "A slave's bytes behind its "
                                "master, as of its last fetch; -1 when unknown.",
                                value=-1 if report.lag_bytes is None else report.lag_bytes)
        yield GaugeMetricFamily("qmq_replication_lag_ms", "Age of the oldest record a slave "
                                "lacks, as of its last fetch; -1 when unknown.",
                                value=-1 if report.lag_ms is None else report.lag_ms)
        changes = CounterMetricFamily("qmq_replication_role_changes", "Changes of role, epoch, "
                                      "master or switchover this server was told of.")
        changes.add_metric([], self.role_changes)
        yield changes
        # The data plane's counts, when it keeps them (serverkit.replica.Replica.counters).
        counters = getattr(self._replication, "counters", None)
        figures = counters() if counters is not None else {}
        for name, text in (("crc_errors", "Copied ranges that failed their CRC check on arrival "
                                          "and were fetched again."),
                           ("scrub_repairs", "Rotten records the background scrub found in this "
                                             "server's copy, cut and fetched again."),
                           ("unreadable_records", "A slave's fetches its master refused at a "
                                                  "record of a kind this server does not read "
                                                  "(upgrade it)."),
                           ("undecodable_records", "A slave's copied records whose CRC "
                                                   "held but whose body this server cannot "
                                                   "decode: its copy stops there (upgrade "
                                                   "it)."),
                           ("unreadable_fetches", "A master's fetch answers cut short of, or "
                                                  "refused at, a record of a kind the slave "
                                                  "does not read.")):
            family = CounterMetricFamily(f"qmq_replication_{name}", text)
            family.add_metric([], figures.get(name, 0))
            yield family
        yield from self._kind_families()

    def _kind_families(self) -> Iterator[Metric]:
        """The record-kind gate (serverkit.kind_gate), on a master: per counted slave and
        gated kind whether it reads it, and per kind whether it may be written now."""
        reads = GaugeMetricFamily("qmq_replication_slave_reads_kind", "1 when the slave said "
                                  "in its last fetch that it reads this gated record kind of "
                                  "the log, 0 when not (or not heard from); a master's view.",
                                  labels=["slave", "log", "kind"])
        writable = GaugeMetricFamily("qmq_replication_kind_writable", "1 while every slave a "
                                     "master counts reads this gated record kind (it may be "
                                     "written: holds, hand-offs), else 0.",
                                     labels=["log", "kind"])
        source = getattr(self._replication, "source", None)
        view = getattr(self._replication, "kinds_view", None)
        if source is not None and view is not None and source.active:
            for slave, logs in view().items():
                for log, entry in logs.items():
                    known = entry["reads"] or ()  # type: ignore[index]
                    for kind in sorted(source.kind_reads.kinds[log].reads):
                        reads.add_metric([slave, log, str(kind)], 1.0 if kind in known else 0.0)
            for log, kinds in source.kind_reads.kinds.items():
                for kind in sorted(kinds.reads):
                    writable.add_metric([log, str(kind)],
                                        1.0 if source.kind_refusal(log, kind) is None else 0.0)
        yield reads
        yield writable


__all__ = ["RoleMetrics"]
