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

Publishing a stored batch (``committed``: answers, the tail, traces) can raise too, on a bug
path: the server's ``restore`` (when given) first puts the stored batch where publishing would
have (the delay server: its schedule window, so the stored copy is dispatched at its due time
and does not hold back the done watermark) and says what a resend does; the batch is then
answered ``Internal`` (retriable: its messages ARE stored; a realtime broker takes the
producer's resend with the same ids as a duplicate; a delay server schedules a second copy,
whose dispatch the realtime broker de-duplicates only within its dedup window of the first),
the failure is logged with the batch's size and counted in ``publish_failures``, and the
committer goes on with the next commit. Before, the exception ended the committer task and no
send of that or any later commit was answered until a restart.

A commit runs in the committer task or, when a send finds no commit running, in that send's
own request task (``commit_now``), or, for a send answered by callback (``commit_soon``), in no
task: the store call's done callback publishes it and starts the next (for an
``IoThread.submit`` call, its ``then``, and for a ``commit_then`` store call, which makes no
future, the ``then`` it is given: in the store thread's hand-back itself, no loop turn after
it, unless a round handed back just before it resumes a task first). A stop or a demote
may cancel either of the others while the store call runs. The store thread writes the batch anyway, so both servers hand in their store call as
an ``IoThread.submit`` future, which a cancel does not cancel: the task gets its
CancelledError only once the call has finished, and the batch is first published and answered
(or refused) as usual. Before (review s12 rvbroker-1), such a batch was stored but never
published, answered or traced, and the other sends of its batch waited forever.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Generic, TypeVar

from logstore.errors import DiskFull, LogWriteFailed, OutOfDescriptors
from serverkit.io_thread import Submitted
from wire.errors import Internal, Overloaded, QmqError

log = logging.getLogger(__name__)
T = TypeVar("T")  # one queued item (a request, or one message of one)
R = TypeVar("R")  # what the store call returns for a batch


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
    """Commits what ``pending`` holds, all of it at once, whenever ``wake()`` is called, or
    at once in the sender's own task (``commit_now``) when no commit is running.

    Event loop only: ``pending`` is appended to by the server's send path and swapped for an
    empty list by the commit, both on the event loop; only ``commit`` (the server's store
    call, which goes to its I/O thread) leaves it.

    - ``commit(batch)``: stores the batch, returns what ``committed`` is told;
    - ``committed(batch, result)``: answers a stored batch;
    - ``failed(batch, error)``: answers a refused batch with ``error`` (see the module table);
    - ``write_failed()``: a sticky write failure happened: the server goes read-only;
    - ``restore(batch, result)`` (optional): ``committed`` raised for a stored batch: put it
      where publishing would have; returns what a resend does, for the answer's message;
    - ``commit_then(batch, then)`` (optional): ``commit``'s store call with no future, for a
      ``commit_soon`` commit: starts it and has ``then(result, None)``, or ``then(None,
      error)``, called on the event loop once it ended (``IoThread.submit_then``).
    """

    def __init__(self, name: str, commit: Callable[[list[T]], Awaitable[R]],
                 committed: Callable[[list[T], R], None],
                 failed: Callable[[list[T], QmqError], None],
                 write_failed: Callable[[], None],
                 restore: Callable[[list[T], R], str] | None = None,
                 commit_then: Callable[[list[T], Callable[[R | None, BaseException | None],
                                                          None]], None] | None = None) -> None:
        self.name = name
        self._restore = restore
        self._commit_then = commit_then
        self.pending: list[T] = []  # event loop: queued for the next commit
        self._commit = commit
        self._committed = committed
        self._failed = failed
        self._write_failed = write_failed
        self._wakeup = asyncio.Event()
        # True while a commit runs (in the committer task or a sender's): at most one at a
        # time, so batches are stored and published in the order they were taken.
        self._running = False
        # ``commit_pending``'s futures, each resolved as the running commit ends. Not an
        # ``asyncio.Event`` cleared and set per commit: two Python calls a commit for a wait
        # only a stop makes (issue 18).
        self._idle_waiters: list[asyncio.Future[None]] = []
        # The batch of the ``commit_soon`` commit running, for its store call's
        # ``then`` (``_stored_soon``, bound once here): no ``partial`` per commit.
        self._batch: list[T] | None = None
        self._stored_soon_call = self._stored_soon
        self._stored_then_call = self._stored_then  # commit_then's, bound once too
        # Stored batches whose publishing raised (a bug path): answered Internal instead
        # (metrics: qmq_realtime_commit_publish_failures).
        self.publish_failures = 0

    def wake(self) -> None:
        """Event loop: something was queued in ``pending``; the committer takes it soon."""
        self._wakeup.set()

    async def commit_now(self) -> None:
        """Event loop, right after queueing into ``pending``: commit what is queued in the
        caller's task if no commit is running, else leave it to the committer task, which
        takes it as soon as the running commit ends.

        No committer wake-up before the store call and none for the caller after it: at low
        rates, where each commit carries one request, that is two task steps and two loop
        turns fewer per commit. The publishing still runs in a task step after the store
        call's result arrived, as the committer task's does: a round handed back before it
        (a visibility round, a retention round) resumes first, so publishing never overtakes
        it. Requests read in the same loop turn after the one committing go into the next
        commit (the committer task's took them together)."""
        if self._running or not self.pending:
            self._wakeup.set()
            return
        await self.commit_batch()

    def commit_soon(self) -> None:
        """Event loop, right after queueing into ``pending`` from no task (a send answered by
        callback): start committing what is queued now if no commit is running, else the
        running commit takes it as it ends. The batch is published (or refused) in a done
        callback of the store call's future, scheduled in the order results come back, as a
        task's wake-up is: a round handed back before it still goes first. No task, no
        committer wake-up: the next queued batch starts in the callback that ends this one.
        An ``IoThread.submit`` store call is published in the thread's hand-back itself
        (``Submitted.then``), with no loop turn between the result and its publishing; with a
        ``commit_then`` there is no future at all (``_stored_then``)."""
        if self._running or not self.pending:
            return
        # Take everything queued and start its store call (here, not in a method of its own:
        # one call fewer a commit); ``_stored_soon`` ends it.
        self._running = True
        batch, self.pending = self.pending, []
        self._batch = batch
        try:
            commit_then = self._commit_then
            if commit_then is not None:  # no future: the hand-back calls _stored_then
                commit_then(batch, self._stored_then_call)
                return
            call = self._commit(batch)  # inside: a call that raises at once is refused too
            if type(call) is Submitted:  # published in the store thread's hand-back itself
                call.then(self._stored_soon_call)
                return
            future = asyncio.ensure_future(call)
        except Exception as exc:
            self._batch = None
            try:
                self._refuse(batch, exc)
            finally:
                self._ended()
            return
        future.add_done_callback(self._stored_soon_call)

    def _stored_soon(self, call: asyncio.Future[R]) -> None:
        """The store call of the ``commit_soon`` commit running finished (its ``then``, or
        its done callback), as a future: its outcome read and told to ``_stored_then``. Both
        servers' commits take ``commit_then`` (no future), so this is the path of a committer
        given no such hook."""
        if call.cancelled():  # not an IoThread.submit future (those refuse a cancel)
            self._stored_then(None, RuntimeError("the store call was cancelled"))
        elif (exc := call.exception()) is None:
            self._stored_then(call.result(), None)
        else:
            self._stored_then(None, exc)

    def _stored_then(self, result: R | None, error: BaseException | None) -> None:
        """The store call of the ``commit_soon`` commit running ended, ``result`` or ``error``
        (a ``commit_then`` call's ``then``, with no future: issue 18): ``_stored``, then the
        next commit starts with what queued. One call for the three steps on the usual path
        (two Python calls a commit fewer)."""
        batch: list[T] = self._batch  # type: ignore[assignment]
        self._batch = None
        try:
            if error is None:
                try:  # ``_publish``, inline
                    self._committed(batch, result)  # type: ignore[arg-type]
                except Exception as exc:
                    self._publish_failed(batch, exc, result)  # type: ignore[arg-type]
            elif isinstance(error, Exception):
                self._refuse(batch, error)
        finally:
            self._running = False  # ``_ended``, inline
            if self._idle_waiters:
                self._release_idle()
            if self.pending:
                self.commit_soon()

    def _stored(self, batch: list[T], call: asyncio.Future[R]) -> None:
        """The store call of ``batch`` finished in ``commit_batch``, whose task a stop or
        demote cancelled while the call ran: publish or refuse the batch as its outcome says;
        the caller goes on."""
        if call.cancelled():  # not an IoThread.submit future (those refuse a cancel)
            self._refuse(batch, RuntimeError("the store call was cancelled"))
        elif (exc := call.exception()) is None:
            self._publish(batch, call.result())
        elif isinstance(exc, Exception):
            self._refuse(batch, exc)

    def _ended(self) -> None:
        """A ``commit_soon`` commit ended: the next one starts at once with what queued."""
        self._running = False
        if self._idle_waiters:
            self._release_idle()
        if self.pending:
            self.commit_soon()

    def _release_idle(self) -> None:
        """No commit runs now: resume every ``commit_pending`` waiting for that."""
        waiters, self._idle_waiters = self._idle_waiters, []
        for waiter in waiters:
            if not waiter.done():  # its task was cancelled meanwhile
                waiter.set_result(None)

    async def run(self) -> None:
        """The committer task: one commit each time it is woken with something queued (and
        no commit running: the running one wakes it again as it ends)."""
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            if self.pending and not self._running:
                await self.commit_batch()

    async def commit_pending(self) -> None:
        """Commit what is queued now (a server's ``stop()``, once ``run`` is cancelled),
        after the commit running in a sender's task, if any."""
        while self._running:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._idle_waiters.append(waiter)
            await waiter
        if self.pending:
            await self.commit_batch()

    async def commit_batch(self) -> None:
        """Take everything queued and commit it in one store call; answer it either way."""
        assert not self._running, "one commit at a time"
        self._running = True
        batch, self.pending = self.pending, []
        try:
            call = None
            try:
                call = self._commit(batch)  # inside: a call that raises at once is refused too
                result = await call
            except asyncio.CancelledError:
                # A stop or demote cancelled the task running this commit (a sender's or the
                # committer's). The store call runs anyway: when it is a future that a cancel
                # does not cancel (``IoThread.submit``), its outcome is published or refused
                # as usual, so no stored batch goes unanswered, untraced or out of the tail.
                if isinstance(call, asyncio.Future) and call.done() and not call.cancelled():
                    self._stored(batch, call)
                raise
            except Exception as exc:
                self._refuse(batch, exc)
                return
            self._publish(batch, result)
        finally:
            self._running = False
            if self._idle_waiters:
                self._release_idle()
            if self.pending:
                self._wakeup.set()  # queued during this commit: the committer task takes it

    def _refuse(self, batch: list[T], exc: Exception) -> None:
        """The store call raised ``exc``: answer the batch with the error it means."""
        error, sticky = commit_error(exc, self.name)
        if sticky:
            self._write_failed()
        self._failed(batch, error)

    def _publish(self, batch: list[T], result: R) -> None:
        """The batch is stored: publish and answer it (a publishing bug answers it Internal)."""
        try:
            self._committed(batch, result)
        except Exception as exc:
            self._publish_failed(batch, exc, result)

    def _publish_failed(self, batch: list[T], exc: Exception, result: R) -> None:
        """``committed`` raised for a stored batch (our bug): ``restore`` it, answer it
        ``Internal`` (retriable) and keep the committer running for the next commits."""
        self.publish_failures += 1
        resend = "resend with the same ids (stored already: de-duplicated)"
        if self._restore is not None:
            try:
                resend = self._restore(batch, result)
            except Exception:
                log.exception("%s could not restore a stored batch whose publishing failed",
                              self.name)
        log.error("%s stored a batch of %d sends but publishing it failed (%s: %s); they are "
                  "answered internal (retriable, stored already: %s) and later commits go on; "
                  "publish failures so far: %d", self.name, len(batch),
                  type(exc).__name__, exc, resend, self.publish_failures, exc_info=exc)
        error = Internal(f"{self.name} stored the batch of {len(batch)} sends but failed to "
                         f"publish it: {type(exc).__name__}: {exc}; {resend}")
        try:
            self._failed(batch, error)
        except Exception:  # never lose the committer to the answering of a failure
            log.exception("%s could not answer a batch whose publishing failed", self.name)


__all__ = ["GroupCommitter", "commit_error"]
