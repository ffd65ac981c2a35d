"""The pull log's action records: the body of one ``logstore`` record per state change.

Each action is one record of the ``SegmentedLog`` under ``<directory>/actions/``; logstore's
framing supplies the length, magic, version and CRC-32. The body is::

    Offset | Size | Field
    -------+------+---------------------------------------------------------------
    0      | 1    | action_type: u8, one of the ACTION_* codes below
    1      | 1    | body_version: u8, 1
    2      | N    | fields: a msgpack array, in the order of the table for the type

    Type | Name              | Fields (msgpack array, in order)
    -----+-------------------+------------------------------------------------------------------
    1    | GROUP_CREATED     | subject str, group str, start_sequence uint, now_ms uint
    2    | PULL              | subject str, group str, consumer str, first_pull_seq uint,
         |                   | consumer_log_seqs [uint], new_cursor uint, now_ms uint
    3    | ACK               | subject str, group str, consumer str, ranges [[lo uint, hi uint]],
         |                   | now_ms uint   (inclusive pull-seq ranges, lo <= hi)
    4    | RELEASE           | subject str, group str, consumer str, pull_seqs [uint],
         |                   | reason uint (1 = ack timeout), now_ms uint
    5    | CONSUMER_REMOVED  | subject str, group str, consumer str, now_ms uint
         |                   | (releases everything the consumer held, in pull-seq order)
    6    | EPOCH_STARTED     | epoch uint (written on open after an unclean shutdown)
    7    | CLOSED            | (no fields; the last action of a clean close)
    8    | OPENED            | (no fields; fsynced on every open, so that a session which then
         |                   | crashes never ends with the previous session's CLOSED)

What it does NOT guarantee: the CRC (logstore's) detects torn writes and bit rot, not tampering;
an action that decodes is not checked against the state here (the store's replay does that);
nothing is compressed, so a PULL costs a few bytes per consumer-log sequence.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import msgpack

# One reused msgpack Packer per thread: msgpack.packb makes a Packer, with its buffer, per call,
# most of a small action's encoding (issue 18: each pull records one action, on the event loop
# at low rates). wire.packing is that Packer, shared with the messages' and frames' encoders.
from wire.packing import PACKER_KEEP_BYTES_MAX, packb, packers

HEADER = struct.Struct(
    ">B"  # action_type: ACTION_* code
    "B"  # body_version: BODY_VERSION
)
BODY_VERSION = 1

ACTION_GROUP_CREATED = 1
ACTION_PULL = 2
ACTION_ACK = 3
ACTION_RELEASE = 4
ACTION_CONSUMER_REMOVED = 5
ACTION_EPOCH_STARTED = 6
ACTION_CLOSED = 7
ACTION_OPENED = 8

RELEASE_REASON_ACK_TIMEOUT = 1
RELEASE_REASONS = (RELEASE_REASON_ACK_TIMEOUT,)

U64_MAX = (1 << 64) - 1  # msgpack's largest unsigned integer; every uint field is at most this


@dataclass(frozen=True)
class GroupCreated:
    subject: str
    group: str
    start_sequence: int
    now_ms: int


@dataclass(frozen=True)
class Pull:
    subject: str
    group: str
    consumer: str
    first_pull_seq: int  # pull seq of consumer_log_seqs[0]; the rest follow densely
    consumer_log_seqs: tuple[int, ...]
    new_cursor: int
    now_ms: int


@dataclass(frozen=True)
class Ack:
    subject: str
    group: str
    consumer: str
    ranges: tuple[tuple[int, int], ...]  # inclusive pull-seq ranges
    now_ms: int


@dataclass(frozen=True)
class Release:
    subject: str
    group: str
    consumer: str
    pull_seqs: tuple[int, ...]
    reason: int
    now_ms: int


@dataclass(frozen=True)
class ConsumerRemoved:
    subject: str
    group: str
    consumer: str
    now_ms: int


@dataclass(frozen=True)
class EpochStarted:
    epoch: int


@dataclass(frozen=True)
class Closed:
    pass


@dataclass(frozen=True)
class Opened:
    pass


Action = GroupCreated | Pull | Ack | Release | ConsumerRemoved | EpochStarted | Closed | Opened

# Field kinds: "s" str, "u" uint, "U" list of uint, "R" list of [uint, uint] with lo <= hi.
_SCHEMAS: dict[int, tuple[type, str]] = {
    ACTION_GROUP_CREATED: (GroupCreated, "ssuu"),
    ACTION_PULL: (Pull, "sssuUuu"),
    ACTION_ACK: (Ack, "sssRu"),
    ACTION_RELEASE: (Release, "sssUuu"),
    ACTION_CONSUMER_REMOVED: (ConsumerRemoved, "sssu"),
    ACTION_EPOCH_STARTED: (EpochStarted, "u"),
    ACTION_CLOSED: (Closed, ""),
    ACTION_OPENED: (Opened, ""),
}
_TYPE_OF: dict[type, int] = {cls: code for code, (cls, _kinds) in _SCHEMAS.items()}


def _is_uint(value: object) -> bool:
    return type(value) is int and 0 <= value <= U64_MAX


def _check(kind: str, value: object) -> object:
    """Validate one decoded field; returns it in its dataclass form (tuples, not lists)."""
    if kind == "s":
        if type(value) is not str:
            raise ValueError(f"expected a string, got {type(value).__name__}")
        return value
    if kind == "u":
        if not _is_uint(value):
            raise ValueError(f"expected an unsigned integer, got {value!r}")
        return value
    if kind == "U":
        if type(value) not in (list, tuple) or (value and not (
                set(map(type, value)) == {int} and min(value) >= 0 and max(value) <= U64_MAX)):
            raise ValueError("expected a list of unsigned integers")
        return tuple(value)
    assert kind == "R", kind
    if type(value) not in (list, tuple):
        raise ValueError("expected a list of ranges")
    ranges = []
    for item in value:
        if (type(item) not in (list, tuple) or len(item) != 2
                or not _is_uint(item[0]) or not _is_uint(item[1]) or item[0] > item[1]):
            raise ValueError(f"bad ack range {item!r}")
        ranges.append((item[0], item[1]))
    return tuple(ranges)


def _fields(action: Action) -> list[object]:
    return [getattr(action, name) for name in action.__dataclass_fields__]


_PULL_HEADER = HEADER.pack(ACTION_PULL, BODY_VERSION)


def _encode_pull(action: Pull) -> bytes:
    """``encode_action`` for a PULL, the action of every pull: the same checks and bytes, in
    one step rather than field by field."""
    seqs = action.consumer_log_seqs
    if not (type(action.subject) is str and type(action.group) is str
            and type(action.consumer) is str and _is_uint(action.first_pull_seq)
            and _is_uint(action.new_cursor) and _is_uint(action.now_ms)):
        raise ValueError(f"bad PULL action fields {action!r:.200}")
    if type(seqs) not in (list, tuple) or (seqs and not (
            set(map(type, seqs)) == {int} and min(seqs) >= 0 and max(seqs) <= U64_MAX)):
        raise ValueError("expected a list of unsigned integers")
    return encode_checked_pull(action.subject, action.group, action.consumer,
                               action.first_pull_seq, seqs, action.new_cursor, action.now_ms)


def encode_checked_pull(subject: str, group: str, consumer: str, first_pull_seq: int,
                        seqs: tuple[int, ...], new_cursor: int, now_ms: int) -> bytes:
    """The PULL record body for fields the caller has already checked as ``_encode_pull``
    does (``PullLogStore.record_tail_pull``): the same bytes, with no Pull built."""
    # msgpack packs a tuple as an array: the values go as they are, copied into no list. The
    # thread's Packer straight, with no packb call between (one per pull; issue 18).
    body: bytes = packers.pack((subject, group, consumer, first_pull_seq, seqs, new_cursor,
                                 now_ms))
    if len(body) > PACKER_KEEP_BYTES_MAX:
        packers.renew()  # as packb: not kept with its grown buffer
    return _PULL_HEADER + body


def encode_action(action: Action) -> bytes:
    """The record body for ``action``."""
    if type(action) is Pull:
        return _encode_pull(action)
    code = _TYPE_OF[type(action)]
    _cls, kinds = _SCHEMAS[code]
    values = _fields(action)
    for kind, value in zip(kinds, values):
        _check(kind, value)  # refuse to write what we could not read back
    # msgpack packs a tuple as an array: the values go as they are, copied into no list.
    packed = [list(map(list, v)) if k == "R" else v for k, v in zip(kinds, values)]
    return HEADER.pack(code, BODY_VERSION) + packb(packed)


def decode_action(body: bytes) -> Action:
    """Parse a record body into an action; raises ValueError naming the defect."""
    if len(body) < HEADER.size:
        raise ValueError(f"action body of {len(body)} bytes is shorter than its {HEADER.size}-byte header")
    code, version = HEADER.unpack_from(body)
    if code not in _SCHEMAS:
        raise ValueError(f"unknown action type {code}")
    if version != BODY_VERSION:
        raise ValueError(f"unknown action body version {version}")
    try:
        fields = msgpack.unpackb(body[HEADER.size:], raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad bytes
        raise ValueError(f"undecodable msgpack: {exc}") from exc
    cls, kinds = _SCHEMAS[code]
    if type(fields) is not list or len(fields) != len(kinds):
        raise ValueError(f"action type {code} needs {len(kinds)} fields, got {fields!r:.80}")
    values = [_check(kind, value) for kind, value in zip(kinds, fields)]
    action = cls(*values)
    if isinstance(action, Pull):
        if action.consumer_log_seqs and action.first_pull_seq + len(action.consumer_log_seqs) - 1 > U64_MAX:
            raise ValueError("pull seqs run past the u64 range")
    if isinstance(action, Release) and action.reason not in RELEASE_REASONS:
        raise ValueError(f"unknown release reason {action.reason}")
    return action
