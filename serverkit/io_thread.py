"""``IoThread``: the one thread a synchronous store is called on, for an asyncio server.

Storage is single-owner (docs/ARCHITECTURE.md): each store gets its own ``IoThread`` and is only
ever called there, in submission order. Leaner than ``loop.run_in_executor``: calls go in
through a C queue, and finished calls are handed back in bunches, so a burst of quick calls
wakes the event loop once rather than once per call.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections import deque
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class IoThread:
    """Runs ``fn(*args)`` on its thread for ``await io.call(fn, *args)``; exceptions propagate.

    Owners: ``_calls`` is a thread-safe queue (the event loop puts, the thread gets); ``_done``
    is shared and only touched under ``_done_lock`` (the thread appends, the loop takes all);
    ``_loop`` is written once by the event loop's first ``call``, before the thread can need
    it. ``call`` runs on the event loop, ``_run`` on the thread, ``_deliver`` on the loop.
    """

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._done: deque[tuple[asyncio.Future[Any], Any, BaseException | None]] = deque()
        self._done_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """The result of ``fn(*args)`` run on the thread after every call submitted before."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._calls.put((future, fn, args))
        return await future

    def _run(self) -> None:
        while True:
            item = self._calls.get()
            if item is None:
                return
            future, fn, args = item
            try:
                result, error = fn(*args), None
            except BaseException as exc:  # handed to the awaiting coroutine
                result, error = None, exc
            with self._done_lock:
                wake = not self._done
                self._done.append((future, result, error))
            if wake:
                assert self._loop is not None
                try:
                    self._loop.call_soon_threadsafe(self._deliver)
                except RuntimeError:  # the loop is closed: nobody is waiting any more
                    return

    def _deliver(self) -> None:
        with self._done_lock:
            done, self._done = self._done, deque()
        for future, result, error in done:
            if future.done():  # the caller was cancelled
                continue
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)

    def close(self, wait: bool = True) -> None:
        """Finish the calls already submitted, then end the thread; ``wait=False`` returns at
        once (a call still running, e.g. an open being cancelled, ends on its own)."""
        self._calls.put(None)
        if wait:
            self._thread.join()


__all__ = ["IoThread"]
