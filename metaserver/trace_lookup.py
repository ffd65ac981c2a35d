"""Message lookup by id: the history of one message across servers, read from trace files.

Where the MetaServer finds them: ``MetaConfig.trace_dirs``, directories it can read (``qmq
metaserver --trace-dir DIR``, repeatable; ``qmq up`` gives its own data dir). Each is a trace
directory as ``tracelog.events.TraceWriter`` lays it out (``<dir>/<YYYYMMDDHH>/<server>.jsonl``)
or a directory above several (a root of data dirs), searched with
``tracelog.events.find_trace_dirs``. Servers on other machines are found when their trace
directories are mounted or copied there, which is also how the Spark audit reads them
(docs/METASERVER.md says why the MetaServer does not ask the brokers).

The search reads only the hour directories of the window asked for, in chunks, and looks for
the id as a JSON string with ``bytes.find`` before it decodes a line, so lines of other messages
cost no JSON parsing. A match is an event whose ``msg_id`` or ``origin_id`` is the id: the
message itself, then each retry copy of its chain. It stops at ``TRACE_EVENTS_MAX`` events or
``TRACE_SCAN_BYTES_MAX`` bytes read and says so (``truncated``). Synchronous: the HTTP handler
runs it on a worker thread.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii  # type: ignore[attr-defined]
from typing import Any

from tracelog.events import HOUR_MS, hour_dir_name
from tracelog.reading import find_trace_dirs, line_events

# Events one lookup returns at most (a message redelivered or retried many times has many).
TRACE_EVENTS_MAX = 1000
# Bytes of trace files one lookup reads at most before it gives up with what it found.
TRACE_SCAN_BYTES_MAX = 4 * 1024**3
# Widest window a lookup may search, in hours (30 days), and the default (3 days, the realtime
# retention default: older messages are gone from the brokers anyway).
TRACE_WINDOW_HOURS_MAX = 30 * 24
TRACE_WINDOW_HOURS_DEFAULT = 72
# Bytes read from a file at a time.
READ_CHUNK_BYTES = 8 * 1024 * 1024


@dataclass
class TraceLookup:
    """What a lookup found: events in time order and how much it read."""

    message_id: str
    events: list[dict[str, Any]] = field(default_factory=list)
    directories: list[str] = field(default_factory=list)  # trace directories searched
    files_scanned: int = 0
    bytes_scanned: int = 0
    truncated: bool = False  # a limit stopped the search: there may be more

    def to_json(self) -> dict[str, Any]:
        """The lookup as the console and the admin API show it."""
        return {"id": self.message_id, "events": self.events, "directories": self.directories,
                "files_scanned": self.files_scanned, "bytes_scanned": self.bytes_scanned,
                "truncated": self.truncated}


def trace_directories(roots: tuple[str, ...]) -> list[str]:
    """The trace directories under the configured ``roots`` (a root may be one itself)."""
    found: list[str] = []
    for root in roots:
        if os.path.isdir(root):
            found += [d for d in find_trace_dirs(root) if d not in found]
    return found


def hour_names(since_ms: int, until_ms: int) -> set[str]:
    """The hour directory names (``YYYYMMDDHH``, UTC) that events between the two times are in."""
    assert since_ms <= until_ms, (since_ms, until_ms)
    first = since_ms - since_ms % HOUR_MS
    return {hour_dir_name(ms) for ms in range(first, until_ms + 1, HOUR_MS)}


def find_message(roots: tuple[str, ...], message_id: str, since_ms: int, until_ms: int,
                 *, events_max: int = TRACE_EVENTS_MAX,
                 scan_bytes_max: int = TRACE_SCAN_BYTES_MAX) -> TraceLookup:
    """Every traced event of ``message_id`` (or of a retry copy whose origin it is) written in the
    hours from ``since_ms`` to ``until_ms``, in time order."""
    result = TraceLookup(message_id, directories=trace_directories(roots))
    hours = hour_names(since_ms, until_ms)
    needle = encode_basestring_ascii(message_id).encode("ascii")
    files = [os.path.join(directory, hour, name)
             for directory in result.directories
             for hour in sorted(h for h in _listdir(directory) if h in hours)
             for name in sorted(_listdir(os.path.join(directory, hour)))
             if name.endswith(".jsonl")]
    for path in files:
        if result.bytes_scanned >= scan_bytes_max or len(result.events) >= events_max:
            result.truncated = True
            break
        _scan_file(path, needle, message_id, result, scan_bytes_max)
        result.files_scanned += 1
    if len(result.events) > events_max:
        result.events = result.events[:events_max]
        result.truncated = True
    result.events.sort(key=lambda e: (e["ts_ms"], e.get("server") or ""))
    return result


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:  # removed by retention while we looked, or unreadable: nothing there
        return []


def _scan_file(path: str, needle: bytes, message_id: str, result: TraceLookup,
               scan_bytes_max: int) -> None:
    """Add the matching events of one file to ``result``; a torn last line is skipped."""
    carry = b""
    try:
        with open(path, "rb") as file:
            while result.bytes_scanned < scan_bytes_max:
                chunk = file.read(READ_CHUNK_BYTES)
                if not chunk:
                    break
                result.bytes_scanned += len(chunk)
                data = carry + chunk
                end = data.rfind(b"\n") + 1
                carry = data[end:]
                _match_lines(data[:end], needle, message_id, result)
            else:
                result.truncated = True
    except OSError:
        return  # rotated away by retention while we read: what was read counts
    if carry.endswith(b"}"):
        _match_lines(carry, needle, message_id, result)


def _match_lines(data: bytes, needle: bytes, message_id: str, result: TraceLookup) -> None:
    """Decode only the lines of ``data`` that hold ``needle``; keep the events of the id."""
    at = data.find(needle)
    while at >= 0:
        start = data.rfind(b"\n", 0, at) + 1
        stop = data.find(b"\n", at)
        stop = len(data) if stop < 0 else stop
        try:
            raw = json.loads(data[start:stop])
        except ValueError:
            raw = None
        for event in line_events(raw):
            if message_id in (event["msg_id"], event["origin_id"]):
                result.events.append(event)
        at = data.find(needle, stop)
