"""Reading traces back: finding trace directories under a data dir and reading their events as the
audit does (for ``qmq audit --data-dir``, tests and debugging; the audit itself reads with Spark).

Split from ``tracelog.events``, which defines the format these functions read.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Iterable
from typing import Any

from tracelog.events import EVENT_FIELD_NAMES, PRODUCED_FLAG, complete


_HOUR_DIR_NAME = re.compile(r"^[0-9]{10}$")


def _is_trace_dir(path: str, names: list[str]) -> bool:
    """A trace directory has an hour directory (``YYYYMMDDHH``) holding a ``.jsonl`` file."""
    for name in names:
        if _HOUR_DIR_NAME.match(name):
            try:
                if any(f.endswith(".jsonl") for f in os.listdir(os.path.join(path, name))):
                    return True
            except OSError:
                continue
    return False


def find_trace_dirs(root: str | os.PathLike[str]) -> list[str]:
    """Every trace directory under ``root`` (``root`` itself included), sorted: directories
    with an hour directory that holds a trace file, as ``TraceWriter`` lays them out. A data dir
    of ``qmq up`` gives ``<root>/realtime/trace`` and ``<root>/delay/trace``; a directory of
    several servers' data dirs gives each of theirs. Symbolic links are not followed, and the
    search does not descend into a trace directory."""
    found = []
    for path, dirs, _files in os.walk(os.fspath(root)):
        if _is_trace_dir(path, dirs):
            found.append(path)
            dirs[:] = []
        else:
            dirs.sort()
    return sorted(found)


def _trace_files(path: str) -> list[str]:
    if os.path.isdir(path):
        return sorted(glob.glob(os.path.join(glob.escape(path), "*", "*.jsonl")))
    return [path]


def read_events(paths: Iterable[str | os.PathLike[str]]) -> list[dict[str, Any]]:
    """Every event in ``paths`` (trace directories or .jsonl files), file by file in name order,
    normalised as the audit reads them: all EVENT_FIELDS present, ``origin_id`` defaulting to
    ``msg_id``, ``retries`` to 0, and a line flagged ``produced`` expanded into its ``produced``
    event followed by its own. Lines that are not a JSON object with the required fields (a
    torn last line, garbage) are skipped. For tests and debugging; the audit reads with Spark."""
    events = []
    for path in paths:
        for file_path in _trace_files(os.fspath(path)):
            with open(file_path, encoding="utf-8", errors="replace") as file:
                for line in file:
                    try:
                        raw = json.loads(line)
                    except ValueError:
                        continue
                    events += line_events(raw)
    return events


def line_events(raw: Any) -> list[dict[str, Any]]:
    """The events of one decoded line, normalised as the audit reads them (see ``read_events``):
    none for a line that is not an object with the required fields, two for a line flagged
    ``produced``."""
    if not isinstance(raw, dict) or not complete(raw):
        return []
    event = {name: raw.get(name) for name in EVENT_FIELD_NAMES}
    if event["origin_id"] is None:
        event["origin_id"] = event["msg_id"]
    if event["retries"] is None:
        event["retries"] = 0
    if raw.get(PRODUCED_FLAG) is True and event["event"] != "produced":
        ts_ms = event["created_at_ms"]
        return [{**event, "event": "produced",
                 "ts_ms": event["ts_ms"] if ts_ms is None else ts_ms}, event]
    return [event]
