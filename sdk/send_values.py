"""What one send is made of, apart from the Producer's state: durations and due times in epoch ms
from what the application gives (``duration_ms``, ``epoch_ms``, ``due_ms``, ``deliver_times``),
client and message ids (``default_client_id``, ``IdMaker``), payloads spliced from a template
(``spliced_payloads``, and ``plain_payload`` for one ``send``) and how many fit a frame
(``fit_payloads``). Pure functions and one
small class; ``sdk.producer`` uses them and re-exports the public ones."""

from __future__ import annotations

import itertools
import os
import socket
import uuid
from collections.abc import Iterator, Sequence
from datetime import datetime, timedelta
from itertools import repeat
from typing import Any

import msgpack

from wire.errors import BadRequest, DelayOutOfRange
from wire.limits import MAX_DELAY_MS
from wire.message import (
    KEY_BODY,
    KEY_CREATED_AT_MS,
    KEY_DELIVER_AT_MS,
    KEY_ID,
    KEY_SUBJECT,
    encode_plain_message,
)
from wire.packing import packb

PAYLOAD_OVERHEAD_BYTES = 8  # msgpack bin header per payload, rounded up


def duration_ms(value: timedelta | int | float, name: str) -> int:
    """A duration as whole milliseconds: a timedelta, or a number already in milliseconds."""
    if isinstance(value, timedelta):
        return int(value / timedelta(milliseconds=1))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    raise BadRequest(f"{name} must be a timedelta or milliseconds, got {type(value).__name__}")


def epoch_ms(value: datetime | int, name: str) -> int:
    """A point in time as epoch milliseconds: an aware datetime, or an int already in epoch ms."""
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise BadRequest(f"{name} must be timezone-aware, got naive datetime {value}")
        return int(value.timestamp() * 1000)
    if type(value) is int:
        return value
    raise BadRequest(f"{name} must be an aware datetime or epoch ms, got {type(value).__name__}")


def due_ms(now_ms: int, delay: timedelta | int | None,
           deliver_at: datetime | int | None) -> int | None:
    """The due time in epoch ms of one message sent at ``now_ms`` with ``delay`` or
    ``deliver_at`` (None: not delayed); BadRequest for both at once or a negative delay."""
    if delay is not None and deliver_at is not None:
        raise BadRequest("give delay or deliver_at, not both")
    if delay is not None:
        delay_ms = duration_ms(delay, "delay")
        if delay_ms < 0:
            raise BadRequest(f"delay must not be negative, got {delay_ms} ms")
        return now_ms + delay_ms
    if deliver_at is not None:
        return epoch_ms(deliver_at, "deliver_at")
    return None


def deliver_times(
    count: int,
    now_ms: int,
    delay: timedelta | int | Sequence[timedelta | int] | None,
    deliver_at: datetime | int | Sequence[datetime | int] | None,
) -> list[int] | None:
    """``send_many``'s due times in epoch ms, one per message (None: not delayed), checked as
    ``send`` checks one: not both arguments, no negative delay, none past MAX_DELAY_MS."""
    if delay is not None and deliver_at is not None:
        raise BadRequest("give delay or deliver_at, not both")
    given = delay if delay is not None else deliver_at
    if given is None:
        return None
    name = "delay" if delay is not None else "deliver_at"
    values = list(given) if isinstance(given, (list, tuple)) else None
    if values is not None and len(values) != count:
        raise BadRequest(f"{name} has {len(values)} values for {count} bodies: give one per body "
                         "or a single value for all")
    if delay is not None:
        if values is None:
            delays_ms = [duration_ms(delay, "delay")] * count  # type: ignore[arg-type]  # one value
        else:
            delays_ms = [v if type(v) is int else duration_ms(v, "delay") for v in values]
        low_ms = min(delays_ms)
        if low_ms < 0:
            raise BadRequest(f"delay must not be negative, got {low_ms} ms")
        due = [now_ms + d for d in delays_ms]
    elif values is None:
        due = [epoch_ms(deliver_at, "deliver_at")] * count  # type: ignore[arg-type]
    else:
        due = [v if type(v) is int else epoch_ms(v, "deliver_at") for v in values]
    earliest, latest = min(due), max(due)
    if earliest < 0:
        raise BadRequest(f"message field deliver_at_ms must be >= 0, got {earliest}")
    if latest - now_ms > MAX_DELAY_MS:
        raise DelayOutOfRange(f"deliver_at_ms is {latest - now_ms} ms ahead of now, exceeds "
                              f"MAX_DELAY_MS {MAX_DELAY_MS}")
    return due


def default_client_id() -> str:
    """``host-pid-random``: unique per process and readable in the MetaServer's client list."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class IdMaker:
    """Message ids: 16 random hex digits per producer, then a 16-hex-digit counter.

    As unique as ``uuid4().hex`` for our purpose (64 random bits tell producers apart, the
    counter tells one producer's messages apart) at a seventh of the cost: no syscall per id.
    ``prefix`` (16 hex digits) and ``made`` (the counter of the last id made) are for tests.

    The ids come from one C iterator, per 256 consecutive counters a shared head (the prefix
    and the counter's high 14 hex digits, formatted once) plus its last two hex digits from a
    table: one C-level concatenation per id, no formatting (83 ns against 219 ns for
    ``"%016x" %``). ``next()`` makes one id without a Python call (the iterator's
    ``__next__``, which ``send`` calls once per message); ``many`` takes a run of them."""

    def __init__(self, *, prefix: str | None = None, made: int = 0) -> None:
        self._prefix = os.urandom(8).hex() if prefix is None else prefix
        first = made + 1
        # The rest of the first counter's block, then whole blocks (a Python call per 256 ids).
        self._ids = itertools.chain(
            map(self._head(first >> 8).__add__, _LOW_HEX[first & 0xFF:]),
            itertools.chain.from_iterable(map(self._block, itertools.count((first >> 8) + 1))))
        self.next = self._ids.__next__

    def _head(self, high: int) -> str:
        """The first 30 hex digits of the ids of counters ``high << 8`` .. ``high << 8 | 0xFF``
        (more past 2**64, as ``"%016x"`` gives)."""
        return f"{self._prefix}{high:014x}"

    def _block(self, high: int) -> Iterator[str]:
        """The ids of the 256 counters from ``high << 8``, in order."""
        return map(self._head(high).__add__, _LOW_HEX)

    def __call__(self) -> str:
        return self.next()

    def many(self, count: int) -> list[str]:
        """``count`` fresh ids in one go (the ids of one ``send_many`` call): the same strings
        as ``count`` calls, taken from the same iterator in one C-level pass."""
        return list(itertools.islice(self._ids, count))


_LOW_HEX = tuple(f"{low:02x}" for low in range(256))  # the last two hex digits of a counter


def spliced_payloads(template_payload: bytes, fields: dict[str, Any],
                      columns: dict[str, Sequence[Any]]) -> list[bytes] | None:
    """One payload per row of ``columns``: the template's bytes with the values of the keys in
    ``columns`` (one column per key, all of one length) packed and spliced in.

    ``fields`` is the template decoded, in wire order. The bytes between the changing values
    are constant, so each payload is one ``b"".join`` of constant pieces and packed values, and
    every step runs in C (map, zip, join) rather than a Python call per message. None when the
    template's own values spliced in do not give back its bytes exactly (then the caller packs
    each message whole)."""
    packer = msgpack.Packer(use_bin_type=True)
    packb = packer.pack
    pieces: list[bytes | str] = []  # constant bytes, each followed by the key of a column
    constant = [packer.pack_map_header(len(fields))]
    for key, value in fields.items():
        constant.append(packb(key))
        if key in columns:
            pieces += [b"".join(constant), key]
            constant = []
        else:
            constant.append(packb(value))
    tail = b"".join(constant)
    rebuilt = b"".join(p if isinstance(p, bytes) else packb(fields[p]) for p in pieces) + tail
    if rebuilt != template_payload or len(pieces) != 2 * len(columns):
        return None
    parts: list[Any] = [repeat(p) if isinstance(p, bytes) else map(packb, columns[p])
                        for p in pieces]
    parts.append(repeat(tail))
    return list(map(b"".join, zip(*parts)))


# The constant bytes of ``encode_plain_message``'s map (its order: id, subject, body, created,
# due), for an id of IdMaker's 32 ASCII characters (a str8) and times packed as uint64, which
# msgpack chooses for every value from 2**32 (epoch ms since 1970-02-19) up to U64_MAX.
_PLAIN_ID_LENGTH = 32
_PLAIN_HEAD_REALTIME = b"\x84" + packb(KEY_ID) + b"\xd9\x20"  # fixmap of 4, "i", str8 of 32
_PLAIN_HEAD_DELAYED = b"\x85" + packb(KEY_ID) + b"\xd9\x20"  # fixmap of 5
_PLAIN_CREATED = packb(KEY_CREATED_AT_MS) + b"\xcf"  # "c", uint64 follows
_PLAIN_DUE = packb(KEY_DELIVER_AT_MS) + b"\xcf"  # "d", uint64 follows
_U64_PACKED_MIN = 1 << 32
_U64_MAX = (1 << 64) - 1
_BIN8_HEADS = tuple(b"\xc4" + bytes((size,)) for size in range(256))  # bin 8 of each size


def plain_middle(subject: str) -> bytes:
    """The bytes between the id and the body in ``plain_payload``'s payloads for ``subject``
    (made once per subject by the producer)."""
    return packb(KEY_SUBJECT) + packb(subject) + packb(KEY_BODY)


def plain_payload(message_id: str, subject: str, middle: bytes, body: bytes,
                  created_at_ms: int, deliver_at_ms: int | None) -> bytes:
    """``encode_plain_message(message_id, subject, body, created_at_ms, deliver_at_ms)``:
    the same bytes, spliced from constant pieces (``middle`` is ``plain_middle(subject)``)
    when the id has IdMaker's 32 ASCII characters and the times pack as uint64 (any epoch ms
    after 1970-02-19), in a third of the time; else packed by ``encode_plain_message``. For
    ``send``'s fields it knows valid, as that function is."""
    if (len(message_id) != _PLAIN_ID_LENGTH or not message_id.isascii()
            or not _U64_PACKED_MIN <= created_at_ms <= _U64_MAX
            or (deliver_at_ms is not None and not _U64_PACKED_MIN <= deliver_at_ms <= _U64_MAX)):
        return encode_plain_message(message_id, subject, body, created_at_ms, deliver_at_ms)
    size = len(body)
    # A bin 16 or bin 32 header as one int's bytes (its type byte in the high byte).
    head = (_BIN8_HEADS[size] if size < 256 else (0xC50000 | size).to_bytes(3, "big")
            if size < 65536 else (0xC600000000 | size).to_bytes(5, "big"))
    if deliver_at_ms is None:
        return b"".join((_PLAIN_HEAD_REALTIME, message_id.encode(), middle, head, body,
                         _PLAIN_CREATED, created_at_ms.to_bytes(8, "big")))
    return b"".join((_PLAIN_HEAD_DELAYED, message_id.encode(), middle, head, body,
                     _PLAIN_CREATED, created_at_ms.to_bytes(8, "big"),
                     _PLAIN_DUE, deliver_at_ms.to_bytes(8, "big")))


def fit_payloads(payloads: list[bytes], pos: int, end: int, room_bytes: int) -> tuple[int, int]:
    """How far from ``pos`` (at most to ``end``) payloads fit in ``room_bytes`` with their framing
    allowance: (the end of the run, its size in bytes)."""
    size = 0
    stop = pos
    while stop < end:
        need = len(payloads[stop]) + PAYLOAD_OVERHEAD_BYTES
        if size + need > room_bytes:
            break
        size += need
        stop += 1
    return stop, size
