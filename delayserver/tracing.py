"""The delay server's trace events (``sdk.trace``): produced and scheduled when a delayed message
is made durable, dispatched when a realtime broker confirmed it (with its lateness), cancelled."""

from __future__ import annotations

from typing import Iterable

from sdk.message import peek_trace_fields
from sdk.trace import TraceWriter, trace_event


class DelayTracer:
    """Emits a delay server's trace events; every method is a no-op when tracing is off."""

    def __init__(self, writer: TraceWriter | None) -> None:
        self.writer = writer
        self.enabled = writer is not None and writer.enabled

    def _emit(self, kind: str, payload: bytes, ts_ms: int) -> None:
        fields = peek_trace_fields(payload)
        if fields is None:
            return
        assert self.writer is not None
        self.writer.emit(trace_event(
            kind, ts_ms=ts_ms, msg_id=fields["msg_id"], subject=fields["subject"],
            origin_id=fields["origin_id"], created_at_ms=fields["created_at_ms"],
            deliver_at_ms=fields["deliver_at_ms"], retries=fields["retries"],
        ))
        if kind == "scheduled" and fields["internal"] is None and not fields["retries"]:
            # A producer's own delayed message: this is where it entered the system.
            self.writer.emit(trace_event(
                "produced", ts_ms=fields["created_at_ms"] or ts_ms, msg_id=fields["msg_id"],
                subject=fields["subject"], created_at_ms=fields["created_at_ms"],
                deliver_at_ms=fields["deliver_at_ms"],
            ))

    def scheduled(self, payloads: Iterable[bytes], now_ms: int) -> None:
        """Delayed messages made durable."""
        if self.enabled:
            for payload in payloads:
                self._emit("scheduled", payload, now_ms)

    def dispatched(self, payloads: Iterable[bytes], now_ms: int) -> None:
        """Messages a realtime broker confirmed (lateness = now - deliver_at)."""
        if self.enabled:
            for payload in payloads:
                self._emit("dispatched", payload, now_ms)

    def cancelled(self, message_id: str, subject: str | None, deliver_at_ms: int,
                  now_ms: int) -> None:
        """A pending message withdrawn by its producer."""
        if self.enabled and subject is not None:
            assert self.writer is not None
            self.writer.emit(trace_event("cancelled", ts_ms=now_ms, msg_id=message_id,
                                         subject=subject, deliver_at_ms=deliver_at_ms))
