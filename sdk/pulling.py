"""A Consumer's pull loop for one (wire subject, broker group): long polls, one at a time.

The steady state costs no task step per pull: a pull goes out with
``Connection.request_nowait``; its answer, as it is read, hands the messages to the
subscription's prefetch buffer (``Consumer._hand_over``, so a waiting application runs in the
next loop turn) and schedules ``_next``, which runs in that turn after the application's step
and writes the next pull. The loop's task (``run``) sleeps through all of that. It wakes only
when a pull cannot simply follow: an error (backoff, reconnect, a refusal), no room for half a
pull in the buffer, an answer whose messages do not fit, a new route (the master may have
moved), a success after a failure (pulls go back to the group's first address). With a
handler, the next pull waits one more turn, for the handler's task. Cancelling the task
(close, the group left the route) forgets the pull that is out, so a late answer is dropped.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from sdk.connection import Connection, RequestTimeout
from sdk.received import Subscription, _PulledBatch
from sdk.routes import Route
from wire.errors import QmqError
from wire.limits import MAX_PULL_WAIT_MS

if TYPE_CHECKING:
    from sdk.consumer import Consumer

log = logging.getLogger(__name__)

# Extra time a pull may take beyond its wait_ms before we call the broker silent, in ms.
PULL_TIMEOUT_SLACK_MS = 5_000
# A retry subject's polls wait this many times ``wait_ms`` (at most MAX_PULL_WAIT_MS): it
# carries only the group's retries, and a dead broker is noticed by the subject's own polls.
RETRY_WAIT_FACTOR = 3


class PullLoop:
    """The pulls of one subscription source from one broker group (``Consumer._pull_loop``
    runs ``run`` as its task)."""

    def __init__(self, consumer: Consumer, sub: Subscription, source: str,
                 broker_group: str) -> None:
        self._consumer = consumer
        self._sub = sub
        self._source = source
        self._broker_group = broker_group
        self._key = (source, broker_group)
        self._loop = asyncio.get_running_loop()
        # A retry subject carries only this group's retries: read it from its start.
        self._start = consumer.start if source == sub.subject else "earliest"
        self._wait_ms = consumer.wait_ms if source == sub.subject else min(
            MAX_PULL_WAIT_MS, RETRY_WAIT_FACTOR * consumer.wait_ms)
        self._failures = 0
        self._address = ""
        self._conn: Connection | None = None
        self._route: Route | None = None  # the route _address was chosen from (_route_address)
        self._batch: _PulledBatch | None = None  # what the pulls from one address share
        self._rid: int | None = None  # the pull out now
        self._asked = 0
        self._got = 0
        # What run() waits for: set when a pull cannot simply follow the last (None: go on;
        # an answer: its messages did not fit; an exception: the pull failed).
        self._wake: asyncio.Future[dict[str, Any] | None] | None = None

    async def run(self) -> None:
        """Pull until the route drops the group, a pull is refused, or the task is cancelled."""
        sub, consumer = self._sub, self._consumer
        prefetch = sub._prefetch
        while True:
            address = self._route_address()
            if address is None:
                sub.addresses.pop(self._key, None)
                return
            # Pull only what fits in the prefetch buffer, so a consumer never holds more than
            # ``prefetch`` messages it has not handed to the application (others of the group
            # get the rest); wait for room for half a batch rather than pull a few at a time.
            if prefetch.capacity - len(prefetch.items) < prefetch.refill_min:
                await prefetch.wait_room()
            wake = self._wake = self._loop.create_future()
            try:
                self._send(await consumer._pool.get(address), address)
                answer = await wake
            except QmqError as exc:
                sub.pull_sent_at.pop(self._key, None)
                if not exc.retriable:
                    # Raised by the iterator (or logged once by a handler's dispatch loop), so
                    # only a debug line here: a refusal is reported once.
                    log.debug("pull of %r from broker group %s refused (%s: %s); stopping it",
                              self._source, self._broker_group, exc.code, exc.message)
                    prefetch.put_nowait(exc)
                    # Refused: no heartbeat or leave for it either (each would be refused too).
                    sub.addresses.pop(self._key, None)
                    return
                await self._back_off(exc, address)
                continue
            finally:
                self._wake = None
                if self._rid is not None and self._conn is not None:
                    self._conn.forget(self._rid)  # cancelled: a late answer is dropped
                self._rid = None
                sub.pulls_out.discard(self._key)
            if answer is not None:  # its messages did not fit: wait for room for them
                assert self._batch is not None  # set by _send
                await prefetch.put_all(consumer._received(answer, sub, self._batch))

    def _route_address(self) -> str | None:
        """The address to pull from now (None: the group left the route)."""
        route = self._consumer._routes.cached(self._source, "consumer")
        group = route.group(self._broker_group) if route is not None else None
        if group is None:
            return None
        address = group.addresses[self._failures % len(group.addresses)]
        self._sub.addresses[self._key] = address
        # _next pulls from the same address while the route is this one and no pull failed
        # (after a failure the address is its group's next, and after a success its first).
        self._route = route if self._failures == 0 else None
        return address

    def _send(self, conn: Connection, address: str) -> None:
        """Write a pull for what fits in the buffer (raises what ``request_nowait`` does)."""
        sub = self._sub
        prefetch = sub._prefetch
        self._asked = min(sub.pull_size.size, prefetch.capacity - len(prefetch.items))
        consumer = self._consumer
        op = {
            "op": "pull", "subject": self._source, "group": consumer.group,
            "consumer_id": consumer.consumer_id, "max_count": self._asked,
            "wait_ms": self._wait_ms, "tags": sub.tags, "start": self._start,
            "broadcast": consumer.broadcast,
        }
        if self._batch is None or self._batch.address != address:
            self._batch = _PulledBatch(consumer, self._broker_group, address,
                                       (address, self._broker_group, self._source))
        sub.pull_sent_at[self._key] = self._loop.time()
        sub.pulls_out.add(self._key)
        self._conn, self._address = conn, address
        self._rid = conn.request_nowait(op, self._wait_ms + PULL_TIMEOUT_SLACK_MS,
                                        self._answered, self._failed)

    def _answered(self, answer: dict[str, Any]) -> None:
        """The pull's answer as it is read: its messages to the buffer if they all fit (a
        waiting application runs in the next turn), then the next pull from ``_next``, which
        runs after that application's step."""
        self._rid = None
        self._sub.pulls_out.discard(self._key)
        self._failures = 0
        payloads = answer.get("payloads")
        self._got = len(payloads) if payloads else 0
        assert self._batch is not None  # set by _send
        if payloads and not self._consumer._hand_over(answer, self._sub, self._batch):
            self._sub.pulled(self._asked, self._got)
            wake = self._wake
            if wake is not None and not wake.done():
                wake.set_result(answer)
            return
        self._loop.call_soon(self._next)

    def _failed(self, exc: BaseException) -> None:
        """The pull failed: ``run`` handles it (backoff, reconnect, refusal)."""
        self._rid = None
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_exception(exc)

    def _next(self, handler_turn: bool = False) -> None:
        """After the answer's turn: note it, then write the next pull unless ``run`` must see
        to something first."""
        wake = self._wake
        if wake is None or wake.done():
            return  # the task was cancelled or stopped meanwhile
        sub = self._sub
        if not handler_turn:
            sub.pulled(self._asked, self._got)
            if self._got and sub.handler_driven:
                # A handler's dispatch loop took the first message in this turn and made its
                # handler task: let that run before the next pull is written.
                self._loop.call_soon(self._next, True)
                return
        prefetch = sub._prefetch
        conn = self._conn
        if (prefetch.capacity - len(prefetch.items) < prefetch.refill_min
                or conn is None or conn._close_error is not None
                or self._consumer._routes.cached(self._source, "consumer") is not self._route):
            wake.set_result(None)
            return
        try:
            self._send(conn, self._address)
        except Exception as exc:  # noqa: BLE001 - run() raises it, as a failed request
            wake.set_exception(exc)

    async def _back_off(self, exc: QmqError, address: str) -> None:
        """After a retriable failure: pause (doubling per failure), asking for a fresh route."""
        self._failures += 1
        consumer, sub = self._consumer, self._sub
        if isinstance(exc, RequestTimeout):
            # Silent past wait_ms plus slack: the connection is likely half-dead.
            await consumer._pool.discard(address)
        backoff_ms = consumer._backoff_ms(self._failures)
        log.warning("pull of %r from broker group %s at %s failed (%s); retrying in %d ms",
                    self._source, self._broker_group, address, exc, backoff_ms)
        sub.refresh_wanted.set()
        await asyncio.sleep(backoff_ms / 1000)
