"""Checking request bodies and query parameters: unknown fields, wrong types and bad values are 400s.

A field spec is ``Field(type, required, default, check)``; ``parse_object`` returns a dict with every
declared field present (defaults filled in) or raises BadRequest naming the field and the value.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from metaserver.errors import BadRequest
# Limits of a heartbeat's replica report (docs/REPLICATION.md 13.4), of min_insync, and of a
# server id (the same as a fetch's).
from wire.limits import (
    MAX_SERVER_ID_CHARS, MIN_INSYNC_MAX, REPLICA_INSYNC_MAX, REPLICA_POSITIONS_MAX,
    UNDECODABLE_REASON_CHARS_MAX,
)

# User subjects and group names (DESIGN.md 5).
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
# Internal subjects: %retry%<subject>%<group> and %dead%<subject>%<group>.
INTERNAL_SUBJECT_RE = re.compile(
    r"%(retry|dead)%[A-Za-z0-9][A-Za-z0-9._-]{0,199}%[A-Za-z0-9][A-Za-z0-9._-]{0,199}"
)
# host:port, host being a name, IPv4 or [IPv6].
ADDRESS_RE = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.-]{0,252}):(\d{1,5})")
PORT_MAX = 65_535

# Largest request body accepted, in bytes (aiohttp's client_max_size; a heartbeat with a full
# backlog of BACKLOG_ENTRIES_MAX entries stays far below it). Over it: 413 too_large.
BODY_SIZE_BYTES_MAX = 4 * 1024 * 1024

# Limits of one heartbeat (named so tests can hit max-1, max and max+1).
BACKLOG_ENTRIES_MAX = 10_000
CLIENT_SUBJECTS_MAX = 1000
# Largest JSON number we store as a count (fits a signed 64-bit column).
COUNT_MAX = 2**63 - 1

BROKER_KINDS = ("realtime", "delay")
BROKER_REPORTED_STATES = ("rw", "readonly")
ROLES = ("producer", "consumer")

_MISSING = object()


@dataclass(frozen=True)
class Field:
    """One field of a JSON object: its Python type, whether it is required, and a value check."""

    types: type | tuple[type, ...]
    required: bool = True
    default: Any = None
    check: Callable[[str, Any], Any] | None = None


def _refuse_constant(name: str) -> Any:
    """``json.loads`` hook: Python's parser accepts NaN and Infinity, JSON (RFC 8259) does not;
    stored, they would make our own answers invalid JSON and PostgreSQL refuse the row."""
    raise BadRequest(f"request body holds {name}, which is not a JSON number")


def _finite_float(text: str) -> float:
    """``json.loads`` hook: a number like 1e999 would become infinity; refuse it."""
    value = float(text)
    if math.isinf(value):
        raise BadRequest(f"request body holds the number {text[:40]}, beyond a 64-bit float")
    return value


# A \u escape of a UTF-16 surrogate: the only way a lone surrogate gets into a decoded body.
_SURROGATE_ESCAPE_RE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def load_json_object(raw: bytes) -> dict[str, Any]:
    """Decode a request body that must be one JSON object of finite numbers and encodable text."""
    try:
        value = json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite_float)
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise BadRequest("request body nests arrays or objects too deeply") from None
    if not isinstance(value, dict):
        raise BadRequest(f"request body must be a JSON object, not {type(value).__name__}")
    if _SURROGATE_ESCAPE_RE.search(raw):
        # A pair of escapes is one character; a lone one is text no database can store.
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequest("request body holds a lone UTF-16 surrogate escape (\\ud800-\\udfff), "
                             "which is not text") from None
    return value


def parse_object(value: Any, spec: dict[str, Field], where: str = "body") -> dict[str, Any]:
    """Check ``value`` against ``spec``: no unknown fields, required ones present, right types."""
    if not isinstance(value, dict):
        raise BadRequest(f"{where} must be a JSON object, not {type(value).__name__}")
    unknown = sorted(set(value) - set(spec))
    if unknown:
        raise BadRequest(f"{where} has unknown field(s) {', '.join(map(repr, unknown))}")
    out: dict[str, Any] = {}
    for name, field in spec.items():
        item = value.get(name, _MISSING)
        if item is _MISSING or (item is None and not field.required):
            if field.required:
                raise BadRequest(f"{where} is missing the required field {name!r}")
            out[name] = field.default() if callable(field.default) else field.default
            continue
        _check_type(f"{where}.{name}", item, field.types)
        out[name] = field.check(f"{where}.{name}", item) if field.check else item
    return out


def _check_type(key: str, item: Any, types: type | tuple[type, ...]) -> None:
    """Raise BadRequest unless ``item`` has one of ``types`` (a bool is never an int)."""
    wanted = types if isinstance(types, tuple) else (types,)
    if isinstance(item, bool) and bool not in wanted:
        ok = False
    else:
        ok = isinstance(item, wanted)
    if not ok:
        names = " or ".join(_json_type_name(t) for t in wanted)
        raise BadRequest(f"{key} must be {names}, not {_json_type_name(type(item))} {item!r}")


def _json_type_name(t: type) -> str:
    """Return the JSON name of a Python type for error messages."""
    return {
        str: "a string",
        int: "an integer",
        bool: "a boolean",
        list: "an array",
        dict: "an object",
        float: "a number",
        type(None): "null",
    }.get(t, t.__name__)


def check_name(key: str, value: str) -> str:
    """Check a group or user subject name against ``NAME_RE``."""
    if not NAME_RE.fullmatch(value):
        raise BadRequest(f"{key} {value!r} is not a valid name ({NAME_RE.pattern})")
    return value


def check_subject(key: str, value: str) -> str:
    """Check a subject name: a user name or an internal %retry%/%dead% name."""
    if not (NAME_RE.fullmatch(value) or INTERNAL_SUBJECT_RE.fullmatch(value)):
        raise BadRequest(f"{key} {value!r} is not a valid subject ({NAME_RE.pattern})")
    return value


def check_address(key: str, value: str) -> str:
    """Check a ``host:port`` address with a port in 1..65535."""
    match = ADDRESS_RE.fullmatch(value)
    if not match or not 1 <= int(match.group(2)) <= PORT_MAX:
        raise BadRequest(f"{key} {value!r} is not a host:port address with a port 1..{PORT_MAX}")
    return value


def check_count(key: str, value: int) -> int:
    """Check a non-negative integer count."""
    if not 0 <= value <= COUNT_MAX:
        raise BadRequest(f"{key} {value} must be between 0 and {COUNT_MAX}")
    return value


def check_nonempty(key: str, value: str) -> str:
    """Check a non-empty string of at most 200 characters (ids, app names)."""
    if not 1 <= len(value) <= 200:
        raise BadRequest(f"{key} {value!r} must be 1 to 200 characters")
    return value


def one_of(*allowed: str) -> Callable[[str, Any], Any]:
    """Return a check that accepts only the given strings."""

    def check(key: str, value: str) -> str:
        """Raise BadRequest unless ``value`` is allowed."""
        if value not in allowed:
            raise BadRequest(f"{key} {value!r} must be one of {', '.join(allowed)}")
        return value

    return check


BACKLOG_ENTRY = {
    "subject": Field(str, check=check_subject),
    "group": Field(str, check=check_name),
    "lag": Field(int, check=check_count),
    "consumers": Field(int, required=False, default=0, check=check_count),
    # Since the broker started: entries handed out again, and nacked copies sent to retry or
    # to the dead-letter subject (the console's redelivery and retry counts).
    "redelivered": Field(int, required=False, default=0, check=check_count),
    "retried": Field(int, required=False, default=0, check=check_count),
    "dead": Field(int, required=False, default=0, check=check_count),
}


def check_backlog(key: str, value: list[Any] | dict[str, Any]) -> list[Any] | dict[str, Any]:
    """Check a heartbeat backlog: a list of ``{subject, group, lag, consumers}`` or a stats object."""
    if isinstance(value, dict):
        return value
    if len(value) > BACKLOG_ENTRIES_MAX:
        raise BadRequest(f"{key} has {len(value)} entries, over the limit {BACKLOG_ENTRIES_MAX}")
    return [parse_object(entry, BACKLOG_ENTRY, f"{key}[{i}]") for i, entry in enumerate(value)]


def check_subject_list(key: str, value: list[Any]) -> list[str]:
    """Check a list of distinct subject names."""
    if len(value) > CLIENT_SUBJECTS_MAX:
        raise BadRequest(f"{key} has {len(value)} subjects, over the limit {CLIENT_SUBJECTS_MAX}")
    for i, item in enumerate(value):
        _check_type(f"{key}[{i}]", item, str)
        check_subject(f"{key}[{i}]", item)
    return sorted(set(value))


# A server id: server.id's 16 hex digits, or the MetaServer's own "addr:<group>/<address>".
SERVER_ID_RE = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_SERVER_ID_CHARS}}}")
SERVER_ROLES = ("master", "slave", "unknown")
REPLICATION_MODES = ("sync", "async")
LOG_NAME_RE = re.compile(r"[a-z][a-z0-9_]{0,31}")


def check_server_id(key: str, value: str) -> str:
    """Check a server id against ``SERVER_ID_RE``."""
    if not SERVER_ID_RE.fullmatch(value):
        raise BadRequest(f"{key} {value!r} is not a server id ({SERVER_ID_RE.pattern})")
    return value


def check_min_insync(key: str, value: int) -> int:
    """Check a group's min_insync: 0 .. MIN_INSYNC_MAX."""
    if not 0 <= value <= MIN_INSYNC_MAX:
        raise BadRequest(f"{key} {value} must be between 0 and MIN_INSYNC_MAX {MIN_INSYNC_MAX}")
    return value


SETTINGS = {
    "mode": Field(str, required=False, check=one_of(*REPLICATION_MODES)),
    "min_insync": Field(int, required=False, check=check_min_insync),
}


def check_settings(key: str, value: dict[str, Any]) -> dict[str, Any]:
    """Check a ``replication`` object ``{mode?, min_insync?}``."""
    return parse_object(value, SETTINGS, key)


def check_positions(key: str, value: dict[str, Any]) -> dict[str, int]:
    """Check a ``positions`` object: at most REPLICA_POSITIONS_MAX log names -> offsets."""
    if len(value) > REPLICA_POSITIONS_MAX:
        raise BadRequest(f"{key} has {len(value)} logs, over REPLICA_POSITIONS_MAX "
                         f"{REPLICA_POSITIONS_MAX}")
    for name, offset in value.items():
        if not LOG_NAME_RE.fullmatch(name):
            raise BadRequest(f"{key} names the log {name!r}, not {LOG_NAME_RE.pattern}")
        _check_type(f"{key}.{name}", offset, int)
        check_count(f"{key}.{name}", offset)
    return value


def check_undecodable_at(key: str, value: dict[str, Any]) -> dict[str, Any]:
    """Check a slave's ``undecodable_at``: where its copy stopped at a record whose body it
    cannot decode (docs/REPLICATION.md 8.2)."""
    out = parse_object(value, UNDECODABLE_AT, key)
    if not LOG_NAME_RE.fullmatch(out["log"]):
        raise BadRequest(f"{key}.log {out['log']!r} is not {LOG_NAME_RE.pattern}")
    if len(out["reason"]) > UNDECODABLE_REASON_CHARS_MAX:
        raise BadRequest(f"{key}.reason has {len(out['reason'])} characters, over "
                         f"UNDECODABLE_REASON_CHARS_MAX {UNDECODABLE_REASON_CHARS_MAX}")
    return out


def check_insync(key: str, value: list[Any]) -> list[str]:
    """Check an in-sync proposal: at most REPLICA_INSYNC_MAX server ids."""
    if len(value) > REPLICA_INSYNC_MAX:
        raise BadRequest(f"{key} has {len(value)} servers, over REPLICA_INSYNC_MAX "
                         f"{REPLICA_INSYNC_MAX}")
    for i, item in enumerate(value):
        _check_type(f"{key}[{i}]", item, str)
        check_server_id(f"{key}[{i}]", item)
    return list(value)


UNDECODABLE_AT = {
    "log": Field(str),
    "offset": Field(int, check=check_count),
    "kind": Field(int, required=False, check=check_count),  # null: the body too short
    "version": Field(int, required=False, check=check_count),
    "reason": Field(str),
}

REPLICA = {
    "position": Field(int, required=False, check=check_count),
    "positions": Field(dict, required=False, check=check_positions),
    "lag_bytes": Field(int, required=False, check=check_count),
    "lag_ms": Field(int, required=False, check=check_count),
    "insync": Field(list, required=False, default=list, check=check_insync),
    "handover_ready": Field(str, required=False, check=check_server_id),
    "writable": Field(bool, required=False, default=True),
    # Since session 15; a server sends it only to a MetaServer whose answers list it in
    # ``replica_fields`` (an older one answers an unknown field 400).
    "undecodable_at": Field(dict, required=False, check=check_undecodable_at),
}
# What a register or heartbeat answer says this MetaServer takes in ``replica``.
REPLICA_FIELDS = sorted(REPLICA)


def check_replica(key: str, value: dict[str, Any]) -> dict[str, Any]:
    """Check a heartbeat's ``replica`` report."""
    return parse_object(value, REPLICA, key)


# The replication fields register and heartbeat share (docs/REPLICATION.md 13.4).
ROLE_FIELDS = {
    "server_id": Field(str, required=False, check=check_server_id),
    "epoch": Field(int, required=False, default=0, check=check_count),
    "role": Field(str, required=False, default="unknown", check=one_of(*SERVER_ROLES)),
    "master_id": Field(str, required=False, check=check_server_id),
    "replication": Field(dict, required=False, check=check_settings),
}

REGISTER = {
    "group": Field(str, check=check_name),
    "kind": Field(str, check=one_of(*BROKER_KINDS)),
    "address": Field(str, check=check_address),
    "state": Field(str, required=False, default="rw", check=one_of(*BROKER_REPORTED_STATES)),
    **ROLE_FIELDS,
}

def check_backlog_removed(key: str, value: list[Any]) -> list[list[str]]:
    """Check a heartbeat's removed backlog pairs: ``[subject, group]`` each."""
    if len(value) > BACKLOG_ENTRIES_MAX:
        raise BadRequest(f"{key} has {len(value)} entries, over the limit {BACKLOG_ENTRIES_MAX}")
    out = []
    for i, pair in enumerate(value):
        if (not isinstance(pair, list) or len(pair) != 2
                or not all(isinstance(item, str) for item in pair)):
            raise BadRequest(f"{key}[{i}] must be a [subject, group] pair of strings")
        out.append([check_subject(f"{key}[{i}][0]", pair[0]), check_name(f"{key}[{i}][1]", pair[1])])
    return out


def check_backlog_rows(key: str, value: list[Any]) -> list[Any]:
    """Check a heartbeat's changed backlog rows (a list, as ``check_backlog``)."""
    checked = check_backlog(key, value)
    assert isinstance(checked, list)
    return checked


# A server's backlog report. ``backlog`` replaces the backlog held (absent: unchanged); or
# ``backlog_base`` with ``backlog_changes`` and ``backlog_removed`` change it
# (metaserver/backlog.py; the broker's side is serverkit/backlog.py).
BACKLOG_FIELDS = {
    "backlog": Field((list, dict), required=False, default=None, check=check_backlog),
    "backlog_base": Field(int, required=False, default=None, check=check_count),
    "backlog_changes": Field(list, required=False, default=list, check=check_backlog_rows),
    "backlog_removed": Field(list, required=False, default=list, check=check_backlog_removed),
    "stats": Field(dict, required=False, default=None),
}

BACKLOG_REPORT = {
    "group": Field(str, check=check_name),
    "kind": Field(str, check=one_of(*BROKER_KINDS)),
    "address": Field(str, check=check_address),
    "server_id": Field(str, required=False, check=check_server_id),
    **BACKLOG_FIELDS,
}

# A broker heartbeat: its lease renewal. Servers report their backlog apart
# (BACKLOG_REPORT); the backlog fields are still taken from an older server.
HEARTBEAT = {
    **REGISTER,
    **BACKLOG_FIELDS,
    "replica": Field(dict, required=False, check=check_replica),
}

DEREGISTER = {
    "group": Field(str, check=check_name),
    "address": Field(str, check=check_address),
    "server_id": Field(str, required=False, check=check_server_id),
}

SWITCHOVER = {
    "group": Field(str, check=check_name),
    "to": Field(str, required=False, check=check_server_id),
    "unclean": Field(bool, required=False, default=False),
}

REPLICATION_SETTINGS = {
    "group": Field(str, check=check_name),
    **SETTINGS,
}

CLIENT_HEARTBEAT = {
    "client_id": Field(str, check=check_nonempty),
    "app": Field(str, check=check_nonempty),
    "group": Field(str, required=False, default=""),
    "subjects": Field(list, required=False, default=list, check=check_subject_list),
    "role": Field(str, check=one_of(*ROLES)),
}

CLIENT_LEAVE = {
    "client_id": Field(str, check=check_nonempty),
}

# Most clients one batched heartbeat (``POST /api/clients/heartbeats``) names, alive or left:
# a client process sends all of its consumers in one request, in chunks of at most this many.
CLIENTS_PER_HEARTBEAT_MAX = 1000


def check_client_list(key: str, value: list[Any]) -> list[dict[str, Any]]:
    """Check the ``clients`` of a batched heartbeat: each one a single heartbeat's body."""
    if len(value) > CLIENTS_PER_HEARTBEAT_MAX:
        raise BadRequest(f"{key} has {len(value)} clients, over the limit "
                         f"CLIENTS_PER_HEARTBEAT_MAX {CLIENTS_PER_HEARTBEAT_MAX}")
    out = []
    for i, item in enumerate(value):
        client = parse_object(item, CLIENT_HEARTBEAT, where=f"{key}[{i}]")
        if client["role"] == "consumer" or client["group"]:
            check_name(f"{key}[{i}].group", client["group"])
        out.append(client)
    return out


def check_client_ids(key: str, value: list[Any]) -> list[str]:
    """Check the ``left`` client ids of a batched heartbeat."""
    if len(value) > CLIENTS_PER_HEARTBEAT_MAX:
        raise BadRequest(f"{key} has {len(value)} client ids, over the limit "
                         f"CLIENTS_PER_HEARTBEAT_MAX {CLIENTS_PER_HEARTBEAT_MAX}")
    for i, item in enumerate(value):
        _check_type(f"{key}[{i}]", item, str)
        check_nonempty(f"{key}[{i}]", item)
    return list(dict.fromkeys(value))


CLIENT_HEARTBEATS = {
    "clients": Field(list, required=False, default=list, check=check_client_list),
    "left": Field(list, required=False, default=list, check=check_client_ids),
}

READONLY = {
    "group": Field(str, check=check_name),
    "readonly": Field(bool),
}

ROUTE_QUERY = {
    "subject": Field(str, check=check_subject),
    "role": Field(str, check=one_of(*ROLES)),
    "kind": Field(str, required=False, default="realtime", check=one_of(*BROKER_KINDS)),
}
