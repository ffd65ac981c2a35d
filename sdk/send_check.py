"""The servers' quick check of a sent payload, ahead of the full one (used by the realtime
broker and the delay server, so it lives with the pieces they share).

Every sent payload is decoded and validated before it is stored. ``sdk.message.decode_message``
plus ``validate_message`` build a ``Message`` and check every field and limit: about 7 us per
message, a quarter of the broker's CPU per message. ``quick_check`` does the same checks
straight on the decoded map and builds no object, for the payloads our producers make. It only
ever *accepts*: anything it is not sure of (an unknown key, a value out of range, a future
``deliver_at_ms``, bytes that are not msgpack) returns None and the caller runs the full check,
which decides and words the error. The names, ids and tags are still checked by sdk.message's
own functions; tests/unit/test_send_check.py holds both paths to the same answers.
"""

from __future__ import annotations

from typing import NamedTuple

import msgpack

from sdk.errors import BadRequest
from sdk.limits import (
    MAX_BODY_BYTES,
    MAX_PROPERTIES,
    MAX_PROPERTY_KEY_BYTES,
    MAX_PROPERTY_VALUE_BYTES,
)
from sdk.message import (
    ORIGIN_ID_PROPERTY,
    validate_message_id,
    validate_subject,
    validate_tags,
)

# Payload keys quick_check understands (sdk.message's table); any other key defers.
_KEYS = frozenset("isbctpdrx")
# Subjects already found valid; cleared when it passes this size, so it stays bounded.
VALID_SUBJECTS_MAX = 10_000


class Checked(NamedTuple):
    """What the broker needs of a valid message."""

    id: str
    subject: str
    tags: tuple[str, ...]
    expire_at_ms: int | None
    deliver_at_ms: int | None
    # What its trace events need (realtime.tracing), so they cost no second decoding:
    created_at_ms: int = 0
    retries: int = 0
    origin_id: str | None = None  # the ORIGIN_ID_PROPERTY of a retry copy, else None


class QuickCheck:
    """``check(payload, deliver_at_max_ms)``: a ``Checked`` or None (run the full check)."""

    def __init__(self) -> None:
        self._valid_subjects: set[str] = set()
        self._unpackb = msgpack.unpackb

    def check(self, payload: bytes, deliver_at_max_ms: int) -> Checked | None:
        try:
            fields = self._unpackb(payload, raw=False, strict_map_key=True)
        except Exception:
            return None
        if type(fields) is not dict or not fields.keys() <= _KEYS:
            return None
        message_id = fields.get("i")
        subject = fields.get("s")
        body = fields.get("b")
        created_at_ms = fields.get("c")
        if (type(message_id) is not str or type(subject) is not str or type(body) is not bytes
                or type(created_at_ms) is not int or created_at_ms < 0
                or len(body) > MAX_BODY_BYTES):
            return None
        try:
            validate_message_id(message_id)
            if subject not in self._valid_subjects:
                validate_subject(subject, allow_internal=True)
                if len(self._valid_subjects) >= VALID_SUBJECTS_MAX:
                    self._valid_subjects.clear()
                self._valid_subjects.add(subject)
            tags: tuple[str, ...] = ()
            if "t" in fields:
                tag_list = fields["t"]
                if type(tag_list) is not list:
                    return None
                validate_tags(tag_list)
                tags = tuple(tag_list)
        except BadRequest:
            return None
        if "p" in fields and not _properties_ok(fields["p"]):
            return None
        expire_at_ms = fields.get("x")
        deliver_at_ms = fields.get("d")
        retries = fields.get("r", 0)
        for value in (expire_at_ms, deliver_at_ms):
            if value is not None and (type(value) is not int or value < 0):
                return None
        if ("x" in fields and expire_at_ms is None) or ("d" in fields and deliver_at_ms is None):
            return None  # an explicit nil: the full check refuses it
        if type(retries) is not int or retries < 0:
            return None
        if deliver_at_ms is not None and deliver_at_ms > deliver_at_max_ms:
            return None
        properties = fields.get("p")
        return Checked(message_id, subject, tags, expire_at_ms, deliver_at_ms, created_at_ms,
                       retries, properties.get(ORIGIN_ID_PROPERTY) if properties else None)


def _properties_ok(properties: object) -> bool:
    if type(properties) is not dict or len(properties) > MAX_PROPERTIES:
        return False
    for key, value in properties.items():
        if type(key) is not str or type(value) is not str or not key:
            return False
        if (len(key) * 4 > MAX_PROPERTY_KEY_BYTES
                and len(key.encode("utf-8")) > MAX_PROPERTY_KEY_BYTES):
            return False
        if (len(value) * 4 > MAX_PROPERTY_VALUE_BYTES
                and len(value.encode("utf-8")) > MAX_PROPERTY_VALUE_BYTES):
            return False
    return True


__all__ = ["Checked", "QuickCheck", "VALID_SUBJECTS_MAX"]
