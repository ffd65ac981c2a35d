"""Trace events: what the servers append so that ``spark_audit`` can prove delivery (DESIGN.md 12).

Format: JSON Lines, one event per line, UTF-8 (in practice ASCII), files rotated hourly by the
writer's clock::

    <directory>/<YYYYMMDDHH, UTC>/<server name with unsafe characters replaced by _>-<pid>.jsonl

Why JSON Lines and not Parquet: a server appends a few lines at a time and never rewrites, so a
crash leaves at most one torn last line, which both Spark's reader (``DROPMALFORMED``) and
``read_events`` drop; Parquet needs a footer written at close, so an unclosed file is unreadable,
and it would add pyarrow to every server. The cost: JSON is 3-5x larger than Parquet and slower to
parse (the audit parses every line; docs/AUDIT.md has the figures). The audit gives Spark the
explicit schema below, so nothing is inferred.

Fields (``EVENT_FIELDS``; a missing key reads as null, so ``trace_event`` omits null fields):

    field          type            meaning
    event          string          one of EVENT_KINDS (required)
    ts_ms          long            event time, ms since the epoch (required)
    server         string          who wrote it, e.g. "realtime:rt-1" (filled in by the writer)
    msg_id         string          the message (a retry copy has its own id) (required)
    origin_id      string          root id of the retry chain; = msg_id for a first delivery
    subject        string          the USER subject, never the %retry%/%dead% name (required)
    group          string | null   consumer group
    consumer       string | null   consumer id
    created_at_ms  long | null     the message's created_at_ms
    deliver_at_ms  long | null     the message's deliver_at_ms (null = at once)
    retries        int             the copy's retry count (0 for a first delivery; absent = 0)
    lateness_ms    long | null     dispatched only: ts_ms - deliver_at_ms
    tags           array<string>   the message's tags (absent = none); on ``subscribed``, the
                                   consumer's tag filter (absent = every message)
    reason         string | null   why: ``gave_up`` (see GIVE_UP_REASONS), ``unsubscribed``
                                   (``left`` or ``expired``); ``handed``: the server name of
                                   the realtime broker group holding it ("realtime:<group>");
                                   ``cancelled`` by a realtime broker: ``held_cancelled`` (a
                                   ``cancel_held`` dropped the message it held)

Subscription events (``SUBSCRIPTION_KINDS``) are about a consumer, not a message: they carry
``subject``, ``group``, ``consumer`` (all required) and no ``msg_id``. Every other kind needs a
``msg_id``.

A line may also carry ``"produced":true`` (``LINE_FIELDS``; written as ``PRODUCED_MEMBER``): on a
``stored`` or ``scheduled`` line it says the message entered the system there, and readers
(``spark_audit.load``, ``read_events``) expand the line into two events: a ``produced`` event
(ts_ms = the line's created_at_ms, or its ts_ms when it has none; every other field the line's)
and the line's own event. So a broker writes one line where it used to write two, and every
reader still sees the ``produced`` event. Files written before the flag existed have separate
``produced`` lines and no flag, so they read exactly as before.

Kinds: ``produced`` a broker accepted the message from a producer (ts_ms = the message's
created_at_ms; written as the ``produced`` flag of its stored or scheduled line, see above); ``stored`` the realtime broker made it durable; ``scheduled`` the delay server made
a delayed message durable; ``cancelled``; ``dispatched`` the delay server got the realtime
broker's confirmation; ``handed`` the delay server handed it to a realtime broker group ahead of
its due time (``hold``; ``reason`` names the group) and recorded that: the group holds it now and
traces its ``stored`` and ``dispatched`` when it makes it visible; ``pulled`` handed to a consumer (a redelivery is ``pulled`` too, plus a
``redelivered`` event); ``acked``; ``nacked``; ``retried`` a retry copy was handed to the delay
server (msg_id = the copy's id, origin_id = the root); ``dead`` a copy stored in the dead-letter
subject; ``expired`` not delivered because expire_at passed. ``pulled`` events carry the
message's created_at_ms and deliver_at_ms (the audit needs them for lateness and early delivery).
``gave_up`` a server dropped, skipped or gave up on the message (``reason`` says why; ``group``
null = for every group); ``subscribed`` a consumer pulled with a tag filter other than the one it
had (or for the first time since the broker started); ``unsubscribed`` it left or expired.

Tracing is best effort: ``TraceWriter.emit`` never blocks on I/O and memory is bounded, so when
the disk is slow or failing, events are dropped (oldest batch first) and counted
(``dropped_events``), with one warning per flush interval. Events still in memory are lost if the
process dies; events handed to the OS survive a process crash but not a machine crash (no fsync).
The audit treats a missing ``acked`` as a lost message, so a writer that drops events makes the
audit fail loudly rather than pass quietly.

Cost: a line's members are encoded on the thread that emits it. The servers use the fast path
(``message_members`` once per message, ``TraceWriter.line`` per event or ``TraceWriter.frame``
once per batch of one kind, ``emit_lines`` once per batch; or ``emit_framed``, whose frame and
lines the writer's thread builds): string formatting with strings escaped by json's own C escaper, no dict and no
``json.dumps``; ``emit(trace_event(...))`` is the general, slower path (tests, tools). Both give
the same JSON (a Hypothesis test compares them). ``bench/trace.py`` measures the broker's cost.

This module is the format: kinds, fields, and the encoders of a line. ``tracelog.writer`` holds
``TraceWriter`` (batches, hourly files, drops), ``tracelog.reading`` finds trace directories and
reads events back.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable
from json.encoder import encode_basestring_ascii  # type: ignore[attr-defined]
from typing import Any


EVENT_KINDS = (
    "produced", "stored", "scheduled", "cancelled", "dispatched", "pulled", "acked", "nacked",
    "redelivered", "retried", "dead", "expired", "gave_up", "subscribed", "unsubscribed",
    "handed",
)
_EVENT_KIND_SET = frozenset(EVENT_KINDS)
# Kinds about a consumer's subscription rather than a message: no msg_id.
SUBSCRIPTION_KINDS = ("subscribed", "unsubscribed")
# ``gave_up`` reasons: a server dropped, skipped or gave up on a message. The audit reports the
# message as lost with the reason, unless the group settled it after all.
GIVE_UP_REASONS = {
    "dispatch_refused": "the realtime broker refused the delay server's dispatch for good "
                        "(bad_request, too_large or forbidden); it left the schedule",
    "dispatch_unrecorded": "dispatched and confirmed, but writing its dispatch record failed: "
                           "a restart may dispatch it again (the broker de-duplicates)",
    "redelivery_unreadable": "its record could not be read for a redelivery; acked in the "
                             "group's name so it does not come back forever",
    "ack_unreadable": "a consumer acked it after a restart, but its record could not be read "
                      "to name it (msg_id is <subject>@<consumer-log sequence>, with its "
                      "locator: the audit counts it as the ack of the copy stored there)",
    "record_unreadable": "a group's pull passed over its record for good: it fails "
                         "verification (damaged on disk); named by the id read without the CRC "
                         "check, else <subject>@<consumer-log sequence>",
    "retention_hard_cap": "retention's hard cap (age or bytes) deleted it before every consumer "
                          "group of its subject had consumed it",
    "held_unreadable": "handed to the realtime broker ahead of its due time, its held record "
                       "could no longer be read (damaged on disk) when it fell due: never "
                       "made visible",
}
UNSUBSCRIBE_REASONS = ("left", "expired")

# (name, Spark SQL type): the one schema; spark_audit.schema builds its StructType from it.
EVENT_FIELDS: tuple[tuple[str, str], ...] = (
    ("event", "string"),
    ("ts_ms", "long"),
    ("server", "string"),
    ("msg_id", "string"),
    ("origin_id", "string"),
    ("subject", "string"),
    ("group", "string"),
    ("consumer", "string"),
    ("created_at_ms", "long"),
    ("deliver_at_ms", "long"),
    ("retries", "int"),
    ("lateness_ms", "long"),
    ("tags", "array<string>"),
    ("reason", "string"),
)
EVENT_FIELD_NAMES = tuple(name for name, _ in EVENT_FIELDS)
# What a line may carry: the event fields plus the flag readers expand (see above); not an event
# field, so the events DataFrame and read_events never show it.
PRODUCED_FLAG = "produced"
# Where the realtime broker stored a copy, so a record it can no longer read (not even its id)
# can be tied back to its message: a ``stored`` line carries its consumer-log sequence ``seq``
# (and ``log_subject``, the internal subject, when the copy is a retry or dead copy stored under
# ``%retry%...``/``%dead%...``), and a ``gave_up`` line named ``<subject>@<seq>`` carries the
# same pair. The audit (``spark_audit.names``) matches them per server. Not event fields:
# ``read_events`` leaves them out, the audit keeps them beside the events.
LOCATOR_FIELDS: tuple[tuple[str, str], ...] = (("seq", "long"), ("log_subject", "string"))
LOCATOR_FIELD_NAMES = tuple(name for name, _ in LOCATOR_FIELDS)
LINE_FIELDS: tuple[tuple[str, str], ...] = (EVENT_FIELDS + LOCATOR_FIELDS
                                            + ((PRODUCED_FLAG, "boolean"),))
# The flag as line members, for ``TraceWriter.line``'s ``extra``.
PRODUCED_MEMBER = f',"{PRODUCED_FLAG}":true'
REQUIRED_FIELDS = ("event", "ts_ms", "subject")  # a line without one is dropped
MESSAGE_ID_FIELD = "msg_id"  # also required, except on SUBSCRIPTION_KINDS lines
SUBSCRIPTION_REQUIRED_FIELDS = ("group", "consumer")  # required on SUBSCRIPTION_KINDS lines

# Longest an event waits in memory before being written (plus one trickle interval).
FLUSH_INTERVAL_MS_DEFAULT = 1_000
# The writer thread looks every TRICKLE_INTERVAL_MS_DEFAULT: from TRICKLE_EVENTS_MIN_DEFAULT to
# TRICKLE_EVENTS_MAX_DEFAULT events waiting at a look is a trickle (a steady rate up to ~40,000
# events a second; 2,000 msg/s is ~6,000: a write every ~100 ms), written at once: small
# writes (~0.4 ms of CPU each), none holding the GIL long, instead of one a second that stalled a server's event loop
# (7-11 ms of CPU at 2,000 msg/s; the slowest 1% of messages in windows a second apart). Fewer
# wait for FLUSH_INTERVAL_MS_DEFAULT: a write costs a fixed part too (its thread comes back to
# cold caches: a write every 50 ms cost ~1 CPU-us/msg more than every 1 s at 2,000 msg/s).
# More is a burst, written after it (see PENDING_EVENTS_MAX_DEFAULT): a look at its start may
# write up to TRICKLE_EVENTS_MAX_DEFAULT events (a hot slot's first look wrote 1,024 in 1.1 ms
# of CPU), the rest waits.
TRICKLE_INTERVAL_MS_DEFAULT = 50
TRICKLE_EVENTS_MIN_DEFAULT = 512
TRICKLE_EVENTS_MAX_DEFAULT = 2_048
BATCH_MAX_DEFAULT = 10_000  # events per write (and per drop when the writer falls behind)
# Events held in memory at most; beyond, the oldest full batch is dropped. Half of it waiting
# wakes the writer thread before its interval: a hot slot's burst (80,000 broker events for
# 20,000 messages, stored/dispatched/pulled/acked) is written after its rounds, not in the
# middle of them (the writer's join and encode take the GIL from the rounds and pulls).
# ~250 bytes an event: ~50 MB at most.
PENDING_EVENTS_MAX_DEFAULT = 200_000
HOUR_MS = 3_600_000

_UNSAFE_NAME_CHARS = re.compile(r"[^A-Za-z0-9._-]")
# ASCII output (ensure_ascii) so a line is valid in any reader's encoding; compact separators.
_ENCODER = json.JSONEncoder(separators=(",", ":"), check_circular=False)
# The JSON string literal of a str, ASCII-escaped exactly as _ENCODER writes it (the C
# accelerator json itself uses): the fast path builds lines from these without a dict.
_json_str: Callable[[str], str] = encode_basestring_ascii
# Public name of the same, for the servers' fast paths that build members themselves.
json_string_literal = _json_str
# '{"event":"<kind>","ts_ms":' per kind: the start of every line, built once.
_LINE_STARTS = {kind: f'{{"event":{_json_str(kind)},"ts_ms":' for kind in EVENT_KINDS}


def trace_event(event: str, *, ts_ms: int, msg_id: str, subject: str,
                origin_id: str | None = None, group: str | None = None,
                consumer: str | None = None, created_at_ms: int | None = None,
                deliver_at_ms: int | None = None, retries: int = 0,
                lateness_ms: int | None = None, produced: bool = False,
                tags: Iterable[str] | None = None, reason: str | None = None) -> dict[str, Any]:
    """Build one event for ``TraceWriter.emit``: null fields are left out, ``origin_id`` defaults
    to ``msg_id``, a ``dispatched`` event's ``lateness_ms`` defaults to ts_ms - deliver_at_ms.
    ``produced``: the line also stands for a ``produced`` event (see the module docstring).
    ``tags``: the message's tags (left out when empty). Subscription events are built by
    ``subscription_event``."""
    if event not in _EVENT_KIND_SET or event in SUBSCRIPTION_KINDS:
        raise ValueError(f"trace event kind {event!r} is not one of "
                         f"{', '.join(k for k in EVENT_KINDS if k not in SUBSCRIPTION_KINDS)}")
    out: dict[str, Any] = {"event": event, "ts_ms": ts_ms, "msg_id": msg_id, "subject": subject}
    if origin_id is not None and origin_id != msg_id:
        out["origin_id"] = origin_id
    if group is not None:
        out["group"] = group
    if consumer is not None:
        out["consumer"] = consumer
    if created_at_ms is not None:
        out["created_at_ms"] = created_at_ms
    if deliver_at_ms is not None:
        out["deliver_at_ms"] = deliver_at_ms
    if retries:
        out["retries"] = retries
    if lateness_ms is None and event == "dispatched" and deliver_at_ms is not None:
        lateness_ms = ts_ms - deliver_at_ms
    if lateness_ms is not None:
        out["lateness_ms"] = lateness_ms
    if tags:
        out["tags"] = list(tags)
    if reason is not None:
        out["reason"] = reason
    if produced:
        out[PRODUCED_FLAG] = True
    return out


def subscription_event(event: str, *, ts_ms: int, subject: str, group: str, consumer: str,
                       tags: Iterable[str] | None = None, reason: str | None = None
                       ) -> dict[str, Any]:
    """A ``subscribed`` (with the consumer's tag filter; None or empty = every message) or
    ``unsubscribed`` (with a reason from UNSUBSCRIBE_REASONS) event for ``TraceWriter.emit``."""
    if event not in SUBSCRIPTION_KINDS:
        raise ValueError(f"subscription event kind {event!r} is not one of "
                         f"{', '.join(SUBSCRIPTION_KINDS)}")
    if event == "unsubscribed" and reason not in UNSUBSCRIBE_REASONS:
        raise ValueError(f"unsubscribed reason {reason!r} is not one of "
                         f"{', '.join(UNSUBSCRIBE_REASONS)}")
    out: dict[str, Any] = {"event": event, "ts_ms": ts_ms, "subject": subject, "group": group,
                           "consumer": consumer}
    if tags:
        out["tags"] = sorted(tags)
    if reason is not None:
        out["reason"] = reason
    return out


def complete(raw: dict[str, Any]) -> bool:
    """Whether a parsed line has the fields its kind requires (REQUIRED_FIELDS; ``msg_id``, or
    ``group`` and ``consumer`` for SUBSCRIPTION_KINDS). Readers drop the others."""
    if any(raw.get(name) is None for name in REQUIRED_FIELDS):
        return False
    if raw["event"] in SUBSCRIPTION_KINDS:
        return all(raw.get(name) is not None for name in SUBSCRIPTION_REQUIRED_FIELDS)
    return raw.get(MESSAGE_ID_FIELD) is not None


def _json_int(name: str, value: object) -> str:
    if type(value) is not int:  # bool is an int to Python but not to the schema
        raise ValueError(f"trace field {name} must be an int, got {value!r}")
    return str(value)


def message_members(msg_id: str, subject: str, *, origin_id: str | None = None,
                    created_at_ms: int | None = None, deliver_at_ms: int | None = None,
                    retries: int = 0, tags: Iterable[str] | None = None) -> str:
    """The message's part of an event line, pre-encoded: JSON object members (no braces) with
    the same values and the same omissions as ``trace_event``. Built once per message and
    shared by its events (``TraceWriter.line``): the fast path of a broker's tracing.

    Raises ValueError for a value the schema cannot hold (a non-str id, a non-int time)."""
    if type(msg_id) is not str or type(subject) is not str:
        raise ValueError(f"trace msg_id and subject must be str, got {msg_id!r}, {subject!r}")
    out = f'"msg_id":{_json_str(msg_id)}{subject_member(subject)}'
    if origin_id is not None and origin_id != msg_id:
        if type(origin_id) is not str:
            raise ValueError(f"trace origin_id must be a str, got {origin_id!r}")
        out += f',"origin_id":{_json_str(origin_id)}'
    # The common case (ints, no retries) costs two type checks and one f-string.
    if type(created_at_ms) is int and type(deliver_at_ms) is int:
        out += f',"created_at_ms":{created_at_ms},"deliver_at_ms":{deliver_at_ms}'
    elif type(created_at_ms) is int and deliver_at_ms is None:
        out += f',"created_at_ms":{created_at_ms}'
    else:
        if created_at_ms is not None:
            out += f',"created_at_ms":{_json_int("created_at_ms", created_at_ms)}'
        if deliver_at_ms is not None:
            out += f',"deliver_at_ms":{_json_int("deliver_at_ms", deliver_at_ms)}'
    if retries:
        out += f',"retries":{_json_int("retries", retries)}'
    if tags:
        out += tags_member(tags)
    return out


def tags_member(tags: Iterable[str]) -> str:
    """``,"tags":[...]`` for a message's (non-empty) tags. Raises ValueError for a non-str."""
    encoded = []
    for tag in tags:
        if type(tag) is not str:
            raise ValueError(f"trace tags must be str, got {tag!r}")
        encoded.append(_json_str(tag))
    return f',"tags":[{",".join(encoded)}]'


def reason_member(reason: str) -> str:
    """``,"reason":...`` for ``TraceWriter.line``'s ``extra`` (a ``gave_up`` line)."""
    return f',"reason":{_json_str(reason)}'


def locator_member(sequence: int, log_subject: str | None = None) -> str:
    """``,"seq":N`` (and ``,"log_subject":...`` for an internal subject) for ``TraceWriter.line``'s
    ``extra``: where the broker stored a copy (``LOCATOR_FIELDS``)."""
    out = f',"seq":{_json_int("seq", sequence)}'
    if log_subject is not None:
        out += f',"log_subject":{_json_str(log_subject)}'
    return out


def subject_member(subject: str) -> str:
    """``,"subject":...``: the part of ``message_members`` after the id, for a caller that
    caches it per subject (the broker's fast path for a producer's own message)."""
    return f',"subject":{_json_str(subject)}'


def consumer_members(group: str | None, consumer: str | None = None) -> str:
    """``,"group":...,"consumer":...`` for ``TraceWriter.line`` ("" when both are None)."""
    out = ""
    if group is not None:
        out += f',"group":{_json_str(group)}'
    if consumer is not None:
        out += f',"consumer":{_json_str(consumer)}'
    return out


def hour_dir_name(now_ms: int) -> str:
    """The hourly directory name for a writer clock reading: ``YYYYMMDDHH`` in UTC."""
    return time.strftime("%Y%m%d%H", time.gmtime(now_ms // 1000))


def safe_server_name(server: str) -> str:
    """``server`` with every character outside ``[A-Za-z0-9._-]`` replaced by ``_``."""
    return _UNSAFE_NAME_CHARS.sub("_", server)
