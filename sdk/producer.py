"""The asyncio Producer: validated, batched, retried sends to the subject's realtime brokers.

Path of one ``send``:

1. The message is built and checked with ``wire.message.validate_message`` before anything is
   queued, so a bad message raises at once without a round trip.
2. It joins the open batch of its subject. A batch leaves after the current event-loop turn when
   fewer than ``linger_in_flight_min`` batches of its subject are on the wire (so a lone message,
   or a low-rate sender's, does not wait); otherwise it lingers up to ``linger_ms`` for more
   messages and leaves at the latest when a batch on the wire is answered. It leaves at once
   when it holds ``batch_size_max`` messages (or would pass the frame limit). ``send_many``
   puts many messages into batches in one go.
   Overlap (opt-in, ``split_sends_min``): with many ``send`` calls waiting at once (at the peak
   since the producer was last idle, at least 2 * split_sends_min), a batch leaves as soon as it
   holds half that peak, and the rest of those senders form the next batch meanwhile. So two
   batches are on the wire, the client building and settling one while the broker stores the
   other, instead of one batch of every sender and the two sides waiting on each other in turn.
   Off by default: each fsync then covers half the sends and both sides' CPU per send rose
   ~60-70% (twice the per-batch costs), for a median rate of 5,370 against 9,989 sends/s over
   ten runs each (docs/BENCHMARKS.md, "W1 send CPU"), and 8,905 against 10,308 over 14 runs
   each after the C commit encoders ("W1 send: the delay store's commit encoders in C"); it
   can pay only once the per-batch costs fall.
3. At most ``in_flight_max`` batches are on the wire at a time; more wait for a slot.
4. A batch goes to one broker group of the subject's producer route, round robin per batch,
   starting at a random group (``route_start``), so that short-lived producers (the CLI, a
   cron job) spread over the groups as a long-lived one does.
5. A retriable failure (connection lost, no answer in ``send_timeout_ms``, readonly, overloaded,
   internal, not_master) refreshes the route and resends the SAME message ids to the next group,
   after a pause doubled per resend: 3 times whatever the time, and then while
   ``retry_budget_ms`` from the batch's first failure lasts (a master's stall or a failover
   outlasts a few quick resends), or exactly ``retries_max`` times when that is given; the
   broker de-duplicates an id it already stored (status "duplicate").
   A non-retriable error (bad_request, forbidden, too_large, ...) fails the send at once.

Delivery is at least once: a message whose answer was lost may be stored on two groups if the
first group's de-duplication window cannot see the resend (different group). Consumers de-duplicate
by ``message.id`` when that matters.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import threading
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from time import monotonic, time_ns
from typing import Any, Literal, overload

import msgpack

from sdk.connection import CONNECT_TIMEOUT_MS_DEFAULT, ConnectionPool
from wire.clock import wall_clock_ms
from wire.errors import (
    BadRequest,
    ConnectionLost,
    Internal,
    NoRoute,
    QmqError,
    TooLarge,
    type_name,
)
from wire.limits import MAX_BODY_BYTES, MAX_DELAY_MS, MAX_SEND_BATCH_MESSAGES
from wire.message import (
    KEY_BODY,
    KEY_DELIVER_AT_MS,
    KEY_ID,
    Message,
    encode_checked_message,
    encode_message,
    validate_message,
    validate_message_id,
)
from sdk.retry_policy import (
    RETRIES_MIN_DEFAULT,
    RETRY_BACKOFF_MS_DEFAULT,
    RETRY_BUDGET_MS_DEFAULT,
    RetryPolicy,
)
from sdk.routes import Route, RouteCache
from sdk.batching import BatchingMixin, Key
from sdk.cancelling import CancellingMixin
from sdk.send_batch import Batch, Call, Part, Receipt, fail_parts, settle
from sdk.send_values import (
    IdMaker,
    default_client_id,
    deliver_times,
    due_ms,
    duration_ms,
    epoch_ms,
    plain_middle,
    plain_payload,
    spliced_payloads,
)
from wire.tls import TlsOption, client_context

log = logging.getLogger(__name__)

# Subjects a producer remembers as valid (``send``'s plain path); forgotten all at once when
# full, so a producer sending to ever new subjects stays bounded.
PLAIN_SUBJECTS_MAX = 1024

# Batches of a subject on the wire from which a new batch lingers (linger_ms) for more messages
# instead of leaving after its event-loop turn. 1 by default: 8 lowered p50 at 2,000 msg/s by
# 0.26-0.35 ms but raised the server's CPU per message by ~6% (with a sync slave ~20%) with
# 0.15 more send requests per message (docs/BENCHMARKS.md, "Producer linger at low rate").
LINGER_IN_FLIGHT_MIN_DEFAULT = 1



class Producer(BatchingMixin, CancellingMixin):
    """Sends messages to realtime brokers found through the MetaServer at ``meta_url``.
    ``meta_url`` may name several MetaServers ("http://a:8090,http://b:8090" or a list): requests
    go to the one that answered last and fail over to the next.

    Use as ``async with Producer(url) as producer:``; leaving the block flushes pending batches.
    Options (times in milliseconds):

    * ``linger_ms`` (2): longest a batch waits for more messages of its subject while
      ``linger_in_flight_min`` batches of that subject are on the wire (with fewer it leaves
      after the event-loop turn).
    * ``linger_in_flight_min`` (1): batches of a subject on the wire from which a new batch
      lingers; with fewer, a low-rate sender's message does not wait behind the batch on the
      wire. 1 lingers behind any batch on the wire; 8 trades ~0.3 ms of p50 at 2,000 msg/s for
      more send requests (server CPU, LINGER_IN_FLIGHT_MIN_DEFAULT).
      ``in_flight_max`` stays the cap of batches on the wire.
    * ``batch_size_max`` (128): messages per batch; capped at MAX_SEND_BATCH_MESSAGES.
    * ``in_flight_max`` (32): batches on the wire at once.
    * ``split_sends_min`` (0: off): with at least twice this many ``send`` calls waiting at
      their peak, a batch leaves once it holds half the peak, so that the next forms while it
      is on the wire (the overlap, module docstring 2). 8 is the value measured.
    * ``send_timeout_ms`` (5000): wait for one broker answer before trying again.
    * ``retries_max`` (None): a fixed number of resends of a failed batch, made whatever the
      time, and no more (0: one attempt); the retry budget is then not used. None: at least
      RETRIES_MIN_DEFAULT (3) resends, then more while ``retry_budget_ms`` lasts.
    * ``retry_backoff_ms`` (50): pause before the first resend, doubled per resend up to
      RETRY_BACKOFF_MS_MAX.
    * ``retry_budget_ms`` (10000): with ``retries_max`` None, after the RETRIES_MIN_DEFAULT
      resends, resends go on while the next would start within this long of the first
      failure (0: none; RETRY_BUDGET_MS_DEFAULT).
    * ``route_start`` (random): the index (modulo the route's length) of the group that a
      subject's first batch goes to; later batches go round robin from there.

    ``token`` is the app's token: said in every broker hello and sent as Bearer to the
    MetaServer; with auth on, a missing or revoked one fails with Unauthorized and a subject
    outside its produce patterns with Forbidden. ``tls`` (an ``ssl.SSLContext`` or a CA file
    path) makes every broker connection TLS and verifies an https MetaServer with it.
    """

    def __init__(
        self,
        meta_url: str | Sequence[str],
        *,
        app: str = "default",
        token: str | None = None,
        linger_ms: int = 2,
        linger_in_flight_min: int = LINGER_IN_FLIGHT_MIN_DEFAULT,
        batch_size_max: int = 128,
        in_flight_max: int = 32,
        split_sends_min: int = 0,
        send_timeout_ms: int = 5000,
        retries_max: int | None = None,
        retry_backoff_ms: int = RETRY_BACKOFF_MS_DEFAULT,
        retry_budget_ms: int = RETRY_BUDGET_MS_DEFAULT,
        connect_timeout_ms: int = CONNECT_TIMEOUT_MS_DEFAULT,
        client_id: str | None = None,
        routes: RouteCache | None = None,
        delay_routes: RouteCache | None = None,
        clock_ms: Callable[[], int] = wall_clock_ms,
        tls: TlsOption = None,
        route_start: int | None = None,
    ) -> None:
        route_start = random.randrange(1 << 16) if route_start is None else route_start
        for name, value, low in (
            ("linger_ms", linger_ms, 0),
            ("linger_in_flight_min", linger_in_flight_min, 1),
            ("batch_size_max", batch_size_max, 1),
            ("in_flight_max", in_flight_max, 1),
            ("split_sends_min", split_sends_min, 0),
            ("send_timeout_ms", send_timeout_ms, 1),
            ("retries_max", RETRIES_MIN_DEFAULT if retries_max is None else retries_max, 0),
            ("retry_backoff_ms", retry_backoff_ms, 0),
            ("retry_budget_ms", retry_budget_ms, 0),
            ("route_start", route_start, 0),
        ):
            if type(value) is not int or value < low:
                raise ValueError(f"Producer option {name} must be an int >= {low}, got {value!r}")
        self.meta_url = meta_url
        self.app = app
        self.client_id = client_id or default_client_id()
        self.linger_ms = linger_ms
        self.linger_in_flight_min = linger_in_flight_min
        self.batch_size_max = min(batch_size_max, MAX_SEND_BATCH_MESSAGES)
        self.in_flight_max = in_flight_max
        self.split_sends_min = split_sends_min
        self.send_timeout_ms = send_timeout_ms
        # An explicit retries_max is a maximum (as it was before the budget); the budget serves
        # the default only.
        self._retry = RetryPolicy.of_options(retries_max, retry_backoff_ms, retry_budget_ms)
        self.retries_max = self._retry.retries_max
        self.retry_backoff_ms = retry_backoff_ms
        self.retry_budget_ms = self._retry.budget_ms
        self._clock_ms = clock_ms
        ssl_context = client_context(tls)
        self._routes = routes or RouteCache(meta_url, token=token, ssl_context=ssl_context)
        self._delay_routes = delay_routes or RouteCache(meta_url, kind="delay", token=token,
                                                        ssl_context=ssl_context)
        self._pool = ConnectionPool(
            client_id=self.client_id, app=app, token=token, connect_timeout_ms=connect_timeout_ms,
            ssl_context=ssl_context,
        )
        self._open: dict[Key, Batch] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._in_flight: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the event loop of the first send
        self._loop_thread: int | None = None  # the thread it ran in (_bind_loop)
        # (subject, delayed) -> the turn of its next batch; a subject's first batch takes
        # route_start (the group at that index modulo the route's length).
        self._round_robin: dict[Key, int] = {}
        self._route_start = route_start
        self._on_wire: dict[Key, int] = {}  # (subject, delayed) -> batches sent, not yet settled
        # send() calls waiting for their answer, and their peak since none was (event loop
        # only): the overlap's measure of how many senders there are (module docstring 2);
        # counted only with split_sends_min set, the one user.
        self._sends_waiting = 0
        self._sends_waiting_peak = 0
        self._new_id = IdMaker()
        # Subjects a full check passed (event loop only): a plain send to one of them (no tags,
        # properties, expiry or own id) skips building and validating a Message.
        # Each maps to its payloads' constant middle (plain_middle).
        self._plain_subjects: dict[str, bytes] = {}
        self._closing = False
        self._closed = False

    async def __aenter__(self) -> Producer:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def send(
        self,
        subject: str,
        body: bytes,
        *,
        tags: tuple[str, ...] | list[str] = (),
        properties: dict[str, str] | None = None,
        message_id: str | None = None,
        expire_at: datetime | int | None = None,
        delay: timedelta | int | None = None,
        deliver_at: datetime | int | None = None,
    ) -> Receipt:
        """Send one message and return its Receipt once a broker has it.

        ``expire_at``: an aware datetime or epoch ms after which the message is not delivered.
        ``message_id``: your own id (1..128 printable ASCII) to make resends idempotent; a fresh
        one is made otherwise.
        ``delay`` (a timedelta or ms) or ``deliver_at`` (a timezone-aware datetime or epoch ms):
        a delay server holds the message until then (never delivers it earlier); the receipt
        names that delay group and ``deliver_at_ms``, and ``cancel(receipt)`` withdraws it.
        More than MAX_DELAY_MS (2 years) ahead raises DelayOutOfRange; a time in the past is
        delivered at once.
        Raises BadRequest/TooLarge for an invalid message before sending, the broker's error for
        a rejected one, and the last retriable error once the resends are over (``retries_max``,
        then ``retry_budget_ms``).
        """
        if self._closing:
            raise RuntimeError("Producer is closed")
        if delay is not None and deliver_at is not None:
            raise BadRequest("give delay or deliver_at, not both")
        if isinstance(tags, str):
            raise BadRequest(f"tags must be a list of str, got the str {tags!r}")
        # The default clock's value without its Python call (one per send).
        clock_ms = self._clock_ms
        now_ms = time_ns() // 1_000_000 if clock_ms is wall_clock_ms else clock_ms()
        # An int deliver_at is epoch ms as given (due_ms's answer, without its calls).
        deliver_at_ms = (deliver_at if delay is None and type(deliver_at) is int
                         else due_ms(now_ms, delay, deliver_at))
        plain = (not tags and not properties and expire_at is None and message_id is None)
        middle = self._plain_subjects.get(subject) if plain and type(subject) is str else None
        if (middle is not None and type(body) is bytes
                and len(body) <= MAX_BODY_BYTES and type(now_ms) is int and now_ms >= 0
                and (deliver_at_ms is None or (type(deliver_at_ms) is int
                                               and 0 <= deliver_at_ms <= now_ms + MAX_DELAY_MS))):
            # What validate_message would check of such a message: the subject passed it
            # before, the id is ours, and the body, creation and due times were just checked.
            # Anything else takes the full path, which words the error.
            sent_id = self._new_id.next()
            payload = plain_payload(sent_id, subject, middle, body, now_ms, deliver_at_ms)
        else:
            message = Message.create(
                subject,
                body,
                now_ms=now_ms,
                tags=tuple(tags),
                properties=dict(properties or {}),
                deliver_at_ms=deliver_at_ms,
                expire_at_ms=None if expire_at is None else epoch_ms(expire_at, "expire_at"),
                id=self._new_id() if message_id is None else message_id,
            )
            validate_message(message, now_ms=now_ms)  # checks the field types too
            payload = encode_checked_message(message)
            sent_id = message.id
            if plain:
                if len(self._plain_subjects) >= PLAIN_SUBJECTS_MAX:
                    self._plain_subjects.clear()
                self._plain_subjects[subject] = plain_middle(subject)
        # The loop of the first send, kept: asyncio.get_running_loop() is a getpid() system
        # call each time (~0.5 us here). The same thread with that loop running means this
        # send runs on it (a thread runs one loop at a time); anything else is checked, and a
        # send from another loop raises WrongEventLoop before it joins a batch.
        loop = self._loop
        if loop is None or self._loop_thread != threading.get_ident() or not loop.is_running():
            loop = self._bind_loop()
        future = loop.create_future()
        if not self.split_sends_min:  # no overlap: nothing reads the count of waiting sends
            self._enqueue_one(subject, future, sent_id, payload, deliver_at_ms)
            result = await future
        else:
            waiting = self._sends_waiting = self._sends_waiting + 1
            if waiting > self._sends_waiting_peak:
                self._sends_waiting_peak = waiting
            try:
                self._enqueue_one(subject, future, sent_id, payload, deliver_at_ms)
                result = await future
            finally:
                waiting = self._sends_waiting = self._sends_waiting - 1
                if not waiting:
                    self._sends_waiting_peak = 0
        if isinstance(result, BaseException):
            raise result
        return result

    @overload
    async def send_many(
        self, subject: str, bodies: list[bytes] | tuple[bytes, ...], *,
        tags: tuple[str, ...] | list[str] = (), properties: dict[str, str] | None = None,
        expire_at: datetime | int | None = None,
        delay: timedelta | int | Sequence[timedelta | int] | None = None,
        deliver_at: datetime | int | Sequence[datetime | int] | None = None,
        return_exceptions: Literal[False] = False, message_ids: Sequence[str] | None = None,
    ) -> list[Receipt]: ...

    @overload
    async def send_many(
        self, subject: str, bodies: list[bytes] | tuple[bytes, ...], *,
        tags: tuple[str, ...] | list[str] = (), properties: dict[str, str] | None = None,
        expire_at: datetime | int | None = None,
        delay: timedelta | int | Sequence[timedelta | int] | None = None,
        deliver_at: datetime | int | Sequence[datetime | int] | None = None,
        return_exceptions: Literal[True], message_ids: Sequence[str] | None = None,
    ) -> list[Receipt | QmqError]: ...

    async def send_many(
        self,
        subject: str,
        bodies: list[bytes] | tuple[bytes, ...],
        *,
        tags: tuple[str, ...] | list[str] = (),
        properties: dict[str, str] | None = None,
        expire_at: datetime | int | None = None,
        delay: timedelta | int | Sequence[timedelta | int] | None = None,
        deliver_at: datetime | int | Sequence[datetime | int] | None = None,
        return_exceptions: bool = False,
        message_ids: Sequence[str] | None = None,
    ) -> list[Receipt] | list[Receipt | QmqError]:
        """Send one message per body, all to ``subject`` with the same tags, properties and
        expiry, and return their Receipts in order once brokers have them all.

        The fast path for many messages: the messages are validated and encoded in one go and
        go into batches directly, with one future for the whole call instead of one per message.
        Each message gets a fresh id, or its own from ``message_ids`` (one per body, to make a
        later resend idempotent, as the outbox relay does). Batching, routing and retries are
        those of ``send``.
        ``delay`` or ``deliver_at`` (as in ``send``) makes them delayed messages, held by a delay
        server: one value for all, or a list/tuple with one value per body; the receipts carry
        each ``deliver_at_ms`` for ``cancel``.
        A bad body (not bytes, too large), delay (negative, past MAX_DELAY_MS: DelayOutOfRange,
        wrong count) or bad common fields raise before anything is sent.
        If some messages fail, the first failure is raised once all are settled, or with
        ``return_exceptions=True`` each failure takes the place of its Receipt.
        """
        if self._closing:
            raise RuntimeError("Producer is closed")
        if isinstance(tags, str):
            raise BadRequest(f"tags must be a list of str, got the str {tags!r}")
        if not bodies:
            return []
        if message_ids is not None:
            message_ids = list(message_ids)
            if len(message_ids) != len(bodies):
                raise BadRequest(f"message_ids has {len(message_ids)} ids for {len(bodies)} "
                                 "bodies: give one per body")
            for message_id in message_ids:
                validate_message_id(message_id)
        now_ms = self._clock_ms()
        deliver_ats = deliver_times(len(bodies), now_ms, delay, deliver_at)
        template = Message.create(
            subject,
            bodies[0],
            now_ms=now_ms,
            tags=tuple(tags),
            properties=dict(properties or {}),
            deliver_at_ms=None if deliver_ats is None else deliver_ats[0],
            expire_at_ms=None if expire_at is None else epoch_ms(expire_at, "expire_at"),
            id=self._new_id(),
        )
        validate_message(template)
        if set(map(type, bodies)) != {bytes}:  # a C pass; the loop below only when needed
            for body in bodies:
                if not isinstance(body, (bytes, bytearray, memoryview)):
                    raise BadRequest(f"message field body must be bytes, got {type_name(body)}")
            bodies = [bytes(body) for body in bodies]
        if max(map(len, bodies)) > MAX_BODY_BYTES:
            size = max(map(len, bodies))
            raise TooLarge(f"message body of {size} bytes exceeds MAX_BODY_BYTES {MAX_BODY_BYTES}")
        call = Call(len(bodies), self._bind_loop().create_future())
        ids, payloads = self._encode_many(template, bodies, deliver_ats, message_ids)
        self._enqueue(subject, call, ids, payloads, deliver_ats)
        results = await call.future
        if call.failed and not return_exceptions:
            for result in results:
                if isinstance(result, BaseException):
                    raise result
        return results

    def _encode_many(self, template: Message, bodies: list[bytes] | tuple[bytes, ...],
                     deliver_ats: list[int] | None = None,
                     given_ids: list[str] | None = None) -> tuple[list[str], list[bytes]]:
        """Fresh ids (or ``given_ids``), and one payload per body: the template's payload map with its id, body (and
        due time, from ``deliver_ats``) replaced. ``bodies`` are all ``bytes``.

        The payload is a msgpack map whose id, body and due time sit under the keys KEY_ID, KEY_BODY
        and KEY_DELIVER_AT_MS (wire.message); if the template does not encode that way, each message is built
        and encoded on its own instead."""
        ids = self._new_id.many(len(bodies)) if given_ids is None else given_ids
        payload = encode_message(template)
        fields = msgpack.unpackb(payload, raw=False)
        if (fields.get(KEY_ID) != template.id or fields.get(KEY_BODY) != bytes(template.body)
                or fields.get(KEY_DELIVER_AT_MS) != template.deliver_at_ms):
            return ids, [encode_message(Message(
                id=message_id, subject=template.subject, body=body, tags=template.tags,
                properties=template.properties, created_at_ms=template.created_at_ms,
                expire_at_ms=template.expire_at_ms,
                deliver_at_ms=None if deliver_ats is None else deliver_ats[index]))
                for index, (message_id, body) in enumerate(zip(ids, bodies))]
        columns: dict[str, Sequence[Any]] = {KEY_ID: ids, KEY_BODY: bodies}
        if deliver_ats is not None:
            columns[KEY_DELIVER_AT_MS] = deliver_ats
        spliced = spliced_payloads(payload, fields, columns)
        if spliced is not None:
            return ids, spliced
        packb = msgpack.Packer(use_bin_type=True).pack
        payloads: list[bytes] = []
        append = payloads.append
        # One dict reused for every message: only the changing fields are set in it.
        if deliver_ats is None:
            for message_id, body in zip(ids, bodies):
                fields[KEY_ID] = message_id
                fields[KEY_BODY] = body
                append(packb(fields))
            return ids, payloads
        for message_id, body, deliver_at_ms in zip(ids, bodies, deliver_ats):
            fields[KEY_ID] = message_id
            fields[KEY_BODY] = body
            fields[KEY_DELIVER_AT_MS] = deliver_at_ms
            append(packb(fields))
        return ids, payloads

    async def flush(self) -> None:
        """Send every open batch now and wait until all batches in flight are answered."""
        for key in list(self._open):
            self._dispatch(key)
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        """Flush pending batches, then close connections. Sends after close raise."""
        if self._closed:
            return
        self._closing = True
        try:
            await self.flush()
        finally:
            self._closed = True
            await self._pool.close()
            await self._routes.close()
            await self._delay_routes.close()

    # -- sending --------------------------------------------------------------------------------

    async def _send_batch(self, batch: Batch) -> None:
        key = (batch.subject, batch.delayed)
        if self._open.get(key) is batch:  # made as it opened (_open_batch): close it now
            del self._open[key]
        if self._in_flight is None:
            self._in_flight = asyncio.Semaphore(self.in_flight_max)
        try:
            async with self._in_flight:
                try:
                    await self._send_with_retries(batch)
                except BaseException as exc:  # our bug or cancellation: fail its senders
                    error = (exc if isinstance(exc, QmqError)
                             else Internal(f"send failed: {exc!r}"))
                    fail_parts(batch.all_parts(), error)
                    if not isinstance(exc, QmqError):
                        raise
        finally:
            # Off the wire in the step that settled it, before its senders resume: a batch
            # they open then leaves after its loop turn rather than lingering on a timer
            # until the task's done callback (_left_wire).
            self._left_wire(key, batch)

    async def _send_with_retries(self, batch: Batch) -> None:
        subject = batch.subject
        # None until the batch is first needed as Parts: the usual answer (all stored, compact)
        # settles it as formed (Batch.settle_stored).
        pending: list[Part] | None = None
        messages = batch.payloads()
        key = (subject, batch.delayed)
        routes = self._delay_routes if batch.delayed else self._routes
        turn = self._round_robin.get(key, self._route_start)
        self._round_robin[key] = turn + 1
        route: Route | None = None
        attempt = 0
        failed_at: float | None = None  # monotonic(), at the first failure (retry_budget_ms)
        answered = functools.partial(self._answered, key)
        while True:
            try:
                if route is None:
                    route = await (routes.get if attempt == 0 else routes.refresh)(
                        subject, "producer"
                    )
                if not route.groups:
                    raise NoRoute(f"the producer route of {subject!r} has no broker group")
                group = route.groups[(turn + attempt) % len(route.groups)]
                address = group.addresses[(attempt // len(route.groups)) % len(group.addresses)]
                # compact: a broker that stored every message answers with their count, not a
                # result each (one that does not know the field answers with results).
                answer = await self._pool.request(
                    address,
                    {"op": "send", "messages": messages, "compact": True},
                    self.send_timeout_ms, answered,
                )
                if pending is None:
                    if batch.settle_stored(group.group, answer):
                        return
                    pending = batch.all_parts()
                pending, error = settle(subject, group.group, pending, answer)
                if pending:
                    messages = [payload for part in pending for payload in part.payloads]
            except QmqError as exc:
                if pending is None:
                    pending = batch.all_parts()
                if not exc.retriable:
                    fail_parts(pending, exc)
                    return
                error = exc
            if not pending:
                return
            attempt += 1
            failed_at = monotonic() if failed_at is None else failed_at
            pause_ms = self._retry.pause_ms(attempt, (monotonic() - failed_at) * 1000)
            if pause_ms is None:
                if batch.delayed and isinstance(error, ConnectionLost):
                    # "cannot connect to 127.0.0.1:20801" does not say what is missing.
                    error = ConnectionLost(f"delayed send of {subject!r} failed: no delay server "
                                           f"reachable ({error.message})")
                fail_parts(pending, error)
                return
            log.warning(
                "send of %d message(s) to %r failed (%s: %s); resending the same ids, attempt %d%s",
                len(messages), subject, error.code, error.message, attempt + 1,
                self._retry.attempts_said(),
            )
            route = None
            if pause_ms:
                await asyncio.sleep(pause_ms / 1000)


__all__ = [
    "Producer",
    "RETRIES_MIN_DEFAULT",
    "RETRY_BUDGET_MS_DEFAULT",
    "Receipt",
    "default_client_id",
    "due_ms",
    "duration_ms",
    "epoch_ms",
]
