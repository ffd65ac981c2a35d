"""``GroupCommitter``: the group commit of a server's sends, and what a failed commit means.

Sends queue up while a commit runs; the next commit takes everything queued in one store call,
so many sends share one fsync (``flush=sync``). The realtime broker and the delay server both
commit this way; each hands in its store call and what to do with a batch that was committed
or refused.

A failed commit is triaged here, the same for both servers:

| raised by the store          | the batch is answered | and the server                      |
|------------------------------|-----------------------|-------------------------------------|
| ``DiskFull``                 | ``Overloaded``        | keeps taking sends (space may come) |
| ``OutOfDescriptors``         | ``Overloaded``        | keeps taking sends (files may close)|
| ``LogWriteFailed`` (sticky)  | ``Internal``          | goes read-only until restarted      |
| anything else (our bug)      | ``Internal``          | logs the traceback, stays up        |

Two ways to hand in the store call. ``commit`` (awaitable): a committer task waits for a wake-up
and awaits each commit. ``submit`` (callback, the realtime broker): ``wake()`` schedules the
commit's start as a plain callback after the current loop turn (so every send of that turn
shares it, as with the task), and the I/O thread's hand-back calls the outcome in, with no task
or future on either side: at 2,000 msg/s a commit carries one or two messages, and the task's
two wake-ups (the event, then the store call's future) were a loop turn and ~10 us of CPU per
commit (issue 18 item 2).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Generic, Optional, TypeVar

from logstore.errors import DiskFull, LogWriteFailed, OutOfDescriptors
from wire.errors import Internal, Overloaded, QmqError

log = logging.getLogger(__name__)
T = TypeVar("T")  # one queued item (a request, or one message of one)
R = TypeVar("R")  # what the store call returns for a batch
# Told a finished store call's result, or what it raised (then the result is None).
Done = Callable[[Optional[R], Optional[BaseException]], None]


def commit_error(exc: Exception, name: str) -> tuple[QmqError, bool]:
    """The error a batch whose commit raised ``exc`` is answered with, and whether the server
    must go read-only until restarted (a sticky write failure). ``name`` says which server
    ("broker group realtime-1"), for the message."""
    if isinstance(exc, DiskFull):
        return Overloaded(f"{name} disk full, send refused: {exc}"), False
    if isinstance(exc, OutOfDescriptors):
        log.warning("%s refused a batch: %s", name, exc)
        return Overloaded(f"{name} out of file descriptors, send refused: {exc}"), False
    if isinstance(exc, LogWriteFailed):
        log.error("write failure, %s goes read-only until restarted: %s", name, exc)
        return Internal(f"{name} storage write failed: {exc}"), True
    log.error("%s commit failed", name, exc_info=exc)  # a bug: fail the batch loudly, stay up
    return Internal(f"commit failed: {type(exc).__name__}: {exc}"), False


class GroupCommitter(Generic[T, R]):
    """Commits what ``pending`` holds, all of it at once, whenever ``wake()`` is called.

    Event loop only: ``pending``, ``_running``, ``_scheduled``, ``_accepting`` and ``_idle``
    are written on the event loop only (the send path appends to ``pending``, a commit swaps
    it for an empty list); only the store call (``commit`` or ``submit``, on the server's I/O
    thread) leaves it, and a ``submit`` call's outcome comes back on the event loop.

    - ``commit(batch)``: stores the batch, returns what ``committed`` is told; or
      ``submit(batch, done)``: starts storing it and calls ``done(result, error)`` on the
      event loop once finished (exactly one of the two is given);
    - ``committed(batch, result)``: answers a stored batch;
    - ``failed(batch, error)``: answers a refused batch with ``error`` (see the module table);
    - ``write_failed()``: a sticky write failure happened: the server goes read-only.
    """

    def __init__(self, name: str, commit: Callable[[list[T]], Awaitable[R]] | None,
                 committed: Callable[[list[T], R], None],
                 failed: Callable[[list[T], QmqError], None],
                 write_failed: Callable[[], None], *,
                 submit: Callable[[list[T], Done[R]], None] | None = None) -> None:
        if (commit is None) == (submit is None):
            raise ValueError("GroupCommitter takes exactly one of commit and submit")
        self.name = name
        self.pending: list[T] = []  # event loop: queued for the next commit
        self._commit = commit
        self._submit = submit
        self._committed = committed
        self._failed = failed
        self._write_failed = write_failed
        self._wakeup = asyncio.Event()
        self._running = False  # submit: a store call is out (its outcome not yet handled)
        self._scheduled = False  # submit: a start is scheduled for after this loop turn
        self._accepting = False  # submit: run() is running: wake() starts commits
        self._idle: list[asyncio.Future[None]] = []  # commit_pending waiting for _running

    def wake(self) -> None:
        """Event loop: something was queued in ``pending``; the committer takes it soon."""
        if self._submit is None:
            self._wakeup.set()
        elif self._accepting and not self._running and not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._start)

    async def run(self) -> None:
        """The committer: one commit each time it is woken with something queued, until
        cancelled (with ``submit``, a store call already out is still answered)."""
        if self._submit is not None:
            self._accepting = True
            try:
                self.wake()
                await asyncio.get_running_loop().create_future()  # until cancelled
            finally:
                self._accepting = False
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            if self.pending:
                await self.commit_batch()

    async def commit_pending(self) -> None:
        """Commit what is queued now (a server's ``stop()``, once ``run`` is cancelled),
        after the store call already out, if any, was answered."""
        while self._running:
            idle: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._idle.append(idle)
            await idle
        if self.pending:
            await self.commit_batch()

    async def commit_batch(self) -> None:
        """Take everything queued and commit it in one store call; answer it either way."""
        batch, self.pending = self.pending, []
        if self._submit is not None:
            finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._running = True
            self._submit(batch, lambda result, error: self._finish(batch, result, error,
                                                                   finished))
            await finished
            return
        assert self._commit is not None
        try:
            result = await self._commit(batch)
        except Exception as exc:
            self._refused(batch, exc)
            return
        self._committed(batch, result)

    def _start(self) -> None:
        """submit: start a commit of everything queued (scheduled by ``wake``)."""
        self._scheduled = False
        if self._running or not self.pending or not self._accepting:
            return
        batch, self.pending = self.pending, []
        self._running = True
        assert self._submit is not None
        self._submit(batch, lambda result, error: self._finish(batch, result, error, None))

    def _finish(self, batch: list[T], result: R | None, error: BaseException | None,
                finished: asyncio.Future[None] | None) -> None:
        """submit: a store call's outcome, on the event loop: answer the batch, then start the
        next commit at once with what queued meanwhile (it was woken during this one)."""
        self._running = False
        try:
            if error is not None:
                if not isinstance(error, Exception):
                    raise error  # KeyboardInterrupt and the like: not a refused batch
                self._refused(batch, error)
            else:
                self._committed(batch, result)  # type: ignore[arg-type]
        except Exception:  # our bug: never leave the committer stuck or the hand-back broken
            log.exception("%s: answering a commit failed", self.name)
        finally:
            if finished is not None and not finished.done():
                finished.set_result(None)
            idle, self._idle = self._idle, []
            for waiter in idle:
                if not waiter.done():
                    waiter.set_result(None)
        if self.pending and self._accepting:
            self._start()

    def _refused(self, batch: list[T], exc: Exception) -> None:
        """Answer a batch whose store call raised ``exc`` (the module table)."""
        error, sticky = commit_error(exc, self.name)
        if sticky:
            self._write_failed()
        self._failed(batch, error)


__all__ = ["GroupCommitter", "commit_error"]
