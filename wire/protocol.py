"""The data-plane wire codec: pure bytes <-> objects, no sockets, no asyncio.

A frame is ``u32 big-endian length | msgpack map`` (docs/PROTOCOL.md). Two layers, two kinds of
failure:

* ``FrameDecoder`` (wire.framing) turns a byte stream into maps. A declared length over the limit raises TooLarge
  before anything is allocated; a frame that is not a msgpack map with str keys raises BadRequest.
  Either means the stream can no longer be trusted: the server answers with an error (rid nil)
  and closes the connection. The decoder stays failed and re-raises on every later ``feed``.
* ``parse_request`` turns one map into a typed request and raises BadRequest (or TooLarge, ...)
  naming the field and the value's type. The frame boundary is intact, so the server answers
  ``{rid, error}`` and keeps the connection.

Unknown keys in a request are ignored so that a newer client can add optional fields.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Union

from wire.errors import (
    BadRequest,
    DelayOutOfRange,
    NotSupported,
    TooLarge,
    type_name,
)
# Framing, the request types and responses live in wire.framing, wire.requests and
# wire.responses; their names are re-exported here, the codec's one public entry point.
from wire.framing import HEADER_BYTES, FrameDecoder, decode_frame_payload, encode_frame  # noqa: F401
from wire.requests import (  # noqa: F401  (the request types, re-exported)
    Hello, Send, Pull, Ack, Nack, Cancel, Hold, CancelHeld, Heartbeat, Leave, Subjects, Browse, Purge)
from wire.responses import (  # noqa: F401
    browsed_message,
    cancel_result,
    delayed_send_result,
    error_response,
    hello_response,
    parse_response,
    pull_columns,
    pull_response,
    send_result_error,
    send_result_ok,
    send_results_stored,
    send_stored_answer,
)
from wire.limits import (
    MAX_ACK_RANGES,
    MAX_CLIENT_ID_CHARS,
    MAX_DELAY_MS,
    MAX_PULL_BATCH_MESSAGES,
    MAX_PULL_WAIT_MS,
    MAX_SEND_BATCH_MESSAGES,
    MAX_TOKEN_CHARS,
)
from wire.message import (
    DEAD_PREFIX,
    validate_group,
    validate_message_id,
    validate_subject,
    validate_tags,
)

if TYPE_CHECKING:  # the replication ops are parsed by wire.replication, loaded by servers only
    from wire.replication import Fetch, Snapshot

PROTOCOL_VERSION = 1

# Longest ``subjects.prefix``: the longest internal subject, %retry%<200 chars>%<200 chars>.
MAX_SUBJECT_PREFIX_CHARS = 408

# Request ids and sequence numbers are msgpack unsigned integers.
_U64_MAX = 2**64 - 1


Request = Union[Hello, Send, Pull, Ack, Nack, Cancel, Heartbeat, Leave, Subjects, Browse,
                Purge, "Fetch", "Snapshot", Hold, CancelHeld]

_MISSING = object()


class _Fields:
    """Typed access to one request map; every error names the op, the field and the type."""

    __slots__ = ("op", "frame")

    def __init__(self, op: str, frame: dict[str, Any]) -> None:
        self.op = op
        self.frame = frame

    def _bad(self, name: str, expected: str, value: object) -> BadRequest:
        return BadRequest(f"{self.op}.{name} must be {expected}, got {type_name(value)}")

    def get(self, name: str, default: object = _MISSING) -> Any:
        """The raw field; BadRequest naming it when absent and no default is given."""
        value = self.frame.get(name, _MISSING)
        if value is _MISSING:
            if default is _MISSING:
                raise BadRequest(f"{self.op} request lacks field {name!r}")
            return default
        return value

    def text(self, name: str, default: object = _MISSING) -> Any:
        """A non-empty str field; ``default`` (if given) when absent."""
        if name not in self.frame and default is not _MISSING:
            return default
        value = self.get(name)
        if not isinstance(value, str):
            raise self._bad(name, "str", value)
        if value == "":
            raise BadRequest(f"{self.op}.{name} must not be empty")
        return value

    def client_id(self, name: str) -> str:
        """A client id, app name or consumer id: non-empty, at most MAX_CLIENT_ID_CHARS."""
        value = self.text(name)
        if len(value) > MAX_CLIENT_ID_CHARS:
            raise BadRequest(f"{self.op}.{name} of {len(value)} characters exceeds "
                             f"MAX_CLIENT_ID_CHARS {MAX_CLIENT_ID_CHARS}")
        return value

    def array(self, name: str, default: object = _MISSING) -> Any:
        """A list field; ``default`` (if given) when absent."""
        if name not in self.frame and default is not _MISSING:
            return default
        value = self.get(name)
        if not isinstance(value, list):
            raise self._bad(name, "list", value)
        return value


def request_rid(frame: dict[str, Any]) -> int | None:
    """The frame's rid if it is a valid one, else None (for answering a request we reject)."""
    rid = frame.get("rid")
    if type(rid) is int and 0 <= rid <= _U64_MAX:
        return rid
    return None


def _parse_hello(f: _Fields, rid: int) -> Hello:
    protocol = f.get("protocol")
    if type(protocol) is not int:
        raise f._bad("protocol", "int", protocol)
    if protocol != PROTOCOL_VERSION:
        raise NotSupported(
            f"protocol version {protocol} is not supported; this server speaks {PROTOCOL_VERSION}"
        )
    token = f.get("token", None)
    if token is not None and not isinstance(token, str):
        raise f._bad("token", "str or nil", token)
    if token is not None and len(token) > MAX_TOKEN_CHARS:
        # Never echo the token: it may be a secret pasted into the wrong place.
        raise BadRequest(
            f"hello.token of {len(token)} characters exceeds MAX_TOKEN_CHARS {MAX_TOKEN_CHARS}"
        )
    return Hello(rid, f.client_id("client_id"), f.client_id("app"), token, protocol)


def _parse_send(f: _Fields, rid: int) -> Send:
    return _send_of(f.frame, rid)


def _send_of(frame: dict[str, Any], rid: int) -> Send:
    """``send``'s parser read from the map itself: ``parse_request`` makes no ``_Fields``
    for the usual requests (issue 18: a Python call fewer a send); one is made only to name
    a defect."""
    messages = frame.get("messages")
    if type(messages) is not list:
        messages = _Fields("send", frame).array("messages")  # raises, naming what is wrong
    if not messages:
        raise BadRequest("send.messages must not be empty")
    if len(messages) > MAX_SEND_BATCH_MESSAGES:
        raise TooLarge(
            f"send batch of {len(messages)} messages exceeds "
            f"MAX_SEND_BATCH_MESSAGES {MAX_SEND_BATCH_MESSAGES}"
        )
    for payload in messages:
        if type(payload) is not bytes:  # msgpack's bin is bytes itself: no call per message
            raise BadRequest(f"send.messages must hold bin payloads, got {type_name(payload)}")
    compact = frame.get("compact", False)
    if type(compact) is not bool:
        raise _Fields("send", frame)._bad("compact", "bool", compact)
    return Send(rid, messages, compact)


# (subject, group, consumer_id) triples that passed validation. A consumer names the same three
# in every pull and ack, and checking them (two regular expressions) was a third of the cost of
# parsing one; a triple seen before is valid again. Bounded: cleared when full.
_VALID_CONSUMER_FIELDS: set[tuple[str, str, str]] = set()
VALID_CONSUMER_FIELDS_MAX = 4096


def _consumer_fields(f: _Fields) -> tuple[str, str, str]:
    frame = f.frame
    known = (frame.get("subject"), frame.get("group"), frame.get("consumer_id"))
    if (type(known[0]) is str and type(known[1]) is str and type(known[2]) is str
            and known in _VALID_CONSUMER_FIELDS):
        return known  # type: ignore[return-value]
    subject = f.get("subject")
    validate_subject(subject, allow_internal=True)
    group = f.get("group")
    validate_group(group)
    checked = (subject, group, f.client_id("consumer_id"))
    if len(_VALID_CONSUMER_FIELDS) >= VALID_CONSUMER_FIELDS_MAX:
        _VALID_CONSUMER_FIELDS.clear()
    _VALID_CONSUMER_FIELDS.add(checked)
    return checked


def _parse_pull(f: _Fields, rid: int) -> Pull:
    return _pull_of(f.frame, rid)


def _pull_of(frame: dict[str, Any], rid: int) -> Pull:
    """``pull``'s parser read from the map itself, as ``_send_of`` (two Python calls fewer a
    pull: no ``_Fields``, and ``_consumer_fields``'s known triple checked here)."""
    known = (frame.get("subject"), frame.get("group"), frame.get("consumer_id"))
    if (type(known[0]) is str and type(known[1]) is str and type(known[2]) is str
            and known in _VALID_CONSUMER_FIELDS):
        subject, group, consumer_id = known
    else:
        subject, group, consumer_id = _consumer_fields(_Fields("pull", frame))
    # The usual pull (no tag filter, every field well-formed) in one test; anything else takes
    # the checks below, which name the defect.
    max_count = frame.get("max_count")
    wait_ms = frame.get("wait_ms", 0)
    start = frame.get("start", "latest")
    broadcast = frame.get("broadcast", False)
    if (type(max_count) is int and 1 <= max_count <= MAX_PULL_BATCH_MESSAGES
            and type(wait_ms) is int and 0 <= wait_ms <= MAX_PULL_WAIT_MS
            and not frame.get("tags") and type(frame.get("tags", [])) is list
            and (start == "latest" or start == "earliest") and type(start) is str
            and (broadcast is False or broadcast is True)):
        return Pull(rid, subject, group, consumer_id, max_count, wait_ms, [], start,  # type: ignore[arg-type]  # start checked just above
                    broadcast)
    return _parse_pull_checked(_Fields("pull", frame), rid, subject, group, consumer_id)


def _max_count(f: _Fields) -> int:
    """The ``max_count`` of a pull or browse: an int in 1..MAX_PULL_BATCH_MESSAGES."""
    max_count = f.get("max_count")
    if type(max_count) is not int:
        raise f._bad("max_count", "int", max_count)
    if max_count > MAX_PULL_BATCH_MESSAGES:
        raise BadRequest(f"{f.op}.max_count {max_count} exceeds MAX_PULL_BATCH_MESSAGES "
                         f"{MAX_PULL_BATCH_MESSAGES}")
    if max_count < 1:
        raise BadRequest(f"{f.op}.max_count must be >= 1, got {max_count}")
    return max_count


def _parse_pull_checked(f: _Fields, rid: int, subject: str, group: str,
                        consumer_id: str) -> Pull:
    max_count = _max_count(f)
    wait_ms = f.get("wait_ms", 0)
    if type(wait_ms) is not int:
        raise f._bad("wait_ms", "int", wait_ms)
    if wait_ms > MAX_PULL_WAIT_MS:
        raise BadRequest(f"pull.wait_ms {wait_ms} ms exceeds MAX_PULL_WAIT_MS {MAX_PULL_WAIT_MS}")
    if wait_ms < 0:
        raise BadRequest(f"pull.wait_ms must be >= 0, got {wait_ms}")
    tags = f.array("tags", [])
    validate_tags(tags, what="pull tag filter")
    start = f.text("start", default="latest")
    if start not in ("latest", "earliest"):
        raise BadRequest(f"pull.start must be 'latest' or 'earliest', got {start!r}")
    broadcast = f.get("broadcast", False)
    if not isinstance(broadcast, bool):
        raise f._bad("broadcast", "bool", broadcast)
    return Pull(rid, subject, group, consumer_id, max_count, wait_ms, tags, start, broadcast)


def _parse_ack(f: _Fields, rid: int) -> Ack:
    subject, group, consumer_id = _consumer_fields(f)
    raw = f.frame.get("ranges")
    if type(raw) is not list:
        raw = f.array("ranges")  # raises, naming what is wrong
    if not raw:
        raise BadRequest("ack.ranges must not be empty")
    if len(raw) > MAX_ACK_RANGES:
        raise TooLarge(f"ack of {len(raw)} ranges exceeds MAX_ACK_RANGES {MAX_ACK_RANGES}")
    ranges: list[tuple[int, int]] = []
    append = ranges.append
    for item in raw:
        if type(item) is list and len(item) == 2:
            first, last = item
            if type(first) is int and type(last) is int and 0 <= first <= last <= _U64_MAX:
                append((first, last))
                continue
        # Not a well-formed range: the checks below say what is wrong with it.
        if not (
            isinstance(item, list)
            and len(item) == 2
            and all(type(x) is int and 0 <= x <= _U64_MAX for x in item)
        ):
            raise BadRequest(
                f"ack.ranges must hold [first, last] pairs of non-negative int, got {item!r:.80}"
            )
        first, last = item
        if first > last:
            raise BadRequest(f"ack range [{first}, {last}] has first > last")
        ranges.append((first, last))
    return Ack(rid, subject, group, consumer_id, ranges)


def _parse_nack(f: _Fields, rid: int) -> Nack:
    subject, group, consumer_id = _consumer_fields(f)
    seqs = f.array("pull_seqs")
    if not seqs:
        raise BadRequest("nack.pull_seqs must not be empty")
    if len(seqs) > MAX_ACK_RANGES:
        raise TooLarge(
            f"nack of {len(seqs)} pull_seqs exceeds MAX_ACK_RANGES {MAX_ACK_RANGES}"
        )
    for seq in seqs:
        if type(seq) is not int or not 0 <= seq <= _U64_MAX:
            raise BadRequest(f"nack.pull_seqs must hold non-negative int, got {type_name(seq)}")
    retry_after_ms = f.get("retry_after_ms", None)
    if retry_after_ms is not None:
        if type(retry_after_ms) is not int:
            raise f._bad("retry_after_ms", "int or nil", retry_after_ms)
        if retry_after_ms < 0:
            raise BadRequest(f"nack.retry_after_ms must be >= 0, got {retry_after_ms}")
        if retry_after_ms > MAX_DELAY_MS:
            raise DelayOutOfRange(
                f"nack.retry_after_ms {retry_after_ms} ms exceeds MAX_DELAY_MS {MAX_DELAY_MS}"
            )
    return Nack(rid, subject, group, consumer_id, seqs, retry_after_ms)


def _parse_cancel(f: _Fields, rid: int) -> Cancel:
    ids = f.array("ids")
    if not ids:
        raise BadRequest("cancel.ids must not be empty")
    if len(ids) > MAX_SEND_BATCH_MESSAGES:
        raise TooLarge(
            f"cancel of {len(ids)} ids exceeds MAX_SEND_BATCH_MESSAGES {MAX_SEND_BATCH_MESSAGES}"
        )
    for message_id in ids:
        validate_message_id(message_id)
    due = f.array("deliver_at_ms")
    if len(due) != len(ids):
        raise BadRequest(
            f"cancel.deliver_at_ms has {len(due)} entries, cancel.ids has {len(ids)}: one each"
        )
    for value in due:
        if type(value) is not int or not 0 <= value <= _U64_MAX:
            raise BadRequest(f"cancel.deliver_at_ms must hold non-negative int, got {value!r:.40}")
    return Cancel(rid, ids, due)


def _parse_hold(f: _Fields, rid: int) -> Hold:
    messages = _parse_send(f, rid).messages
    visible = f.array("visible_at_ms")
    if len(visible) != len(messages):
        raise BadRequest(f"hold.visible_at_ms has {len(visible)} entries, hold.messages has "
                         f"{len(messages)}: one each")
    for value in visible:
        if type(value) is not int or not 0 <= value <= _U64_MAX:
            raise BadRequest(f"hold.visible_at_ms must hold non-negative int, got {value!r:.40}")
    return Hold(rid, messages, visible)


def _parse_cancel_held(f: _Fields, rid: int) -> CancelHeld:
    subject = f.text("subject")
    validate_subject(subject, allow_internal=True)
    ids = f.array("ids")
    if not ids:
        raise BadRequest("cancel_held.ids must not be empty")
    if len(ids) > MAX_SEND_BATCH_MESSAGES:
        raise TooLarge(f"cancel_held of {len(ids)} ids exceeds MAX_SEND_BATCH_MESSAGES "
                       f"{MAX_SEND_BATCH_MESSAGES}")
    for message_id in ids:
        validate_message_id(message_id)
    return CancelHeld(rid, subject, ids)


def _subscriptions(f: _Fields, op: str) -> list[tuple[str, str]]:
    """The ``subscriptions`` field of a heartbeat or leave: [subject, group] pairs."""
    subscriptions: list[tuple[str, str]] = []
    for item in f.array("subscriptions"):
        if not (isinstance(item, list) and len(item) == 2):
            raise BadRequest(
                f"{op}.subscriptions must hold [subject, group] pairs, got {type_name(item)}"
            )
        subject, group = item
        validate_subject(subject, allow_internal=True)
        validate_group(group)
        subscriptions.append((subject, group))
    return subscriptions


def _parse_heartbeat(f: _Fields, rid: int) -> Heartbeat:
    return Heartbeat(rid, f.client_id("consumer_id"), _subscriptions(f, "heartbeat"))


def _parse_leave(f: _Fields, rid: int) -> Leave:
    return Leave(rid, f.client_id("consumer_id"), _subscriptions(f, "leave"))


def _parse_subjects(f: _Fields, rid: int) -> Subjects:
    prefix = f.get("prefix", "")
    if not isinstance(prefix, str):
        raise f._bad("prefix", "str", prefix)
    if len(prefix) > MAX_SUBJECT_PREFIX_CHARS:
        raise BadRequest(
            f"subjects.prefix of {len(prefix)} characters exceeds MAX_SUBJECT_PREFIX_CHARS "
            f"{MAX_SUBJECT_PREFIX_CHARS}"
        )
    return Subjects(rid, prefix)


def _sequence(f: _Fields, name: str, value: object) -> int:
    if type(value) is not int:
        raise f._bad(name, "int", value)
    if not 0 <= value <= _U64_MAX:
        raise BadRequest(f"{f.op}.{name} {value} is outside 0..{_U64_MAX}")
    return value


def _parse_browse(f: _Fields, rid: int) -> Browse:
    subject = f.get("subject")
    validate_subject(subject, allow_internal=True)
    from_sequence = f.get("from_sequence", None)
    if from_sequence is not None:
        if type(from_sequence) is not int:
            raise f._bad("from_sequence", "int or nil", from_sequence)
        _sequence(f, "from_sequence", from_sequence)
    return Browse(rid, subject, from_sequence, _max_count(f))


def _parse_purge(f: _Fields, rid: int) -> Purge:
    subject = f.get("subject")
    validate_subject(subject, allow_internal=True)
    if not subject.startswith(DEAD_PREFIX):
        raise BadRequest(
            f"purge.subject {subject!r} is not a dead-letter subject: only "
            f"{DEAD_PREFIX}<subject>%<group> subjects can be purged"
        )
    through = _sequence(f, "through_sequence", f.get("through_sequence"))
    return Purge(rid, subject, through)


def _replication() -> Any:
    import wire.replication

    return wire.replication


_PARSERS: dict[str, Callable[[_Fields, int], Request]] = {
    "hello": _parse_hello,
    "send": _parse_send,
    "pull": _parse_pull,
    "ack": _parse_ack,
    "nack": _parse_nack,
    "cancel": _parse_cancel,
    "hold": _parse_hold,
    "cancel_held": _parse_cancel_held,
    "heartbeat": _parse_heartbeat,
    "leave": _parse_leave,
    "subjects": _parse_subjects,
    "browse": _parse_browse,
    "purge": _parse_purge,
    # The replication ops (wire.replication) read their map themselves; that module is imported
    # on the first such request, so a client (which never parses requests) does not load it.
    "fetch": lambda f, rid: _replication().parse_fetch(f.frame, rid),
    "snapshot": lambda f, rid: _replication().parse_snapshot(f.frame, rid),
}
OPS = tuple(_PARSERS)


def parse_request(frame: dict[str, Any]) -> Request:
    """Validate a decoded frame as a request and return its typed form.

    BadRequest for a missing/invalid ``op`` or ``rid``, an unknown op (named), or a field of the
    wrong type (named with the value's type); TooLarge/DelayOutOfRange/NotSupported for limits.
    """
    if type(frame) is not dict and not isinstance(frame, dict):
        raise BadRequest(f"request must be a map, got {type_name(frame)}")
    # Subscripts, not dict.get: no call for the fields every request has.
    try:
        op = frame["op"]
    except KeyError:
        raise BadRequest("request lacks field 'op'") from None
    if type(op) is not str and not isinstance(op, str):
        raise BadRequest(f"request op must be str, got {type_name(op)}")
    try:
        rid = frame["rid"]
    except KeyError:
        raise BadRequest(f"{op} request lacks field 'rid'") from None
    if type(rid) is not int:
        raise BadRequest(f"{op}.rid must be int, got {type_name(rid)}")
    if not 0 <= rid <= _U64_MAX:
        raise BadRequest(f"{op}.rid {rid} is outside 0..{_U64_MAX}")
    # The two usual requests read from the map, with no ``_Fields`` made (issue 18).
    if op == "send":
        return _send_of(frame, rid)
    if op == "pull":
        return _pull_of(frame, rid)
    try:
        parser = _PARSERS[op]
    except KeyError:
        raise BadRequest(f"unknown op {op!r:.80}; known ops: {', '.join(OPS)}") from None
    return parser(_Fields(op, frame), rid)


__all__ = [
    "PROTOCOL_VERSION",
    "HEADER_BYTES",
    "OPS",
    "encode_frame",
    "decode_frame_payload",
    "FrameDecoder",
    "Hello",
    "Send",
    "Pull",
    "Ack",
    "Nack",
    "Cancel",
    "CancelHeld",
    "Hold",
    "Heartbeat",
    "Leave",
    "Subjects",
    "Browse",
    "Purge",
    "MAX_SUBJECT_PREFIX_CHARS",
    "Request",
    "request_rid",
    "parse_request",
    "error_response",
    "hello_response",
    "send_result_ok",
    "send_stored_answer",
    "send_results_stored",
    "delayed_send_result",
    "send_result_error",
    "cancel_result",
    "pull_columns",
    "pull_response",
    "browsed_message",
    "parse_response",
]
