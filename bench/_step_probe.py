"""The probes of ``bench.latency_steps``: a process started through this module records when each
message passes each step (CLOCK_MONOTONIC ns, the same clock in every process on Linux), and
writes what it saw to the file named by ``QMQ_STEP_PROBE_OUT`` when it exits.

    python -m bench._step_probe server <qmq CLI arguments>     # qmq up, probed
    python -m bench._step_probe client <bench.peers.worker arguments>

The probes wrap methods of the server and the SDK by name (``FrameServer._dispatch``,
``Sends._append_and_commit_io``, ...): a benchmark's instrument, not an API. When one of those
is renamed this module fails at start, and tests/e2e/test_latency_steps.py with it. Each probe
adds a few microseconds per request, so the steps come out a little slower than unprobed.
"""

from __future__ import annotations

import atexit
import os
import pickle
import sys
import threading
import time
from typing import Any, Callable

OUT_ENV = "QMQ_STEP_PROBE_OUT"
# Set (to any value) in the server's environment: also count the event loop's work, written to
# ``<QMQ_STEP_PROBE_OUT>.loop`` at exit (``install_loop_counts``).
LOOP_ENV = "QMQ_STEP_PROBE_LOOP"
# Set in the server's environment: time each event-loop callback and each garbage collection
# on the loop thread, written to ``<QMQ_STEP_PROBE_OUT>.long`` at exit, INSTEAD of the step
# probes (their events are allocations and calls of their own on the loop, which it would time).
LONG_ENV = "QMQ_STEP_PROBE_LONG"
LONG_MS = 1.0  # a callback or collection at least this long (wall or loop-thread CPU) is noted
# (step, monotonic ns, the payloads or bodies it concerns): appended on the probed process's
# event loop or store thread (list.append holds the GIL), read once at exit. The items are a
# tuple of bytes, copied, so that the gc untracks each event at its first pass and no event
# keeps a request's list alive: events that held lists were two tracked objects each kept to
# the end of the run, more than the server's own in every older generation's pass. Of 10,000
# such events, 20,000 objects stayed tracked after a young pass, against 2,287 as tuples (187
# after a full pass).
_EVENTS: list[tuple[str, int, tuple[bytes, ...]]] = []
_BODIES = ("received",)  # steps whose items are message bodies, not payloads
_now = time.monotonic_ns


def _body_of(payload: bytes) -> bytes | None:
    import msgpack

    from wire.message import KEY_BODY
    try:
        return msgpack.unpackb(payload, raw=False)[KEY_BODY]
    except Exception:  # not a benchmark message (a warm-up of another tool): skipped
        return None


def _dump() -> None:
    """Write (step, ns, [sequence numbers]) rows; a message's sequence number and send time are
    the first 16 bytes of its body (bench.peers.workloads.make_body)."""
    rows: list[tuple[str, int, list[int]]] = []
    for step, ns, items in _EVENTS:
        bodies = items if step in _BODIES else [_body_of(item) for item in items]
        seqs = [int.from_bytes(body[:8], "big") for body in bodies if body and len(body) >= 16]
        rows.append((step, ns, seqs))
        if step == "batch_sent":  # the producer's send() call, from the body's send time
            rows += [("send", int.from_bytes(body[8:16], "big"),
                      [int.from_bytes(body[:8], "big")]) for body in bodies if body]
    with open(os.environ[OUT_ENV], "wb") as f:
        pickle.dump(rows, f)


def _wrap(owner: type, name: str, make: Callable[[Any], Any]) -> None:
    original = getattr(owner, name)  # AttributeError at start when a probed method moved
    setattr(owner, name, make(original))


def install_server() -> None:
    """Probe the realtime broker: request read, handled, commit begun and ended (store
    thread; inside it the message log's sync begun, its fsync returned when the write and
    fsync are one call, and the sync back in Python), published, pulled, answer written."""
    from logstore.segment_log import SegmentedLog
    from realtime.pulls import Pulls
    from realtime.sends import Sends
    from realtime.storage import commit_run
    from serverkit.frame_server import FrameServer, _FrameConnection

    def dispatch(original: Any) -> Any:
        def probed(self: Any, connection: Any, frame: dict[str, Any]) -> None:
            if frame.get("op") == "send":
                _EVENTS.append(("arrived", _now(), tuple(frame.get("messages") or ())))
            original(self, connection, frame)
        return probed

    def send(original: Any) -> Any:
        async def probed(self: Any, payloads: list[bytes], compact: bool = False) -> Any:
            _EVENTS.append(("handled", _now(), tuple(payloads)))
            return await original(self, payloads, compact)
        return probed

    # The payloads of the commit running on the store thread, for the message log's sync
    # (the one of that thread: qmq up's delay server syncs its own log on another thread).
    committing: dict[int, tuple[bytes, ...]] = {}

    def commit(original: Any) -> Any:
        def probed(self: Any, batch: list[Any], now_ms: int) -> Any:
            begun = _now()
            thread = threading.get_ident()
            committing[thread] = tuple([p for request in batch for p in request.payloads])
            try:
                result = original(self, batch, now_ms)
            finally:
                del committing[thread]
            ended = _now()
            for request in batch:
                payloads = tuple(request.payloads)
                _EVENTS.append(("commit_begun", begun, payloads))
                _EVENTS.append(("commit_ended", ended, payloads))
            return result
        return probed

    def publish(original: Any) -> Any:
        def probed(self: Any, batch: list[Any], committed: Any) -> None:
            now = _now()
            for request in batch:
                _EVENTS.append(("published", now, tuple(request.payloads)))
            original(self, batch, committed)
        return probed

    def record(original: Any) -> Any:
        def probed(self: Any, *args: Any) -> Any:
            pulled = original(self, *args)
            if pulled is not None and len(pulled.payloads):
                _EVENTS.append(("pulled", _now(), tuple(pulled.payloads)))
            return pulled
        return probed

    def write(original: Any) -> Any:
        def probed(self: Any, response: dict[str, Any], *args: Any) -> None:
            payloads = response.get("payloads")
            if payloads:
                _EVENTS.append(("pull_written", _now(), tuple(payloads)))
            original(self, response, *args)
        return probed

    def synced(payloads: tuple[bytes, ...], begun: int, returned: int) -> None:
        ended = _now()
        _EVENTS.append(("sync_begun", begun, payloads))
        _EVENTS.append(("synced", ended, payloads))
        # Where the write and fsync ran in one call, the moment the fsync returned, before
        # the thread had the GIL back.
        if begun <= returned <= ended:
            _EVENTS.append(("fsync_returned", returned, payloads))

    def sync(original: Any) -> Any:
        def probed(self: Any, *args: Any) -> Any:
            payloads = committing.get(threading.get_ident())
            begun = _now()
            result = original(self, *args)
            if payloads is not None:
                synced(payloads, begun,
                       getattr(self._segments[-1].handle, "synced_at_ns", 0))  # append_and_sync's
            return result
        return probed

    def write_run(original: Any) -> Any:
        # The usual commit's one C call (encode, write, fsync, the entries' write): its
        # answer carries the moment the fsync returned (index 5, CLOCK_MONOTONIC ns).
        def probed(*args: Any) -> Any:
            payloads = committing.get(threading.get_ident())
            begun = _now()
            outcome = original(*args)
            if payloads is not None and outcome is not None:
                synced(payloads, begun, outcome[5])
            return outcome
        return probed

    # A commit syncs through sync_then (sync calls it) where there is one; the usual commit
    # through commit_run.write_run (a module function, looked up at each call).
    _wrap(SegmentedLog, "sync_then" if hasattr(SegmentedLog, "sync_then") else "sync", sync)
    _wrap(commit_run, "write_run", write_run)  # type: ignore[arg-type]
    _wrap(FrameServer, "_dispatch", dispatch)
    def send_soon(original: Any) -> Any:
        def probed(self: Any, payloads: list[bytes], compact: bool, done: Any) -> Any:
            _EVENTS.append(("handled", _now(), tuple(payloads)))
            return original(self, payloads, compact, done)
        return probed

    _wrap(Sends, "send", send)
    _wrap(Sends, "send_soon", send_soon)
    _wrap(Sends, "_append_and_commit_io", commit)
    _wrap(Sends, "_publish_committed", publish)
    _wrap(Pulls, "_record_pull_io", record)
    _wrap(_FrameConnection, "send", write)
    atexit.register(_dump)


_LOOP_COUNTS: dict[str, int] = {}


def install_loop_counts() -> None:
    """Count what the server's event loop does (``bench.latency_steps --count-loop``): its
    iterations (``_run_once``) and those whose select did not wait (timeout 0: a callback was
    already queued), the callbacks run by kind (a task step or wake-up, a future's done
    callback, any other ``call_soon``), the tasks and futures made, and the selector's
    ready events. The counters are plain dict increments on the loop thread; they slow each
    iteration by a few microseconds, so CPU figures from a counted run are not quoted."""
    import asyncio
    import selectors
    from asyncio import base_events, events

    counts = _LOOP_COUNTS
    run_once = base_events.BaseEventLoop._run_once

    def counted_run_once(self: Any) -> None:
        counts["iterations"] = counts.get("iterations", 0) + 1
        if self._ready or self._stopping:
            counts["iterations_no_wait"] = counts.get("iterations_no_wait", 0) + 1
        run_once(self)

    handle_run = events.Handle._run

    def counted_handle_run(self: Any) -> None:
        callback = self._callback
        owner = getattr(callback, "__self__", None)
        if isinstance(owner, asyncio.Task):  # a wake-up: named by the task's coroutine
            coro = owner.get_coro()
            name = "task wake-up " + getattr(coro, "__qualname__", type(coro).__name__)
        elif type(callback).__name__ == "TaskStepMethWrapper":
            name = "task step"
        else:
            name = getattr(callback, "__qualname__", None) or type(callback).__name__
        key = "callback " + str(name)
        counts[key] = counts.get(key, 0) + 1
        handle_run(self)

    events.Handle._run = counted_handle_run  # type: ignore[method-assign]
    base_events.BaseEventLoop._run_once = counted_run_once  # type: ignore[method-assign]
    create_task = base_events.BaseEventLoop.create_task

    def counted_create_task(self: Any, coro: Any, **kwargs: Any) -> Any:
        key = "task " + getattr(coro, "__qualname__", type(coro).__name__)
        counts[key] = counts.get(key, 0) + 1
        return create_task(self, coro, **kwargs)

    base_events.BaseEventLoop.create_task = counted_create_task  # type: ignore[method-assign]
    create_future = base_events.BaseEventLoop.create_future

    def counted_create_future(self: Any) -> Any:
        counts["futures (create_future)"] = counts.get("futures (create_future)", 0) + 1
        return create_future(self)

    base_events.BaseEventLoop.create_future = counted_create_future  # type: ignore
    select = selectors.EpollSelector.select

    def counted_select(self: Any, timeout: Any = None) -> Any:
        events = select(self, timeout)
        counts["select events"] = counts.get("select events", 0) + len(events)
        return events

    selectors.EpollSelector.select = counted_select  # type: ignore[method-assign]

    def dump() -> None:
        with open(os.environ[OUT_ENV] + ".loop", "wb") as f:
            pickle.dump(counts, f)

    atexit.register(dump)


def install_client() -> None:
    """Probe a peers worker: a send batch leaving and confirmed, a pull answer read, a message
    handed to the benchmark's receiver."""
    from bench.peers.workloads import Receiver
    from sdk.connection import Connection

    def request(original: Any) -> Any:
        async def probed(self: Any, op: dict[str, Any], timeout_ms: int | None,
                         on_answer: Any = None, coalesce: bool = True) -> Any:
            kind = op.get("op")
            if kind == "send":
                _EVENTS.append(("batch_sent", _now(), tuple(op["messages"])))
            if on_answer is None:
                answer = await original(self, op, timeout_ms, None, coalesce)
            else:  # the consumer takes a pull's messages as the answer is read: note it then
                def noted(answer: dict[str, Any]) -> None:
                    if answer.get("payloads"):
                        _EVENTS.append(("pull_read", _now(), tuple(answer["payloads"])))
                    on_answer(answer)
                answer = await original(self, op, timeout_ms, noted, coalesce)
            if kind == "send":
                _EVENTS.append(("confirmed", _now(), tuple(op["messages"])))
            elif kind == "pull" and on_answer is None and answer.get("payloads"):
                _EVENTS.append(("pull_read", _now(), tuple(answer["payloads"])))
            return answer
        return probed

    def request_nowait(original: Any) -> Any:
        def probed(self: Any, op: dict[str, Any], timeout_ms: int | None, on_answer: Any,
                   on_error: Any) -> Any:
            def noted(answer: dict[str, Any]) -> None:  # a consumer's pull, as it is read
                if answer.get("payloads"):
                    _EVENTS.append(("pull_read", _now(), tuple(answer["payloads"])))
                on_answer(answer)
            return original(self, op, timeout_ms, noted, on_error)
        return probed

    def on_message(original: Any) -> Any:
        def probed(self: Any, body: bytes) -> None:
            _EVENTS.append(("received", _now(), (body,)))
            original(self, body)
        return probed

    _wrap(Connection, "request", request)
    _wrap(Connection, "request_nowait", request_nowait)
    _wrap(Receiver, "on_message", on_message)
    atexit.register(_dump)


def install_long_callbacks() -> None:
    """Note the event loop's long callbacks (``bench.latency_steps --long``): each callback
    whose wall time or loop-thread CPU time reached LONG_MS, by name (a task wake-up by its
    coroutine), and each garbage collection on the loop thread by generation, with the
    monotonic time it began; plus the count of all callbacks."""
    import asyncio
    import gc
    from asyncio import events

    noted: list[tuple[str, int, int, int]] = []  # (name, begun ns, wall ns, cpu ns)
    totals = {"callbacks": 0}
    long_ns = int(LONG_MS * 1e6)
    handle_run = events.Handle._run
    wall, cpu = time.perf_counter_ns, time.thread_time_ns

    def name_of(callback: Any) -> str:
        owner = getattr(callback, "__self__", None)
        if isinstance(owner, asyncio.Task):
            coro = owner.get_coro()
            return "task " + getattr(coro, "__qualname__", type(coro).__name__)
        return str(getattr(callback, "__qualname__", None) or type(callback).__name__)

    def timed_run(self: Any) -> None:
        totals["callbacks"] += 1
        w0, c0 = wall(), cpu()
        handle_run(self)
        w, c = wall() - w0, cpu() - c0
        if w >= long_ns or c >= long_ns:
            noted.append((name_of(self._callback), _now() - w, w, c))

    events.Handle._run = timed_run  # type: ignore[method-assign]
    loop_thread = threading.get_ident()
    started: list[int] = [0, 0, 0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if threading.get_ident() != loop_thread:
            return
        if phase == "start":
            started[0], started[1] = wall(), cpu()
        else:
            w, c = wall() - started[0], cpu() - started[1]
            noted.append((f"gc gen {info['generation']}", _now() - w, w, c))

    gc.callbacks.append(on_gc)

    def dump() -> None:
        with open(os.environ[OUT_ENV] + ".long", "wb") as f:
            pickle.dump({"noted": noted, **totals}, f)

    atexit.register(dump)


def main(argv: list[str]) -> int:
    """Install the probes of ``argv[0]`` (server or client), then run the program."""
    role, rest = argv[0], argv[1:]
    if role == "server":
        if not os.environ.get(LONG_ENV):
            install_server()
        else:  # no step probes: their lists of events would lengthen every gc pass timed
            atexit.register(_dump)
        if os.environ.get(LOOP_ENV) or os.environ.get(LONG_ENV):
            # Both probe asyncio's own loop classes (uvloop runs none of them): its default.
            os.environ.setdefault("QMQ_EVENT_LOOP", "asyncio")
        if os.environ.get(LOOP_ENV):
            install_loop_counts()
        if os.environ.get(LONG_ENV):
            install_long_callbacks()
        from qmq.cli import main as qmq_main
        return qmq_main(rest)
    install_client()
    from bench.peers.worker import main as worker_main
    return worker_main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
