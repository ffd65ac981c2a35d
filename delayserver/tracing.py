"""The delay server's trace events (``tracelog.events``): produced and scheduled when a delayed message
is made durable (one ``scheduled`` line flagged ``produced``, which readers expand into both),
dispatched when a realtime broker confirmed it (with its lateness), handed when one holds it
ahead of its due time (naming the broker group), cancelled, and ``gave_up``
with a reason when the scheduler gives up on one (``dispatch_refused``: the broker refused it for
good and it left the schedule; ``dispatch_unrecorded``: confirmed, but its dispatch record could
not be written). Give-ups are counted in ``gave_up_counts`` whether tracing is on or not."""

from __future__ import annotations

import asyncio
from typing import Container, Iterable, Sequence

from serverkit.send_check import Checked
from tracelog.peek import dispatched_lines, peek_trace_members, trace_members
from tracelog.events import (PRODUCED_MEMBER, _json_str, message_members, reason_member,
                             subject_member)
from tracelog.writer import TraceWriter

# Most messages whose quick-check fields are kept from their commit to their dispatch (~300
# bytes each, ~30 MB): a hot slot of up to this many is traced at dispatch without decoding.
KEPT_MAX_DEFAULT = 100_000


class DelayTracer:
    """Emits a delay server's trace events; every method is a no-op when tracing is off.

    Lines are encoded here (``TraceWriter.line``), each payload's message members once for all
    of its events, and handed to the writer once per call."""

    def __init__(self, writer: TraceWriter | None, kept_max: int = KEPT_MAX_DEFAULT) -> None:
        self.writer = writer
        self.enabled = writer is not None and writer.enabled
        # gave_up reason -> messages (event loop only; read by metrics)
        self.gave_up_counts: dict[str, int] = {}
        # Delay-log offset -> what the quick check read of a message committed into the
        # preload window, so its ``dispatched`` line needs no decoding of the payload
        # (``keep``, ``dispatched_entries``). Event loop only.
        self._kept: dict[int, Checked] = {}
        self.kept_max = kept_max
        # Delay-log offset -> (the message members of its dispatched line, its deliver_at_ms),
        # built from its kept fields ahead of its due time (``prepare``), so a hot slot's
        # lines cost one concatenation each at the due instant. Event loop only.
        self._ready: dict[int, tuple[str, int]] = {}
        # Commits whose scheduled lines wait for their answers to leave (``scheduled_soon``):
        # (checks, payloads, ts_ms) each. Event loop only.
        self._deferred: list[tuple[Sequence[Checked | None], Sequence[bytes], int]] = []

    def keep(self, keys: Sequence[int], checks: Sequence[Checked | None],
             loaded: Container[int]) -> None:
        """Keep what the quick check read of just-committed messages (at delay-log offsets
        ``keys``) that the preload window holds (``loaded``: its offsets) until they are
        dispatched. At most ``kept_max`` are kept (~300 bytes each): past that, and for those
        not loaded or not quick-checked, ``dispatched_entries`` decodes the payload as before.
        A kept message leaves when it is dispatched (``dispatched_entries``), cancelled
        (``drop_kept``) or its window is built afresh (``forget_kept``)."""
        if not self.enabled:
            return
        kept = self._kept
        room = self.kept_max - len(kept) - len(self._ready)
        for key, checked in zip(keys, checks):
            if room <= 0:
                break
            if checked is not None and key in loaded:
                kept[key] = checked
                room -= 1

    def prepare(self, keys: Sequence[int]) -> None:
        """Build the message members of the ``dispatched`` lines of the kept messages at
        delay-log offsets ``keys`` that are a producer's own plain message (the others are
        built at dispatch from their kept fields): the timer's read-ahead calls this ahead of
        their due time, ``dispatched_entries`` for those it did not reach. The plain message's
        members are spelled out as in ``scheduled_checked``, which inlines them: a helper call
        and its tuple cost the send path ~1 us per message."""
        kept, ready = self._kept, self._ready
        if not kept:
            return
        subject_members: dict[str, str] = {}
        pop = kept.pop
        for key in keys:
            checked = kept.get(key)
            if checked is None:
                continue
            (msg_id, subject, tags, _, deliver_at_ms, created_at_ms, retries,
             origin_id) = checked
            if (type(msg_id) is str and type(created_at_ms) is int
                    and type(deliver_at_ms) is int and subject[:1] != "%"
                    and not retries and origin_id is None and not tags):
                member = subject_members.get(subject)
                if member is None:
                    member = subject_members[subject] = subject_member(subject)
                pop(key)
                ready[key] = (f'"msg_id":{_json_str(msg_id)}{member},"created_at_ms":'
                              f'{created_at_ms},"deliver_at_ms":{deliver_at_ms}', deliver_at_ms)

    def drop_kept(self, keys: Iterable[int]) -> None:
        """Forget the kept fields of cancelled messages (their delay-log offsets)."""
        for key in keys:
            self._kept.pop(key, None)
            self._ready.pop(key, None)

    def forget_kept(self) -> None:
        """Forget every kept field (the window they were kept for is gone)."""
        self._kept.clear()
        self._ready.clear()

    def kept_count(self) -> int:
        """How many messages' fields are kept (``keep``; ``prepare``d ones included)."""
        return len(self._kept) + len(self._ready)

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

    def scheduled_checked(self, checks: Sequence[Checked | None], payloads: Sequence[bytes],
                          now_ms: int) -> None:
        """Delayed messages made durable, as what the quick check read of each (None: the
        payload is peeked) and its payload. A producer's own message (the usual case: no retry
        copy, no origin, no tags) gets its line built here in one concatenation, the same text
        as ``scheduled`` (a unit test holds them equal)."""
        if not self.enabled:
            return
        writer = self.writer
        assert writer is not None
        start, end = writer.frame("scheduled", now_ms, PRODUCED_MEMBER)
        subject_members: dict[str, str] = {}
        lines = []
        for checked, payload in zip(checks, payloads):
            if checked is not None:
                # One unpack (Checked's field order) rather than an attribute load per field.
                (msg_id, subject, tags, _, deliver_at_ms, created_at_ms, retries,
                 origin_id) = checked
                if (type(msg_id) is str and type(created_at_ms) is int
                        and type(deliver_at_ms) is int and subject[:1] != "%"
                        and not retries and origin_id is None and not tags):
                    member = subject_members.get(subject)
                    if member is None:
                        member = subject_members[subject] = subject_member(subject)
                    lines.append(f'{start}"msg_id":{_json_str(msg_id)}{member},"created_at_ms":'
                                 f'{created_at_ms},"deliver_at_ms":{deliver_at_ms}{end}')
                    continue
                peeked = trace_members(msg_id, subject, origin_id=origin_id,
                                       created_at_ms=created_at_ms, deliver_at_ms=deliver_at_ms,
                                       retries=retries, tags=tags)
            else:
                peeked = peek_trace_members(payload)
            if peeked is None:
                continue
            own = peeked.internal is None and not peeked.retries
            lines.append(writer.line("scheduled", now_ms, peeked.members,
                                     PRODUCED_MEMBER if own else ""))
        writer.emit_lines(lines)

    def scheduled_soon(self, checks: Sequence[Checked | None], payloads: Sequence[bytes],
                       now_ms: int) -> None:
        """``scheduled_checked`` later (same lines, same ``ts_ms``): kept until
        ``build_deferred``, which the scheduler calls one event-loop turn after the commit's
        answers, with the window's placement (``Scheduler._place_unplaced``): the woken
        requests write their answers first in that turn (serverkit.frame_server), so building
        the lines (~0.7 us per message) does not delay an answer, and it costs no loop callback
        of its own. Meanwhile they are in memory, as are the lines the writer has not written
        yet: a crash loses both alike (docs/AUDIT.md, "The writer")."""
        if self.enabled:
            self._deferred.append((checks, payloads, now_ms))

    def build_deferred(self) -> None:
        """Build and queue the lines ``scheduled_soon`` deferred, now (the scheduler's placement
        after a commit, and a stop)."""
        deferred, self._deferred = self._deferred, []
        for checks, payloads, now_ms in deferred:
            self.scheduled_checked(checks, payloads, now_ms)

    def dispatched(self, payloads: Iterable[bytes], now_ms: int) -> None:
        """Messages a realtime broker confirmed (lateness = now - deliver_at). The line's
        constant parts are built once per batch (``TraceWriter.frame``)."""
        if not self.enabled:
            return
        writer = self.writer
        assert writer is not None
        start, end = writer.frame("dispatched", now_ms)
        writer.emit_lines(dispatched_lines(start, end, payloads, now_ms))

    def dispatched_entries(self, keys: Sequence[int], payloads: Sequence[bytes],
                           now_ms: int) -> None:
        """``dispatched`` of the messages at delay-log offsets ``keys`` (one per payload):
        those whose quick-check fields were kept (``keep``) are not decoded again, and a
        producer's own message gets its line in one concatenation, the same text as
        ``dispatched`` (a unit test holds them equal). Their kept fields are dropped."""
        kept, ready = self._kept, self._ready
        if not self.enabled or not (kept or ready) or len(keys) != len(payloads):
            for key in keys:
                kept.pop(key, None)
                ready.pop(key, None)
            self.dispatched(payloads, now_ms)
            return
        if kept:
            self.prepare(keys)  # not read ahead (a late commit, a retry): their members now
        writer = self.writer
        assert writer is not None
        start, end = writer.frame("dispatched", now_ms)
        lines = []
        pop, ready_pop = kept.pop, ready.pop
        for key, payload in zip(keys, payloads):
            prepared = ready_pop(key, None)
            if prepared is not None:
                lines.append(f'{start}{prepared[0]},"lateness_ms":{now_ms - prepared[1]}{end}')
                continue
            checked = pop(key, None)
            if checked is not None:  # not a producer's own plain message
                peeked = trace_members(checked.id, checked.subject, origin_id=checked.origin_id,
                                       created_at_ms=checked.created_at_ms,
                                       deliver_at_ms=checked.deliver_at_ms,
                                       retries=checked.retries, tags=checked.tags)
            else:
                peeked = peek_trace_members(payload)
            if peeked is None:
                continue
            if peeked.deliver_at_ms is None:
                lines.append(start + peeked.members + end)
            else:
                lines.append(f'{start}{peeked.members},"lateness_ms":'
                             f'{now_ms - peeked.deliver_at_ms}{end}')
        writer.emit_lines(lines)

    def handed_entries(self, keys: Sequence[int], payloads: Sequence[bytes],
                       holders: Sequence[str], now_ms: int) -> None:
        """``handed`` of the messages at delay-log offsets ``keys`` (one per payload), handed
        off ahead of their due time and recorded: each names the realtime broker group holding
        it (``holders``) by its server name in ``reason``, so the audit names that group as
        its holder. Their kept fields serve the line and are dropped."""
        kept, ready = self._kept, self._ready
        if not self.enabled:
            self.drop_kept(keys)
            return
        writer = self.writer
        assert writer is not None
        extras: dict[str, str] = {}
        lines = []
        for key, payload, holder in zip(keys, payloads, holders):
            prepared = ready.pop(key, None)
            if prepared is not None:
                members = prepared[0]
            else:
                checked = kept.pop(key, None)
                peeked = peek_trace_members(payload) if checked is None else trace_members(
                    checked.id, checked.subject, origin_id=checked.origin_id,
                    created_at_ms=checked.created_at_ms, deliver_at_ms=checked.deliver_at_ms,
                    retries=checked.retries, tags=checked.tags)
                if peeked is None:
                    continue
                members = peeked.members
            extra = extras.get(holder)
            if extra is None:
                extra = extras[holder] = reason_member(f"realtime:{holder}")
            lines.append(writer.line("handed", now_ms, members, extra))
        writer.emit_lines(lines)

    def cancelled(self, message_id: str, subject: str | None, deliver_at_ms: int,
                  now_ms: int) -> None:
        """A pending message withdrawn by its producer."""
        if self.enabled and subject is not None:
            writer = self.writer
            assert writer is not None
            members = message_members(message_id, subject, deliver_at_ms=deliver_at_ms)
            writer.emit_lines([writer.line("cancelled", now_ms, members)])
