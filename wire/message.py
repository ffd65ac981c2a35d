"""The message model, its msgpack payload, and the validation of names, ids and limits.

The payload (``encode_message``) is what a producer sends in a ``send`` request and what the
broker stores verbatim and hands back in ``pull``; it is a msgpack map with one-letter keys
(docs/PROTOCOL.md, "Message payload"):

    key  field           msgpack type       presence
    i    id              str                required
    s    subject         str                required
    b    body            bin                required
    c    created_at_ms   int                required
    t    tags            array of str       omitted when empty
    p    properties      map str -> str     omitted when empty
    d    deliver_at_ms   int                omitted when None (deliver now)
    r    retries         int                omitted when 0
    x    expire_at_ms    int                omitted when None (never expires)

The keys are the ``KEY_*`` constants below, and no other Python module spells them
(tests/unit/test_message.py checks); the C twin of the servers' send check
(serverkit/_send_check.c) reads them as the letters of this table.

Unknown keys are ignored when decoding so a newer producer's extra fields pass through old code.
``decode_message`` checks structure and types only; ``validate_message`` checks the limits.
"""

from __future__ import annotations

import re
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import msgpack

from wire.errors import BadRequest, DelayOutOfRange, TooLarge, type_name
from wire.packing import packb
from wire.limits import (
    MAX_BODY_BYTES,
    MAX_DELAY_MS,
    MAX_MESSAGE_ID_CHARS,
    MAX_PROPERTIES,
    MAX_PROPERTY_KEY_BYTES,
    MAX_PROPERTY_VALUE_BYTES,
    MAX_SUBJECT_CHARS,
    MAX_TAG_BYTES,
    MAX_TAGS,
)

# msgpack encodes integers up to 64 bits; anything outside cannot be on the wire.
_INT_MIN = -(2**63)
_INT_MAX = 2**64 - 1

NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_NAME_RE = re.compile(NAME_PATTERN)
# Ids are producer-made; any printable ASCII except space, so they are safe in logs and paths.
_ID_RE = re.compile(r"[\x21-\x7e]+")

# The payload's keys, one letter each since every payload repeats them (the table above).
KEY_ID = "i"
KEY_SUBJECT = "s"
KEY_BODY = "b"
KEY_CREATED_AT_MS = "c"
KEY_TAGS = "t"
KEY_PROPERTIES = "p"
KEY_DELIVER_AT_MS = "d"
KEY_RETRIES = "r"
KEY_EXPIRE_AT_MS = "x"
PAYLOAD_KEYS = frozenset({KEY_ID, KEY_SUBJECT, KEY_BODY, KEY_CREATED_AT_MS, KEY_TAGS,
                          KEY_PROPERTIES, KEY_DELIVER_AT_MS, KEY_RETRIES, KEY_EXPIRE_AT_MS})

RETRY_PREFIX = "%retry%"
DEAD_PREFIX = "%dead%"


@dataclass(frozen=True)
class Message:
    """One message. ``deliver_at_ms`` None means now; ``expire_at_ms`` None means never.

    Times are epoch milliseconds. ``retries`` is set by the system when it re-publishes a nacked
    message. ``tags`` is stored as a tuple and ``properties`` as a dict copy of what was passed.
    """

    id: str
    subject: str
    body: bytes
    tags: tuple[str, ...] = ()
    properties: dict[str, str] = field(default_factory=dict)
    created_at_ms: int = 0
    deliver_at_ms: int | None = None
    retries: int = 0
    expire_at_ms: int | None = None

    def __post_init__(self) -> None:
        # Accept any iterable of tags and any mapping of properties, but store immutable-ish copies
        # so a caller mutating its list afterwards cannot change a message already validated.
        if not isinstance(self.tags, tuple) and isinstance(self.tags, (list, set, frozenset)):
            object.__setattr__(self, "tags", tuple(self.tags))
        if isinstance(self.properties, dict):
            object.__setattr__(self, "properties", dict(self.properties))

    def __hash__(self) -> int:
        # The generated hash would fail on the properties dict; equal messages share an id.
        return hash((self.id, self.subject))

    @classmethod
    def create(
        cls,
        subject: str,
        body: bytes,
        *,
        now_ms: int,
        tags: tuple[str, ...] | list[str] = (),
        properties: dict[str, str] | None = None,
        deliver_at_ms: int | None = None,
        expire_at_ms: int | None = None,
        id: str | None = None,
    ) -> Message:
        """A new message stamped ``created_at_ms=now_ms`` with a fresh id unless one is given."""
        return cls(
            id=id if id is not None else new_message_id(),
            subject=subject,
            body=body,
            tags=tuple(tags),
            properties=dict(properties or {}),
            created_at_ms=now_ms,
            deliver_at_ms=deliver_at_ms,
            expire_at_ms=expire_at_ms,
        )


def new_message_id() -> str:
    """A fresh unique message id: 32 lowercase hex characters of a random UUID."""
    return uuid.uuid4().hex


def tag_hash(tag: str) -> int:
    """A stable unsigned 32-bit hash of a tag (CRC-32 of its UTF-8), stored in ConsumerLog entries."""
    return zlib.crc32(tag.encode("utf-8")) & 0xFFFFFFFF


# --- names -------------------------------------------------------------------------------------


def _check_plain_name(kind: str, name: object) -> str:
    if not isinstance(name, str):
        raise BadRequest(f"{kind} must be str, got {type_name(name)}")
    if len(name) > MAX_SUBJECT_CHARS:
        raise BadRequest(
            f"{kind} of {len(name)} characters exceeds MAX_SUBJECT_CHARS {MAX_SUBJECT_CHARS}"
        )
    if not _NAME_RE.fullmatch(name):
        raise BadRequest(
            f"{kind} {name!r} is not a valid name: it must match "
            f"[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_SUBJECT_CHARS - 1}}}"
        )
    return name


class InternalSubject(NamedTuple):
    """A parsed internal subject: ``kind`` is "retry" or "dead"."""

    kind: Literal["retry", "dead"]
    subject: str
    group: str


def parse_internal_subject(name: str) -> InternalSubject | None:
    """Split ``%retry%<subject>%<group>`` or ``%dead%<subject>%<group>``; None for a plain name.

    Raises BadRequest for a name that starts with ``%`` but is not one of these two forms.
    """
    if not isinstance(name, str):
        raise BadRequest(f"subject must be str, got {type_name(name)}")
    if not name.startswith("%"):
        return None
    kind: Literal["retry", "dead"]
    if name.startswith(RETRY_PREFIX):
        kind, rest = "retry", name[len(RETRY_PREFIX):]
    elif name.startswith(DEAD_PREFIX):
        kind, rest = "dead", name[len(DEAD_PREFIX):]
    else:
        raise BadRequest(
            f"subject {name!r} starts with '%' but is not %retry%<subject>%<group> "
            "or %dead%<subject>%<group>"
        )
    parts = rest.split("%")
    if len(parts) != 2:
        raise BadRequest(f"internal subject {name!r} must be %{kind}%<subject>%<group>")
    subject, group = parts
    _check_plain_name("subject", subject)
    _check_plain_name("group", group)
    return InternalSubject(kind, subject, group)


def validate_subject(name: str, allow_internal: bool = False) -> None:
    """Raise BadRequest unless ``name`` is a valid subject (internal ones only if allowed)."""
    if isinstance(name, str) and name.startswith("%"):
        if not allow_internal:
            raise BadRequest(f"subject {name!r} is internal (starts with '%') and not allowed here")
        parse_internal_subject(name)
        return
    _check_plain_name("subject", name)


def validate_group(name: str) -> None:
    """Raise BadRequest unless ``name`` is a valid consumer-group name (never internal)."""
    _check_plain_name("group", name)


def retry_subject(subject: str, group: str) -> str:
    """The retry subject of (subject, group): ``%retry%<subject>%<group>``."""
    _check_plain_name("subject", subject)
    _check_plain_name("group", group)
    return f"{RETRY_PREFIX}{subject}%{group}"


def dead_subject(subject: str, group: str) -> str:
    """The dead-letter subject of (subject, group): ``%dead%<subject>%<group>``."""
    _check_plain_name("subject", subject)
    _check_plain_name("group", group)
    return f"{DEAD_PREFIX}{subject}%{group}"


def validate_message_id(message_id: object) -> None:
    """Raise BadRequest unless the id is 1..MAX_MESSAGE_ID_CHARS printable ASCII, no spaces."""
    if not isinstance(message_id, str):
        raise BadRequest(f"message id must be str, got {type_name(message_id)}")
    if len(message_id) > MAX_MESSAGE_ID_CHARS:
        raise BadRequest(
            f"message id of {len(message_id)} characters exceeds "
            f"MAX_MESSAGE_ID_CHARS {MAX_MESSAGE_ID_CHARS}"
        )
    if not _ID_RE.fullmatch(message_id):
        raise BadRequest(
            f"message id {message_id!r} must be 1 or more printable ASCII characters without spaces"
        )


def validate_tags(tags: object, what: str = "message") -> None:
    """Raise BadRequest unless ``tags`` is at most MAX_TAGS non-empty str of <= MAX_TAG_BYTES."""
    if not isinstance(tags, (tuple, list)):
        raise BadRequest(f"tags must be a list of str, got {type_name(tags)}")
    if len(tags) > MAX_TAGS:
        raise BadRequest(f"{what} has {len(tags)} tags, exceeds MAX_TAGS {MAX_TAGS}")
    for tag in tags:
        if not isinstance(tag, str):
            raise BadRequest(f"tag must be str, got {type_name(tag)}")
        size = len(tag.encode("utf-8", "surrogatepass"))
        if size == 0:
            raise BadRequest("tag must not be empty")
        if size > MAX_TAG_BYTES:
            raise BadRequest(f"tag of {size} bytes exceeds MAX_TAG_BYTES {MAX_TAG_BYTES}")


# --- validation of a whole message ------------------------------------------------------------


def _need_int(name: str, value: object, optional: bool) -> None:
    """BadRequest unless ``value`` is an int of at most 64 bits (or None when ``optional``)."""
    if value is None and optional:
        return
    if type(value) is not int:
        raise BadRequest(f"message field {name} must be int, got {type_name(value)}")
    if not _INT_MIN <= value <= _INT_MAX:
        raise BadRequest(f"message field {name} {value} does not fit in 64 bits")


def _check_types(msg: Message) -> None:
    """BadRequest unless every field has its declared type (bool is not an int here)."""
    need_int = _need_int
    if not isinstance(msg.id, str):
        raise BadRequest(f"message field id must be str, got {type_name(msg.id)}")
    if not isinstance(msg.subject, str):
        raise BadRequest(f"message field subject must be str, got {type_name(msg.subject)}")
    if not isinstance(msg.body, (bytes, bytearray, memoryview)):
        raise BadRequest(f"message field body must be bytes, got {type_name(msg.body)}")
    if not isinstance(msg.tags, tuple) or not all(isinstance(t, str) for t in msg.tags):
        raise BadRequest("message field tags must be a tuple of str")
    if not isinstance(msg.properties, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in msg.properties.items()
    ):
        raise BadRequest("message field properties must be a dict of str to str")
    need_int("created_at_ms", msg.created_at_ms, optional=False)
    need_int("deliver_at_ms", msg.deliver_at_ms, optional=True)
    need_int("retries", msg.retries, optional=False)
    need_int("expire_at_ms", msg.expire_at_ms, optional=True)


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def validate_message(msg: Message, *, allow_internal: bool = False, now_ms: int | None = None) -> None:
    """Check every limit: BadRequest for names, ids, tags and negative times; TooLarge for sizes.

    With ``now_ms``, also DelayOutOfRange when ``deliver_at_ms`` is past now + MAX_DELAY_MS.
    ``allow_internal`` lets the system publish to ``%retry%``/``%dead%`` subjects.
    """
    _check_types(msg)
    validate_message_id(msg.id)
    validate_subject(msg.subject, allow_internal=allow_internal)
    if len(msg.body) > MAX_BODY_BYTES:
        raise TooLarge(
            f"message body of {len(msg.body)} bytes exceeds MAX_BODY_BYTES {MAX_BODY_BYTES}"
        )
    validate_tags(msg.tags)
    if len(msg.properties) > MAX_PROPERTIES:
        raise TooLarge(
            f"message has {len(msg.properties)} properties, exceeds MAX_PROPERTIES {MAX_PROPERTIES}"
        )
    for key, value in msg.properties.items():
        if key == "":
            raise BadRequest("property key must not be empty")
        if (size := _utf8_len(key)) > MAX_PROPERTY_KEY_BYTES:
            raise TooLarge(
                f"property key of {size} bytes exceeds MAX_PROPERTY_KEY_BYTES {MAX_PROPERTY_KEY_BYTES}"
            )
        if (size := _utf8_len(value)) > MAX_PROPERTY_VALUE_BYTES:
            raise TooLarge(
                f"property {key!r} value of {size} bytes exceeds "
                f"MAX_PROPERTY_VALUE_BYTES {MAX_PROPERTY_VALUE_BYTES}"
            )
    for name in ("created_at_ms", "deliver_at_ms", "expire_at_ms", "retries"):
        value = getattr(msg, name)
        if value is not None and value < 0:
            raise BadRequest(f"message field {name} must be >= 0, got {value}")
    if now_ms is not None and msg.deliver_at_ms is not None:
        ahead_ms = msg.deliver_at_ms - now_ms
        if ahead_ms > MAX_DELAY_MS:
            raise DelayOutOfRange(
                f"deliver_at_ms is {ahead_ms} ms ahead of now, exceeds MAX_DELAY_MS {MAX_DELAY_MS}"
            )


# --- payload codec -----------------------------------------------------------------------------


def encode_message(msg: Message) -> bytes:
    """The msgpack payload of ``msg`` (one-letter keys, see the module docstring).

    Raises BadRequest if a field has the wrong type; limits are ``validate_message``'s job.
    """
    _check_types(msg)
    return encode_checked_message(msg)


def encode_checked_message(msg: Message) -> bytes:
    """``encode_message`` for a message whose field types were already checked (by
    ``validate_message``): the producer's ``send`` validates, then encodes without checking
    the same types twice."""
    try:
        return packb(message_fields(msg))
    except (ValueError, TypeError, OverflowError) as exc:
        # Lone surrogates in a str cannot be encoded as UTF-8.
        raise BadRequest(f"message cannot be encoded: {exc}") from None


def encode_plain_message(message_id: str, subject: str, body: bytes, created_at_ms: int,
                         deliver_at_ms: int | None = None) -> bytes:
    """``encode_message`` of a message with no tags, properties, retries or expiry, from its
    fields rather than a ``Message``: the same bytes (``message_fields`` order). For the
    producer's ``send`` of fields it knows valid; checks nothing itself."""
    fields: dict[str, Any] = {KEY_ID: message_id, KEY_SUBJECT: subject, KEY_BODY: body,
                              KEY_CREATED_AT_MS: created_at_ms}
    if deliver_at_ms is not None:
        fields[KEY_DELIVER_AT_MS] = deliver_at_ms
    try:
        return packb(fields)
    except (ValueError, TypeError, OverflowError) as exc:
        raise BadRequest(f"message cannot be encoded: {exc}") from None


def _field(payload: dict, key: str, name: str, kind: type, required: bool) -> Any:
    if key not in payload:
        if required:
            raise BadRequest(f"message payload lacks {name} (key {key!r})")
        return None
    value = payload[key]
    if kind is int:
        ok = type(value) is int
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise BadRequest(
            f"message field {name} must be {kind.__name__}, got {type_name(value)}"
        )
    return value


def decode_message(data: bytes) -> Message:
    """Parse a payload made by ``encode_message``; BadRequest on anything malformed."""
    try:
        payload = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True)
    except Exception as exc:  # msgpack raises many types (ExtraData, FormatError, ValueError...)
        raise BadRequest(
            f"message payload is not valid msgpack: {type(exc).__name__}: {exc}"[:200]
        ) from None
    if not isinstance(payload, dict):
        raise BadRequest(f"message payload must be a msgpack map, got {type_name(payload)}")
    tags = _field(payload, KEY_TAGS, "tags", list, required=False) or []
    for tag in tags:
        if not isinstance(tag, str):
            raise BadRequest(f"message field tags must hold str, got {type_name(tag)}")
    properties = _field(payload, KEY_PROPERTIES, "properties", dict, required=False) or {}
    for key, value in properties.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise BadRequest(
                "message field properties must map str to str, got "
                f"{type_name(key)} -> {type_name(value)}"
            )
    retries = _field(payload, KEY_RETRIES, "retries", int, required=False)
    return Message(
        id=_field(payload, KEY_ID, "id", str, required=True),
        subject=_field(payload, KEY_SUBJECT, "subject", str, required=True),
        body=_field(payload, KEY_BODY, "body", bytes, required=True),
        tags=tuple(tags),
        properties=properties,
        created_at_ms=_field(payload, KEY_CREATED_AT_MS, "created_at_ms", int, required=True),
        deliver_at_ms=_field(payload, KEY_DELIVER_AT_MS, "deliver_at_ms", int, required=False),
        retries=0 if retries is None else retries,
        expire_at_ms=_field(payload, KEY_EXPIRE_AT_MS, "expire_at_ms", int, required=False),
    )


# Keys of the optional payload fields and the exact type each must have when present.
_OPTIONAL_FIELD_TYPES = ((KEY_DELIVER_AT_MS, int), (KEY_RETRIES, int), (KEY_EXPIRE_AT_MS, int))
_MISSING = object()
_unpackb = msgpack.unpackb


def _optional_fields_ok(fields: dict) -> bool:
    """The optional fields of an unpacked payload have decode_message's types (no call per
    field on the common path: the caller looks here only when there are more than 4 keys)."""
    tags = fields.get(KEY_TAGS, _MISSING)
    if tags is not _MISSING and (type(tags) is not list
                                 or not all(type(tag) is str for tag in tags)):
        return False
    properties = fields.get(KEY_PROPERTIES, _MISSING)
    if properties is not _MISSING and (
            type(properties) is not dict
            or not all(type(k) is str and type(v) is str for k, v in properties.items())):
        return False
    for key, kind in _OPTIONAL_FIELD_TYPES:
        value = fields.get(key, _MISSING)
        if value is not _MISSING and type(value) is not kind:
            return False
    return True


def decode_message_fields(data: bytes) -> dict[str, Any]:
    """The payload's msgpack map (one-letter keys, as in the module docstring), checked as
    ``decode_message`` checks it but without building a ``Message``: the consumer's receive
    path reads its fields straight from the map. Raises the same BadRequest as
    ``decode_message`` for anything malformed (it defers to it to word the error)."""
    try:
        fields = _unpackb(data, raw=False, strict_map_key=True)
    except Exception:
        fields = None
    if (type(fields) is dict and type(fields.get(KEY_ID)) is str
            and type(fields.get(KEY_SUBJECT)) is str and type(fields.get(KEY_BODY)) is bytes
            and type(fields.get(KEY_CREATED_AT_MS)) is int
            and (len(fields) == 4 or _optional_fields_ok(fields))):
        return fields
    return message_fields(decode_message(data))  # raises BadRequest, worded by decode_message


def message_fields(msg: Message) -> dict[str, Any]:
    """The payload map of ``msg``: what ``encode_message`` packs, and what
    ``decode_message_fields`` returns (for a message its fast check did not accept but
    ``decode_message`` did)."""
    fields: dict[str, Any] = {
        KEY_ID: msg.id,
        KEY_SUBJECT: msg.subject,
        KEY_BODY: msg.body if type(msg.body) is bytes else bytes(msg.body),
        KEY_CREATED_AT_MS: msg.created_at_ms,
    }
    if msg.tags:
        fields[KEY_TAGS] = list(msg.tags)
    if msg.properties:
        fields[KEY_PROPERTIES] = msg.properties
    if msg.deliver_at_ms is not None:
        fields[KEY_DELIVER_AT_MS] = msg.deliver_at_ms
    if msg.retries:
        fields[KEY_RETRIES] = msg.retries
    if msg.expire_at_ms is not None:
        fields[KEY_EXPIRE_AT_MS] = msg.expire_at_ms
    return fields


def message_from_fields(fields: dict[str, Any]) -> Message:
    """The ``Message`` of a map from ``decode_message_fields``."""
    return Message(
        id=fields[KEY_ID], subject=fields[KEY_SUBJECT], body=fields[KEY_BODY],
        tags=tuple(fields.get(KEY_TAGS) or ()), properties=fields.get(KEY_PROPERTIES) or {},
        created_at_ms=fields[KEY_CREATED_AT_MS], deliver_at_ms=fields.get(KEY_DELIVER_AT_MS),
        retries=fields.get(KEY_RETRIES) or 0, expire_at_ms=fields.get(KEY_EXPIRE_AT_MS))


__all__ = [
    "Message",
    "decode_message_fields",
    "message_from_fields",
    "InternalSubject",
    "NAME_PATTERN",
    "new_message_id",
    "tag_hash",
    "encode_message",
    "decode_message",
    "validate_message",
    "validate_message_id",
    "validate_tags",
    "validate_subject",
    "validate_group",
    "retry_subject",
    "dead_subject",
    "parse_internal_subject",
]


# The property holding the id of the first message of a retry chain (set on retry copies).
ORIGIN_ID_PROPERTY = "qmq-origin-id"


def peek_message_id(payload: bytes) -> str:
    """The message id of a payload that failed to decode, if it can be read at all, else ""
    (so an error result can still name the message)."""
    try:
        data = msgpack.unpackb(payload, raw=False)
        value = data.get(KEY_ID) if isinstance(data, dict) else None
        return value if isinstance(value, str) else ""
    except Exception:
        return ""


def peek_subject(payload: bytes) -> str | None:
    """The subject written in a payload, read without validating anything (for access checks
    before the full check); None if the payload has no readable subject."""
    try:
        data = msgpack.unpackb(payload, raw=False)
        value = data.get(KEY_SUBJECT) if isinstance(data, dict) else None
        return value if isinstance(value, str) else None
    except Exception:
        return None
