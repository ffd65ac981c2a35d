"""The realtime broker's give-up traces (``gave_up`` with a reason, and ``cancelled`` for a held
message a ``cancel_held`` dropped), and the naming of entries a restart found held or queued for
redelivery so that a later give-up of one can name it: the ``GiveUpTracing`` part of
``realtime.tracing.BrokerTracer`` (split from it; the owners of its fields are written there).
"""

from __future__ import annotations

from itertools import repeat
from typing import Any, Iterable, Sequence

from tracelog.events import consumer_members, locator_member, message_members, reason_member
from tracelog.peek import peek_trace_members
from tracelog.writer import TraceWriter
from wire.message import parse_internal_subject

_peek = peek_trace_members


def _user_subject(subject: str) -> str:
    """The user subject a wire subject (``%retry%<subject>%<group>``...) is traced under."""
    internal = parse_internal_subject(subject)
    return subject if internal is None else internal.subject


def _by_location(subject: str, sequence: int) -> str:
    """The members of a copy the broker cannot read (not even its id): named
    ``<subject>@<consumer-log seq>``, with the locator (``seq``, and ``log_subject`` for an
    internal subject) that the audit matches against the copy's ``stored`` line."""
    user_subject = _user_subject(subject)
    return (message_members(f"{subject}@{sequence}", user_subject)
            + locator_member(sequence, None if user_subject == subject else subject))


class GiveUpTracing:
    """Give-ups and the restart naming behind them; mixed into ``BrokerTracer``, which sets the
    fields below in its ``__init__`` and documents their owners."""

    writer: TraceWriter | None
    enabled: bool
    gave_up_counts: dict[str, int]
    held_cancelled_count: int
    _held: dict[tuple[str, str, str], dict[int, tuple[str, int] | int]]
    _released: dict[tuple[str, str], dict[int, str]]

    def held_before_restart(self, subject: str, key: str, consumer: str,
                            entries: dict[int, int]) -> None:
        """Remember entries (pull seq -> consumer-log seq) a consumer held when the broker
        started, so their acks can be traced (pull-log thread, at start); ``name_from_store``
        then gives them their members."""
        if self.enabled and entries:
            self._held.setdefault((subject, key, consumer), {}).update(entries)

    def queued_before_restart(self, subject: str, key: str, log_seqs: Iterable[int]) -> None:
        """Remember the entries waiting for redelivery when the broker started (at start), so
        ``name_from_store`` names them; a later unreadable redelivery is then traced by name."""
        if self.enabled:
            released = self._released.setdefault((subject, key), {})
            released.update(zip(log_seqs, repeat("")))

    def name_from_store(self, read: Any) -> None:
        """At start, before any pull or ack: read the records of the entries remembered by
        ``held_before_restart`` and ``queued_before_restart`` (``read(subject, log_seq)`` ->
        payload, raising for an unreadable record) and keep their members. Entries whose record
        cannot be read stay unnamed: an ack of one is traced as ``ack_unreadable``."""
        if not self.enabled:
            return
        for (subject, _key, _consumer), held in self._held.items():
            for pull_seq, value in list(held.items()):
                if type(value) is int:
                    members = self._read_members(read, subject, value)
                    if members is not None:
                        held[pull_seq] = (members, value)
        for (subject, _key), released in self._released.items():
            for log_seq in [seq for seq, members in released.items() if not members]:
                members = self._read_members(read, subject, log_seq)
                if members is None:
                    del released[log_seq]
                else:
                    released[log_seq] = members

    @staticmethod
    def _read_members(read: Any, subject: str, log_seq: int) -> str | None:
        try:
            peeked = _peek(read(subject, log_seq))
        except Exception:  # an unreadable record: named later, if ever, by its sequence
            return None
        return None if peeked is None else peeked.members

    def _count_gave_up(self, reason: str, count: int) -> None:
        if count:
            self.gave_up_counts[reason] = self.gave_up_counts.get(reason, 0) + count

    def redeliveries_unreadable(self, subject: str, key: str, log_seqs: Sequence[int],
                                now_ms: int) -> None:
        """Redeliveries whose records could not be read, acked in the group's name so they do
        not come back forever (pull-log thread): ``gave_up`` ``redelivery_unreadable``, named
        by what was remembered when they were released (the unnamed ones as
        ``<subject>@<consumer-log seq>``)."""
        self._count_gave_up("redelivery_unreadable", len(log_seqs))
        if not self.enabled or not log_seqs:
            return
        released = self._released.get((subject, key), {})
        members = [released.pop(seq, None) or _by_location(subject, seq) for seq in log_seqs]
        self._gave_up_lines(members, now_ms, "redelivery_unreadable", key)

    def records_unreadable(self, subject: str, key: str, found: Sequence[tuple[int, str | None]],
                           now_ms: int) -> None:
        """Records a group's pull passed over for good because they fail verification (event
        loop): ``gave_up`` ``record_unreadable`` for the group, named by the id read without
        the CRC check (``MessageStore.unverified_id``), else ``<subject>@<consumer-log seq>``
        with its locator (``_by_location``). Either way the line carries the locator, so the
        audit can also find the origin of a retry copy named by its own id."""
        self._count_gave_up("record_unreadable", len(found))
        if self.enabled and found:
            user_subject = _user_subject(subject)
            log_subject = None if user_subject == subject else subject
            self._gave_up_lines([message_members(msg_id, user_subject)
                                 + locator_member(seq, log_subject) if msg_id
                                 else _by_location(subject, seq)
                                 for seq, msg_id in found], now_ms, "record_unreadable", key)

    def held_deleted(self, held: Sequence[tuple[str, str]], now_ms: int,
                     reason: str = "retention_hard_cap") -> None:
        """Held messages (not yet visible) given up: ``gave_up`` ``reason``
        (``retention_hard_cap``: its hard cap deleted them; ``held_unreadable``: rotten by
        their due time), named by (wire subject, message id)."""
        self._count_gave_up(reason, len(held))
        if self.enabled and held:
            self._gave_up_lines([message_members(message_id, subject)
                                 for subject, message_id in held], now_ms, reason, None)

    def held_cancelled(self, subject: str, message_ids: Sequence[str], now_ms: int) -> None:
        """Held messages a ``cancel_held`` dropped (never made visible): ``cancelled``
        ``reason`` ``held_cancelled``, named by (wire subject, message id); counted in
        ``held_cancelled_count`` even when tracing is off."""
        self.held_cancelled_count += len(message_ids)
        if self.enabled and message_ids:
            writer = self.writer
            assert writer is not None
            extra = reason_member("held_cancelled")
            writer.emit_lines([writer.line("cancelled", now_ms,
                                           message_members(message_id, subject), extra)
                               for message_id in message_ids])

    def retention_deleted(self, count: int, members: Sequence[str], now_ms: int,
                          unnamed: Sequence[tuple[str, int]] = ()) -> None:
        """Messages retention's hard cap deleted before every pull-log group was past them
        (event loop): ``gave_up`` ``retention_hard_cap`` for every group (group null: a group
        that had acked it has settled it), named by the members the store thread built
        (``members_of``), and those whose record could not be read (``unnamed``: (wire
        subject, consumer-log seq)) by their location (``_by_location``)."""
        self._count_gave_up("retention_hard_cap", count)
        if self.enabled and (members or unnamed):
            self._gave_up_lines([*members, *(_by_location(s, seq) for s, seq in unnamed)],
                                now_ms, "retention_hard_cap", None)

    @staticmethod
    def members_of(payload: bytes) -> str | None:
        """The trace members of a stored payload (any thread), or None if it does not parse."""
        peeked = _peek(payload)
        return None if peeked is None else peeked.members

    def acks_unreadable(self, subject: str, key: str, consumer: str, log_seqs: Sequence[int],
                        now_ms: int) -> None:
        """Acks of entries pulled before a restart whose records could not be read to name
        them: ``gave_up`` ``ack_unreadable`` under ``<subject>@<consumer-log seq>`` with its
        locator (``_by_location``), so the audit counts it as the ack of the copy stored there."""
        self._count_gave_up("ack_unreadable", len(log_seqs))
        if self.enabled and log_seqs:
            self._gave_up_lines([_by_location(subject, seq) for seq in log_seqs],
                                now_ms, "ack_unreadable", key, consumer)

    def _gave_up_lines(self, members: Sequence[str], now_ms: int, reason: str,
                       group: str | None, consumer: str | None = None) -> None:
        writer = self.writer
        assert writer is not None
        extra = consumer_members(group, consumer) + reason_member(reason)
        writer.emit_lines([writer.line("gave_up", now_ms, found, extra) for found in members])
