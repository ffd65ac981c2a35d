"""The delay server's trace events (``tracelog.events``): produced and scheduled when a delayed message
is made durable (one ``scheduled`` line flagged ``produced``, which readers expand into both),
dispatched when a realtime broker confirmed it (with its lateness), cancelled, and ``gave_up``
with a reason when the scheduler gives up on one (``dispatch_refused``: the broker refused it for
good and it left the schedule; ``dispatch_unrecorded``: confirmed, but its dispatch record could
not be written). Give-ups are counted in ``gave_up_counts`` whether tracing is on or not."""

from __future__ import annotations

from typing import Iterable, Sequence

from tracelog.peek import TracePeek, peek_trace_members
from tracelog.events import PRODUCED_MEMBER, TraceWriter, message_members, reason_member


class DelayTracer:
    """Emits a delay server's trace events; every method is a no-op when tracing is off.

    Lines are encoded here (``TraceWriter.line``), each payload's message members once for all
    of its events, and handed to the writer once per call."""

    def __init__(self, writer: TraceWriter | None) -> None:
        self.writer = writer
        self.enabled = writer is not None and writer.enabled
        # gave_up reason -> messages (event loop only; read by metrics)
        self.gave_up_counts: dict[str, int] = {}

    def gave_up(self, payloads: Sequence[bytes], now_ms: int, reason: str) -> None:
        """The scheduler gave up on these messages (``reason``: a key of
        ``tracelog.events.GIVE_UP_REASONS``); ``group`` is left out: it concerns every group."""
        if not payloads:
            return
        self.gave_up_counts[reason] = self.gave_up_counts.get(reason, 0) + len(payloads)
        if not self.enabled:
            return
        writer = self.writer
        assert writer is not None
        extra = reason_member(reason)
        lines = []
        for payload in payloads:
            peeked = peek_trace_members(payload)
            if peeked is not None:
                lines.append(writer.line("gave_up", now_ms, peeked.members, extra))
        writer.emit_lines(lines)

    def _emit_all(self, kind: str, payloads: Iterable[bytes], ts_ms: int) -> None:
        writer = self.writer
        assert writer is not None
        lines = []
        for payload in payloads:
            peeked = peek_trace_members(payload)
            if peeked is None:
                continue
            extra = ""
            if kind == "dispatched" and peeked.deliver_at_ms is not None:
                extra = f',"lateness_ms":{ts_ms - peeked.deliver_at_ms}'
            elif kind == "scheduled" and peeked.internal is None and not peeked.retries:
                # A producer's own delayed message entered the system here: its scheduled line
                # is flagged produced, and readers expand it into both events (tracelog.events).
                extra = PRODUCED_MEMBER
            lines.append(writer.line(kind, ts_ms, peeked.members, extra))
        writer.emit_lines(lines)

    def scheduled(self, payloads: Iterable[bytes], now_ms: int) -> None:
        """Delayed messages made durable."""
        if self.enabled:
            self._emit_all("scheduled", payloads, now_ms)

    def scheduled_peeked(self, items: Sequence[tuple[TracePeek | None, bytes]],
                         now_ms: int) -> None:
        """Delayed messages made durable, as (their members if the caller has them already,
        their payload): only those without members are decoded."""
        if not self.enabled:
            return
        writer = self.writer
        assert writer is not None
        line = writer.line
        lines = []
        for peeked, payload in items:
            if peeked is None:
                peeked = peek_trace_members(payload)
                if peeked is None:
                    continue
            # A producer's own delayed message entered the system here (see _emit_all).
            own = peeked.internal is None and not peeked.retries
            lines.append(line("scheduled", now_ms, peeked.members, PRODUCED_MEMBER if own else ""))
        writer.emit_lines(lines)

    def dispatched(self, payloads: Iterable[bytes], now_ms: int) -> None:
        """Messages a realtime broker confirmed (lateness = now - deliver_at). The line's
        constant parts are built once per batch (``TraceWriter.frame``)."""
        if not self.enabled:
            return
        writer = self.writer
        assert writer is not None
        start, end = writer.frame("dispatched", now_ms)
        lines = []
        for payload in payloads:
            peeked = peek_trace_members(payload)
            if peeked is None:
                continue
            if peeked.deliver_at_ms is None:
                lines.append(start + peeked.members + end)
            else:
                lines.append(f'{start}{peeked.members},"lateness_ms":'
                             f'{now_ms - peeked.deliver_at_ms}{end}')
        writer.emit_lines(lines)

    def cancelled(self, message_id: str, subject: str | None, deliver_at_ms: int,
                  now_ms: int) -> None:
        """A pending message withdrawn by its producer."""
        if self.enabled and subject is not None:
            writer = self.writer
            assert writer is not None
            members = message_members(message_id, subject, deliver_at_ms=deliver_at_ms)
            writer.emit_lines([writer.line("cancelled", now_ms, members)])
