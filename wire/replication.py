"""The replication ops of the frame protocol: ``fetch`` and ``snapshot`` (slave -> master).

Pure codec, like ``wire.protocol``, which parses them with every other op (``parse_request``)
and whose framing they use. docs/REPLICATION.md 8.2 and 13.5 and docs/PROTOCOL.md describe them:

* ``fetch``: the bytes of one replicated log from ``offset`` (whole CRC-framed records, as
  stored), at most ``max_bytes``, the master holding the request up to ``wait_ms`` at the log's
  end. The offset acknowledges everything before it. ``last_epoch`` is the epoch of the slave's
  record ending at ``offset``; when the master's epoch history disagrees the answer carries
  ``diverging`` and no data, and the slave cuts its log before fetching again.
  ``reads`` lists the record kinds of that log, among those a master gates (newer than the
  replication protocol: docs/REPLICATION.md 8.2), that the slave reads; absent means none (a
  slave older than the field). A master serves nobody a record of a gated kind it did not say
  it reads, and writes such a kind only while every slave it counts reads it.
* ``snapshot``: part of the master's newest checkpoint of a log whose records the slave needs
  were deleted by the master's retention (the pull log's actions).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, ClassVar, Sequence

from wire.errors import BadRequest, type_name
from wire.limits import MAX_FETCH_BYTES, MAX_FETCH_WAIT_MS, MAX_SERVER_ID_CHARS

# The logs a slave copies from its master (docs/REPLICATION.md 8.1): a realtime group's message
# log and pull-log actions, a delay group's delay log and done journal.
REPLICATED_LOGS = ("message", "actions", "delay", "done")
_REPLICATED_LOG_SET = frozenset(REPLICATED_LOGS)
# Logs a follower that cannot copy from offset 0 starts from a master's snapshot (``snapshot``):
# the pull log's checkpoint, the message log's sequence starts.
SNAPSHOT_LOGS = ("message", "actions")
_SERVER_ID_CHARS = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ._:-")
_U64_MAX = 2**64 - 1
# Most record kinds one fetch may say it reads (a kind is a byte).
READS_MAX = 32


@dataclass(slots=True)
class Fetch:
    """The bytes of ``log`` from ``offset``, at most ``max_bytes``, waiting up to ``wait_ms`` at
    its end; ``offset`` acknowledges [0, offset), ``last_epoch`` is checked by the master."""

    op: ClassVar[str] = "fetch"
    rid: int
    server_id: str
    epoch: int
    log: str
    offset: int
    last_epoch: int
    max_bytes: int
    wait_ms: int
    # The gated record kinds of ``log`` the slave reads (``reads``; absent: none).
    reads: frozenset[int] = frozenset()


@dataclass(slots=True)
class Snapshot:
    """Bytes from ``position`` of the master's newest checkpoint of ``log`` (``sequence`` 0)
    or of the checkpoint ``sequence`` an earlier answer named."""

    op: ClassVar[str] = "snapshot"
    rid: int
    server_id: str
    epoch: int
    log: str
    sequence: int
    position: int
    max_bytes: int


def _uint(op: str, frame: dict[str, Any], name: str, low: int = 0, high: int = _U64_MAX) -> int:
    """An int field in [low, high]; BadRequest naming the op and the field otherwise."""
    if name not in frame:
        raise BadRequest(f"{op} request lacks field {name!r}")
    value = frame[name]
    if type(value) is not int:
        raise BadRequest(f"{op}.{name} must be int, got {type_name(value)}")
    if not low <= value <= high:
        raise BadRequest(f"{op}.{name} {value} is outside {low}..{high}")
    return value


def _text(op: str, frame: dict[str, Any], name: str) -> str:
    if name not in frame:
        raise BadRequest(f"{op} request lacks field {name!r}")
    value = frame[name]
    if not isinstance(value, str) or not value:
        raise BadRequest(f"{op}.{name} must be a non-empty str, got {type_name(value)}")
    return value


def _common(op: str, frame: dict[str, Any], logs: tuple[str, ...]) -> tuple[str, int, str]:
    """The (server_id, epoch, log) every replication request carries."""
    server_id = _text(op, frame, "server_id")
    if len(server_id) > MAX_SERVER_ID_CHARS or not set(server_id) <= _SERVER_ID_CHARS:
        raise BadRequest(f"{op}.server_id {server_id[:80]!r} must be 1..{MAX_SERVER_ID_CHARS} "
                         f"characters of [A-Za-z0-9._:-]")
    log_name = _text(op, frame, "log")
    if log_name not in logs:
        raise BadRequest(f"{op}.log {log_name[:80]!r} is not one of {', '.join(logs)}")
    return server_id, _uint(op, frame, "epoch"), log_name


# A fetch's int fields, taken in one call and checked inline: a slave sends one or two
# fetches a message.
_FETCH_UINTS = itemgetter("epoch", "offset", "last_epoch", "max_bytes", "wait_ms")
# Server ids seen valid (a master hears a handful of slaves): the character check runs once
# per id (at most _SERVER_IDS_KEPT_MAX are kept).
_server_ids_seen: set[str] = set()
_SERVER_IDS_KEPT_MAX = 64


def parse_fetch(frame: dict[str, Any], rid: int) -> Fetch:
    """A ``fetch`` request map (rid already checked) -> ``Fetch``; BadRequest names the field.
    The usual fetch (every field present and in range, a server id seen before) is checked by
    builtins alone; anything else by the field-by-field checks, which word what is wrong."""
    try:
        epoch, offset, last_epoch, max_bytes, wait_ms = _FETCH_UINTS(frame)
        server_id, log_name = frame["server_id"], frame["log"]
        usual = (type(server_id) is str and server_id in _server_ids_seen
                 and type(log_name) is str and log_name in _REPLICATED_LOG_SET
                 and type(epoch) is int and type(offset) is int and type(last_epoch) is int
                 and type(max_bytes) is int and type(wait_ms) is int
                 and 0 <= epoch <= _U64_MAX and 0 <= offset <= _U64_MAX
                 and 0 <= last_epoch <= _U64_MAX and 1 <= max_bytes <= MAX_FETCH_BYTES
                 and 0 <= wait_ms <= MAX_FETCH_WAIT_MS)
    except KeyError:
        usual = False
    if usual:
        return Fetch(rid, server_id, epoch, log_name, offset, last_epoch, max_bytes, wait_ms,
                     _reads(frame))
    server_id, epoch, log_name = _common("fetch", frame, REPLICATED_LOGS)
    if len(_server_ids_seen) < _SERVER_IDS_KEPT_MAX:
        _server_ids_seen.add(server_id)
    return Fetch(rid, server_id, epoch, log_name, _uint("fetch", frame, "offset"),
                 _uint("fetch", frame, "last_epoch"),
                 _uint("fetch", frame, "max_bytes", 1, MAX_FETCH_BYTES),
                 _uint("fetch", frame, "wait_ms", 0, MAX_FETCH_WAIT_MS), _reads(frame))


_NO_READS: frozenset[int] = frozenset()
# ``reads`` lists seen and valid -> their set: a slave sends the same list in every fetch, so
# the check and the set are made once (at most _READS_KEPT_MAX lists are kept). A list equal to
# a kept one (1.0 or True for 1) is taken as those kinds.
_reads_seen: dict[tuple[int, ...], frozenset[int]] = {}
_READS_KEPT_MAX = 64


def _reads(frame: dict[str, Any]) -> frozenset[int]:
    """A fetch's ``reads``: a list of at most READS_MAX kinds (ints 0..255); absent: none."""
    reads = frame.get("reads")
    if reads is None:
        return _NO_READS
    if type(reads) is list and len(reads) <= READS_MAX:
        try:
            found = _reads_seen.get(tuple(reads))
        except TypeError:  # an unhashable item ([1], {}): the check below names it
            found = None
        if found is not None:
            return found
    if type(reads) is not list or len(reads) > READS_MAX or not all(
            type(kind) is int and 0 <= kind <= 255 for kind in reads):
        raise BadRequest(f"fetch.reads must be a list of at most {READS_MAX} record kinds "
                         f"(0..255), got {reads!r:.80}")
    kinds = frozenset(reads)
    if len(_reads_seen) < _READS_KEPT_MAX:
        _reads_seen[tuple(reads)] = kinds
    return kinds


def parse_snapshot(frame: dict[str, Any], rid: int) -> Snapshot:
    """A ``snapshot`` request map -> ``Snapshot``; BadRequest names the field."""
    server_id, epoch, log_name = _common("snapshot", frame, SNAPSHOT_LOGS)
    return Snapshot(rid, server_id, epoch, log_name, _uint("snapshot", frame, "sequence"),
                    _uint("snapshot", frame, "position"),
                    _uint("snapshot", frame, "max_bytes", 1, MAX_FETCH_BYTES))


def fetch_request(server_id: str, epoch: int, log: str, offset: int, last_epoch: int,
                  max_bytes: int, wait_ms: int, reads: Sequence[int] = ()) -> dict[str, Any]:
    """The map a slave sends (without rid, which its connection adds); ``reads`` (the gated
    record kinds of ``log`` it reads) only when it reads some."""
    request = {"op": "fetch", "server_id": server_id, "epoch": epoch, "log": log,
               "offset": offset, "last_epoch": last_epoch, "max_bytes": max_bytes,
               "wait_ms": wait_ms}
    if reads:
        request["reads"] = sorted(reads)
    return request


def snapshot_request(server_id: str, epoch: int, log: str, sequence: int, position: int,
                     max_bytes: int) -> dict[str, Any]:
    """The ``snapshot`` map a slave sends (without rid)."""
    return {"op": "snapshot", "server_id": server_id, "epoch": epoch, "log": log,
            "sequence": sequence, "position": position, "max_bytes": max_bytes}


# --- answers -----------------------------------------------------------------------------------


def _epochs(op: str, epochs: object) -> tuple[tuple[int, int], ...]:
    """An answer's ``epochs``: [epoch, start_offset] pairs; BadRequest otherwise. None or one
    pair (most answers) is checked inline, with no generator run."""
    if type(epochs) is list and len(epochs) <= 1:
        if not epochs:
            return ()
        pair = epochs[0]
        if type(pair) is list and len(pair) == 2:
            epoch, start = pair
            if type(epoch) is int and type(start) is int and 0 <= epoch <= _U64_MAX \
                    and 0 <= start <= _U64_MAX:
                return ((epoch, start),)
    if type(epochs) is not list or not all(
            type(item) is list and len(item) == 2
            and all(type(x) is int and 0 <= x <= _U64_MAX for x in item) for item in epochs):
        raise BadRequest(f"{op} epochs must be a list of [epoch, start_offset] pairs, got "
                         f"{epochs!r:.80}")
    return tuple((item[0], item[1]) for item in epochs)


@dataclass(slots=True)
class FetchAnswer:
    """A ``fetch`` answer: the master's epoch, the log's bytes [offset, next_offset), where the
    log starts and ends, the epoch history entries the slave must record for that range, and
    ``diverging`` ((epoch, end_offset): no data, cut there first) or None.

    Made whole by whoever answers or parses, and not changed after but for ``requires``
    (filled in by the master's loop before it is sent). Not frozen: a frozen dataclass is set
    up by ``object.__setattr__`` field by field, ~0.9 us more per answer, and a master and its
    slave make one each per fetch."""

    epoch: int
    log: str
    offset: int
    data: bytes
    next_offset: int
    log_start: int
    log_end: int
    epochs: tuple[tuple[int, int], ...]
    diverging: tuple[int, int] | None
    # The ends of other logs this log's records may refer to, as the master had them when it
    # read ``data`` (a pull-log action names messages): the slave applies ``data`` only once
    # its copies reach them.
    requires: dict[str, int] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        """The answer's map (without rid)."""
        return {"epoch": self.epoch, "log": self.log, "offset": self.offset, "data": self.data,
                "next_offset": self.next_offset, "log_start": self.log_start,
                "log_end": self.log_end, "epochs": [list(entry) for entry in self.epochs],
                "diverging": None if self.diverging is None else {
                    "epoch": self.diverging[0], "end_offset": self.diverging[1]},
                "requires": dict(self.requires)}


# A fetch answer's int fields, taken in one call (the usual answer: every one present and in
# range, checked inline; anything else by ``_uint`` each, which words what is wrong).
_ANSWER_UINTS = itemgetter("epoch", "offset", "next_offset", "log_start", "log_end")


def parse_fetch_answer(answer: dict[str, Any]) -> FetchAnswer:
    """Client side: a checked ``FetchAnswer``; BadRequest names the defect."""
    op = "fetch answer"
    try:
        epoch, offset, next_offset, log_start, log_end = _ANSWER_UINTS(answer)
        usual = (type(epoch) is int and type(offset) is int and type(next_offset) is int
                 and type(log_start) is int and type(log_end) is int and 0 <= epoch <= _U64_MAX
                 and 0 <= offset <= _U64_MAX and 0 <= next_offset <= _U64_MAX
                 and 0 <= log_start <= _U64_MAX and 0 <= log_end <= _U64_MAX)
    except KeyError:
        usual = False
    if not usual:
        epoch, offset = _uint(op, answer, "epoch"), _uint(op, answer, "offset")
        next_offset = _uint(op, answer, "next_offset")
        log_start, log_end = _uint(op, answer, "log_start"), _uint(op, answer, "log_end")
    data = answer.get("data")
    if not isinstance(data, bytes):
        raise BadRequest(f"{op} data must be bin, got {type_name(data)}")
    if next_offset != offset + len(data):
        raise BadRequest(f"{op} next_offset {next_offset} is not offset {offset} + "
                         f"{len(data)} bytes of data")
    epochs = _epochs(op, answer.get("epochs"))
    raw = answer.get("diverging")
    diverging = None
    if raw is not None:
        if not (isinstance(raw, dict) and type(raw.get("epoch")) is int
                and type(raw.get("end_offset")) is int):
            raise BadRequest(f"{op} diverging must be {{epoch, end_offset}} or nil, got "
                             f"{raw!r:.80}")
        diverging = (raw["epoch"], raw["end_offset"])
    requires = answer.get("requires", {})
    if type(requires) is dict and len(requires) <= 1:
        for name, end in requires.items():  # none or one: checked inline, no generator run
            if name not in _REPLICATED_LOG_SET or type(end) is not int \
                    or not 0 <= end <= _U64_MAX:
                raise BadRequest(f"{op} requires must map log names to offsets, got "
                                 f"{requires!r:.80}")
    elif not isinstance(requires, dict) or not all(
            k in REPLICATED_LOGS and type(v) is int and 0 <= v <= _U64_MAX
            for k, v in requires.items()):
        raise BadRequest(f"{op} requires must map log names to offsets, got {requires!r:.80}")
    log_name = answer.get("log")
    if type(log_name) is not str or not log_name:
        log_name = _text(op, answer, "log")  # raises, naming the field
    return FetchAnswer(epoch, log_name, offset, data, next_offset, log_start, log_end, epochs,
                       diverging, dict(requires))


@dataclass(frozen=True)
class SnapshotAnswer:
    """A ``snapshot`` answer: bytes [position, position + len(data)) of checkpoint
    ``sequence`` (``size`` bytes in all), which covers the log up to ``covers_offset``."""

    epoch: int
    log: str
    sequence: int
    covers_offset: int
    size: int
    position: int
    data: bytes
    # The epoch history entry in force at ``covers_offset`` ([epoch, start_offset]), which the
    # slave's history starts with once it installed the checkpoint.
    epochs: tuple[tuple[int, int], ...] = ()

    def to_wire(self) -> dict[str, Any]:
        """The answer's map (without rid)."""
        return {"epoch": self.epoch, "log": self.log, "sequence": self.sequence,
                "covers_offset": self.covers_offset, "size": self.size,
                "position": self.position, "data": self.data,
                "epochs": [list(entry) for entry in self.epochs]}


def parse_snapshot_answer(answer: dict[str, Any]) -> SnapshotAnswer:
    """Client side: a checked ``SnapshotAnswer``; BadRequest names the defect."""
    op = "snapshot answer"
    data = answer.get("data")
    if not isinstance(data, bytes):
        raise BadRequest(f"{op} data must be bin, got {type_name(data)}")
    parsed = SnapshotAnswer(_uint(op, answer, "epoch"), _text(op, answer, "log"),
                            _uint(op, answer, "sequence"), _uint(op, answer, "covers_offset"),
                            _uint(op, answer, "size"), _uint(op, answer, "position"), data,
                            _epochs(op, answer.get("epochs", [])))
    if parsed.position + len(data) > parsed.size:
        raise BadRequest(f"{op} runs past its size: {parsed.position} + {len(data)} > "
                         f"{parsed.size}")
    return parsed


__all__ = [
    "READS_MAX", "REPLICATED_LOGS", "SNAPSHOT_LOGS", "Fetch", "FetchAnswer", "Snapshot",
    "SnapshotAnswer",
    "fetch_request", "parse_fetch", "parse_fetch_answer", "parse_snapshot",
    "parse_snapshot_answer", "snapshot_request",
]
