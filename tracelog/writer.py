"""The trace writer: buffers encoded trace lines in memory and appends them in batches to hourly
JSON Lines files (the format and the line encoders are ``tracelog.events``'s).

Split from ``tracelog.events`` so that the format (what a line holds) and the writer (when and
where lines reach the disk, and what is dropped when it cannot) are read apart.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from tracelog.events import (  # _-names: the line encoders' package-internal tables
    _ENCODER, _EVENT_KIND_SET, _LINE_STARTS, BATCH_MAX_DEFAULT, EVENT_KINDS,
    FLUSH_INTERVAL_MS_DEFAULT, PENDING_EVENTS_MAX_DEFAULT, _json_str, hour_dir_name,
    safe_server_name)
from wire.clock import wall_clock_ms

log = logging.getLogger(__name__)


class TraceWriter:
    """Buffers events in memory and appends them in batches to hourly JSON Lines files.

    ``emit``/``emit_lines`` encode on the caller's thread and append the lines to a list under a
    lock (no I/O). A background thread writes batches every
    ``flush_interval_ms`` or as soon as a batch holds ``batch_max`` events; ``flush()`` writes
    everything now from the caller's thread; ``close()`` flushes and stops. With
    ``background=False`` there is no thread and only ``flush()``/``close()`` write (tests,
    benchmarks). ``clock_ms`` (injected) decides the hour directory of each write.

    Memory: at most ``pending_events_max`` events wait (plus the batches being written); one
    more and the oldest full batch is dropped and counted in ``dropped_events``. A write error
    drops its batch too (counted, logged once per interval) and the next write reopens the file.

    ``emit`` takes ownership of the dict (it adds ``server``). One writer per server name per
    process: two writers with the same name would append to the same file.
    """

    def __init__(self, directory: str | os.PathLike[str], server: str, *, enabled: bool = True,
                 flush_interval_ms: int = FLUSH_INTERVAL_MS_DEFAULT,
                 batch_max: int = BATCH_MAX_DEFAULT,
                 pending_events_max: int = PENDING_EVENTS_MAX_DEFAULT,
                 clock_ms: Callable[[], int] | None = None, background: bool = True) -> None:
        if flush_interval_ms <= 0:
            raise ValueError(f"flush_interval_ms must be > 0, got {flush_interval_ms}")
        if batch_max < 1:
            raise ValueError(f"batch_max must be >= 1, got {batch_max}")
        if pending_events_max < batch_max:
            raise ValueError(f"pending_events_max {pending_events_max} must be >= batch_max "
                             f"{batch_max}")
        self.directory = os.fspath(directory)
        self.server = server
        self.enabled = enabled
        self._file_name = f"{safe_server_name(server)}-{os.getpid()}.jsonl"
        self._flush_interval_ms = flush_interval_ms
        self._batch_max = batch_max
        self._pending_events_max = pending_events_max
        self._clock_ms = clock_ms or wall_clock_ms
        self._cond = threading.Condition()  # guards everything up to _closed; never held for I/O
        self._server_member = f',"server":{_json_str(server)}'
        self._current: list[str] = []  # encoded lines (see ``line``)
        self._full: deque[list[str]] = deque()
        self._queued_events = 0
        self._dropped_events = 0
        self._closed = False
        self._io_lock = threading.Lock()  # one writer of files at a time, batches in order
        self._file: Any = None
        self._file_hour: str | None = None
        self._written_events = 0
        self._last_error: OSError | None = None
        self._reported_drops = 0
        self._last_report_ms = 0.0
        self._thread: threading.Thread | None = None
        if enabled and background:
            self._thread = threading.Thread(target=self._run, name=f"trace-{server}", daemon=True)
            self._thread.start()

    @property
    def dropped_events(self) -> int:
        """Events dropped so far (queue over its cap, write errors, emits after close)."""
        with self._cond:
            return self._dropped_events

    @property
    def written_events(self) -> int:
        """Events handed to the OS so far."""
        with self._io_lock:
            return self._written_events

    def line(self, kind: str, ts_ms: int, members: str, extra: str = "") -> str:
        """One event as its JSON line (no newline): ``members`` from ``message_members``,
        ``extra`` from ``consumer_members`` and/or ``,"lateness_ms":N``; this writer's server
        name is added. Equal, once parsed, to ``emit`` of the ``trace_event`` dict."""
        try:
            start = _LINE_STARTS[kind]
        except KeyError:
            raise ValueError(f"trace event kind {kind!r} is not one of "
                             f"{', '.join(EVENT_KINDS)}") from None
        if type(ts_ms) is not int:
            raise ValueError(f"trace field ts_ms must be an int, got {ts_ms!r}")
        return f"{start}{ts_ms},{members}{extra}{self._server_member}}}"

    def frame(self, kind: str, ts_ms: int, extra: str = "") -> tuple[str, str]:
        """The constant start and end of the lines of one kind, time and ``extra``:
        ``start + members + end == line(kind, ts_ms, members, extra)``. Built once per batch,
        so a batch's lines cost one concatenation each (the servers' hot loops)."""
        start, end = self.line(kind, ts_ms, "\0", extra).split("\0")
        return start, end

    def emit(self, event: dict[str, Any]) -> None:
        """Queue one event (see ``trace_event``); no I/O. A no-op when disabled. Takes
        ownership of the dict (adds ``server``); a value JSON cannot hold is logged and the
        event dropped (counted)."""
        if not self.enabled:
            return
        kind = event["event"]
        if kind not in _EVENT_KIND_SET:
            raise ValueError(f"trace event kind {kind!r} is not one of {', '.join(EVENT_KINDS)}")
        event["server"] = self.server
        try:
            line = _ENCODER.encode(event)
        except (TypeError, ValueError):
            log.exception("trace event not JSON-serializable, dropped: %r", event)
            self._count_drops(1)
            return
        self.emit_lines([line])

    def emit_lines(self, lines: list[str]) -> None:
        """Queue events already encoded with ``line``: one lock round for the lot, no I/O.
        A no-op when disabled. The writer keeps the list."""
        if not self.enabled or not lines:
            return
        with self._cond:
            if self._closed:
                self._dropped_events += len(lines)
                return
            current = self._current
            current.extend(lines)
            if len(current) >= self._batch_max:
                self._full.append(current)
                self._queued_events += len(current)
                self._current = current = []
                self._cond.notify()
            while self._queued_events + len(current) > self._pending_events_max and self._full:
                # The writer is behind: shed the oldest full batches.
                dropped = self._full.popleft()
                self._queued_events -= len(dropped)
                self._dropped_events += len(dropped)

    def flush(self) -> None:
        """Write every queued event now (from the calling thread)."""
        if not self.enabled:
            return
        with self._io_lock:
            with self._cond:
                batches = list(self._full)
                self._full.clear()
                self._queued_events = 0
                if self._current:
                    batches.append(self._current)
                    self._current = []
            for batch in batches:
                self._write_locked(batch)
            self._report_drops_locked()

    def close(self) -> None:
        """Flush everything and close the file; later emits are dropped. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()
        self.flush()
        with self._io_lock:
            self._report_drops_locked(force=True)
            self._close_file_locked()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _run(self) -> None:
        interval_s = self._flush_interval_ms / 1000
        while True:
            with self._cond:
                if not self._full and not self._closed:
                    self._cond.wait(interval_s)
                closing = self._closed
            if closing:
                return  # close() does the final flush from its own thread
            self.flush()

    def _write_locked(self, batch: list[str]) -> None:
        # Every line is ASCII: keys are ours, strings are escaped by _json_str/_ENCODER.
        data = ("\n".join(batch) + "\n").encode("ascii")
        try:
            file = self._file_for_now_locked()
            file.write(data)
            file.flush()
        except OSError as exc:
            self._last_error = exc
            self._count_drops(len(batch))
            self._close_file_locked()
            return
        self._written_events += len(batch)

    def _file_for_now_locked(self) -> Any:
        hour = hour_dir_name(self._clock_ms())
        if self._file is not None and hour == self._file_hour:
            return self._file
        self._close_file_locked()
        hour_dir = os.path.join(self.directory, hour)
        os.makedirs(hour_dir, exist_ok=True)
        path = os.path.join(hour_dir, self._file_name)
        file = open(path, "ab+")  # noqa: SIM115 (kept open for the hour)
        # A previous run of this pid may have died mid-line: start on a fresh line so the torn
        # line stays one malformed line instead of swallowing our first event.
        size = file.seek(0, os.SEEK_END)
        if size:
            file.seek(size - 1)
            if file.read(1) != b"\n":
                file.write(b"\n")
        self._file, self._file_hour = file, hour
        return file

    def _close_file_locked(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError as exc:
                self._last_error = exc
            self._file, self._file_hour = None, None

    def _count_drops(self, count: int) -> None:
        with self._cond:
            self._dropped_events += count

    def _report_drops_locked(self, force: bool = False) -> None:
        now = time.monotonic() * 1000
        if not force and now - self._last_report_ms < self._flush_interval_ms:
            return
        with self._cond:
            dropped = self._dropped_events
        if dropped > self._reported_drops:
            log.warning("trace writer %s dropped %d events (%d in total); last write error: %s",
                        self.server, dropped - self._reported_drops, dropped, self._last_error)
            self._reported_drops = dropped
        self._last_report_ms = now
