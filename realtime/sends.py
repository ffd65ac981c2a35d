"""``Sends``: the realtime broker's send path. A request's payloads are checked (the quick check
over the whole batch, the full check for what it is unsure of), queued for the group commit
(``serverkit.committer``), appended and committed on the store thread, then answered, put into
the in-memory tail (``Committed``) and traced; the subjects' long polls wake.

The path is batch-shaped: a request's messages travel as ``Checked`` tuples and their payloads,
and the store takes them as columns, so nothing is built per message beyond the check's tuple
and the answer's map.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from itertools import chain
from operator import attrgetter, itemgetter
from typing import Any, Awaitable, Callable, ContextManager, Iterable

from realtime.context import BrokerContext
from serverkit.committer import GroupCommitter
from serverkit.frame_server import Later
from serverkit.send_check import Checked, QuickCheck
from wire.errors import BadRequest, QmqError, ReadOnly
from wire.message import (
    ORIGIN_ID_PROPERTY,
    decode_message,
    peek_message_id,
    tag_hash,
    validate_message,
)
from wire.protocol import send_result_error, send_result_ok, send_results_stored

log = logging.getLogger(__name__)

# A message stamped a little in the future is clock skew between hosts and is stored now;
# further ahead it belongs to a delay server and is refused rather than delivered early.
DELIVER_AT_SKEW_MS_MAX = 5_000

# Columns of a batch of Checked tuples, taken by ``map`` in C rather than a loop per message.
_ids_of = itemgetter(0)
_subjects_of = itemgetter(1)
_tags_of = itemgetter(2)
_expiries_of = itemgetter(3)
_compact_of = attrgetter("compact")  # of a SendRequest

# One subject's stored run as the tail's columns: first sequence, payloads, tags, expiries (ms,
# or None), [payload bytes].
Run = tuple[int, list[bytes], Iterable[tuple[str, ...]], Iterable["int | None"], list[int]]


class SendRequest(Later):
    """One ``send`` request's valid messages, waiting for the next group commit; also the
    request's ``Later`` when it is answered by callback (``send_soon``): the frame server
    writes its answer, with no second object and no ``partial`` per send (issue 18)."""

    __slots__ = ("messages", "payloads", "slots", "results", "future", "log_end", "compact",
                 "on_done")

    def __init__(self, messages: list[Checked], payloads: list[bytes], slots: list[int] | None,
                 results: list[Any], compact: bool) -> None:
        # The Later's own fields, unbound and not answered (as ``Later.__init__`` sets them),
        # set here: no second __init__ call per send.
        self._server = self._connection = self._request = self._outcome = None
        self._given_once = False
        self.messages = messages
        self.payloads = payloads
        # Index in ``results`` of each message; None: all of them, in order.
        self.slots = slots
        self.results = results
        # Set once answered (``send``); None: ``on_done`` is told.
        self.future: asyncio.Future[None] | None = None
        self.log_end = 0  # the message log's end after the commit that stored them
        # The caller takes a count for "all stored" (a compact send) and every message passed
        # the quick check: left True only if the commit stored them all in one run, no result
        # made.
        self.compact = compact
        # ``Sends.send_soon``: called with this request once its commit ended (stored or
        # refused).
        self.on_done: Callable[[SendRequest], None] | None = None


Committed = tuple[list[int | None], int]  # a commit's sequences, and the message log's end


class Sends:
    """The send path of one broker.

    Owners: ``readonly``, ``write_failed``, ``message_errors``, ``sent_by_subject`` and
    ``on_commit`` belong to the event loop (``readonly`` is also set by the server when the
    MetaServer drains the group); ``stats["sent"]`` and ``stats["duplicates"]`` are written on
    the store thread only (``_append_and_commit_io``), read by metrics at scrape time. Methods
    ending in ``_io`` run on the store thread; every other one on the event loop.
    """

    def __init__(self, ctx: BrokerContext) -> None:
        self._ctx = ctx
        self._quick_check = QuickCheck()
        self.readonly = False  # set by the MetaServer (draining) or after a sticky write failure
        self.write_failed = False  # a sticky write failure: read-only until restarted
        # For metrics, read at scrape time: [messages, payload bytes] stored per subject (counted
        # per commit and subject, not per message), messages refused per error code, and a
        # callback told each group commit's message count.
        self.sent_by_subject: dict[str, list[int]] = {}
        self.message_errors: dict[str, int] = {}
        self.on_commit: Callable[[int], None] | None = None
        # Around the answers of one commit: the block the server's
        # ``FrameServer.answers_together()`` gives, so they leave in one write per connection
        # (``send_soon``'s are written right there). The block itself, reused for every commit
        # (it is re-entrant): no call per commit to get it (issue 18).
        self.answers_together: ContextManager[None] = contextlib.nullcontext()
        self.commits: GroupCommitter[SendRequest, Committed] = GroupCommitter(
            f"broker group {ctx.config.group}", self._commit_call, self._publish_committed,
            self._fail_batch, self._go_readonly,
            commit_then=self._commit_then if ctx.submit_then_to_store is not None else None)

    async def send(self, payloads: list[bytes], compact: bool = False
                   ) -> list[dict[str, Any]] | int:
        """Validate and store a batch; each result says stored, duplicate or the error. With
        ``compact``, the number of payloads (an int) instead when every one was stored.

        Replies only once the batch is durable under the flush mode and, under ``sync``
        replication, once the slaves a write waits for have it (a request refused meanwhile,
        its messages stored here alone, is answered with the error: the producer resends with
        the same ids, which de-duplication absorbs).
        """
        request, results = self._request(payloads, compact)
        if request is None:
            return results  # every payload refused: nothing to commit
        future = request.future = asyncio.get_running_loop().create_future()
        self.commits.pending.append(request)
        await self.commits.commit_now()
        await future
        replicated_end = self.replicated_end(request)
        if replicated_end:
            await self.wait_replicated(replicated_end)
        return self.outcome(request)

    def send_soon(self, payloads: list[bytes], compact: bool,
                  done: Callable[[SendRequest], None]) -> SendRequest | list[dict[str, Any]]:
        """``send`` with no task: the results now when no payload is valid (nothing to
        commit), else the request, queued, and ``done(request)`` once its commit ended
        (stored or refused; ``outcome`` then says what ``send`` returns). The request is a
        ``Later`` a handler may return for its answer. The caller still waits for the slaves
        when ``replicated_end`` says so. Raises as ``send`` does before its commit."""
        request, results = self._request(payloads, compact)
        if request is None:
            return results
        request.on_done = done
        commits = self.commits
        commits.pending.append(request)
        commits.commit_soon()
        return request

    def replicated_end(self, request: SendRequest) -> int:
        """The message log's end the slaves must still reach before a committed ``request``
        is answered under ``sync`` replication; 0: nothing left to wait for (the usual case:
        no coroutine is stepped for it). NotMaster when this server stopped being master."""
        end = request.log_end
        replica = self._ctx.replica
        if end and replica.replicating and not replica.replicated_now("message", end):
            return end
        return 0

    async def wait_replicated(self, end: int) -> None:
        """Until the slaves a ``sync`` write waits for have the message log up to ``end``."""
        await self._ctx.replica.wait_replicated("message", end)

    @staticmethod
    def outcome(request: SendRequest) -> list[dict[str, Any]] | int:
        """What ``send`` returns for a request whose commit ended."""
        if request.compact:
            return len(request.results)
        return request.results

    def _request(self, payloads: list[bytes], compact: bool
                 ) -> tuple[SendRequest | None, list[Any]]:
        """The checked request of ``payloads``, not queued yet, and its results (the errors
        of the invalid ones so far); no request when none is valid."""
        self._ctx.replica.check_writable()
        now_ms = self._ctx.clock()
        # Every payload through the quick check in one call (C when built); in the usual case
        # all pass and the request goes to the committer as it came, with no loop here.
        checks = self._quick_check.check_many(payloads, now_ms + DELIVER_AT_SKEW_MS_MAX)
        results: list[Any] = [None] * len(payloads)
        if None not in checks and not self.readonly:
            messages, valid, slots = checks, payloads, None
        else:
            messages, valid, slots = self._full_checks(payloads, checks, results, now_ms)
        if not messages:
            return None, results
        return SendRequest(messages, valid, slots, results, compact and slots is None), results

    def _full_checks(self, payloads: list[bytes], checks: list[Checked | None],
                     results: list[Any], now_ms: int,
                     ) -> tuple[list[Checked], list[bytes], list[int]]:
        """The full check of every payload the quick check did not accept (all of them when
        read-only): the valid messages, their payloads and slots; errors go to ``results``."""
        messages: list[Checked] = []
        valid: list[bytes] = []
        slots: list[int] = []
        readonly = self.readonly
        for slot, (payload, checked) in enumerate(zip(payloads, checks)):
            if checked is None or readonly:
                try:
                    checked = self._full_check(payload, now_ms)
                except QmqError as exc:
                    results[slot] = send_result_error(peek_message_id(payload), exc)
                    self._count_error(exc.code, 1)
                    continue
            messages.append(checked)
            valid.append(payload)
            slots.append(slot)
        return messages, valid, slots

    def _full_check(self, payload: bytes, now_ms: int) -> Checked:
        """Decode and validate with wire.message; the QmqError says what is wrong."""
        message = decode_message(payload)
        validate_message(message, allow_internal=True, now_ms=now_ms)
        deliver_at_ms = message.deliver_at_ms
        if deliver_at_ms is not None and deliver_at_ms > now_ms + DELIVER_AT_SKEW_MS_MAX:
            raise BadRequest(
                f"message {message.id} has deliver_at_ms {message.deliver_at_ms}, "
                f"{message.deliver_at_ms - now_ms} ms ahead, exceeds DELIVER_AT_SKEW_MS_MAX "
                f"{DELIVER_AT_SKEW_MS_MAX}: send delayed messages to a delay server"
            )
        if self.readonly:
            raise ReadOnly(f"broker group {self._ctx.config.group} is read-only; send "
                           "elsewhere")
        return Checked(message.id, message.subject, message.tags, message.expire_at_ms,
                       message.deliver_at_ms, message.created_at_ms, message.retries,
                       message.properties.get(ORIGIN_ID_PROPERTY))

    # ------------------------------------------------------------------ the group commit

    def _commit_call(self, batch: list[SendRequest]) -> Awaitable[Committed]:
        """The group commit's store call: ``_append_and_commit_io`` on the store thread, as a
        future a cancel does not cancel, so a stopping server still publishes what it stored."""
        ctx = self._ctx
        if ctx.submit_to_store is not None:
            return ctx.submit_to_store(self._append_and_commit_io, batch, ctx.clock())
        return ctx.on_store_thread(self._append_and_commit_io, batch, ctx.clock())

    def _commit_then(self, batch: list[SendRequest],
                     then: Callable[[Committed | None, BaseException | None], None]) -> None:
        """``_commit_call`` with no future: ``then(committed, error)`` on the event loop once
        the store thread ran it (``IoThread.submit_then``), for a ``commit_soon`` commit."""
        ctx = self._ctx
        ctx.submit_then_to_store(then, self._append_and_commit_io,  # type: ignore[misc]
                                 batch, ctx.clock())

    def _append_and_commit_io(self, batch: list[SendRequest], now_ms: int) -> Committed:
        """Store thread: append every request's messages (column by column) and commit them.
        Returns each message's sequence (None for a duplicate) and the message log's end."""
        store = self._ctx.store
        try:
            # The requests' messages as one set of columns: the store takes a run of one
            # subject at a time, so requests of the same subject are checked, numbered and
            # encoded together.
            if len(batch) == 1:
                messages, payloads = batch[0].messages, batch[0].payloads
            else:
                messages = list(chain.from_iterable(request.messages for request in batch))
                payloads = list(chain.from_iterable(request.payloads for request in batch))
            tags = list(map(_tags_of, messages))
            if any(tags):
                # Messages of a batch share a few tag sets: hash each distinct set once.
                hashes_of = {message_tags: tuple(map(tag_hash, message_tags))
                             for message_tags in set(tags)}
                hashes: list[Any] = list(map(hashes_of.__getitem__, tags))
            else:
                hashes = [()] * len(messages)
            sequences = store.append_commit(list(map(_subjects_of, messages)),
                                            list(map(_ids_of, messages)), hashes, now_ms,
                                            payloads)
        except BaseException:
            store.discard()  # no request of a failed commit may ride along with the next one
            raise
        assert len(sequences) == len(messages), (len(sequences), len(messages))
        duplicates = sequences.count(None)
        stats = self._ctx.stats
        stats["duplicates"] += duplicates
        stats["sent"] += len(sequences) - duplicates
        replica = self._ctx.replica
        if replica.replicating:
            replica.wrote_io("message")  # a tailing slave's fetch ships it from memory
        return sequences, store.copy_end()

    def _go_readonly(self) -> None:
        """A sticky write failure: refuse sends until restarted."""
        self.readonly = self.write_failed = True

    def _fail_batch(self, batch: list[SendRequest], error: QmqError) -> None:
        """Answer every message of a batch whose commit failed with ``error``."""
        self._count_error(error.code, sum(len(request.messages) for request in batch))
        for request in batch:
            request.compact = False  # failed: a result per message, each naming the error
            slots = request.slots if request.slots is not None else range(len(request.results))
            for slot, message in zip(slots, request.messages):
                request.results[slot] = send_result_error(message.id, error)
        self._answer(batch)
        with self.answers_together:
            self._tell(batch)

    def _publish_committed(self, batch: list[SendRequest], committed: Committed) -> None:
        """Answer a committed batch, feed the tail and the metrics, wake the pulls. The
        slaves' fetches hear of the new end first, so every message a consumer can be handed
        lies below an end a pull-log copy is told it requires."""
        outcomes, log_end = committed
        self._ctx.replica.advanced("message", log_end)
        # ``_answer``, inline (one call fewer a commit): each request's end, and the wake-ups
        # of the senders waiting in a task (``send``).
        by_callback = True
        for request in batch:
            request.log_end = log_end
            future = request.future
            if future is not None:
                by_callback = False
                if not future.done():
                    future.set_result(None)
        # The senders' wake-ups are queued first (their results are filled below, before any
        # of them runs): in the next loop turn the producers are answered, then the long polls
        # this commit wakes (issue 18: a later producer answer lengthens its next linger).
        # Sends answered by callback are written in this step, once their results are filled
        # and before any woken poll runs.
        # Every sender answered by callback (below): the long polls this commit wakes are
        # answered right after them, in this step (no loop turn); else after the senders'
        # tasks, in the loop callback their wake-up schedules.
        view = self._ctx.committed
        view.answering_woken = by_callback
        try:
            self._publish(batch, outcomes)
            if self.on_commit is not None:
                self.on_commit(len(outcomes))
            # One block for both: the producers' answers, then the woken polls', leave as it
            # ends, one write per connection and no end-of-turn callback for either.
            with self.answers_together:
                if len(batch) == 1:  # ``_tell``, inline for the usual commit of one request
                    request = batch[0]
                    on_done = request.on_done
                    if on_done is not None:
                        request.on_done = None
                        try:
                            on_done(request)
                        except Exception:  # a server bug, as in ``_tell``
                            log.exception("answering a send of %d messages failed",
                                          len(request.messages))
                else:
                    self._tell(batch)
                if view.answering_woken:
                    view.answering_woken = False
                    view.answer_woken()
        finally:
            if view.answering_woken:  # the step failed first: a loop callback answers them
                view.answering_woken = False
                view.answer_woken_soon()

    @staticmethod
    def _answer(batch: list[SendRequest]) -> bool:
        """Wake the requests of a commit that ended whose senders wait in a task (``send``);
        True when there is none (every sender is answered by callback, ``_tell``)."""
        by_callback = True
        for request in batch:
            future = request.future
            if future is not None:
                by_callback = False
                if not future.done():
                    future.set_result(None)
        return by_callback

    def _tell(self, batch: list[SendRequest]) -> None:
        """Call the ``on_done`` of each request of a commit that ended (``send_soon``), its
        results filled in; inside the caller's ``answers_together`` block, so that their
        answers leave together, one write per connection."""
        for request in batch:
            on_done = request.on_done
            if on_done is None:
                continue
            request.on_done = None
            try:
                on_done(request)
            except Exception:  # a server bug: the batch's other requests still hear
                log.exception("answering a send of %d messages failed", len(request.messages))

    def _count_error(self, code: str, count: int) -> None:
        self.message_errors[code] = self.message_errors.get(code, 0) + count

    # ------------------------------------------------------------------ publishing a commit

    def _publish(self, batch: list[SendRequest], sequences: list[int | None]) -> None:
        """Fill in the results, put what was stored in the tail and wake the subjects' pulls.

        ``sequences`` has one entry per message of the batch, in order: its sequence if stored,
        None for a duplicate."""
        tracer = self._ctx.tracer
        tracing = tracer.enabled
        now_ms = self._ctx.clock() if tracing else 0
        messages = (batch[0].messages if len(batch) == 1
                    else list(chain.from_iterable(request.messages for request in batch)))
        subjects = set(map(_subjects_of, messages))
        if (len(subjects) == 1 and None not in sequences
                and sequences[-1] - sequences[0] == len(sequences) - 1):
            # The usual commit: one subject, every message stored, in one run. Its requests
            # are published together: one tail run, one call to the tracer.
            subject = next(iter(subjects))
            self._publish_run(subject, batch, messages, sequences)  # type: ignore[arg-type]
            if tracing:
                tracer.stored(messages, sequences, now_ms)
            self._ctx.committed.notify(subject)
            return
        position = 0
        for request in batch:
            count = len(request.messages)
            request_sequences = sequences[position:position + count]
            position += count
            request_subjects = set(map(_subjects_of, request.messages))
            if (len(request_subjects) == 1 and None not in request_sequences
                    and request_sequences[-1] - request_sequences[0] == count - 1):
                self._publish_run(next(iter(request_subjects)), [request], request.messages,
                                  request_sequences)  # type: ignore[arg-type]
            else:
                self._publish_each(request, request_sequences)
            if tracing:
                tracer.stored(request.messages, request_sequences, now_ms)
        for subject in subjects:
            self._ctx.committed.notify(subject)

    def _publish_run(self, subject: str, batch: list[SendRequest], messages: list[Checked],
                     sequences: list[int]) -> None:
        """``_publish`` of a commit whose messages all went to ``subject`` in one run."""
        # A compact request (every message stored) is answered by its count: no results.
        stored = ([] if (batch[0].compact if len(batch) == 1 else all(map(_compact_of, batch)))
                  else send_results_stored(map(_ids_of, messages)))
        position = 0
        for request in batch:
            count = len(request.messages)
            if request.compact:
                pass
            elif request.slots is None:
                request.results[:] = stored[position:position + count]
            else:
                for slot, result in zip(request.slots, stored[position:position + count]):
                    request.results[slot] = result
            position += count
        payloads = (batch[0].payloads if len(batch) == 1
                    else list(chain.from_iterable(request.payloads for request in batch)))
        # ``_tail_add``, inline (one call fewer a commit): counted for the metrics, then into
        # the tail, as its columns.
        size = sum(map(len, payloads))
        sent = self.sent_by_subject.get(subject)
        if sent is None:
            sent = self.sent_by_subject[subject] = [0, 0]
        sent[0] += len(payloads)
        sent[1] += size
        self._ctx.committed.add(subject, sequences[0], payloads, map(_tags_of, messages),
                                map(_expiries_of, messages), size)

    def _publish_each(self, request: SendRequest, sequences: list[int | None]) -> None:
        """``_publish`` of a request with duplicates or several subjects, message by message."""
        request.compact = False  # not all stored in one run: a result per message
        stored: dict[str, Run] = {}
        results = request.results
        slots = request.slots if request.slots is not None else range(len(results))
        for slot, message, payload, sequence in zip(slots, request.messages, request.payloads,
                                                    sequences):
            if sequence is None:
                results[slot] = send_result_ok(message.id, duplicate=True)
                continue
            results[slot] = send_result_ok(message.id)
            subject = message.subject
            run = stored.get(subject)
            if run is None or run[0] + len(run[1]) != sequence:
                if run is not None:  # not contiguous (never expected): keep the later run
                    self._tail_add(subject, run)
                run = stored[subject] = (sequence, [], [], [], [0])
            run[1].append(payload)
            run[2].append(message.tags)  # type: ignore[attr-defined]
            run[3].append(message.expire_at_ms)  # type: ignore[attr-defined]
            run[4][0] += len(payload)
        for subject, run in stored.items():
            self._tail_add(subject, run)

    def _tail_add(self, subject: str, run: Run) -> None:
        """Count a stored run for the metrics and put it into the tail."""
        first, payloads, tags, expiries, size = run
        sent = self.sent_by_subject.get(subject)
        if sent is None:
            sent = self.sent_by_subject[subject] = [0, 0]
        sent[0] += len(payloads)
        sent[1] += size[0]
        self._ctx.committed.add(subject, first, payloads, tags, expiries, size[0])


__all__ = ["DELIVER_AT_SKEW_MS_MAX", "SendRequest", "Sends"]
