"""The realtime broker's trace events (``tracelog.events``): produced, stored, pulled, redelivered,
acked, nacked, retried, dead, expired, gave_up, subscribed and unsubscribed. ``produced`` is
written as a flag on the message's ``stored`` line, which readers expand into both events.

Give-ups (``gave_up`` with a reason, counted in ``gave_up_counts`` even when tracing is off):
a redelivery whose record the store cannot read (``redelivery_unreadable``: the broker acks it
in the group's name so it does not come back forever), an ack of a record the store cannot
read to name it (``ack_unreadable``), a record a group's pull passed over because it fails
verification (``record_unreadable``) and a message retention's hard cap deleted before every
group had consumed it (``retention_hard_cap``). To name the first, the members of entries released for
redelivery are kept (``_released``) until they are handed out again; a broker that restarts
learns them, and those of what consumers held, by reading their records once at start
(``name_from_store``). The give-ups and that naming are in ``realtime.trace_give_ups``
(``GiveUpTracing``, a part of ``BrokerTracer``); what settles a held entry (acks, nacks,
copies, expiries) in ``realtime.trace_settled`` (``SettledTracing``, another part).

Subscriptions: the first pull of a consumer since the start, and any pull whose tag filter
differs from its last one, is traced as ``subscribed`` with the filter; a consumer's leave or
expiry as ``unsubscribed``. The audit expects of a group only what its filters select.

Events carry the user subject (a retry copy's ``%retry%<subject>%<group>`` is traced under
``<subject>``) and the chain's origin id, read from the payload without building a ``Message``.
To name what an ack settled (acks carry pull sequences, not ids), the tracer remembers the pulled
entries each consumer still holds; ``prune`` forgets those released by an ack timeout or a
consumer's expiry. After a restart the entries pulled before it are no longer known, and their
acks are traced by reading the ids from the store instead (``acked_payloads``).

Each method runs on the thread that has the data at hand (the event loop or a storage thread);
``TraceWriter.emit`` is thread-safe and never blocks on I/O. Pull bookkeeping is touched only
inside the pull log's calls (on its thread, or on the event loop through
``Broker.on_pulllog_quick`` while that thread is idle: one at a time either way).
"""

from __future__ import annotations

from itertools import islice, repeat
from operator import itemgetter
from typing import Any, Iterable, Sequence

from serverkit.send_check import Checked
from tracelog.peek import TracePeek, dispatched_lines, peek_trace_members, trace_members
from realtime.trace_give_ups import GiveUpTracing
from realtime.trace_settled import SettledTracing
from tracelog.events import (PRODUCED_MEMBER, consumer_members, json_string_literal, locator_member,
                             subject_member, subscription_event)
from tracelog.writer import TraceWriter

_peek = peek_trace_members
_json_str = json_string_literal
# Subjects whose encoded ``,"subject":...`` member is kept for the store fast path; a few
# dozen bytes each, the others are encoded per message.
SUBJECT_MEMBERS_MAX = 1_024
# The members of messages stored lately, by subject and consumer-log sequence, for their first
# pull: most messages are pulled soon after they are stored, and this saves decoding their
# payload again. Bounded: per subject the last RECENT_PER_SUBJECT_MAX sequences, for at most
# RECENT_SUBJECTS_MAX subjects (the others decode), and RECENT_ENTRIES_MAX in all (past it the
# subjects give up their oldest down to RECENT_ENTRIES_MAX / subjects kept); about 250 bytes an
# entry, 64 MB at most
# (reached only by subjects stored and not pulled: a pull takes its entries out). Consumers
# running behind by up to this many messages (32 pulls of 1024: a hot slot of 20,000 made
# visible at once, drained by one consumer) are still traced without a decode, which costs
# ~3 us a message on the broker (~35 ms of a 20,000 drain when the window was 8,192).
RECENT_PER_SUBJECT_MAX = 32_768
RECENT_SUBJECTS_MAX = 32
RECENT_ENTRIES_MAX = 262_144
# Batches of up to this many messages have their stored lines built one message at a time
# (``_stored_few``), larger ones column by column (``_stored_run``): at 2,000 msg/s a commit
# carries a few messages and the event loop's code is out of the CPU caches between two, where
# 2-3 messages cost 64-77 CPU-us one by one against 82-104 by columns, and 4 about the same
# (BrokerTracer.stored, caches evicted before each call; docs/BENCHMARKS.md, sendpath-s14).
# A commit of one message (a producer waiting for each confirmation) is built inline in
# ``stored``, without the lists of either (docs/BENCHMARKS.md, session 23, tracec).
STORED_FEW_MAX = 3
# ``locator_member`` of sequence 0 without a log subject: what the locator of any sequence
# starts with, the rest of it (an internal subject's log_subject) being the same for a batch.
_SEQ_ZERO = locator_member(0)


# Fields of a Checked, taken by ``map`` in C over a batch.
_id_of = itemgetter(0)
_subject_of = itemgetter(1)
_deliver_of = itemgetter(4)
_created_of = itemgetter(5)
_retries_of = itemgetter(6)
_origin_of = itemgetter(7)
_tags_of = itemgetter(2)


def _producers_own(peeked: TracePeek) -> bool:
    """Not delayed, not a retry or dead copy: the message enters the system here."""
    return peeked.internal is None and peeked.deliver_at_ms is None and not peeked.retries


class BrokerTracer(GiveUpTracing, SettledTracing):
    """Emits a realtime broker's trace events; every method is a no-op when tracing is off.

    Events are encoded here, straight to JSON lines (``TraceWriter.line``), and handed to the
    writer once per call; the ``stored``, ``pulled`` and ``acked`` lines as members only
    (``TraceWriter.emit_framed``: the writer's thread builds their frame and joins them). A message's members are encoded once and shared by its events: on
    store from what the send check already read, on pull from the payload (one decoding), and
    an entry pulled is remembered with its members, so its ack costs no decoding.

    Owners (the broker calls each method on the thread that has the data at hand, and its
    docstring says which when it is not the event loop):

    - ``_held`` (what each consumer holds) and ``_released`` (what waits for redelivery): the
      pull log's calls (on its thread, or on the event loop while that thread is idle, never
      two at once: ``Broker.on_pulllog_quick``; ``pulled_columns``, ``acked``, ``prune``,
      ``forget``, ``held_before_restart``, ``queued_before_restart``, ``consumers``), and the
      store thread
      once at start (``name_from_store``), before any pull or ack;
    - ``_subscriptions``: the event loop (``subscribed``, ``unsubscribed``,
      ``expire_subscriptions``);
    - ``gave_up_counts``: one writer per reason (``redelivery_unreadable`` the pull log's
      calls, ``ack_unreadable``, ``record_unreadable`` and ``retention_hard_cap`` the event
      loop), read by metrics at scrape time;
    - ``_recent`` (members of messages just stored): filled on the event loop (``stored``),
      taken in the pull log's calls (``pulled_columns``); each side's step is a dict operation
      done in C, atomic under the GIL, and a member not found is decoded from the payload;
    - ``_subject_members``: the event loop (``stored``);
    - ``writer`` and ``enabled``: set at construction, never written after
      (``TraceWriter.emit_lines`` is thread-safe).
    """

    def __init__(self, writer: TraceWriter | None) -> None:
        self.writer = writer
        self.enabled = writer is not None and writer.enabled
        # (subject, pull-log group, consumer) -> pull seq -> (message members, consumer-log
        # seq) of what it holds, or the consumer-log seq alone for an entry pulled before a
        # restart whose record could not be read then (members unknown); a pull-log call
        self._held: dict[tuple[str, str, str], dict[int, tuple[str, int] | int]] = {}
        # (subject, pull-log group) -> consumer-log seq -> members of entries released for
        # redelivery and not handed out again yet (a pull-log call)
        self._released: dict[tuple[str, str], dict[int, str]] = {}
        # (subject, pull-log group, consumer) -> its last tag filter (event loop only)
        self._subscriptions: dict[tuple[str, str, str], frozenset[str]] = {}
        # gave_up reason -> messages, counted whether tracing is on or not (read by metrics);
        # each reason has one writer: redelivery_unreadable a pull-log call,
        # ack_unreadable the event loop
        self.gave_up_counts: dict[str, int] = {}
        self.held_cancelled_count = 0  # held messages a cancel_held dropped (event loop)
        # wire subject -> consumer-log sequence -> members; filled on store (event loop), taken
        # on the first pull (a pull-log call): single dict operations are atomic under the GIL.
        self._recent: dict[str, dict[int, str]] = {}
        # wire subject -> its encoded subject member (event loop only)
        self._subject_members: dict[str, str] = {}

    def made_visible(self, messages: Sequence[Checked], sequences: Sequence[int],
                     payloads: Sequence[bytes], now_ms: int) -> None:
        """Held messages made visible (the hand-off ahead of the due time): ``stored`` with
        their sequences and ``dispatched`` with their lateness, the events a dispatch at the
        due time leaves (docs/AUDIT.md: the broker writes the hand-off's ``dispatched``)."""
        if not self.enabled or not messages:
            return
        self.stored(messages, sequences, now_ms)
        writer = self.writer
        assert writer is not None
        start, end = writer.frame("dispatched", now_ms)
        writer.emit_lines(dispatched_lines(start, end, payloads, now_ms))

    def visible_members(self, checked: Checked) -> str | None:
        """The members a held message's ``stored`` and ``dispatched`` lines will carry, built
        at the hand-off (ahead of the due time) for ``made_visible_members``; None when tracing
        is off or the message is not a plain delayed one (the general path takes it)."""
        if not self.enabled or checked.deliver_at_ms is None:
            return None
        peeked = trace_members(checked.id, checked.subject, origin_id=checked.origin_id,
                               created_at_ms=checked.created_at_ms,
                               deliver_at_ms=checked.deliver_at_ms, retries=checked.retries,
                               tags=checked.tags)
        if peeked is None or _producers_own(peeked):
            return None
        return peeked.members

    def made_visible_members(self, subject: str, members: Sequence[str],
                             sequences: Sequence[int], deliver_at_ms: Sequence[int],
                             now_ms: int) -> None:
        """``made_visible`` of held messages of ``subject`` whose members ``visible_members``
        built: the same lines, queued as columns (a hot slot's due instant). The writer keeps
        ``members`` and ``sequences``: the caller no longer changes them."""
        if not self.enabled or not members:
            return
        writer = self.writer
        assert writer is not None
        s_start, s_end = writer.frame("stored", now_ms)
        d_start, d_end = writer.frame("dispatched", now_ms)
        # What every line of the batch shares is built once: the locator's part after the
        # sequence (an internal subject's log_subject) joins the stored lines' end, and each
        # distinct due time's lateness the dispatched lines' (a hot slot has one).
        locator_tail = locator_member(0, subject if subject[:1] == "%" else None)
        assert locator_tail.startswith(_SEQ_ZERO), locator_tail
        s_end = locator_tail[len(_SEQ_ZERO):] + s_end
        # Queued as columns: the writer joins the lines when it writes them (one C join),
        # not here on the event loop in the hot slot's window.
        writer.emit_columns([s_start, members, ',"seq":', sequences, s_end])
        if len(set(deliver_at_ms)) == 1:
            d_end = f',"lateness_ms":{now_ms - deliver_at_ms[0]}{d_end}'
            writer.emit_columns([d_start, members, d_end])
        else:
            writer.emit_lines([f'{d_start}{member},"lateness_ms":{now_ms - due}{d_end}'
                               for member, due in zip(members, deliver_at_ms)])
        self._remember(subject, sequences, members)

    # ------------------------------------------------------------------ subscriptions

    def subscribed(self, subject: str, key: str, consumer: str, tags: frozenset[str],
                   now_ms: int) -> None:
        """A pull of ``consumer`` of pull-log group ``key`` with tag filter ``tags`` (empty:
        every message); traced when it is new or differs from the consumer's last (event loop).
        Pulls of internal subjects (retry copies, dead letters) are not subscriptions."""
        if not self.enabled:
            return
        hkey = (subject, key, consumer)
        if self._subscriptions.get(hkey) == tags or subject[:1] == "%":
            return
        self._subscriptions[hkey] = tags
        writer = self.writer
        assert writer is not None
        writer.emit(subscription_event("subscribed", ts_ms=now_ms, subject=subject, group=key,
                                       consumer=consumer, tags=tags))

    def unsubscribed(self, consumers: Iterable[tuple[str, str, str]], now_ms: int,
                     reason: str) -> None:
        """(subject, pull-log group, consumer) left or expired (event loop)."""
        if not self.enabled:
            return
        writer = self.writer
        assert writer is not None
        for hkey in consumers:
            if self._subscriptions.pop(hkey, None) is not None:
                subject, key, consumer = hkey
                writer.emit(subscription_event("unsubscribed", ts_ms=now_ms, subject=subject,
                                               group=key, consumer=consumer, reason=reason))

    def expire_subscriptions(self, last_seen: dict[tuple[str, str], dict[str, int]],
                             now_ms: int, expiry_ms: int) -> None:
        """Trace as expired the subscriptions of consumers not seen (``last_seen``: (subject,
        group) -> consumer -> last pull or heartbeat) for ``expiry_ms`` (event loop)."""
        if not self.enabled or not self._subscriptions:
            return
        gone = []
        for hkey in self._subscriptions:
            seen_ms = last_seen.get((hkey[0], hkey[1]), {}).get(hkey[2])
            if seen_ms is None or now_ms - seen_ms > expiry_ms:
                gone.append(hkey)
        if gone:
            self.unsubscribed(gone, now_ms, "expired")

    def stored(self, messages: Sequence[Checked], sequences: Sequence[int | None],
               now_ms: int) -> None:
        """Messages made durable: what the send check read of each, and its consumer-log
        sequence (None: a duplicate, not traced). No payload is decoded again. A producer's
        own message (not delayed, not a retry or dead copy) is also ``produced`` at its
        created_at_ms: its stored line carries the ``produced`` flag that readers expand."""
        if not self.enabled or not messages:
            return
        writer = self.writer
        assert writer is not None
        if len(messages) == 1:
            # One message a commit (a producer waiting for each confirmation, issue 18):
            # ``_stored_few``'s line and ``_remember``'s step for it, without their lists.
            checked, sequence = messages[0], sequences[0]
            subject, msg_id = checked.subject, checked.id
            created_at_ms, deliver_at_ms = checked.created_at_ms, checked.deliver_at_ms
            if (sequence is not None and subject[:1] != "%" and type(msg_id) is str
                    and type(created_at_ms) is int and not checked.retries
                    and checked.origin_id is None and not checked.tags
                    and (deliver_at_ms is None or type(deliver_at_ms) is int)):
                subject_member = (self._subject_members.get(subject)
                                  or self._subject_member(subject))
                if deliver_at_ms is None:  # a producer's own message: flagged produced
                    extra, due = PRODUCED_MEMBER, ""
                else:  # dispatched by a delay server
                    extra, due = "", f',"deliver_at_ms":{deliver_at_ms}'
                members = (f'"msg_id":{_json_str(msg_id)}{subject_member},'
                           f'"created_at_ms":{created_at_ms}{due}')
                writer.emit_framed("stored", now_ms, [f'{members},"seq":{sequence}'], extra)
                recent = self._recent.get(subject)
                if recent is None or len(self._recent) != 1:
                    self._remember(subject, (sequence,), (members,))
                    return
                # The only subject kept: its share is the smaller bound (``_remember``).
                share = min(RECENT_PER_SUBJECT_MAX, RECENT_ENTRIES_MAX)
                recent[sequence] = members
                if sequence >= share:
                    recent.pop(sequence - share, None)
                if len(recent) > RECENT_ENTRIES_MAX:  # gaps in the sequences: the oldest go
                    list(map(recent.pop, list(islice(recent, len(recent) - share)),
                             repeat(None)))
                return
        if len(messages) <= STORED_FEW_MAX:
            if self._stored_few(messages, sequences, now_ms):
                return
        elif self._stored_run(messages, sequences, now_ms):
            return
        # A producer's own message: one stored line flagged produced stands for both events
        # (readers expand it, tracelog.events), a quarter of the lines a message costs.
        start, end = writer.frame("stored", now_ms, PRODUCED_MEMBER)
        lines = []
        remembered: dict[str, tuple[list[int], list[str]]] = {}
        for checked, sequence in zip(messages, sequences):
            if sequence is None:
                continue
            msg_id, subject, created_at_ms = checked.id, checked.subject, checked.created_at_ms
            if (type(msg_id) is str and type(created_at_ms) is int and subject[:1] != "%"
                    and checked.deliver_at_ms is None and not checked.retries
                    and checked.origin_id is None and not checked.tags):
                # The common case, built here: message_members' output for these values
                # (a unit test holds them equal) without its general checks.
                members = (f'"msg_id":{_json_str(msg_id)}{self._subject_member(subject)},'
                           f'"created_at_ms":{created_at_ms}')
                lines.append(f'{start}{members},"seq":{sequence}{end}')
            else:
                peeked = trace_members(msg_id, subject, origin_id=checked.origin_id,
                                       created_at_ms=created_at_ms,
                                       deliver_at_ms=checked.deliver_at_ms,
                                       retries=checked.retries, tags=checked.tags)
                if peeked is None:
                    continue
                members = peeked.members
                # The locator after the members: they are remembered for the pull, which
                # does not carry it.
                located = members + locator_member(sequence, subject if subject[:1] == "%"
                                                   else None)
                lines.append(writer.line("stored", now_ms, located,
                                         PRODUCED_MEMBER if _producers_own(peeked) else ""))
            run = remembered.get(subject)
            if run is None:
                run = remembered[subject] = ([], [])
            run[0].append(sequence)
            run[1].append(members)
        writer.emit_lines(lines)
        for subject, (subject_sequences, subject_members) in remembered.items():
            self._remember(subject, subject_sequences, subject_members)

    def _stored_few(self, messages: Sequence[Checked], sequences: Sequence[int | None],
                    now_ms: int) -> bool:
        """``stored`` of up to STORED_FEW_MAX messages of one user subject, each of the usual
        kind (no retry copy, no tags; a producer's own or dispatched by a delay server): each
        line in one concatenation, where ``_stored_run``'s passes over columns cost the same
        for a few messages as for hundreds. The same text (unit tests hold it equal); False,
        having emitted nothing, for any other batch."""
        subject = messages[0].subject
        if subject[:1] == "%":
            return False
        # The kept member looked up here: a call fewer a commit (issue 18).
        subject_member = self._subject_members.get(subject) or self._subject_member(subject)
        located = []
        members_of = []
        extras = []  # each line's extra members
        for checked, sequence in zip(messages, sequences):
            msg_id, created_at_ms = checked.id, checked.created_at_ms
            deliver_at_ms = checked.deliver_at_ms
            if (sequence is None or checked.subject != subject or type(msg_id) is not str
                    or type(created_at_ms) is not int or checked.retries
                    or checked.origin_id is not None or checked.tags):
                return False
            if deliver_at_ms is None:  # a producer's own message: its line is flagged produced
                extra, due = PRODUCED_MEMBER, ""
            elif type(deliver_at_ms) is int:  # dispatched by a delay server
                extra, due = "", f',"deliver_at_ms":{deliver_at_ms}'
            else:
                return False
            members = (f'"msg_id":{_json_str(msg_id)}{subject_member},'
                       f'"created_at_ms":{created_at_ms}{due}')
            located.append(f'{members},"seq":{sequence}')
            members_of.append(members)
            extras.append(extra)
        writer = self.writer
        assert writer is not None
        if extras.count(extra) == len(extras):  # the usual: the writer's thread builds the lines
            writer.emit_framed("stored", now_ms, located, extra)
        else:  # produced and dispatched messages in one commit: each line its own frame
            writer.emit_lines([writer.line("stored", now_ms, member, extra)
                               for member, extra in zip(located, extras)])
        self._remember(subject, sequences, members_of)  # type: ignore[arg-type]  # no None
        return True

    def _stored_run(self, messages: Sequence[Checked], sequences: Sequence[int | None],
                    now_ms: int) -> bool:
        """``stored`` of the usual batch, every line built by maps in C: one user subject, all
        stored, no retry copy, and either none delayed (a producer's own messages: lines
        flagged produced) or all delayed (dispatched by a delay server: with deliver_at_ms);
        none with tags.
        The same text as the per-message path (unit tests hold them equal); False, having
        done nothing, for any other batch."""
        subjects = set(map(_subject_of, messages))
        if (len(subjects) != 1 or None in sequences
                or set(map(_retries_of, messages)) != {0}
                or set(map(_origin_of, messages)) != {None}
                or any(map(_tags_of, messages))):
            return False
        subject = next(iter(subjects))
        ids = list(map(_id_of, messages))
        created = list(map(_created_of, messages))
        if (subject[:1] == "%" or set(map(type, ids)) != {str}
                or set(map(type, created)) != {int}):
            return False
        delivers = list(map(_deliver_of, messages))
        deliver_types = set(map(type, delivers))
        joined = "".join(ids)
        if len(_json_str(joined)) == len(joined) + 2:
            # Nothing in any id needs escaping (one C pass over them all says so; ids the send
            # check accepted are printable ASCII and rarely hold a quote or a backslash): each
            # JSON string is the id in quotes.
            id_columns = [repeat('"msg_id":"'), ids, repeat('"')]
        else:
            id_columns = [repeat('"msg_id":'), map(_json_str, ids)]
        head = f'{self._subject_member(subject)},"created_at_ms":'
        if deliver_types == {int}:
            extra = ""
            times = set(created).union(delivers)
        elif deliver_types == {type(None)}:
            extra = PRODUCED_MEMBER
            times = set(created)
        else:
            return False
        # A batch's messages were mostly created (and are due) within the same few
        # milliseconds: each distinct time is converted once.
        text = {value: str(value) for value in times}.__getitem__
        columns = [*id_columns, repeat(head), map(text, created)]
        if extra == "":
            columns += [repeat(',"deliver_at_ms":'), map(text, delivers)]
        members = list(map("".join, zip(*columns)))
        writer = self.writer
        assert writer is not None
        # The frame around the lines is built by the writer's thread.
        writer.emit_framed("stored", now_ms, list(map("".join, zip(
            members, repeat(',"seq":'), map(str, sequences)))), extra)
        self._remember(subject, sequences, members)  # type: ignore[arg-type]  # no None here
        return True

    def _subject_member(self, subject: str) -> str:
        """``,"subject":...`` of a user subject, kept for the first SUBJECT_MEMBERS_MAX."""
        encoded = self._subject_members.get(subject)
        if encoded is None:
            encoded = subject_member(subject)
            if len(self._subject_members) < SUBJECT_MEMBERS_MAX:
                self._subject_members[subject] = encoded
        return encoded

    def _remember(self, subject: str, sequences: Sequence[int], members: Sequence[str]) -> None:
        """Keep the members of messages just stored for their first pull (``pulled``): of each
        of RECENT_SUBJECTS_MAX subjects the last ``share`` sequences, where a subject's share
        is RECENT_PER_SUBJECT_MAX while up to 8 subjects are kept and shrinks to
        RECENT_ENTRIES_MAX / subjects kept beyond that, so RECENT_ENTRIES_MAX bounds them all.
        Over that total the subjects give up their oldest members down to their share: a
        subject stored and not pulled never holds a busy subject's room for good (review s13
        rvperf-3: refusing the new batch did)."""
        kept_by_subject = self._recent
        recent = kept_by_subject.get(subject)
        if recent is None:
            if len(kept_by_subject) >= RECENT_SUBJECTS_MAX:
                return
            recent = kept_by_subject[subject] = {}
        share = min(RECENT_PER_SUBJECT_MAX, RECENT_ENTRIES_MAX // len(kept_by_subject))
        recent.update(zip(sequences, members))
        # Sequences arrive in increasing order: forget those now ``share`` behind.
        low, high = sequences[0] - share, sequences[-1] - share
        if high >= 0:
            list(map(recent.pop, range(max(low, 0), high + 1), repeat(None)))
        # At most RECENT_SUBJECTS_MAX lengths summed; the pull log's calls only pop entries.
        if sum(map(len, kept_by_subject.values())) > RECENT_ENTRIES_MAX:
            for kept in kept_by_subject.values():
                excess = len(kept) - share
                if excess > 0:  # oldest first: a dict keeps the stored (increasing) order
                    # pop(, None): a pull on the pull-log thread may take one meanwhile
                    # (review s13 rvperf-8: del raised KeyError out of the publishing).
                    list(map(kept.pop, list(islice(kept, excess)), repeat(None)))

    def pulled(self, subject: str, key: str, consumer: str, out: list[dict[str, Any]],
               now_ms: int, log_seqs: Sequence[int] = ()) -> None:
        """Entries of a pull response handed to ``consumer`` (``pulled_columns`` of them)."""
        if not self.enabled or not out:
            return
        redelivered = [entry["redelivered"] for entry in out]
        self.pulled_columns(subject, key, consumer, [entry["pull_seq"] for entry in out],
                            [entry["payload"] for entry in out],
                            redelivered if any(redelivered) else None, now_ms, log_seqs)

    def pulled_columns(self, subject: str, key: str, consumer: str, pull_seqs: Sequence[int],
                       payloads: Sequence[bytes], redelivered: Sequence[int] | None,
                       now_ms: int, log_seqs: Sequence[int] = ()) -> None:
        """Entries handed to ``consumer`` of pull-log group ``key`` (a pull-log call), as
        columns: their pull seqs, payloads, times redelivered (None: all first deliveries) and
        consumer-log sequences (to find the members of messages stored lately without decoding
        their payloads). Per entry this is a dict lookup and one string concatenation."""
        if not self.enabled or not pull_seqs:
            return
        writer = self.writer
        assert writer is not None
        recent = self._recent.get(subject) if log_seqs else None
        if len(pull_seqs) == 1 and redelivered is None and recent is not None:
            # One entry, a first delivery of a message stored lately (a consumer pulling each
            # message as it comes, issue 18): what the general path below does for it.
            member = recent.pop(log_seqs[0], None)
            if member is not None:
                held = self._held.get((subject, key, consumer))
                if held is None:
                    held = self._held[(subject, key, consumer)] = {}
                held[pull_seqs[0]] = (member, log_seqs[0])
                writer.emit_framed("pulled", now_ms, [member], (key, consumer))
                return
            members = [None]
        elif recent is not None:
            members = list(map(recent.pop, log_seqs, repeat(None)))
        else:
            members = [None] * len(pull_seqs)
        held = self._held.setdefault((subject, key, consumer), {})
        if redelivered is not None and log_seqs:
            released = self._released.get((subject, key))
            if released:  # redeliveries: named when they were released, no decode
                named = list(map(released.pop, log_seqs, repeat(None)))
                members = [found or again or None for found, again in zip(members, named)]
        if None in members:  # not stored lately (or taken by another group): decode
            for index, found in enumerate(members):
                if found is None:
                    peeked = _peek(payloads[index])
                    if peeked is not None:
                        members[index] = peeked.members
        if not log_seqs:  # a caller that does not know them (tests, benchmarks)
            log_seqs = [-1] * len(pull_seqs)
        if None in members:  # unreadable payloads: nothing to name them by
            kept = [i for i, found in enumerate(members) if found is not None]
            pull_seqs = [pull_seqs[i] for i in kept]
            members = [members[i] for i in kept]
            log_seqs = [log_seqs[i] for i in kept]
            if redelivered is not None:
                redelivered = [redelivered[i] for i in kept]
        # Held with their consumer-log seqs: released entries keep their names (``prune``).
        held.update(zip(pull_seqs, zip(members, log_seqs)))
        # A broadcast consumer's pull-log group, group#consumer, is its own audit group. The
        # frame (and its consumer members) is built by the writer's thread.
        writer.emit_framed("pulled", now_ms, members, (key, consumer))  # type: ignore[arg-type]
        if redelivered is not None:
            extra = consumer_members(key, consumer)
            writer.emit_lines([writer.line("redelivered", now_ms, found, extra)
                               for found, times in zip(members, redelivered) if times])
