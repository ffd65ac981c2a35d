"""Hand-written trace of subject "orders" with every anomaly the audit must find.

Group "billing" reads from the start; group "search" first pulls m5 (deliverable at T+2000), so
it is expected to receive only messages deliverable from then on. DEADLINE_MS is 10 s and the
horizon is the last event, m9's produced at T+25000.

    m1   produced, stored, pulled, acked                          ok, latency 5
    m2   produced, stored, never pulled                           OVERDUE for billing (held)
    m3   pulled twice (redelivered), acked                        DUPLICATE for billing
    m4   delayed to T+1000, dispatched at T+990, pulled at T+995  EARLY
    m5   delayed to T+2000, dispatched 4 ms late                  ok for both groups
    m6   nacked, retried once (m6.r1), nacked, dead (m6.r2)       DEAD (not lost)
    m7   nacked, retried once (m7.r1), acked                      succeeded after 1 retry
    m8   delayed, cancelled                                       not expected
    m9   produced last: due after the horizon                     in flight for both groups
    m10  produced at T+3000, acked by both groups                 ok
    m11  expired before delivery                                  not expected
    m12  delayed to T+1000, the broker refused its dispatch       LOST for billing (gave_up)
"""

from __future__ import annotations

from pyspark.sql import DataFrame, SparkSession

from tracelog.events import EVENT_FIELD_NAMES, trace_event
from spark_audit import EVENT_SCHEMA, normalize_events

T = 1_767_225_600_000  # 2026-01-01T00:00:00Z
DEADLINE_MS = 10_000
RT, DS = "realtime:rt-1", "delay:d-1"


def _e(kind, dt, msg_id, server=RT, *, origin=None, group=None, consumer=None, created=None,
       deliver_at=None, retries=0, lateness=None, reason=None):
    event = trace_event(kind, ts_ms=T + dt, msg_id=msg_id, subject="orders", origin_id=origin,
                        group=group, consumer=consumer, created_at_ms=created,
                        deliver_at_ms=deliver_at, retries=retries, lateness_ms=lateness,
                        reason=reason)
    event["server"] = server
    return event


def _immediate(msg_id, dt):
    return [_e("produced", dt, msg_id, created=T + dt), _e("stored", dt + 1, msg_id)]


def _pull(kind, dt, msg_id, group="billing", consumer="c1", *, created, deliver_at=None,
          origin=None, retries=0):
    return _e(kind, dt, msg_id, group=group, consumer=consumer, created=T + created,
              deliver_at=None if deliver_at is None else T + deliver_at, origin=origin,
              retries=retries)


def _delayed(msg_id, dt, deliver_dt, dispatch_dt):
    events = [_e("produced", dt, msg_id, DS, created=T + dt, deliver_at=T + deliver_dt),
              _e("scheduled", dt + 1, msg_id, DS, created=T + dt, deliver_at=T + deliver_dt)]
    if dispatch_dt is not None:
        events += [_e("dispatched", dispatch_dt, msg_id, DS, created=T + dt,
                      deliver_at=T + deliver_dt),
                   _e("stored", dispatch_dt, msg_id)]
    return events


def _retry(msg_id, origin, retries, dt, deliver_dt, dispatch_dt, created_dt):
    copy = dict(origin=origin, group="billing", created=T + created_dt, deliver_at=T + deliver_dt,
                retries=retries)
    return [_e("retried", dt, msg_id, **copy),
            _e("scheduled", dt + 1, msg_id, DS, **copy),
            _e("dispatched", dispatch_dt, msg_id, DS, **copy),
            _e("stored", dispatch_dt, msg_id, **copy)]


def scenario_events() -> list[dict]:
    """The events above, each a full trace event dict (server set)."""
    return [
        *_immediate("m1", 0),
        _pull("pulled", 5, "m1", created=0), _pull("acked", 8, "m1", created=0),
        *_immediate("m2", 10),
        *_immediate("m3", 20),
        _pull("pulled", 30, "m3", created=20),
        _pull("redelivered", 40, "m3", consumer="c2", created=20),
        _pull("pulled", 40, "m3", consumer="c2", created=20),
        _pull("acked", 45, "m3", consumer="c2", created=20),
        *_delayed("m4", 50, 1000, 990),
        _pull("pulled", 995, "m4", created=50, deliver_at=1000),
        _pull("acked", 996, "m4", created=50, deliver_at=1000),
        *_delayed("m5", 60, 2000, 2004),
        _pull("pulled", 2010, "m5", created=60, deliver_at=2000),
        _pull("acked", 2012, "m5", created=60, deliver_at=2000),
        _pull("pulled", 2020, "m5", "search", "s1", created=60, deliver_at=2000),
        _pull("acked", 2021, "m5", "search", "s1", created=60, deliver_at=2000),
        *_immediate("m6", 100),
        _pull("pulled", 110, "m6", created=100), _pull("nacked", 111, "m6", created=100),
        *_retry("m6.r1", "m6", 1, 112, 200, 201, 112),
        _pull("pulled", 205, "m6.r1", created=112, deliver_at=200, origin="m6", retries=1),
        _pull("nacked", 206, "m6.r1", created=112, deliver_at=200, origin="m6", retries=1),
        _e("dead", 207, "m6.r2", origin="m6", group="billing", created=T + 207, retries=2),
        *_immediate("m7", 120),
        _pull("pulled", 150, "m7", created=120), _pull("nacked", 151, "m7", created=120),
        *_retry("m7.r1", "m7", 1, 152, 5000, 5002, 152),
        _pull("pulled", 5010, "m7.r1", created=152, deliver_at=5000, origin="m7", retries=1),
        _pull("acked", 5011, "m7.r1", created=152, deliver_at=5000, origin="m7", retries=1),
        *_delayed("m8", 140, 9000, None),
        _e("cancelled", 150, "m8", DS),
        *_immediate("m10", 3000),
        _pull("pulled", 3003, "m10", created=3000), _pull("acked", 3004, "m10", created=3000),
        _pull("pulled", 3005, "m10", "search", "s1", created=3000),
        _pull("acked", 3006, "m10", "search", "s1", created=3000),
        *_immediate("m11", 400),
        _e("expired", 405, "m11"),
        *_delayed("m12", 300, 1000, None),
        _e("gave_up", 1000, "m12", DS, created=T + 300, deliver_at=T + 1000,
           reason="dispatch_refused"),
        *_immediate("m9", 25_000)[:1],
    ]


def events_frame(spark: SparkSession, events: list[dict]) -> DataFrame:
    """Trace event dicts (``trace_event`` style) as the normalised events DataFrame."""
    rows = [tuple(event.get(name) for name in EVENT_FIELD_NAMES) for event in events]
    return normalize_events(spark.createDataFrame(rows, EVENT_SCHEMA))
