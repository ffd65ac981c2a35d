"""The servers' quick check of a sent payload, ahead of the full one (used by the realtime
broker and the delay server, so it lives with the pieces they share).

Every sent payload is decoded and validated before it is stored. ``wire.message.decode_message``
plus ``validate_message`` build a ``Message`` and check every field and limit: about 7 us per
message, a quarter of the broker's CPU per message. ``QuickCheck`` does the same checks
straight on the decoded map and builds no object, for the payloads our producers make. It only
ever *accepts*: anything it is not sure of (an unknown key, a value out of range, a future
``deliver_at_ms``, bytes that are not msgpack) returns None and the caller runs the full check,
which decides and words the error. Subjects and tags are still checked by wire.message's own
functions, ids by the same rule written inline; tests/unit/test_send_check.py holds both paths
to the same answers.
"""

from __future__ import annotations

from itertools import repeat
from typing import NamedTuple

import msgpack

from logstore.twins import c_twin
from wire.errors import BadRequest
from wire.limits import (
    MAX_BODY_BYTES,
    MAX_MESSAGE_ID_CHARS,
    MAX_PROPERTIES,
    MAX_PROPERTY_KEY_BYTES,
    MAX_PROPERTY_VALUE_BYTES,
    MAX_TAG_BYTES,
    MAX_TAGS,
)
from wire.message import (
    KEY_BODY,
    KEY_CREATED_AT_MS,
    KEY_DELIVER_AT_MS,
    KEY_EXPIRE_AT_MS,
    KEY_ID,
    KEY_PROPERTIES,
    KEY_RETRIES,
    KEY_SUBJECT,
    KEY_TAGS,
    ORIGIN_ID_PROPERTY,
    PAYLOAD_KEYS,
    validate_subject,
    validate_tags,
)

# The C twin of ``check`` over a batch (serverkit/_send_check.c); optional, chosen by
# logstore.twins: without it ``check_many`` runs ``check`` per payload, with the same results.
_check_many_c = c_twin("serverkit._send_check", "check_many")

_new_tuple = tuple.__new__
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
    """``check(payload, deliver_at_max_ms)``: a ``Checked`` or None (run the full check);
    ``check_many`` does it for a batch."""

    def __init__(self) -> None:
        self._valid_subjects: set[str] = set()
        self._unpackb = msgpack.unpackb

    def check_many(self, payloads: list[bytes], deliver_at_max_ms: int,
                   ) -> list[Checked | None]:
        """``check`` of every payload, in order. With the C twin built, the common shapes are
        decided in one C call and only what it leaves open runs ``check``."""
        if _check_many_c is None or type(payloads) is not list:
            return list(map(self.check, payloads, repeat(deliver_at_max_ms)))
        out = _check_many_c(payloads, deliver_at_max_ms, self._valid_subjects, Checked,
                            MAX_BODY_BYTES, MAX_MESSAGE_ID_CHARS, MAX_TAGS, MAX_TAG_BYTES)
        if None in out:
            check = self.check
            for index, checked in enumerate(out):
                if checked is None:
                    out[index] = check(payloads[index], deliver_at_max_ms)
        return out

    def check(self, payload: bytes, deliver_at_max_ms: int) -> Checked | None:
        """The fields of ``payload`` if it is surely a valid message due by
        ``deliver_at_max_ms``, else None (the caller runs the full check)."""
        try:
            fields = self._unpackb(payload, raw=False, strict_map_key=True)
        except Exception:
            return None
        if type(fields) is not dict:
            return None
        get = fields.get
        message_id = get(KEY_ID)
        subject = get(KEY_SUBJECT)
        body = get(KEY_BODY)
        created_at_ms = get(KEY_CREATED_AT_MS)
        # validate_message_id's rule, [\x21-\x7e]{1,MAX}, as str methods (no regex, no call):
        # ASCII and printable is \x20-\x7e, and the space is refused apart.
        if (type(message_id) is not str or type(subject) is not str or type(body) is not bytes
                or type(created_at_ms) is not int or created_at_ms < 0
                or len(body) > MAX_BODY_BYTES or not 0 < len(message_id) <= MAX_MESSAGE_ID_CHARS
                or not message_id.isascii() or not message_id.isprintable()
                or " " in message_id):
            return None
        if subject not in self._valid_subjects:
            try:
                validate_subject(subject, allow_internal=True)
            except BadRequest:
                return None
            if len(self._valid_subjects) >= VALID_SUBJECTS_MAX:
                self._valid_subjects.clear()
            self._valid_subjects.add(subject)
        if len(fields) == 4:
            # Exactly id, subject, body and created_at_ms (all four found above): a producer's plain message,
            # nothing more to check. A tuple made directly, not through the NamedTuple's
            # Python-level __new__.
            return _new_tuple(Checked, (message_id, subject, (), None, None, created_at_ms, 0,
                                        None))
        if not fields.keys() <= PAYLOAD_KEYS:  # an unknown key: the full check decides
            return None
        tags: tuple[str, ...] = ()
        if KEY_TAGS in fields:
            tag_list = fields[KEY_TAGS]
            if type(tag_list) is not list:
                return None
            try:
                validate_tags(tag_list)
            except BadRequest:
                return None
            tags = tuple(tag_list)
        if KEY_PROPERTIES in fields and not _properties_ok(fields[KEY_PROPERTIES]):
            return None
        expire_at_ms = get(KEY_EXPIRE_AT_MS)
        deliver_at_ms = get(KEY_DELIVER_AT_MS)
        retries = get(KEY_RETRIES, 0)
        for value in (expire_at_ms, deliver_at_ms):
            if value is not None and (type(value) is not int or value < 0):
                return None
        if ((KEY_EXPIRE_AT_MS in fields and expire_at_ms is None)
                or (KEY_DELIVER_AT_MS in fields and deliver_at_ms is None)):
            return None  # an explicit nil: the full check refuses it
        if type(retries) is not int or retries < 0:
            return None
        if deliver_at_ms is not None and deliver_at_ms > deliver_at_max_ms:
            return None
        properties = get(KEY_PROPERTIES)
        return _new_tuple(Checked, (message_id, subject, tags, expire_at_ms, deliver_at_ms,
                                    created_at_ms, retries,
                                    properties.get(ORIGIN_ID_PROPERTY) if properties else None))


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
