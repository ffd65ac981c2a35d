"""The pull side of ``sdk.consumer.Consumer`` (``PullLoopsMixin``): per wire subject a route task,
per broker group of its route a pull loop that long-polls the broker and fills the
subscription's prefetch buffer.

A pull loop keeps one pull on the broker at a time. Its pulls ask only for what fits in the
prefetch buffer (``min(pull size, free room)``), counting what earlier pulls of the loop brought
and have not yet put in the buffer, so ``prefetch`` bounds what the consumer holds. When a pull
comes back full (a backlog), the next one is sent at once, before the answer's messages are
decoded and handed over (``_pull_ahead``): the broker prepares it while this process decodes,
instead of the two taking turns. Everything here runs on the consumer's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Coroutine
from typing import TYPE_CHECKING, Any, cast

from sdk.connection import ConnectionPool, RequestTimeout
from sdk.received import ReceivedMessage, Subscription, _PulledBatch
from sdk.routes import Route, RouteCache
from wire.errors import NoRoute, QmqError
from wire.limits import MAX_PULL_WAIT_MS
from wire.message import decode_message_fields
from wire.protocol import pull_columns

if TYPE_CHECKING:
    from sdk.consumer import Consumer

# Logged under the Consumer's name: where an application configures the consumer's logging.
log = logging.getLogger("sdk.consumer")

# Extra time a pull may take beyond its wait_ms before we call the broker silent, in ms.
PULL_TIMEOUT_SLACK_MS = 5_000
# A retry subject's polls wait this many times ``wait_ms`` (at most MAX_PULL_WAIT_MS): it
# carries only the group's retries, and a dead broker is noticed by the subject's own polls.
RETRY_WAIT_FACTOR = 3
# First reconnect pause after a failed pull, doubled per failure, in milliseconds.
RECONNECT_BACKOFF_MS_INITIAL = 100
# A pull sent ahead (Consumer._pull_ahead): its request, what it asked for, where it went.
_PullAhead = tuple["asyncio.Task[dict[str, Any]]", int, str]


def _drop_pull(task: asyncio.Task[dict[str, Any]]) -> None:
    """Forget a pull sent ahead whose loop ended: cancel it, or read its failure so asyncio
    does not log it as never retrieved. What the broker recorded for it goes back to the
    group at the consumer's leave, or after the ack timeout, like any unacked message."""
    if not task.done():
        task.cancel()
    elif not task.cancelled():
        task.exception()


class PullLoopsMixin:
    """Route tasks and pull loops of ``Consumer``, which sets these fields (event loop)."""

    group: str
    consumer_id: str
    broadcast: bool
    start: str
    wait_ms: int
    route_refresh_ms: int
    reconnect_backoff_max_ms: int
    _pool: ConnectionPool
    _routes: RouteCache


    async def _route_loop(self, sub: Subscription, source: str) -> None:
        failures = 0
        route: Route | None = None
        # A periodic refresh takes an answer another consumer of the shared cache got in the
        # last half period (so a subject costs the MetaServer at most two requests a period
        # per process, not one per consumer); one a failed pull asked for goes out at once.
        max_age_ms = 0
        while True:
            try:
                if route is None:
                    route = await self._routes.get(source, "consumer")
                else:
                    route = await self._routes.refresh(source, "consumer", max_age_ms)
                failures = 0
            except NoRoute as exc:
                failures += 1
                log.warning("no consumer route for %r yet: %s", source, exc.message)
            except QmqError as exc:  # the MetaServer rejected the request: surface it
                sub._prefetch.put_nowait(exc)
                return
            if route is not None:
                self._sync_pull_loops(sub, source, route)
            wait_ms = self.route_refresh_ms if failures == 0 else self._backoff_ms(failures)
            sub.refresh_wanted.clear()
            max_age_ms = 0
            try:
                async with asyncio.timeout(wait_ms / 1000):
                    await sub.refresh_wanted.wait()
            except TimeoutError:
                max_age_ms = self.route_refresh_ms // 2 if failures == 0 else 0

    def _sync_pull_loops(self, sub: Subscription, source: str, route: Route) -> None:
        names = {g.group for g in route.groups}
        for (loop_source, name), task in list(sub.pull_loops.items()):
            if loop_source == source and name not in names:
                log.info("broker group %s left the route of %r; stopping its pulls", name, source)
                task.cancel()
                del sub.pull_loops[(source, name)]
                sub.addresses.pop((source, name), None)
        for name in names:
            running = sub.pull_loops.get((source, name))
            if running is None or running.done():
                sub.pull_loops[(source, name)] = asyncio.get_running_loop().create_task(
                    self._pull_loop(sub, source, name), name=f"qmq-pull {source}@{name}"
                )

    def _backoff_ms(self, failures: int) -> int:
        return min(RECONNECT_BACKOFF_MS_INITIAL << min(failures - 1, 20), self.reconnect_backoff_max_ms)

    async def _pull_loop(self, sub: Subscription, source: str, broker_group: str) -> None:
        failures = 0
        # A retry subject carries only this group's retries: read it from its start.
        start = self.start if source == sub.subject else "earliest"
        wait_ms = self.wait_ms if source == sub.subject else min(
            MAX_PULL_WAIT_MS, RETRY_WAIT_FACTOR * self.wait_ms)
        prefetch = sub._prefetch
        # The next pull, sent before the last answer was handed over (see _pull_ahead).
        ahead: _PullAhead | None = None
        try:
            while True:
                if ahead is None:
                    address = self._pull_address(sub, source, broker_group, failures)
                    if address is None:
                        return
                    # Pull only what fits in the prefetch buffer, so a consumer never holds
                    # more than ``prefetch`` messages it has not handed to the application
                    # (others of the group get the rest); wait for room for half a batch
                    # rather than pull a few at a time.
                    if prefetch.capacity - len(prefetch.items) < prefetch.refill_min:
                        await prefetch.wait_room()
                    asked = min(sub.pull_size.size, prefetch.capacity - len(prefetch.items))
                    pulling: Awaitable[dict[str, Any]] = self._send_pull(
                        sub, source, broker_group, address, asked, wait_ms, start)
                else:
                    pulling, asked, address = ahead
                    ahead = None
                try:
                    answer = await pulling
                except QmqError as exc:
                    sub.pull_sent_at.pop((source, broker_group), None)
                    if not exc.retriable:
                        # Raised by the iterator (or logged once by a handler's dispatch
                        # loop), so only a debug line here: a refusal is reported once.
                        log.debug("pull of %r from broker group %s refused (%s: %s); stopping "
                                  "it", source, broker_group, exc.code, exc.message)
                        sub._prefetch.put_nowait(exc)
                        # Refused: no heartbeat or leave for it either (each would be refused).
                        sub.addresses.pop((source, broker_group), None)
                        return
                    failures += 1
                    if isinstance(exc, RequestTimeout):
                        # Silent past wait_ms plus slack: the connection is likely half-dead.
                        await self._pool.discard(address)
                    backoff_ms = self._backoff_ms(failures)
                    log.warning("pull of %r from broker group %s at %s failed (%s); retrying in "
                                "%d ms", source, broker_group, address, exc, backoff_ms)
                    sub.refresh_wanted.set()
                    await asyncio.sleep(backoff_ms / 1000)
                    continue
                finally:
                    sub.pulls_out.discard((source, broker_group))
                failures = 0
                payloads = answer.get("payloads")
                got = len(payloads) if payloads else 0
                sub.pulled(asked, got)
                if not got:
                    continue
                if got >= asked:
                    ahead = self._pull_ahead(sub, source, broker_group, got, wait_ms, start)
                    if ahead is not None:
                        await asyncio.sleep(0)  # its request leaves before the decode below
                batch = _PulledBatch(cast("Consumer", self), broker_group, address,
                                     (address, broker_group, source))
                await prefetch.put_all(self._received(answer, sub, batch))
        finally:
            if ahead is not None:
                _drop_pull(ahead[0])

    def _pull_address(self, sub: Subscription, source: str, broker_group: str,
                      failures: int) -> str | None:
        """The address the next pull of ``broker_group`` goes to (noted for heartbeats and
        leave), or None once the group has left the route."""
        route = self._routes.cached(source, "consumer")
        group = route.group(broker_group) if route is not None else None
        if group is None:
            sub.addresses.pop((source, broker_group), None)
            return None
        address = group.addresses[failures % len(group.addresses)]
        sub.addresses[(source, broker_group)] = address
        return address

    def _send_pull(self, sub: Subscription, source: str, broker_group: str, address: str,
                   asked: int, wait_ms: int, start: str,
                   ) -> Coroutine[Any, Any, dict[str, Any]]:
        """The pull request for up to ``asked`` messages (not yet awaited)."""
        op = {
            "op": "pull", "subject": source, "group": self.group,
            "consumer_id": self.consumer_id, "max_count": asked,
            "wait_ms": wait_ms, "tags": sub.tags, "start": start,
            "broadcast": self.broadcast,
        }
        sub.pull_sent_at[(source, broker_group)] = asyncio.get_running_loop().time()
        sub.pulls_out.add((source, broker_group))
        return self._pool.request(address, op, wait_ms + PULL_TIMEOUT_SLACK_MS)

    def _pull_ahead(self, sub: Subscription, source: str, broker_group: str, got: int,
                    wait_ms: int, start: str) -> _PullAhead | None:
        """After a pull came back full (``got`` messages, a backlog), send the next one at once,
        before this answer's messages are decoded and handed over: the broker prepares it
        while this process decodes. It asks only for what fits once the ``got`` are in the
        buffer, so ``prefetch`` still bounds what the consumer holds; one pull of a loop is on
        the broker at a time (the previous one has answered), so the broker's burst share
        between the consumers of a group is unchanged."""
        prefetch = sub._prefetch
        room = prefetch.capacity - len(prefetch.items) - got
        if room < prefetch.refill_min:
            return None
        address = self._pull_address(sub, source, broker_group, 0)
        if address is None:
            return None
        asked = min(sub.pull_size.size, room)
        task = asyncio.get_running_loop().create_task(
            self._send_pull(sub, source, broker_group, address, asked, wait_ms, start),
            name=f"qmq-pull-ahead {source}@{broker_group}")
        return task, asked, address

    @staticmethod
    def _received(answer: dict[str, Any], sub: Subscription, batch: _PulledBatch,
                  ) -> list[ReceivedMessage]:
        """The messages of a pull response, in order. What cannot be read (a broker bug or
        corruption) is logged and left unacked, so it is redelivered, not lost."""
        try:
            pull_seqs, payloads, redelivered = pull_columns(answer)
        except QmqError as exc:
            log.error("broker group %s answered a pull of %r with unreadable columns: %s",
                      batch.broker_group, sub.subject, exc.message)
            return []
        out: list[ReceivedMessage] = []
        append = out.append
        for pull_seq, payload, times in zip(pull_seqs, payloads, redelivered):
            try:
                fields = decode_message_fields(payload)
            except QmqError as exc:
                log.error("broker group %s sent an unreadable message of %r (pull seq %d): %s",
                          batch.broker_group, sub.subject, pull_seq, exc.message)
                continue
            append(ReceivedMessage(fields, pull_seq, times, batch))
        return out


__all__ = ["PULL_TIMEOUT_SLACK_MS", "RECONNECT_BACKOFF_MS_INITIAL", "RETRY_WAIT_FACTOR",
           "PullLoopsMixin"]
