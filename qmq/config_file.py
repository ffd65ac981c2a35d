"""``--config FILE``: the settings of ``qmq up``, ``metaserver``, ``realtime`` and ``delay`` in
one TOML file, read with tomllib.

Each server reads its own table, whose keys are the fields of its config dataclass (every
setting, including the ones no flag has: retention, the de-duplication window, the flush
interval, per-group ack timeouts, the retry schedule, the delay server's tick and dispatch
settings, the MetaServer's broker expiry)::

    [metaserver]
    db_url = "postgresql+asyncpg://qmq@db/qmq"
    broker_expiry_ms = 15000

    [realtime]
    data_dir = "/var/lib/qmq/realtime"
    retention_ms = 259200000
    retry_backoff_ms = [5000, 10000, 30000]
    ack_timeout_ms_by_group = { billing = 120000 }

    [delay]
    data_dir = "/var/lib/qmq/delay"
    tick_ms = 5

One key stands above the tables, since it is the whole process's: ``event_loop = "uvloop"``
(``auto``, ``uvloop`` or ``asyncio``, as ``--event-loop``; qmq.event_loop).

A flag given on the command line wins over the file; the file wins over the flags' defaults. An
unknown table or key, or a value of the wrong type, fails at start naming the file, the table,
the key and the value; the config dataclass then checks the values themselves (ranges), naming
the key and the value too. docs/CLI.md lists the keys.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from collections.abc import Iterable
from typing import Any

from qmq.event_loop import EVENT_LOOPS

SECTIONS = ("metaserver", "realtime", "delay")
# The keys above the tables: the process's own settings, not one server's.
TOP_KEYS = ("event_loop",)
# Flags whose config field has another name (the rest are the field's name with - as _).
FIELD_OF_FLAG = {"meta": "meta_url", "db": "db_url", "no_trace": "trace",
                 "no_metrics": "metrics_port"}


def load(path: str) -> dict[str, dict[str, Any]]:
    """The tables of ``path``; refuses a file that is not TOML or has a table we do not know."""
    try:
        with open(path, "rb") as file:
            data = tomllib.load(file)
    except OSError as exc:
        raise ValueError(f"--config {path}: cannot read it: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--config {path}: not valid TOML: {exc}") from None
    for name, table in data.items():
        if name == "event_loop":
            if table not in EVENT_LOOPS:
                raise ValueError(f"--config {path} event_loop = {table!r}: must be one of "
                                 f"{', '.join(EVENT_LOOPS)}")
            continue
        if name not in SECTIONS or not isinstance(table, dict):
            raise ValueError(f"--config {path}: unknown table or key {name!r} at the top "
                             f"(tables: {', '.join(f'[{s}]' for s in SECTIONS)}; "
                             f"keys: {', '.join(TOP_KEYS)})")
    return data


def settings(config_class: type, path: str, section: str,
             data: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The ``[section]`` table of a loaded file as keywords of ``config_class``, each key a
    field of it and each value of the field's type (a TOML array becomes a tuple)."""
    fields = {f.name for f in dataclasses.fields(config_class) if f.init}
    hints = typing.get_type_hints(config_class)
    out = {}
    for key, value in data.get(section, {}).items():
        where = f"--config {path} [{section}] {key}"
        if key not in fields:
            raise ValueError(f"--config {path} [{section}]: unknown key {key!r} "
                             f"(keys: {', '.join(sorted(fields))})")
        out[key] = _typed(value, hints[key], where)
    return out


def _typed(value: Any, hint: Any, where: str) -> Any:
    """``value`` as ``hint`` (int, float, str, bool, X | None, tuple[int, ...], dict[str, int])."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        for option in args:
            if option is type(None):
                continue
            try:
                return _typed(value, option, where)
            except ValueError:
                pass
        raise ValueError(f"{where} = {value!r}: must be {_name(hint)}")
    if origin is tuple and isinstance(value, list):
        return tuple(_typed(item, args[0], where) for item in value)
    if origin is dict and isinstance(value, dict):
        return {str(k): _typed(v, args[1], f"{where}.{k}") for k, v in value.items()}
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(hint, type) and origin is None and isinstance(value, hint) and not (
            hint is int and isinstance(value, bool)):
        return value
    raise ValueError(f"{where} = {value!r}: must be {_name(hint)}")


def _name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def explicit_flags(argv: Iterable[str]) -> set[str]:
    """The config fields the command line set with a flag (``--ack-timeout-ms 5`` or
    ``--ack-timeout-ms=5``): those win over the file."""
    fields = set()
    for token in argv:
        if token == "--":
            break
        if token.startswith("--"):
            dest = token[2:].split("=", 1)[0].replace("-", "_")
            fields.add(FIELD_OF_FLAG.get(dest, dest))
            if dest == "trace_dir":  # the MetaServer's --trace-dir (repeatable) sets trace_dirs
                fields.add("trace_dirs")
    return fields


def merge(from_flags: dict[str, Any], from_file: dict[str, Any],
          explicit: set[str]) -> dict[str, Any]:
    """A config's keywords: the flags' values (defaults included), then the file's, then the
    flags given explicitly."""
    return {**from_flags, **from_file, **{k: v for k, v in from_flags.items() if k in explicit}}


__all__ = ["FIELD_OF_FLAG", "SECTIONS", "TOP_KEYS", "explicit_flags", "load", "merge", "settings"]
