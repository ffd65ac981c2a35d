"""A payload's trace view: the message members of a trace line, read from a stored payload or
from fields a server already has, without building a ``Message``.

The servers' tracers (``realtime.tracing``, ``delayserver.tracing``) call these once per message;
the members are pre-encoded JSON (``tracelog.events.message_members``) that every event of the
message reuses.
"""

from __future__ import annotations

from typing import Any, Iterable, NamedTuple

import msgpack

from tracelog.events import message_members
from wire.errors import BadRequest
from wire.message import (
    KEY_CREATED_AT_MS,
    KEY_DELIVER_AT_MS,
    KEY_ID,
    KEY_PROPERTIES,
    KEY_RETRIES,
    KEY_SUBJECT,
    KEY_TAGS,
    ORIGIN_ID_PROPERTY,
    parse_internal_subject,
)


class TracePeek(NamedTuple):
    """A payload as the tracers need it: its message members pre-encoded for a trace line
    (``tracelog.events.message_members``) and what decides which events it gets."""

    members: str
    created_at_ms: int | None
    deliver_at_ms: int | None
    retries: int
    internal: str | None  # "retry" or "dead" for a copy on an internal subject, else None


def _trace_peek(msg_id: Any, wire: Any, origin_id: Any, created_at_ms: Any,
                deliver_at_ms: Any, retries: Any, tags: Any = None) -> TracePeek:
    internal = parse_internal_subject(wire) if wire[:1] == "%" else None
    members = message_members(
        msg_id, internal.subject if internal is not None else wire, origin_id=origin_id,
        created_at_ms=created_at_ms, deliver_at_ms=deliver_at_ms, retries=retries, tags=tags)
    return TracePeek(members, created_at_ms, deliver_at_ms, retries,
                     internal.kind if internal is not None else None)


def peek_trace_members(payload: bytes) -> TracePeek | None:
    """A payload's trace view (``TracePeek``: its id, user subject, origin id, times and
    retries encoded as event members), read without building or validating a Message. None if
    unreadable or if a field is of a type the trace schema cannot hold. The message's tags are
    among the members, so the audit knows which groups' filters select it."""
    try:
        data = msgpack.unpackb(payload, raw=False)
        properties = data.get(KEY_PROPERTIES)
        return _trace_peek(data[KEY_ID], data[KEY_SUBJECT],
                           properties.get(ORIGIN_ID_PROPERTY) if properties else None,
                           data.get(KEY_CREATED_AT_MS), data.get(KEY_DELIVER_AT_MS),
                           data.get(KEY_RETRIES, 0), data.get(KEY_TAGS))
    except Exception:
        return None


def dispatched_lines(start: str, end: str, payloads: Iterable[bytes], now_ms: int) -> list[str]:
    """The ``dispatched`` lines of ``payloads`` at ``now_ms`` between a writer's ``frame``
    ``start`` and ``end``, each with its lateness (now - deliver_at) when it has a deliver time;
    an unreadable payload has none. The delay server's dispatch at the due time and a broker's
    hand-off made visible both write these."""
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
    return lines


def trace_members(msg_id: str, wire_subject: str, *, origin_id: str | None,
                  created_at_ms: int | None, deliver_at_ms: int | None,
                  retries: int, tags: tuple[str, ...] = ()) -> TracePeek | None:
    """``peek_trace_members`` of a message whose fields are at hand already (a broker that
    checked it before storing it), so its payload need not be decoded again; None if a field
    does not fit the trace schema or the subject is a malformed internal name."""
    try:
        return _trace_peek(msg_id, wire_subject, origin_id, created_at_ms, deliver_at_ms,
                           retries, tags)
    except (ValueError, BadRequest, TypeError):
        return None


__all__ = ["TracePeek", "peek_trace_members", "trace_members"]
