"""``Pulls``: the realtime broker's pull path, long polling included.

A pull of one (subject, pull-log group) takes the group's redeliveries first, then scans the
consumer log from its cursor (tag filter, expiry), records what it took in the pulling
consumer's pull log and answers it as three columns (``Pulled``). Pulls of one group run one at
a time. A group that keeps up is served from the in-memory tail (``Committed``) in one pull-log call
(made on the event loop while the pull-log thread is idle: ``Broker.on_pulllog_quick``), or
with none when its known cursor says it is caught up
(``ConsumerBook``); only a group behind the tail, or a redelivery of an old message, reads the
message store.

A pull asked ``direct`` (the realtime server's) is first tried synchronously: when no other
pull of its group runs, its cursor is known, the tail covers it and the pull log can record on
the loop, it is answered without ever suspending. A long poll that then finds nothing parks with
no task (``ParkedPull``): the commit that wakes it queues it, and one loop callback, after the
senders' wake-ups, tries each woken poll the same way and hands its end to the one callback
its server gave (``Pulls.parked_answered``), which answers the poll (the request's ``Later``).
Whatever cannot be done at once (a planned pull, a store
read, the pull-log thread busy, the group's lock taken) goes on as an ordinary task.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any, Awaitable, Callable, Coroutine, Iterable

from realtime.committed import Wake
from realtime.consumers import ConsumerKey, group_key
from realtime.context import BrokerContext
from realtime.parked_pull import Connection, ParkedPull
from realtime.pull_planning import (
    NOTHING_PULLED,
    PULL_RESPONSE_PAYLOAD_BYTES_MAX,
    PULL_SCAN_ENTRIES_MAX,
    PullPlanning,
    Pulled,
)
from realtime.tail import SubjectTail
from wire.protocol import Pull
from wire.responses import pull_response

log = logging.getLogger(__name__)

def burst_share(max_count: int, backlog: int, pulls_waiting: int, share_min: int) -> int:
    """How many of a group's ``backlog`` entries one pull may take while ``pulls_waiting``
    pulls of the group (this one included) wait for them: an even share, at least
    ``share_min`` and at most ``max_count``. So a burst that wakes many idle consumers reaches
    them all instead of the first few to take a full batch each; a lone pull takes what it
    asks for. ``share_min`` 0 turns sharing off."""
    if share_min <= 0 or pulls_waiting <= 1:
        return max_count
    share = -(-backlog // pulls_waiting)  # ceil
    return min(max_count, max(share_min, share))


# Where a parked pull's end goes: the poll and what it pulled, or the error that ended it.
ParkedAnswered = Callable[[ParkedPull, "Pulled | BaseException"], None]


def _keep_answer(poll: ParkedPull, answer: Pulled | BaseException) -> None:
    """``Pulls.parked_answered`` with no server: the poll, a ``Later``, keeps its answer (for
    the frame server that takes it over, if one does) as a ``Later``'s outcome is kept: the
    response map (``pull_response``), or the exception. (A ``Pulled`` kept as it is would
    reach the frame server as a tuple it cannot answer with: review rvd-L2.)"""
    if isinstance(answer, BaseException):
        poll.fail(answer)
    else:
        poll.answer(pull_response(*answer))


# What a pull takes from the tail: the chosen sequences, their payloads, the new cursor, the
# time it took them at (ms) and the expired entries it passed over (None: not traced).
_Taken = tuple[list[int], dict[int, bytes], int, int, "list[bytes] | None"]

class Pulls(PullPlanning):
    """The pull path of one broker.

    Owners: ``waiting_pulls``, ``_pulls_in_progress``, the per-group locks and their users,
    and the parked pulls due (``_due``) belong to the event loop;
    ``stats["pulled"]`` and ``stats["redelivered"]`` are written only by ``_record_pull_io``
    (a pull-log call: on its thread, or on the event loop through ``on_pulllog_quick`` or a
    direct attempt made while the thread is idle, one at
    a time either way), read by metrics at scrape time. Methods ending in ``_io`` run on the
    I/O thread their first docstring line names; every other one on the event loop.
    """

    def __init__(self, ctx: BrokerContext,
                 release: Callable[[list[ConsumerKey]], Awaitable[int]],
                 pulllog_quick_now: Callable[[], bool] = lambda: False) -> None:
        self._ctx = ctx
        self._release = release  # hands a departed consumer's holdings to the others
        # Whether a pull-log call made now would run on the loop (``on_pulllog_quick``'s test).
        self._pulllog_quick_now = pulllog_quick_now
        self.waiting_pulls = 0  # long polls waiting now (metrics)
        # Pulls of one (subject, pull-log group) run one at a time: cursor -> entries -> record.
        self._group_locks: dict[tuple[str, str], asyncio.Lock] = {}
        # (subject, pull-log group) -> its pulls holding or queued on its lock: a direct
        # attempt runs only when there are none (it never interleaves with one).
        self._lock_users: dict[tuple[str, str], int] = {}
        # (subject, pull-log group) -> its pulls in progress now (parked, queued on the lock or
        # running): the consumers ready for more, among whom a burst is shared (burst_share).
        self._pulls_in_progress: dict[tuple[str, str], int] = {}
        # Parked pulls told their outcome, for the one loop callback that goes on with them.
        self._due: list[ParkedPull] = []
        # Tasks of woken parked pulls that needed the async path (referenced until they end).
        self._continuing: set[asyncio.Task[None]] = set()
        # The event loop, written by the first ``pull`` (every other method here runs after
        # one): ``asyncio.get_running_loop`` makes a getpid system call each time (issue 18:
        # about three per message on a woken pull and its re-park).
        self._loop: asyncio.AbstractEventLoop | None = None
        ctx.committed.answer_woken = self._run_due
        ctx.committed.answer_woken_soon = self._run_due_soon
        ctx.committed.tell_direct = self._tell_due  # type: ignore[assignment]
        # Where a parked pull's end goes (``_finish``): the realtime server sets its own, which
        # answers the poll (a ``Later``) once the role allows it; one bound method for every
        # poll, none made per pull.
        self.parked_answered: ParkedAnswered = _keep_answer

    async def pull(self, request: Pull, connection: Connection | None = None,
                   direct: bool = False) -> Pulled | ParkedPull:
        """Hand the group's next entries (redeliveries first) to the pulling consumer.

        With ``wait_ms`` it waits until something arrives or the wait ends (long polling).
        ``connection`` (the consumer's) tells whether it has ended (``closed``): a long poll
        that wakes for a consumer killed meanwhile returns nothing, instead of recording
        entries as held by a consumer nobody answers for (they would wait for its expiry before anyone else got them).
        A long poll of a consumer that leaves (op ``leave``) meanwhile ends empty too.

        With ``direct`` it is first tried without suspending, and a long poll that would wait
        parks with no task and returns its ``ParkedPull``: its end goes to
        ``parked_answered`` (a ``Later`` the caller returns to its frame server).
        (``pull_now`` is the same with no coroutine for what it does without suspending.)
        """
        out = self.pull_now(request, connection, direct)
        if type(out) is Pulled or type(out) is ParkedPull:
            return out
        return await out  # type: ignore[misc]

    def pull_now(self, request: Pull, connection: Connection | None = None,
                 direct: bool = True) -> Pulled | ParkedPull | Coroutine[
                     Any, Any, Pulled | ParkedPull]:
        """``pull`` as far as it goes without suspending: what it pulled, or (``direct``) the
        ``ParkedPull`` it parked, or else the coroutine that goes on with it, to await. The
        realtime server's pull: no coroutine made for a pull answered or parked at once
        (issue 18: four coroutines a pull, one per layer). Without ``direct`` it never parks
        with no task and always returns the coroutine."""
        subject, consumer_id = request.subject, request.consumer_id
        # ``group_key`` called only for a broadcast pull (one call fewer a usual pull).
        key = group_key(request.group, consumer_id, True) if request.broadcast else request.group
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        began_s = loop.time()
        tags = frozenset(request.tags)
        ctx = self._ctx
        now_ms = ctx.clock()
        ctx.tracer.subscribed(subject, key, consumer_id, tags, now_ms)
        poll = ParkedPull(self._tell_due, request, key, tags, began_s + request.wait_ms / 1000,
                          (subject, key, consumer_id), ctx.book.leaves, connection)
        group = poll.group
        in_progress = self._pulls_in_progress
        in_progress[group] = in_progress.get(group, 0) + 1
        if direct:
            try:
                out = self._attempt_now(poll, now_ms, began_s)
            except BaseException:
                self._pull_ended(group)
                raise
            if out is not None:
                if out is not poll:
                    self._pull_ended(group)
                return out
        return self._pull_later(poll, direct)

    async def _pull_later(self, poll: ParkedPull, direct: bool) -> Pulled | ParkedPull:
        """``pull_now``'s async part: ``_pull_until`` for ``poll``'s pull (parking it with no
        task again if ``direct``); it ends there unless it parked."""
        try:
            out = await self._pull_until(poll.request, poll.key, poll.tags, poll.deadline,
                                         poll.leave_key, poll.mark, poll.connection,
                                         poll if direct else None)
        except BaseException:
            self._pull_ended(poll.group)
            raise
        if out is not poll:
            self._pull_ended(poll.group)
        return out

    def _pull_ended(self, group: tuple[str, str]) -> None:
        """A pull of ``group`` was answered: one fewer in progress."""
        in_progress = self._pulls_in_progress
        count = in_progress[group] - 1
        if count:
            in_progress[group] = count
        else:
            del in_progress[group]

    async def _pull_until(self, request: Pull, key: str, tags: frozenset[str], deadline: float,
                          leave_key: ConsumerKey, mark: int,
                          connection: Connection | None,
                          poll: ParkedPull | None = None) -> Pulled | ParkedPull:
        """``pull``'s attempts until it takes something or its wait ends; given ``poll``, a
        wait parks it with no task and returns it."""
        subject, consumer_id = request.subject, request.consumer_id
        loop = asyncio.get_running_loop()
        ctx = self._ctx
        book, committed, clock = ctx.book, ctx.committed, ctx.clock
        while True:
            if (connection is not None and connection.closed) or book.left_since(leave_key, mark):
                return NOTHING_PULLED
            wake = committed.wake(subject)
            book.seen(subject, key, consumer_id, clock())
            pulled = await self._pull_once(request, key, tags)
            if pulled.payloads and book.left_since(leave_key, mark):
                # The consumer left while this pull was recording entries for it: hand them
                # on like the leave did with the rest.
                await self._release([leave_key])
                return NOTHING_PULLED
            if pulled.payloads:
                book.seen(subject, key, consumer_id, clock())
                return pulled
            remaining = deadline - loop.time()
            if remaining <= 0 or committed.stopping:
                return NOTHING_PULLED
            if poll is not None:
                self._park_direct(poll, wake)
                return poll
            self.waiting_pulls += 1
            book.park(leave_key)  # present while parked, however long it waits
            try:
                woken = await committed.park(wake, deadline)
            finally:
                self.waiting_pulls -= 1
                book.unpark(leave_key, clock())
            if not woken:
                return NOTHING_PULLED

    # ------------------------------------------------------------------ without a task

    def _attempt_now(self, poll: ParkedPull, now_ms: int, now_s: float | None = None,
                     seen: bool = False) -> Pulled | ParkedPull | None:
        """One attempt of ``poll``'s pull made without suspending, as ``_pull_until``'s loop
        makes one, at ``now_ms`` (the broker's clock, read once in the step that makes it):
        what it pulled, itself parked again, or None when the attempt needs the async path
        (nothing was taken or recorded then). ``now_s``: the loop's time read in the same
        step, if it was (the pull's own: it is read only when the attempt would park).
        ``seen``: the consumer is already marked seen at ``now_ms`` (the woken poll's
        ``ConsumerBook.unpark`` did it in the same step: presence written once, not twice)."""
        request = poll.request
        ctx = self._ctx
        book, committed = ctx.book, ctx.committed
        connection = poll.connection
        if (connection is not None and connection.closed) or (
                book.leaves != poll.mark and book.left_since(poll.leave_key, poll.mark)):
            return NOTHING_PULLED  # (no leave since it began: no left_since call)
        subject = request.subject
        group = poll.group
        end = committed.ends.get(subject, 0)
        # One read of the known cursor for both questions (``ConsumerBook.caught_up``'s test
        # made on it), from the book's dict: no call. A caught-up group (a new long poll, about
        # one a message) is told so here, with no ``_pull_once_now`` call (issue 18).
        known = book.known_cursors.get(group)
        pulled: Pulled | None
        if known is not None and known >= end:
            pulled = NOTHING_PULLED  # nothing to take, nothing to redeliver
        else:
            pulled = self._pull_once_now(request, poll.key, poll.tags, now_ms, group, known,
                                         end)
            if pulled is None:
                return None
        if pulled.payloads:
            if not seen:
                book.seen(subject, poll.key, request.consumer_id, now_ms)
            return pulled  # nothing suspended since the leave check: it holds
        if now_s is None:
            assert self._loop is not None  # set by the pull that made ``poll``
            now_s = self._loop.time()
        if poll.deadline <= now_s or committed.stopping:
            if not seen:
                book.seen(subject, poll.key, request.consumer_id, now_ms)
            return NOTHING_PULLED
        # The wake is taken only now, to park on (``_pull_until`` takes it before it looks):
        # nothing suspended since the look, so no commit came between (one call fewer for
        # every attempt that takes something). Seen at ``now_ms`` as it parks, in the same
        # call (``ConsumerBook.park``; its key is (subject, poll.key, consumer id)): one call
        # fewer for a parking pull, about one a message (issue 18).
        self._park_direct(poll, committed.wake(subject), None if seen else now_ms)
        return poll

    def _pull_once_now(self, request: Pull, key: str, tags: frozenset[str], now_ms: int,
                       group: tuple[str, str], known: int | None, end: int) -> Pulled | None:
        """``_pull_once`` of a group not known to be caught up (``_attempt_now`` asked), when
        it can run without suspending: no other pull of it running, its cursor known, the tail
        covering it and the pull log recording on the loop. None (nothing taken) otherwise.
        ``group``: (subject, ``key``); ``known``: its known cursor (None: unknown), below the
        committed ``end``."""
        subject = request.subject
        ctx = self._ctx
        book, committed = ctx.book, ctx.committed
        if group in self._lock_users or not self._pulllog_quick_now():
            return None
        if known is None:
            return None
        tail = committed.tail.covering(subject, known)
        if tail is None:
            return None
        # As ``_take_from_tail`` and ``take_cursor`` then ``remember_cursor``, written out: the
        # known cursor stays in place unless the pull fails (three calls and two tuples fewer
        # per pull that takes something; nothing here suspends, so nothing else moves it).
        release_round = book.release_rounds
        if self._pulls_in_progress.get(group, 1) > 1:  # a lone pull takes what it asks for
            request = self._shared(request, group, end - known)
        payloads: dict[int, bytes] = {}
        chosen: list[int] = []
        expired: list[bytes] | None = [] if ctx.tracer.enabled else None
        try:
            new_cursor = tail.take(known, min(end, known + PULL_SCAN_ENTRIES_MAX),
                                   request.max_count, tags, now_ms,
                                   PULL_RESPONSE_PAYLOAD_BYTES_MAX, payloads, chosen, expired)
            # new_cursor == known: the tail does not reach what the store says is committed.
            out = None if new_cursor == known else self._record_pull_io(
                request, key, chosen, new_cursor, payloads, now_ms, known)
        except BaseException:
            book.take_cursor(group)  # dropped, as by a pull that ran
            raise
        if out is None:
            # The tail fell short, or the pull log says the cursor moved: the known cursor is
            # dropped and the async path plans the pull.
            book.take_cursor(group)
            return None
        if expired:
            ctx.tracer.expired(expired, key, now_ms)
        # ``remember_cursor``, written out (one call fewer a message): no release round can
        # pass within this step, as nothing above suspends or releases, so the cursor is known.
        assert release_round == book.release_rounds, (release_round, book.release_rounds)
        book.known_cursors[group] = new_cursor
        return out

    def _park_direct(self, poll: ParkedPull, wake: Wake, seen_ms: int | None = None) -> None:
        """Park ``poll`` on ``wake`` until its deadline, with no task; ``seen_ms``: its
        consumer is also marked seen then (``ConsumerBook.park``)."""
        self.waiting_pulls += 1
        # Present while parked, however long it waits.
        self._ctx.book.park(poll.leave_key, seen_ms)
        poll.woken = None
        poll.wake = wake
        poll.slot = self._ctx.committed.park_direct(wake, poll.deadline, poll)

    def _tell_due(self, polls: Iterable[ParkedPull], woken: bool) -> None:
        """``polls`` are told their outcome (``woken``: True, or False past their deadline),
        those not told one already: queued for ``_run_due``, all of a commit's in one call
        (``Committed.tell_direct``); the first queued in a step schedules ``_run_due``. It runs
        after whatever the same step queued before (a commit's senders are woken first). A
        step that calls ``_run_due`` itself before it ends (``Committed.answering_woken``)
        schedules nothing."""
        due = self._due
        was_empty = not due
        for poll in polls:
            if poll.woken is None:
                poll.woken = woken
                due.append(poll)
        if was_empty and due and not self._ctx.committed.answering_woken:
            assert self._loop is not None  # set by the pull that parked them
            self._loop.call_soon(self._run_due)

    def _run_due_soon(self) -> None:
        """A step that was to call ``_run_due`` itself ended first (``Committed``'s
        ``answer_woken_soon``): the polls it queued go on in a loop callback."""
        if self._due:
            assert self._loop is not None
            self._loop.call_soon(self._run_due)

    def _run_due(self) -> None:
        """Go on with every parked pull told its outcome, in the order they were told: each is
        answered now, parked again, or handed to a task when it needs the async path. Runs as
        the loop callback ``_tell_due`` scheduled, or earlier, in the step that published the
        commit once its senders were answered (``Committed.answer_woken``); then the callback
        finds nothing left."""
        due, self._due = self._due, []
        for poll in due:
            try:
                self._resume(poll)
            except Exception as exc:  # a bug: its consumer gets an error answer, the rest go on
                log.exception("pull of %s for %s failed after its long poll", *poll.group)
                if not poll.ended:
                    self._finish(poll, exc)

    def _resume(self, poll: ParkedPull) -> None:
        """One woken (or expired) parked pull: unparked, then attempted as ``_pull_until``."""
        ctx = self._ctx
        self.waiting_pulls -= 1
        now_ms = ctx.clock()
        seen = ctx.book.unpark(poll.leave_key, now_ms)
        assert poll.wake is not None and poll.slot is not None
        if poll.woken:
            # Told True, so its wake was woken (``notify`` set that first, or ``park_direct``
            # found it so), and a woken wake's lists are not read again: only the deadline
            # slot keeps the poll (``Committed.unpark``'s work for this case, with no call).
            assert poll.wake.woken
            poll.slot.discard(poll)
        else:
            ctx.committed.unpark(poll.wake, poll.slot, poll)
        poll.wake = poll.slot = None
        if not poll.woken:
            self._finish(poll, NOTHING_PULLED)
            return
        out = self._attempt_now(poll, now_ms, None, seen)
        if out is None:
            assert self._loop is not None
            task = self._loop.create_task(self._continue(poll))
            self._continuing.add(task)
            task.add_done_callback(self._continuing.discard)
        elif type(out) is not ParkedPull:  # (never subclassed: no isinstance call)
            self._finish(poll, out)

    async def _continue(self, poll: ParkedPull) -> None:
        """A woken parked pull that needs the async path: ``_pull_until`` in a task."""
        try:
            out = await self._pull_until(poll.request, poll.key, poll.tags, poll.deadline,
                                         poll.leave_key, poll.mark, poll.connection, poll)
        except Exception as exc:
            self._finish(poll, exc)
            return
        if not isinstance(out, ParkedPull):
            self._finish(poll, out)

    def _finish(self, poll: ParkedPull, answer: Pulled | BaseException) -> None:
        """``poll``'s pull ends with ``answer``: handed to ``parked_answered``."""
        poll.ended = True
        # ``_pull_ended``, written out: one call fewer per woken pull.
        in_progress = self._pulls_in_progress
        group = poll.group
        count = in_progress[group] - 1
        if count:
            in_progress[group] = count
        else:
            del in_progress[group]
        self.parked_answered(poll, answer)

    # ------------------------------------------------------------------ one attempt

    async def _pull_once(self, request: Pull, key: str, tags: frozenset[str]) -> Pulled:
        """One attempt of a pull: nothing when the group is known to be caught up, else under
        the group's lock from the tail (known cursor) or as the pull log plans it."""
        subject = request.subject
        group = (subject, key)
        book = self._ctx.book
        if book.caught_up(group, self._ctx.committed.ends.get(subject, 0)):
            return NOTHING_PULLED  # nothing to redeliver either: no need to ask the pull log
        lock = self._group_locks.get(group)
        if lock is None:
            lock = self._group_locks[group] = asyncio.Lock()
        users = self._lock_users
        users[group] = users.get(group, 0) + 1
        try:
            async with lock:
                known, release_round = book.take_cursor(group)
                out = None
                if known is not None:
                    request = self._shared(
                        request, group, self._ctx.committed.ends.get(subject, 0) - known)
                    out, new_cursor = await self._pull_from_tail(request, key, tags, known)
                if out is None:
                    out, new_cursor, drained = await self._pull_planned(request, key, tags)
                    if not drained:
                        return out
                # The redelivery queue is empty (only the lock holder takes from it): unless a
                # release round put something back meanwhile, the next pull may skip the plan.
                book.remember_cursor(group, new_cursor, release_round)
                return out
        finally:
            count = users[group] - 1
            if count:
                users[group] = count
            else:
                del users[group]

    def _shared(self, request: Pull, group: tuple[str, str], backlog: int) -> Pull:
        """``request`` asking at most its group's share of ``backlog`` (``burst_share``)."""
        waiting = self._pulls_in_progress.get(group, 1)
        if waiting <= 1:
            return request  # a lone pull takes what it asks for (burst_share's rule): no call
        share = burst_share(request.max_count, backlog, waiting,
                            self._ctx.config.burst_share_min_messages)
        if share < request.max_count:
            return dataclasses.replace(request, max_count=share)
        return request

    def _take_from_tail(self, request: Pull, tags: frozenset[str], cursor: int,
                        tail: SubjectTail, end: int, now_ms: int) -> _Taken | None:
        """The entries a pull takes at ``now_ms`` from ``tail`` (the subject's run covering
        ``cursor``) after ``cursor`` up to the committed ``end`` (chosen sequences, their
        payloads, the new cursor, now, the expired passed over), or None when the tail does not
        reach up to the committed end."""
        ctx = self._ctx
        payloads: dict[int, bytes] = {}
        chosen: list[int] = []
        expired: list[bytes] | None = [] if ctx.tracer.enabled else None
        new_cursor = tail.take(cursor, min(end, cursor + PULL_SCAN_ENTRIES_MAX), request.max_count,
                               tags, now_ms, PULL_RESPONSE_PAYLOAD_BYTES_MAX, payloads, chosen,
                               expired)
        if new_cursor == cursor:
            return None  # the tail does not reach what the store says is committed
        return chosen, payloads, new_cursor, now_ms, expired

    async def _pull_from_tail(self, request: Pull, key: str, tags: frozenset[str],
                              cursor: int) -> tuple[Pulled | None, int]:
        """One pull-log call (on the event loop while the pull-log thread is idle): entries
        from the tail after the cursor the group had at its last pull. None when the tail does
        not reach back to it, or when the pull log says the cursor moved or entries wait for
        redelivery after all."""
        ctx = self._ctx
        committed = ctx.committed
        end = committed.ends.get(request.subject, 0)
        if cursor >= end:
            return NOTHING_PULLED, cursor
        tail = committed.tail.covering(request.subject, cursor)
        if tail is None:
            return None, cursor
        taken = self._take_from_tail(request, tags, cursor, tail, end, ctx.clock())
        if taken is None:
            return None, cursor
        chosen, payloads, new_cursor, now_ms, expired = taken
        out = await ctx.on_pulllog_quick(self._record_pull_io, request, key, chosen,
                                          new_cursor, payloads, now_ms, cursor)
        if out is not None and expired:
            ctx.tracer.expired(expired, key, now_ms)
        return out, new_cursor


__all__ = ["Connection", "NOTHING_PULLED", "PULL_RESPONSE_PAYLOAD_BYTES_MAX",
           "PULL_SCAN_ENTRIES_MAX", "ParkedPull", "ParkedAnswered", "Pulled", "Pulls"]
