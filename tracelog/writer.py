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
from collections.abc import Callable, Iterator, Sequence
from itertools import chain, repeat
from typing import Any, Union

from tracelog.events import (  # _-names: the line encoders' package-internal tables
    _ENCODER, _EVENT_KIND_SET, _LINE_STARTS, BATCH_MAX_DEFAULT, EVENT_KINDS,
    FLUSH_INTERVAL_MS_DEFAULT, HOUR_MS, PENDING_EVENTS_MAX_DEFAULT, TRICKLE_EVENTS_MAX_DEFAULT,
    TRICKLE_EVENTS_MIN_DEFAULT, TRICKLE_INTERVAL_MS_DEFAULT, _json_str, consumer_members,
    hour_dir_name, safe_server_name)
from wire.clock import wall_clock_ms

log = logging.getLogger(__name__)

# A column of ``emit_columns``: a str shared by every line, or one str or int per line.
Column = Union[str, Sequence[str], Sequence[int]]
# The extra members of ``emit_framed``: a str, or (group, consumer) for ``consumer_members``.
Extra = Union[str, tuple[Union[str, None], Union[str, None]]]
# What a batch holds: lists of encoded lines (``emit_lines``), (columns, lines) of
# ``emit_columns``, or (kind, ts_ms, extra, members) of ``emit_framed``, whose lines are joined
# (and the frame built) only when written.
_Item = Union[list[str], tuple[list[Column], int], tuple[str, int, Extra, list[str]]]
# Frame ends a writer keeps, by extra: one per (group, consumer) pulling, plus a few.
_ENDS_KEPT_MAX = 1_024
# ``emit_framed`` items of up to this many lines are joined with the lines around them.
_FRAMED_TOGETHER_MAX = 64


class TraceWriter:
    """Buffers events in memory and appends them in batches to hourly JSON Lines files.

    ``emit``/``emit_lines`` encode on the caller's thread and append the lines to a list under a
    lock (no I/O); ``emit_columns`` queues the parts of many lines, which the write joins (in
    C) when it writes them: the caller's thread (a server's event loop in a burst) does no
    per-line concatenation. A background thread looks every ``trickle_interval_ms`` while
    anything waits (and sleeps until the first line when nothing does): a
    trickle (``trickle_events_min`` to ``trickle_events_max`` events waiting) is written at
    once, in small writes that hold the GIL briefly; fewer wait until ``flush_interval_ms`` has
    passed since nothing waited; more is a burst, written after it (at ``flush_interval_ms``,
    or as soon as full batches hold half of ``pending_events_max`` events), not during it.
    ``flush()`` writes everything now from the caller's thread; ``close()`` flushes and stops.
    With ``background=False`` there is no thread and only ``flush()``/``close()`` write (tests,
    benchmarks). ``clock_ms`` (injected) decides the hour directory of each write;
    ``monotonic_s`` (injected) is the thread's interval clock.

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
                 trickle_interval_ms: int = TRICKLE_INTERVAL_MS_DEFAULT,
                 trickle_events_max: int = TRICKLE_EVENTS_MAX_DEFAULT,
                 trickle_events_min: int = TRICKLE_EVENTS_MIN_DEFAULT,
                 clock_ms: Callable[[], int] | None = None, background: bool = True,
                 monotonic_s: Callable[[], float] | None = None) -> None:
        if flush_interval_ms <= 0:
            raise ValueError(f"flush_interval_ms must be > 0, got {flush_interval_ms}")
        if trickle_interval_ms <= 0:
            raise ValueError(f"trickle_interval_ms must be > 0, got {trickle_interval_ms}")
        if trickle_events_min < 0:
            raise ValueError(f"trickle_events_min must be >= 0, got {trickle_events_min}")
        if trickle_events_max < 0:
            raise ValueError(f"trickle_events_max must be >= 0, got {trickle_events_max}")
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
        self._trickle_interval_ms = min(trickle_interval_ms, flush_interval_ms)
        self._trickle_events_max = trickle_events_max
        self._trickle_events_min = trickle_events_min
        self._monotonic_s = monotonic_s or time.monotonic
        self._batch_max = batch_max
        self._pending_events_max = pending_events_max
        # Full batches waiting that wake the writer thread before its interval: half of what
        # memory may hold, so a burst is written after it (PENDING_EVENTS_MAX_DEFAULT).
        self._wake_events = max(batch_max, pending_events_max // 2)
        self._clock_ms = clock_ms or wall_clock_ms
        # Guards everything up to _closed; never held for I/O. A plain lock (nothing takes it
        # twice) that ``_queue`` enters itself: a Condition's ``with`` is two Python calls more
        # per emit, on a server's event loop two emits a message (issue 18).
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._server_member = f',"server":{_json_str(server)}'
        # The batch being filled: items of encoded lines (see ``line``) or columns, and
        # how many events they hold; full batches wait in _full with their event counts.
        self._current: list[_Item] = []
        self._current_events = 0
        self._full: deque[tuple[list[_Item], int]] = deque()
        self._queued_events = 0
        self._dropped_events = 0
        self._closed = False
        self._io_lock = threading.Lock()  # one writer of files at a time, batches in order
        self._file: Any = None
        self._file_hour: int | None = None  # hours since the epoch of the open file
        self._written_events = 0
        self._slice_cpu_s = 0.0  # this thread's CPU clock when a write last let the GIL go
        self._last_error: OSError | None = None
        self._reported_drops = 0
        self._last_report_ms = 0.0
        # emit_framed's frame ends built by writes, by extra (under _io_lock)
        self._ends: dict[Extra, str] = {}
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
        self._queue(lines, len(lines))

    def emit_columns(self, columns: list[Column]) -> None:
        """Queue lines given as columns: line i is the concatenation, in order, of each
        column's item i (a str column is the same in every line; ints are written in
        decimal); every sequence column holds one item per line. What ``emit_lines`` of those
        lines would write, under the same limits, with the joining left to the write: one C
        join for all the lines (``[start, members, end]`` of a ``frame`` shared by a batch).
        A no-op when disabled. The writer keeps the lists."""
        if not self.enabled:
            return
        counts = {len(c) for c in columns if type(c) is not str}
        if len(counts) > 1:
            raise ValueError(f"trace columns of {sorted(counts)} lines: one item per line in "
                             "each")
        count = counts.pop() if counts else 0
        if count:
            self._queue((columns, count), count)

    def emit_framed(self, kind: str, ts_ms: int, members: list[str], extra: Extra = "") -> None:
        """Queue the lines ``line(kind, ts_ms, m, extra)`` of each ``m`` in ``members``, the
        frame around them built by the write, on the writer's thread: the emitter (a server's
        event loop, a few lines a call) builds neither the frame nor the lines. ``extra`` may
        be (group, consumer), encoded by the write as ``consumer_members`` does. What
        ``emit_lines`` of those lines would write, under the same limits and in the same
        order. A no-op when disabled or ``members`` is empty. The writer keeps the list."""
        if not self.enabled or not members:
            return
        if kind not in _EVENT_KIND_SET or type(ts_ms) is not int:
            self.line(kind, ts_ms, "")  # raises the ValueError that names the bad value
        # ``_queue``, inline: a server emits through here twice a message (stored, pulled),
        # one Python call fewer each (issue 18). Keep the two the same.
        events = len(members)
        with self._lock:
            if self._closed:
                self._dropped_events += events
                return
            if not (self._current_events or self._queued_events):
                self._cond.notify()  # the first line: the writer thread sleeps until it comes
            self._current.append((kind, ts_ms, extra, members))
            self._current_events += events
            if self._current_events >= self._batch_max:
                self._full.append((self._current, self._current_events))
                self._queued_events += self._current_events
                self._current, self._current_events = [], 0
                if self._queued_events >= self._wake_events:
                    self._cond.notify()
            while (self._queued_events + self._current_events > self._pending_events_max
                   and self._full):
                # The writer is behind: shed the oldest full batches.
                _dropped, events = self._full.popleft()
                self._queued_events -= events
                self._dropped_events += events

    def _end_of(self, extra: Extra) -> str:
        """The end of an ``emit_framed`` item's lines (after the members): the same for every
        kind and time, so kept by ``extra`` (the writer's thread, under the I/O lock)."""
        end = self._ends.get(extra)
        if end is None:
            if len(self._ends) >= _ENDS_KEPT_MAX:
                self._ends.clear()
            members = extra if type(extra) is str else consumer_members(*extra)
            end = self._ends[extra] = f"{members}{self._server_member}}}"
        return end

    def _queue(self, item: _Item, events: int) -> None:
        """Append ``item`` (``events`` lines) to the batch being filled, under the lock
        (``emit_framed`` does the same inline)."""
        with self._lock:
            if self._closed:
                self._dropped_events += events
                return
            if not (self._current_events or self._queued_events):
                self._cond.notify()  # the first line: the writer thread sleeps until it comes
            self._current.append(item)
            self._current_events += events
            if self._current_events >= self._batch_max:
                self._full.append((self._current, self._current_events))
                self._queued_events += self._current_events
                self._current, self._current_events = [], 0
                if self._queued_events >= self._wake_events:
                    self._cond.notify()
            while (self._queued_events + self._current_events > self._pending_events_max
                   and self._full):
                # The writer is behind: shed the oldest full batches.
                _dropped, events = self._full.popleft()
                self._queued_events -= events
                self._dropped_events += events

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
                    batches.append((self._current, self._current_events))
                    self._current, self._current_events = [], 0
            self._slice_cpu_s = time.thread_time()
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
        # Every trickle interval: write what waits if it is a trickle (a few thousand events at
        # most), so that no write holds the GIL for long; a burst waits until it is over (or
        # flush_interval_ms has passed since nothing waited, or the wake at half of
        # pending_events_max), so that the write does not take the GIL in its middle.
        tick_s = self._trickle_interval_ms / 1000
        interval_s = self._flush_interval_ms / 1000
        idle_s = self._monotonic_s()  # when nothing waited last
        while True:
            with self._cond:
                # With nothing waiting the thread sleeps until the first line (``_queue`` wakes
                # it): an idle server's writer takes no look at all (issue 18: idle CPU).
                empty = not (self._queued_events or self._current_events)
                if self._queued_events < self._wake_events and not self._closed:
                    self._cond.wait(None if empty else tick_s)
                closing = self._closed
                waiting = self._queued_events + self._current_events
                woken = self._queued_events >= self._wake_events
            if closing:
                return  # close() does the final flush from its own thread
            now_s = self._monotonic_s()
            if not waiting or empty:  # nothing waited until now
                idle_s = now_s
            elif (self._trickle_events_min <= waiting <= self._trickle_events_max or woken
                  or now_s - idle_s >= interval_s):
                self.flush()
                idle_s = now_s

    def _write_locked(self, batch: tuple[list[_Item], int]) -> None:
        items, events = batch
        try:
            file = self._file_for_now_locked()
            # Every line is ASCII: keys are ours, strings are escaped by _json_str/_ENCODER.
            for text in _texts(items, self._end_of):
                file.write(text.encode("ascii"))
                if (time.thread_time() - self._slice_cpu_s >= WRITE_SLICE_CPU_S
                        and (self._queued_events + self._current_events
                             <= self._trickle_events_max)):
                    # Let the GIL go for a while: a thread waiting for it (a server's event
                    # loop) takes it. The write's own release does not hand it over: this
                    # thread takes it back before the waiter wakes, which then waits the
                    # switch interval (5 ms) before it can ask for it. Only while what came
                    # meanwhile is a trickle: under a high rate the writer would get one slice
                    # per switch interval, fall behind and drop events (a saturated loop at
                    # ~290,000 events/s dropped 200,000-290,000 in 4 s, against 0-150,000).
                    _pause(WRITE_PAUSE_S)
                    self._slice_cpu_s = time.thread_time()
            file.flush()
        except OSError as exc:
            self._last_error = exc
            self._count_drops(events)
            self._close_file_locked()
            return
        self._written_events += events

    def _file_for_now_locked(self) -> Any:
        # Hours since the epoch are UTC hours: the name is formatted only when one changes
        # (strftime costs tens of us; a trickle is written many times a second).
        hour = self._clock_ms() // HOUR_MS
        if self._file is not None and hour == self._file_hour:
            return self._file
        self._close_file_locked()
        hour_dir = os.path.join(self.directory, hour_dir_name(hour * HOUR_MS))
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


# Lines joined and encoded at a time by a write: a few hundred KB. One text of a whole batch
# (megabytes) costs several times the CPU, in page faults of the large allocations each copy
# takes (a 10,000-line batch of ~250-byte lines: 3.6-4.8 ms in one piece, 0.9-1.4 ms in
# pieces of 1,024, load ~5).
WRITE_LINES_MAX = 1_024
# A write lets the GIL go for WRITE_PAUSE_S after each piece once it has used WRITE_SLICE_CPU_S
# of CPU since it last did: a burst's write (80,000 events: ~14 ms of CPU) held it in 5 ms
# slices (the switch interval), each one a stall of a server's event loop.
WRITE_SLICE_CPU_S = 0.000_5
WRITE_PAUSE_S = 0.000_2
_pause: Callable[[float], None] = time.sleep  # (replaced by tests, to count the pauses)


def _texts(items: list[_Item], end_of: Callable[[Extra], str]) -> Iterator[str]:
    """The text of a batch's items in order, each line ended by a newline, in pieces of at
    most about WRITE_LINES_MAX lines; ``end_of`` gives an ``emit_framed`` item's frame end."""
    # Texts of whole lines (one or several each) not written yet, and how many lines they hold.
    texts: list[str] = []
    count = 0
    for item in items:
        if type(item) is list:
            if len(item) < WRITE_LINES_MAX:
                texts += item
                count += len(item)
            else:  # a large batch of lines: its own pieces
                if texts:
                    yield _ended(texts)
                    texts, count = [], 0
                for first in range(0, len(item), WRITE_LINES_MAX):
                    yield _ended(item[first:first + WRITE_LINES_MAX])
                continue
        elif len(item) == 4 and len(item[3]) <= _FRAMED_TOGETHER_MAX:
            # A few framed lines (a small commit's, pull's or ack's): built here and joined
            # with the lines around them. The start holds the time, so it differs from item to
            # item: one f-string, no cache; the end is cached by its extra members.
            kind, ts_ms, extra, members = item  # type: ignore[misc]
            end = end_of(extra)
            if len(members) == 1:
                texts.append(f"{_LINE_STARTS[kind]}{ts_ms},{members[0]}{end}")
            else:
                start = f"{_LINE_STARTS[kind]}{ts_ms},"
                texts.append(start + (f"{end}\n{start}").join(members) + end)
            count += len(members)
        else:
            if texts:
                yield _ended(texts)
                texts, count = [], 0
            if len(item) == 2:
                yield from _column_texts(*item)  # type: ignore[misc]
            else:
                kind, ts_ms, extra, members = item  # type: ignore[misc]
                yield from _column_texts([f"{_LINE_STARTS[kind]}{ts_ms},", members,
                                          end_of(extra)], len(members))
            continue
        if count >= WRITE_LINES_MAX:
            yield _ended(texts)
            texts, count = [], 0
    if texts:
        yield _ended(texts)


def _ended(texts: list[str]) -> str:
    """``texts`` (whole lines, one or several each, without their last newline) as one text,
    its last line ended by a newline too. ``texts`` is the caller's to drop: the empty text
    appended for that newline saves copying the joined text once more to add it."""
    texts.append("")
    return "\n".join(texts)


def _column_texts(columns: list[Column], count: int) -> Iterator[str]:
    """The lines of an ``emit_columns`` item, in pieces of WRITE_LINES_MAX lines."""
    if len(columns) == 3:
        start, middle, end = columns
        if type(start) is str and type(end) is str and type(middle[0]) is str:
            # The usual frame around members: one join with the frame between them.
            between, end = end + "\n" + start, end + "\n"
            for first in range(0, count, WRITE_LINES_MAX):
                yield start
                yield between.join(middle[first:first + WRITE_LINES_MAX])  # type: ignore
                yield end
            return
    for first in range(0, count, WRITE_LINES_MAX):
        stop = min(first + WRITE_LINES_MAX, count)
        parts = [repeat(column, stop - first) if type(column) is str
                 else column[first:stop] if type(column[0]) is str
                 else map(str, column[first:stop])
                 for column in columns]
        parts.append(repeat("\n", stop - first))
        yield "".join(chain.from_iterable(zip(*parts)))  # type: ignore[arg-type]
