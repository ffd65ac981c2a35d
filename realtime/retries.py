"""Retries and dead letters (DESIGN.md section 8): what a nacked message becomes.

A nacked message is re-published as a copy with ``retries + 1`` to ``%retry%<subject>%<group>``,
delayed by the group's backoff schedule (or the delay the handler asked for), through a delay
server. After ``retries_max`` retries the copy goes to ``%dead%<subject>%<group>`` instead, at
once. Consumers of the group receive its retry subject automatically (the SDK subscribes to it).

Each copy gets its own id, ``<root id>.r<retries>`` (``qmq-origin-id`` holds the root id), so
brokers' de-duplication never mistakes the n-th retry for the (n-1)-th, while a resend of the same
retry (after a crash between publishing and acking) keeps its id and is de-duplicated.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from wire.errors import BadRequest
from wire.message import (
    ORIGIN_ID_PROPERTY,
    Message,
    dead_subject,
    decode_message,
    encode_message,
    new_message_id,
    parse_internal_subject,
    retry_subject,
    validate_message_id,
)

# Default backoff: 5s 10s 30s 1m 2m 5m 10m 30m 1h 2h, then 2h for every later retry.
DEFAULT_BACKOFF_MS = (5_000, 10_000, 30_000, 60_000, 120_000, 300_000, 600_000, 1_800_000,
                      3_600_000, 7_200_000)
DEFAULT_RETRIES_MAX = 16
ORIGIN_SUBJECT_PROPERTY = "qmq-origin-subject"  # the subject the chain started on
# Largest retries count a copy carries: msgpack's unsigned 64-bit maximum (the count saturates).
RETRIES_COUNT_MAX = 2**64 - 1


@dataclass(frozen=True)
class RetryPolicy:
    """A group's retry schedule."""

    backoff_ms: tuple[int, ...] = DEFAULT_BACKOFF_MS  # delay before retry n is backoff_ms[n-1]
    retries_max: int = DEFAULT_RETRIES_MAX  # after this many retries the message is dead

    def __post_init__(self) -> None:
        if not self.backoff_ms or any(not isinstance(v, int) or v < 0 for v in self.backoff_ms):
            raise ValueError(f"backoff_ms {self.backoff_ms!r} must be non-negative ints, at least one")
        if not isinstance(self.retries_max, int) or self.retries_max < 0:
            raise ValueError(f"retries_max {self.retries_max!r} must be an int >= 0")

    def delay_ms_for(self, retries: int) -> int:
        """The delay before retry number ``retries`` (1-based); the last step repeats."""
        return self.backoff_ms[min(retries, len(self.backoff_ms)) - 1]


@dataclass(frozen=True)
class RetryPolicies:
    """The default policy, per-group overrides (``by_group``: the ``[realtime]`` table's
    ``retry_backoff_ms_by_group`` and ``retries_max_by_group``) and per (subject, group) ones;
    the most specific wins."""

    default: RetryPolicy = RetryPolicy()
    overrides: dict[tuple[str, str], RetryPolicy] = field(default_factory=dict)
    by_group: dict[str, RetryPolicy] = field(default_factory=dict)

    @classmethod
    def from_settings(cls, backoff_ms: tuple[int, ...], retries_max: int,
                      backoff_ms_by_group: dict[str, tuple[int, ...]],
                      retries_max_by_group: dict[str, int]) -> RetryPolicies:
        """The policies of a broker's settings: a group named in either per-group table gets
        its own policy, taking what that table does not say from the defaults."""
        groups = set(backoff_ms_by_group) | set(retries_max_by_group)
        return cls(RetryPolicy(backoff_ms, retries_max), by_group={
            group: RetryPolicy(backoff_ms_by_group.get(group, backoff_ms),
                               retries_max_by_group.get(group, retries_max))
            for group in sorted(groups)})

    def for_group(self, subject: str, group: str) -> RetryPolicy:
        """The policy of ``group`` consuming ``subject``."""
        policy = self.overrides.get((subject, group))
        if policy is not None:
            return policy
        return self.by_group.get(group, self.default)


@dataclass(frozen=True)
class RetryCopy:
    """What to publish for one nacked message."""

    subject: str  # %retry%... (through a delay server) or %dead%... (stored at once)
    payload: bytes
    message: Message
    dead: bool


def origin_subject(subject: str) -> str:
    """The user subject behind a retry or dead subject (itself for a plain subject)."""
    internal = parse_internal_subject(subject)
    return internal.subject if internal is not None else subject


def plan_retry(payload: bytes, group: str, policies: RetryPolicies, now_ms: int,
               retry_after_ms: int | None = None) -> RetryCopy:
    """The copy to publish for a nacked ``payload`` consumed by ``group``."""
    message = decode_message(payload)
    subject = origin_subject(message.subject)
    # Saturates: a producer may have stored any 64-bit count, and a copy that cannot be encoded
    # would make the message impossible to nack (and so to ever get rid of).
    retries = min(message.retries + 1, RETRIES_COUNT_MAX)
    policy = policies.for_group(subject, group)
    root_id = message.properties.get(ORIGIN_ID_PROPERTY, message.id)
    copy_id = f"{root_id}.r{retries}"
    try:
        validate_message_id(copy_id)
    except BadRequest:
        # Too long, or the producer set qmq-origin-id to something that is no id: the copy
        # still needs a valid id of its own; the property keeps the chain's root.
        copy_id = new_message_id()
    properties = dict(message.properties)
    properties.setdefault(ORIGIN_ID_PROPERTY, root_id)
    properties.setdefault(ORIGIN_SUBJECT_PROPERTY, subject)
    dead = retries > policy.retries_max
    if dead:
        target, deliver_at_ms = dead_subject(subject, group), None
    else:
        delay_ms = retry_after_ms if retry_after_ms is not None else policy.delay_ms_for(retries)
        target, deliver_at_ms = retry_subject(subject, group), now_ms + delay_ms
    copy = replace(message, id=copy_id, subject=target, retries=retries, properties=properties,
                   deliver_at_ms=deliver_at_ms)
    return RetryCopy(target, encode_message(copy), copy, dead)
