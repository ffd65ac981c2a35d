"""The data-plane requests as typed objects (one class per op); ``wire.protocol.parse_request``
builds them from a frame's map (split from ``wire.protocol``, which re-exports them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal


# --- requests ----------------------------------------------------------------------------------
#
# Requests are slotted dataclasses, not frozen ones: one is made per request on every server's
# hot path, and a frozen dataclass's __init__ (object.__setattr__ per field) cost four times as
# much. Treat them as read-only all the same.


@dataclass(slots=True)
class Hello:
    """First request on a connection: who the client is and its app token."""

    op: ClassVar[str] = "hello"
    rid: int
    client_id: str
    app: str
    token: str | None
    protocol: int


@dataclass(slots=True)
class Send:
    """A batch of ``encode_message`` payloads; the broker stores each verbatim.

    ``compact``: the client takes ``send_stored_answer`` (a count) instead of a result per
    message when every message was stored; a server that does not know the field ignores it."""

    op: ClassVar[str] = "send"
    rid: int
    messages: list[bytes]
    compact: bool = False


@dataclass(slots=True)
class Pull:
    """Ask for up to ``max_count`` messages of (subject, group), waiting up to ``wait_ms``."""

    op: ClassVar[str] = "pull"
    rid: int
    subject: str
    group: str
    consumer_id: str
    max_count: int
    wait_ms: int
    tags: list[str]
    start: Literal["latest", "earliest"]
    broadcast: bool


@dataclass(slots=True)
class Ack:
    """Acknowledge inclusive [first, last] pull-sequence ranges."""

    op: ClassVar[str] = "ack"
    rid: int
    subject: str
    group: str
    consumer_id: str
    ranges: list[tuple[int, int]]


@dataclass(slots=True)
class Nack:
    """Hand pulled messages back for a retry after ``retry_after_ms`` (None = group backoff)."""

    op: ClassVar[str] = "nack"
    rid: int
    subject: str
    group: str
    consumer_id: str
    pull_seqs: list[int]
    retry_after_ms: int | None


@dataclass(slots=True)
class Cancel:
    """Cancel delayed messages by id; ``deliver_at_ms[i]`` is when ``ids[i]`` is due (its
    receipt says), which is how the delay server finds it without an index of every id."""

    op: ClassVar[str] = "cancel"
    rid: int
    ids: list[str]
    deliver_at_ms: list[int]


@dataclass(slots=True)
class Hold:
    """A delay server hands messages to a realtime broker ahead of their due time: each is
    stored now and made visible at ``visible_at_ms[i]`` (docs/PROTOCOL.md ``hold``). Only a
    broker whose hello says ``holds`` takes it."""

    op: ClassVar[str] = "hold"
    rid: int
    messages: list[bytes]
    visible_at_ms: list[int]


@dataclass(slots=True)
class CancelHeld:
    """Drop held messages of ``subject`` by id, if not yet visible."""

    op: ClassVar[str] = "cancel_held"
    rid: int
    subject: str
    ids: list[str]


@dataclass(slots=True)
class Heartbeat:
    """Keep a consumer online and say which (subject, group) pairs it consumes."""

    op: ClassVar[str] = "heartbeat"
    rid: int
    consumer_id: str
    subscriptions: list[tuple[str, str]]


@dataclass(slots=True)
class Leave:
    """A consumer closing gracefully: the broker hands what it still holds (pulled, not acked)
    of these (subject, group) pairs to the group's other consumers at once, instead of after
    the consumer expiry time."""

    op: ClassVar[str] = "leave"
    rid: int
    consumer_id: str
    subscriptions: list[tuple[str, str]]


@dataclass(slots=True)
class Subjects:
    """Admin: the subjects a realtime broker stores whose name starts with ``prefix``."""

    op: ClassVar[str] = "subjects"
    rid: int
    prefix: str


@dataclass(slots=True)
class Browse:
    """Admin: read up to ``max_count`` stored messages of ``subject`` without consuming them,
    from ``from_sequence`` (None: from the subject's purge watermark)."""

    op: ClassVar[str] = "browse"
    rid: int
    subject: str
    from_sequence: int | None
    max_count: int


@dataclass(slots=True)
class Purge:
    """Admin: hide a dead-letter subject's messages up to and including ``through_sequence``."""

    op: ClassVar[str] = "purge"
    rid: int
    subject: str
    through_sequence: int


__all__ = ["Hello", "Send", "Pull", "Ack", "Nack", "Cancel", "Hold", "CancelHeld", "Heartbeat", "Leave", "Subjects", "Browse", "Purge"]
