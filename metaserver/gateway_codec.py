"""The HTTP gateway's JSON: request checks, message <-> JSON, pull receipts and error statuses.

Pure functions, no I/O (``metaserver.gateway`` serves them). docs/HTTP.md describes every field;
``metaserver.openapi`` describes the same shapes for machines.

A **receipt** names one pulled message for ``ack`` and ``nack``: the broker it came from, the
subject it was pulled from (a ``%retry%`` subject for a retry), the consumer group, the consumer
id and the pull sequence, as base64url of a JSON array. It is not secret and not signed: it only
lets its holder ack what that holder's token may consume anyway (the broker checks the token on
every ack), and the gateway acts only on addresses of the subject's current route.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from metaserver import validation as v
from metaserver.dead_letters import message_view
from metaserver.errors import ApiError, BadRequest
from wire.errors import DelayOutOfRange, QmqError
from wire.limits import (
    MAX_ACK_RANGES,
    MAX_CLIENT_ID_CHARS,
    MAX_DELAY_MS,
    MAX_PULL_BATCH_MESSAGES,
    MAX_PULL_WAIT_MS,
    MAX_SEND_BATCH_MESSAGES,
    MAX_TOKEN_CHARS,
)
from wire.message import Message, parse_internal_subject

# Largest gateway request body, in bytes: a send of up to MAX_FRAME_BYTES (8 MiB) of message
# bodies, base64-encoded (4/3) with room for the JSON around them. Over it: 413 too_large.
GATEWAY_REQUEST_BYTES_MAX = 12 * 1024 * 1024
# Messages a pull asks for when the request does not say, and its wait.
PULL_COUNT_DEFAULT = 32
PULL_WAIT_MS_DEFAULT = 0
# The first element of every receipt's array: a gateway that changes the layout bumps it.
RECEIPT_VERSION = 1
# Longest receipt accepted, in characters (an address, two names, a consumer id and a seq).
RECEIPT_CHARS_MAX = 2048

# HTTP status of each error code of the binary protocol (wire.errors) and the MetaServer; a
# code not listed is 503 when retriable, else 500.
HTTP_STATUS = {
    "bad_request": 400, "delay_out_of_range": 400, "unauthorized": 401, "forbidden": 403,
    "not_found": 404, "conflict": 409, "too_large": 413, "not_supported": 501,
    "internal": 500,
}


def error_status(code: str, retriable: bool) -> int:
    """The HTTP status of an error with ``code``."""
    return HTTP_STATUS.get(code, 503 if retriable else 500)


def error_json(exc: QmqError | ApiError) -> dict[str, Any]:
    """``{code, message}`` of an error, as every gateway answer spells it."""
    return {"code": exc.code, "message": exc.message}


def _check_body_encoding(key: str, value: str) -> str:
    return v.one_of("utf-8", "base64")(key, value)


def _check_strings(key: str, value: list[Any]) -> list[str]:
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise BadRequest(f"{key}[{i}] must be a string, not {item!r:.60}")
    return value


def _check_properties(key: str, value: dict[str, Any]) -> dict[str, str]:
    for name, item in value.items():
        if not isinstance(item, str):
            raise BadRequest(f"{key}[{name!r:.60}] must be a string, not {item!r:.60}")
    return value


def _check_ms(key: str, value: int) -> int:
    if not 0 <= value <= 2**63 - 1:
        raise BadRequest(f"{key} {value} must be between 0 and {2**63 - 1}")
    return value


SEND_MESSAGE = {
    "subject": v.Field(str),
    "body": v.Field(str),
    "encoding": v.Field(str, required=False, default="utf-8", check=_check_body_encoding),
    "id": v.Field(str, required=False),
    "tags": v.Field(list, required=False, default=list, check=_check_strings),
    "properties": v.Field(dict, required=False, default=dict, check=_check_properties),
    "delay_ms": v.Field(int, required=False, check=_check_ms),
    "deliver_at_ms": v.Field(int, required=False, check=_check_ms),
    "deliver_at": v.Field(str, required=False),
    "expire_at_ms": v.Field(int, required=False, check=_check_ms),
}


def check_batch(key: str, value: list[Any]) -> list[Any]:
    """1 .. MAX_SEND_BATCH_MESSAGES items (their shape is checked one by one, per message)."""
    if not value:
        raise BadRequest(f"{key} is empty: give 1 to {MAX_SEND_BATCH_MESSAGES} messages")
    if len(value) > MAX_SEND_BATCH_MESSAGES:
        raise TooLargeBatch(f"send batch of {len(value)} messages exceeds "
                            f"MAX_SEND_BATCH_MESSAGES {MAX_SEND_BATCH_MESSAGES}")
    return value


class TooLargeBatch(ApiError):
    """A send or cancel over MAX_SEND_BATCH_MESSAGES: 413 like the binary protocol's frame."""

    status = 413
    code = "too_large"


SEND = {"messages": v.Field(list, check=check_batch)}


@dataclass(frozen=True)
class SendItem:
    """One message of a send request, checked for shape: what ``Producer.send`` is given."""

    subject: str
    body: bytes
    message_id: str | None
    tags: list[str]
    properties: dict[str, str]
    delay_ms: int | None
    deliver_at_ms: int | None
    expire_at_ms: int | None


def send_item(fields: dict[str, Any], where: str) -> SendItem:
    """One message of a send whose shape ``v.parse_object(raw, SEND_MESSAGE)`` checked, with
    its values checked here (at most one due time, the RFC 3339 time, base64); its limits and
    names are checked by the SDK's ``validate_message``, as on the binary protocol."""
    due = [k for k in ("delay_ms", "deliver_at_ms", "deliver_at") if fields[k] is not None]
    if len(due) > 1:
        raise BadRequest(f"{where} gives {' and '.join(due)}: give at most one of delay_ms, "
                         "deliver_at_ms and deliver_at")
    deliver_at_ms = fields["deliver_at_ms"]
    if fields["deliver_at"] is not None:
        deliver_at_ms = rfc3339_ms(f"{where}.deliver_at", fields["deliver_at"])
    if fields["delay_ms"] is not None and fields["delay_ms"] > MAX_DELAY_MS:
        raise DelayOutOfRange(f"{where}.delay_ms {fields['delay_ms']} exceeds MAX_DELAY_MS "
                              f"{MAX_DELAY_MS}")
    return SendItem(subject=fields["subject"], body=decode_body(
        f"{where}.body", fields["body"], fields["encoding"]), message_id=fields["id"],
        tags=fields["tags"], properties=fields["properties"], delay_ms=fields["delay_ms"],
        deliver_at_ms=deliver_at_ms, expire_at_ms=fields["expire_at_ms"])


def rfc3339_ms(key: str, text: str) -> int:
    """An RFC 3339 time with its offset (``2027-01-01T09:00:00Z``) as epoch ms."""
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise BadRequest(f"{key} {text[:60]!r} is not an RFC 3339 time "
                         "(e.g. 2027-01-01T09:00:00Z)") from None
    if when.tzinfo is None:
        raise BadRequest(f"{key} {text[:60]!r} has no time-zone offset (add Z or +01:00)")
    ms = int(when.timestamp() * 1000)
    if ms < 0:
        raise BadRequest(f"{key} {text[:60]!r} is before 1970")
    return ms


def decode_body(key: str, text: str, encoding: str) -> bytes:
    """A message body given as UTF-8 text or base64."""
    if encoding == "utf-8":
        try:
            return text.encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequest(f"{key} holds a lone surrogate, which is not text") from None
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"{key} is not valid base64") from None


def check_receipt_list(key: str, value: list[Any]) -> list[str]:
    """1 .. MAX_ACK_RANGES receipts, each a string."""
    if not 1 <= len(value) <= MAX_ACK_RANGES:
        raise BadRequest(f"{key} has {len(value)} receipts; give 1 to MAX_ACK_RANGES "
                         f"{MAX_ACK_RANGES}")
    return _check_strings(key, value)


def _check_consumer_id(key: str, value: str) -> str:
    if not 1 <= len(value) <= MAX_CLIENT_ID_CHARS:
        raise BadRequest(f"{key} of {len(value)} characters must be 1 to MAX_CLIENT_ID_CHARS "
                         f"{MAX_CLIENT_ID_CHARS}")
    return value


def _range_check(name: str, low: int, high: int) -> Any:
    def check(key: str, value: int) -> int:
        if not low <= value <= high:
            raise BadRequest(f"{key} {value} must be between {low} and {name} {high}")
        return value
    return check


PULL = {
    "subject": v.Field(str, check=v.check_name),
    "group": v.Field(str, check=v.check_name),
    "consumer_id": v.Field(str, check=_check_consumer_id),
    "max_count": v.Field(int, required=False, default=PULL_COUNT_DEFAULT,
                         check=_range_check("MAX_PULL_BATCH_MESSAGES", 1,
                                            MAX_PULL_BATCH_MESSAGES)),
    "wait_ms": v.Field(int, required=False, default=PULL_WAIT_MS_DEFAULT,
                       check=_range_check("MAX_PULL_WAIT_MS", 0, MAX_PULL_WAIT_MS)),
    "tags": v.Field(list, required=False, default=list, check=_check_strings),
    "start": v.Field(str, required=False, default="latest",
                     check=v.one_of("latest", "earliest")),
}

ACK = {"receipts": v.Field(list, check=check_receipt_list)}

NACK = {
    "receipts": v.Field(list, check=check_receipt_list),
    "retry_after_ms": v.Field(int, required=False,
                              check=_range_check("MAX_DELAY_MS", 0, MAX_DELAY_MS)),
}

CANCEL_ITEM = {
    "subject": v.Field(str, check=v.check_name),
    "id": v.Field(str),
    "broker_group": v.Field(str, check=v.check_name),
    "deliver_at_ms": v.Field(int, check=_check_ms),
}

CANCEL = {"messages": v.Field(list, check=check_batch)}


@dataclass(frozen=True)
class Receipt:
    """What an ack or nack needs about one pulled message."""

    address: str
    source: str  # the subject it was pulled from: the user subject or its %retry% subject
    group: str
    consumer_id: str
    pull_seq: int


def make_receipt(address: str, source: str, group: str, consumer_id: str,
                 pull_seq: int) -> str:
    """The receipt string of one pulled message."""
    raw = json.dumps([RECEIPT_VERSION, address, source, group, consumer_id, pull_seq],
                     separators=(",", ":")).encode("utf-8")
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii")


def read_receipt(key: str, text: str) -> Receipt:
    """The Receipt of a string ``make_receipt`` made; BadRequest for anything else."""
    if len(text) > RECEIPT_CHARS_MAX:
        raise BadRequest(f"{key} of {len(text)} characters is not a receipt (at most "
                         f"{RECEIPT_CHARS_MAX})")
    try:
        raw = json.loads(base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)))
        version, address, source, group, consumer_id, pull_seq = raw
    except (ValueError, TypeError, binascii.Error):
        raise BadRequest(f"{key} {text[:40]!r} is not a receipt from a pull") from None
    if version != RECEIPT_VERSION or not all(isinstance(x, str) for x in (
            address, source, group, consumer_id)) or type(pull_seq) is not int:
        raise BadRequest(f"{key} {text[:40]!r} is not a receipt of this gateway's version "
                         f"{RECEIPT_VERSION}")
    v.check_address(f"{key}.address", address)
    v.check_subject(f"{key}.subject", source)
    v.check_name(f"{key}.group", group)
    _check_consumer_id(f"{key}.consumer_id", consumer_id)
    if not 0 <= pull_seq <= 2**64 - 1:
        raise BadRequest(f"{key} has pull sequence {pull_seq} out of range")
    return Receipt(address, source, group, consumer_id, pull_seq)


def pulled_json(message: Message, receipt: str, redelivered: int) -> dict[str, Any]:
    """One pulled message as the gateway answers it: the user subject (a retry copy's too)."""
    internal = parse_internal_subject(message.subject)
    subject = internal.subject if internal is not None else message.subject
    return {"receipt": receipt, "subject": subject, "redelivered": redelivered,
            **message_view(message)}


def check_token_length(token: str | None) -> None:
    """BadRequest for a bearer token no broker would take in hello (its length, never it)."""
    if token is not None and len(token) > MAX_TOKEN_CHARS:
        raise BadRequest(f"token of {len(token)} characters exceeds MAX_TOKEN_CHARS "
                         f"{MAX_TOKEN_CHARS}")
