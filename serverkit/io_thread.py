"""``IoThread``: the one thread a synchronous store is called on, for an asyncio server.

Storage is single-owner (docs/ARCHITECTURE.md): each store gets its own ``IoThread`` and is only
ever called there, in submission order. Leaner than ``loop.run_in_executor``: calls go in
through a C queue, and finished calls are handed back in bunches, so a burst of quick calls
wakes the event loop once rather than once per call.

The thread wakes the event loop through an eventfd of its own, registered with the loop as a
reader, rather than ``loop.call_soon_threadsafe``: that one is a write to the loop's self-pipe
socket, then the loop's ``_read_from_self`` reads it until empty (two ``recv``) before a handle
queued for the next turn runs ``_deliver``; here the eventfd's reader is ``_deliver`` itself,
with one 8-byte write and one read. A hop to the thread and back (30,000 sequential calls of
a function that does nothing, 6 pairs alternated with the self-pipe, load 2.5-4.3) costs a
median 29 us of CPU against 39 (lower in every pair); it still holds a queue put that wakes the
thread and two GIL hand-offs, against ~7 us for a hop within the loop. Where ``os.eventfd`` is
missing (not Linux) the thread wakes the loop with ``call_soon_threadsafe``.

``os.eventfd_write`` and ``os.eventfd_read`` release the GIL around their 8-byte syscall; a C
twin that keeps it was tried (session 18, docs/BENCHMARKS.md) and is not used: at those moments
the other thread does not wait for the GIL, so the release costs no switch (a hop made 5.8-6.0
context switches either way, on one core), and with the store thread holding it while its write
wakes the loop, the loop waits for it instead (``qmq up``'s CPU per message, one message a
cycle, rose in 3 of 3 alternating pairs, by 77-109 us at load 5.7-7.0).

The thread's wake-up of the loop and its wait for the next call are one call,
``CallQueue.take(wake_fd)``, which (in its C twin, ``serverkit/_call_queue.c``) writes the
eventfd and waits on a semaphore in ONE release of the GIL. Written apart (``os.eventfd_write``,
then ``SimpleQueue.get``), the thread took the GIL back between the two, and on uvloop the loop
that write had just woken held it in 37-49% of the commits of a server at one message a cycle:
the thread slept once more, on the GIL, for the few bytecodes before its wait (session 23,
docs/BENCHMARKS.md: one GIL release and take fewer per commit, of three). Session 18
had tried a thread that wrote its wake-up and waited in one release, on an eventfd counting its
queue, on asyncio's loop: CPU rose (by 24-111 us, 3 of 3 pairs, load 9-14); this queue keeps
SimpleQueue's order and wake-up rules and waits on a semaphore, and the store thread's CPU per
message measured lower on uvloop (13 of 18 alternating pairs).

A ``submit`` call given a ``then`` (``Submitted.then``) has its continuation run in the
hand-back itself, one loop turn sooner than a future's done callback (asyncio always queues
those), unless a result handed back before it in the same bunch resumed a task: then it is
queued behind that task's step, as a done callback would be. ``submit_then(then, fn, *args)``
(the realtime group commit's store call) follows the same rule with no future at all:
``then(result, error)`` is called, so a commit makes no future, no ``set_result`` and no
reading of it back (issue 18).

``idle()`` lets an owner run a call that does no I/O on the event loop instead, when nothing is
queued or running here: it then runs after every call submitted before it and beside none, as
it would here.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import queue
import threading
from collections import deque
from typing import Any, Callable, Protocol, TypeVar

from logstore.twins import c_twin

T = TypeVar("T")

PR_SET_NAME = 15  # prctl(2): name the calling thread (at most 15 bytes are kept)

# What the thread adds to its eventfd as it ends, past any count of result wake-ups (each adds
# 1): a read that sees it knows no write follows, so the loop may close the fd.
_ENDED = 1 << 40


class CallQueue(Protocol):
    """An ``IoThread``'s calls: ``put`` on the event loop, ``take`` on the thread only."""

    def put(self, item: Any) -> None:
        """Queue ``item`` behind every item put before; wakes a waiting ``take``."""

    def take(self, wake_fd: int) -> Any:
        """Add 1 to the eventfd ``wake_fd`` (-1: none), then the oldest item, waiting for one
        while none is queued. A failed write raises OSError and takes nothing."""


class CallQueuePython:
    """The Python twin of ``serverkit._call_queue``'s queue (``new_call_queue``): a
    ``SimpleQueue``, and the eventfd written with ``os.eventfd_write`` before the ``get``, so
    the GIL is taken back between the two (the C twin's point is not to)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()  # thread-safe itself
        self.put = self._queue.put

    def take(self, wake_fd: int) -> Any:
        """``CallQueue.take``."""
        if wake_fd >= 0:
            os.eventfd_write(wake_fd, 1)
        return self._queue.get()


def new_call_queue_python() -> CallQueue:
    """An empty ``CallQueuePython`` (the Python twin of ``_call_queue.new_call_queue``)."""
    return CallQueuePython()


# The C twin (serverkit/_call_queue.c), chosen by logstore.twins; it writes an eventfd, so
# only where there is one (Linux; elsewhere the thread wakes the loop another way anyway).
new_call_queue = ((c_twin("serverkit._call_queue", "new_call_queue")
                   if hasattr(os, "eventfd") else None) or new_call_queue_python)


class IoThread:
    """Runs ``fn(*args)`` on its thread for ``await io.call(fn, *args)``; exceptions propagate.

    Owners: ``_calls`` is a thread-safe queue (the event loop puts, the thread takes); ``_done``
    is shared and only touched under ``_done_lock`` (the thread appends, the loop takes all);
    ``_loop`` is written once by the event loop's first ``call``, before the thread can need
    it; ``_submitted`` is written by the event loop only (``call``, ``submit``, ``submit_then``), ``_finished`` by the
    thread only, once a call's function returned (an int read is atomic). ``call``, ``submit``,
    ``submit_then`` and ``idle`` run on the event loop, ``_run`` on the thread, ``_deliver`` on the loop.
    ``_wake_fd`` (an eventfd, None without ``os.eventfd``): the thread writes it, the loop
    reads it in ``_deliver``; whoever sees the thread's last write (``_ENDED``) closes it: the
    loop's ``_deliver``, or the thread itself when no loop is bound or the loop is closed.
    ``close(wait=False)`` detaches it (``_detached``, set once by the loop under
    ``_done_lock``): the loop stops reading it there and then, and the thread closes it as it
    ends and wakes the loop with ``call_soon_threadsafe`` meanwhile, so the descriptor is
    closed whether the loop runs again, stays stopped or is closed first (review s13
    rvperf-4: a thread ending while its loop was stopped wrote its last wake-up for a loop
    that was then closed without reading it, one descriptor lost per such close). The
    thread never closes it while the loop's selector lists it: a reused descriptor number
    would reach that selector. ``_ended`` (under ``_done_lock``): the thread wrote its last.
    """

    def __init__(self, name: str) -> None:
        self._calls: CallQueue = new_call_queue()
        # (future, then, result, error): a future's entry (``call``, ``submit``) or a
        # ``submit_then`` call's (future None).
        self._done: deque[tuple[asyncio.Future[Any] | None, Callable[..., None] | None, Any,
                                BaseException | None]] = deque()
        self._done_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._submitted = 0  # calls put on the queue (event loop)
        self._finished = 0  # calls whose function has returned or raised (the thread)
        eventfd = getattr(os, "eventfd", None)
        self._wake_fd: int | None = (eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
                                     if eventfd is not None else None)
        self._detached = False  # close(wait=False): the loop reads the eventfd no more
        self._ended = False  # the thread wrote its last wake-up (_ENDED)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """The result of ``fn(*args)`` run on the thread after every call submitted before."""
        loop = self._loop
        if loop is None:
            loop = self._bind()
        future: asyncio.Future[T] = loop.create_future()
        self._submitted += 1
        self._calls.put((future, fn, args, None))
        return await future

    def submit(self, fn: Callable[..., T], *args: Any) -> Submitted[T]:
        """Event loop: ``call``'s future itself, one that a cancel does not cancel. The call
        runs on the thread whatever happens to its caller (as every call does); a task
        cancelled while awaiting it gets its CancelledError only once the call has finished,
        and can then still act on the outcome (``GroupCommitter`` publishes a stored batch)."""
        loop = self._loop
        if loop is None:
            loop = self._bind()
        future: Submitted[T] = Submitted(loop=loop)
        self._submitted += 1
        self._calls.put((future, fn, args, None))
        return future

    def submit_then(self, then: Callable[[Any, BaseException | None], None],
                    fn: Callable[..., Any], *args: Any) -> None:
        """Event loop: run ``fn(*args)`` on the thread (after every call submitted before),
        then ``then(result, None)``, or ``then(None, error)`` when it raised, on the loop: in
        the hand-back itself, or queued behind a task that a result handed back before it in
        the same bunch resumes (``Submitted.then``'s rule). No future: nothing can cancel
        the call or its ``then``."""
        if self._loop is None:
            self._bind()
        self._submitted += 1
        self._calls.put((None, fn, args, then))

    def _bind(self) -> asyncio.AbstractEventLoop:
        """Event loop, at the first call: this loop is the one the thread hands results to."""
        loop = self._loop = asyncio.get_running_loop()
        if self._wake_fd is not None:
            loop.add_reader(self._wake_fd, self._deliver)
        return loop

    def idle(self) -> bool:
        """Event loop: no call is queued or running on the thread. A call made on the event
        loop while this holds (with no ``await`` in between) runs after every call submitted
        before it and beside none: what the thread would give it, without the hop."""
        return self._submitted == self._finished

    def _run(self) -> None:
        name_os_thread(self._thread.name)
        take = self._calls.take
        wake_fd = -1  # the loop's eventfd when the last call's hand-back must wake it
        while True:
            item = take(wake_fd)  # the wake-up written, then the wait: one GIL release
            wake_fd = -1
            if item is None:
                self._end()
                return
            future, fn, args, then = item
            try:
                result, error = fn(*args), None
            except BaseException as exc:  # handed to the awaiting coroutine (or the then)
                result, error = None, exc
            self._finished += 1  # the store is free: what follows touches only the hand-back
            with self._done_lock:
                wake = not self._done
                self._done.append((future, then, result, error))
                detached = self._detached
            if wake:
                assert self._loop is not None
                if self._wake_fd is not None and not detached:
                    wake_fd = self._wake_fd  # written by the next take, before it waits
                else:
                    try:
                        self._loop.call_soon_threadsafe(self._deliver)
                    except RuntimeError:  # the loop is closed: nobody waits; the calls still run
                        pass

    def _end(self) -> None:
        """The thread, last: tell the loop no wake-up follows (it then closes the eventfd), or
        close it here when no loop reads it (none bound, closed, or detached by ``close``)."""
        with self._done_lock:  # against close(wait=False) detaching it meanwhile
            fd = self._wake_fd
            if fd is None:
                return
            loop = self._loop
            if loop is None or loop.is_closed() or self._detached:
                self._wake_fd = None  # seen by close() after its join
                os.close(fd)
            else:
                os.eventfd_write(fd, _ENDED)
                self._ended = True

    def _deliver(self) -> None:
        # The eventfd is read (reset) before the results are taken: a result appended after
        # the take found the queue empty and wrote it again, so none is left without a wake-up.
        fd = self._wake_fd
        if fd is not None and not self._detached:  # detached: the thread's, not read here
            try:
                if os.eventfd_read(fd) >= _ENDED:  # the thread's last write: no more follow
                    assert self._loop is not None
                    self._loop.remove_reader(fd)
                    self._wake_fd = None
                    os.close(fd)
            except BlockingIOError:  # read already by an earlier turn (close's own call)
                pass
        with self._done_lock:
            done, self._done = self._done, deque()
        queued = False  # a result's callbacks went to the loop's queue: later ``then``s follow
        for future, then, result, error in done:
            if future is None:  # a ``submit_then`` call: its then is told the outcome itself
                args: tuple[Any, ...] = (result, error)
            else:
                if future.done():  # the caller was cancelled
                    continue
                if error is None:
                    future.set_result(result)
                else:
                    future.set_exception(error)
                then = future._then if type(future) is Submitted else None
                if then is None:
                    queued = True  # its awaiting task (or callbacks) resumes in the next turn
                    continue
                args = (future,)
            if queued:
                self._loop.call_soon(then, *args)  # type: ignore[union-attr,arg-type]
            else:
                try:
                    then(*args)  # type: ignore[misc]
                except Exception as exc:  # reported as the loop reports a callback's
                    self._loop.call_exception_handler(  # type: ignore[union-attr]
                        {"message": "Exception in a submitted call's then",
                         "exception": exc, "future": future})

    def close(self, wait: bool = True) -> None:
        """Event loop: finish the calls already submitted, then end the thread; ``wait=False``
        returns at once (a call still running, e.g. an open being cancelled, ends on its own:
        the loop stops reading the eventfd now, results come back through
        ``call_soon_threadsafe`` while the loop runs, and the eventfd is closed now, when the
        thread wrote its last already, or by the thread as it ends)."""
        self._calls.put(None)
        if wait:
            self._thread.join()
            if self._wake_fd is not None and self._loop is not None:
                self._deliver()  # results not yet handed back, and the eventfd closed now
        elif self._wake_fd is not None and self._loop is not None and not self._detached:
            self._detach(self._loop, self._wake_fd)

    def _detach(self, loop: asyncio.AbstractEventLoop, fd: int) -> None:
        """Event loop, ``close(wait=False)``: take the eventfd out of the loop's selector and
        hand it to the thread (or close it, when the thread wrote its last already); hand
        back the results finished before."""
        with self._done_lock:  # the thread decides how to wake the loop under it
            loop.remove_reader(fd)
            self._detached = True
            if self._ended:  # nothing follows its last write
                self._wake_fd = None
                os.close(fd)
        self._deliver()


class Submitted(asyncio.Future[T]):
    """The future of an ``IoThread.submit`` call: ``cancel()`` refuses (returns False), so a
    task cancelled while awaiting it is resumed with CancelledError once it is done (asyncio's
    Task delivers a cancel its waiter refused at the task's next step).

    ``then(callback)`` has ``callback(future)`` called once it is done, like a done callback
    but in the hand-back itself (``IoThread._deliver``) rather than in the loop's next turn,
    unless a result handed back before it in the same bunch resumes something in that turn
    (a task awaiting ``call``): then it is queued behind that, so it never overtakes a round
    handed back just before it (the hazard that reverted c049321: a commit published ahead
    of a visibility round lost its run from the tail). One loop turn less per group commit."""

    _then: Callable[[Submitted[T]], None] | None = None

    def cancel(self, msg: Any = None) -> bool:
        return False

    def then(self, callback: Callable[[Submitted[T]], None]) -> None:
        """Event loop: ``callback(self)`` once done (at most one ``then`` per future)."""
        assert self._then is None, "one then per submitted call"
        if self.done():
            self.get_loop().call_soon(callback, self)
        else:
            self._then = callback


def name_os_thread(name: str) -> None:
    """Give the calling OS thread ``name`` (its first 15 bytes), so ``top -H``,
    /proc/<pid>/task/<tid>/comm and ``bench.path_cpu`` tell a server's threads apart (Python
    names only its own ``threading`` objects). Linux only; silently skipped elsewhere."""
    try:
        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError, TypeError):
        pass


__all__ = ["CallQueue", "CallQueuePython", "IoThread", "Submitted", "name_os_thread",
           "new_call_queue", "new_call_queue_python"]
