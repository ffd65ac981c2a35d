"""The asyncio Consumer: long-poll pulls from every broker group of a subject, batched acks.

Shape of a running consumer (one per process and group is typical):

* per subscribed subject, one **route task** keeps the consumer route fresh (every
  ``route_refresh_ms``, and at once when a pull fails) and starts one **pull loop** per broker
  group in the route. A group that leaves the route has its loop stopped.
* a pull loop long-polls its broker (``wait_ms``) and puts what it gets into the subscription's
  bounded prefetch queue (``prefetch`` messages); it asks for at most what fits and waits
  while less than half a batch fits, so a slow application is not handed more than it can
  hold. Connection loss -> reconnect with
  exponential backoff (100 ms doubling to ``reconnect_backoff_max_ms``).
* acks are out of order: ``msg.ack()`` only records the pull sequence; an **ack task** turns
  the recorded sequences of each (broker, subject) into [first, last] ranges and sends them every
  ``ack_interval_ms`` (20) or as soon as ``ack_pending_max`` (1024) are waiting. One slow message
  never holds back the acks of the others, nor the iterator.
* a **heartbeat task** tells every broker we pull from (op heartbeat) and the MetaServer
  (``/api/clients/heartbeat``) that this consumer is alive, every ``heartbeat_interval_ms``.

Delivery is at least once. A message not acked within the group's ack timeout (60 s by default,
on the broker) is handed out again. ``close()`` ends with op leave to every broker: what the
consumer still holds (prefetched and never handed to the application, or not acked) goes to the
group's other consumers at once; a consumer that dies without closing loses it to them after
the broker's consumer expiry (30 s).

Retries (DESIGN.md 8): ``msg.nack()`` hands the message back; the broker re-publishes a copy with
``retries + 1`` through a delay server to ``%retry%<subject>%<group>`` on the group's backoff
schedule (or after ``retry_after``), and after the last retry to ``%dead%<subject>%<group>``. A
subscription also pulls its group's retry subject (from its earliest message, since it belongs to
this group alone), so retries come back through the same iterator or handler with
``msg.subject`` the user subject and ``msg.retries`` counting. A handler that raises is nacked.
A non-broadcast subscription only: broadcast groups have no retries.

Parts of ``Consumer`` live in mixins: its handlers in ``sdk.consumer_handlers``, its heartbeats
and leave to the brokers in ``sdk.consumer_presence``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from collections.abc import Callable, Sequence
from typing import Any, Literal

from sdk.acks import ACK_ATTEMPTS_MAX, AckBatcher, seqs_to_ranges
from sdk.connection import CONNECT_TIMEOUT_MS_DEFAULT, ConnectionPool
from sdk.consumer_handlers import HandlerMixin, HandlerT, _HandlerSpec
from sdk.consumer_presence import CONTROL_TIMEOUT_MS, BrokerPresenceMixin
from sdk.presence import Presence
from sdk.pulling import PullLoop
from sdk.send_values import default_client_id
from sdk.received import PullSize, ReceivedMessage, Subscription, _PulledBatch
from sdk.routes import Route, RouteCache
from sdk.threaded import ThreadedHandlers
from wire.errors import NoRoute, QmqError
from wire.limits import MAX_PULL_BATCH_MESSAGES, MAX_PULL_WAIT_MS
from wire.message import (
    decode_message_fields,
    retry_subject,
    validate_group,
    validate_subject,
    validate_tags,
)
from wire.protocol import pull_columns
from wire.http import parse_meta_urls
from wire.tls import TlsOption, client_context

log = logging.getLogger(__name__)

# Long-poll wait of one pull, in ms. An idle consumer costs the broker its polls per second
# (issue 19): a poll parked on the broker keeps the consumer present however long it waits, and
# an answer comes as soon as anything arrives, so a longer wait costs no latency; it only
# bounds how soon a silently dead broker is noticed (wait + sdk.pulling.PULL_TIMEOUT_SLACK_MS). RocketMQ
# parks pulls for 15 s.
PULL_WAIT_MS_DEFAULT = 20_000
# First reconnect pause after a failed pull, doubled per failure, in milliseconds.
RECONNECT_BACKOFF_MS_INITIAL = 100
# Messages asked for per pull (Kafka's max.poll.records is 500, RocketMQ pulls 32 but keeps up
# to 1000 per queue): large enough that the per-request cost of a pull on the broker and here
# is shared by many messages at high rates, while at low rates a long poll still answers with
# the first message that arrives, so latency does not depend on it.
PULL_BATCH_DEFAULT = 256
# Acks waiting before they are sent without waiting for ack_interval_ms: at high rates acks go
# as one request of a few ranges per this many messages; at low rates every ack_interval_ms.
ACK_PENDING_MAX_DEFAULT = 1024

class Consumer(HandlerMixin, BrokerPresenceMixin):
    """Consumes subjects for consumer ``group`` via the MetaServer at ``meta_url``.
    ``meta_url`` may name several MetaServers ("http://a:8090,http://b:8090" or a list): requests
    go to the one that answered last and fail over to the next.

    Options (times in milliseconds): ``pull_batch`` (256) messages asked for per pull at rest,
    ``pull_batch_max`` (1024) most a pull grows to while pulls come back full (``PullSize``;
    ``pull_batch_max=pull_batch`` keeps pulls fixed), ``prefetch`` most messages pulled and
    not yet handed to the application per subscription (not given: ``pull_batch`` at rest,
    two pulls' worth while pulls are grown), ``wait_ms`` (20000) long-poll wait (a retry subject's: 3 times it, at
    most 60000), ``heartbeat_interval_ms`` (5000),
    ``concurrency`` (16) default handler concurrency, ``broadcast`` (False) every consumer gets
    every message, ``start`` ("latest") where a new group starts, ``ack_interval_ms`` (20) and
    ``ack_pending_max`` (1024) for ack batching, ``route_refresh_ms`` (30000),
    ``close_timeout_ms`` (10000) how long close waits for running handlers,
    ``handler_threads`` (= ``concurrency``) worker threads of the plain-function handlers.

    Why these defaults: a pull and an ack cost the broker about as much per request as a few
    dozen messages do, so at high rates each must carry hundreds of messages (RocketMQ keeps up
    to 1000 per queue prefetched, Kafka polls 500). A long poll answers as soon as anything
    arrives, so at low rates pulls stay small and latency does not grow. ``prefetch`` bounds
    what one consumer holds that others of its group could have taken: a stuck application, or
    a consumer killed with kill -9, keeps at most ``prefetch`` messages (plus those in its
    handlers) from the others until the broker's ack timeout or consumer expiry hands them on.
    A pull asks only for what fits (``min(pull size, free prefetch)``) and is sent once half a
    pull fits. A pull that comes back full doubles the pull size (up to ``pull_batch_max``), one
    less than half full halves it (down to ``pull_batch``): a lone consumer behind a backlog
    drains it in large pulls, while in a group with others waiting the broker cuts each pull to
    its even share of a burst, so those pulls stay at ``pull_batch`` and the burst spreads. (Each of a subscription's pull loops, one per broker group and for the retry
    subject, asks for what fits when it sends its pull; if several answer at once the buffer
    fills and the later answers wait for room, so the bound is ``prefetch`` plus what those
    concurrent pulls brought.) Acks go as pull-sequence ranges every ``ack_interval_ms``, or at once when
    ``ack_pending_max`` wait: one request of a few ranges per thousand messages at high rates.

    ``token`` and ``tls`` work as for the Producer; with auth on, a subject outside the token's
    consume patterns fails its subscription with Forbidden.
    """

    def __init__(
        self,
        meta_url: str | Sequence[str],
        *,
        group: str,
        app: str = "default",
        token: str | None = None,
        consumer_id: str | None = None,
        broadcast: bool = False,
        start: Literal["latest", "earliest"] = "latest",
        pull_batch: int = PULL_BATCH_DEFAULT,
        pull_batch_max: int = MAX_PULL_BATCH_MESSAGES,
        prefetch: int | None = None,
        wait_ms: int = PULL_WAIT_MS_DEFAULT,
        heartbeat_interval_ms: int = 5000,
        concurrency: int = 16,
        ack_interval_ms: int = 20,
        ack_pending_max: int = ACK_PENDING_MAX_DEFAULT,
        route_refresh_ms: int = 30_000,
        reconnect_backoff_max_ms: int = 5_000,
        close_timeout_ms: int = 10_000,
        connect_timeout_ms: int = CONNECT_TIMEOUT_MS_DEFAULT,
        routes: RouteCache | None = None,
        tls: TlsOption = None,
        handler_threads: int | None = None,
    ) -> None:
        validate_group(group)
        handler_threads = concurrency if handler_threads is None else handler_threads
        self._prefetch_given = prefetch
        prefetch = pull_batch if prefetch is None else prefetch
        if start not in ("latest", "earliest"):
            raise ValueError(f"Consumer option start must be 'latest' or 'earliest', got {start!r}")
        for name, value, low, high in (
            ("pull_batch", pull_batch, 1, MAX_PULL_BATCH_MESSAGES),
            ("pull_batch_max", pull_batch_max, pull_batch, MAX_PULL_BATCH_MESSAGES),
            ("prefetch", prefetch, 1, None),
            ("wait_ms", wait_ms, 0, MAX_PULL_WAIT_MS),
            ("heartbeat_interval_ms", heartbeat_interval_ms, 1, None),
            ("concurrency", concurrency, 1, None),
            ("ack_interval_ms", ack_interval_ms, 0, None),
            ("ack_pending_max", ack_pending_max, 1, None),
            ("route_refresh_ms", route_refresh_ms, 1, None),
            ("reconnect_backoff_max_ms", reconnect_backoff_max_ms, 0, None),
            ("close_timeout_ms", close_timeout_ms, 0, None),
            ("handler_threads", handler_threads, 1, None),
        ):
            if type(value) is not int or value < low or (high is not None and value > high):
                bound = f"{low}..{high}" if high is not None else f">= {low}"
                raise ValueError(f"Consumer option {name} must be an int {bound}, got {value!r}")
        self.meta_url = meta_url
        self.group = group
        self.app = app
        self.consumer_id = consumer_id or default_client_id()
        self.broadcast = broadcast
        self.start = start
        self.pull_batch = pull_batch
        self.pull_batch_max = pull_batch_max
        self.prefetch = prefetch
        self.wait_ms = wait_ms
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.concurrency = concurrency
        self.route_refresh_ms = route_refresh_ms
        self.reconnect_backoff_max_ms = reconnect_backoff_max_ms
        self.close_timeout_ms = close_timeout_ms
        ssl_context = client_context(tls)
        # Consumers of one loop with the same MetaServers, token and TLS share their heartbeat
        # to the MetaServer (sdk.presence) and, unless given ``routes``, their route cache
        # (joined at start, on the loop); a caller's context is shared only with itself.
        tls_key = tls if tls is None or isinstance(tls, ssl.SSLContext) else os.fspath(tls)
        self._shared_key = (",".join(parse_meta_urls(meta_url)), token, tls_key)
        self._new_routes: Callable[[], RouteCache] = lambda: RouteCache(
            meta_url, token=token, ssl_context=ssl_context)
        self._routes = routes or self._new_routes()
        self._routes_given = routes is not None
        self._presence: Presence | None = None
        self._pool = ConnectionPool(
            client_id=self.consumer_id, app=app, token=token, connect_timeout_ms=connect_timeout_ms,
            ssl_context=ssl_context,
        )
        self._ack_interval_ms = ack_interval_ms
        self._ack_pending_max = ack_pending_max
        self._acks: AckBatcher | None = None
        self._subscriptions: dict[str, Subscription] = {}
        self._handlers: list[_HandlerSpec] = []
        self._handler_tasks: set[asyncio.Task[None]] = set()
        # Worker threads of the handlers that are plain functions (sdk.threaded).
        self._threads = ThreadedHandlers(handler_threads)
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._started = False
        self._closing = False
        self._closed = asyncio.Event()

    # -- lifecycle ------------------------------------------------------------------------------

    async def __aenter__(self) -> Consumer:
        self._start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _start(self) -> None:
        if self._started:
            return
        if self._closing:
            raise RuntimeError("Consumer is closed")
        self._started = True
        self._acks = AckBatcher(self._control, self._ack_interval_ms, self._ack_pending_max,
                                resolve=self._ack_address)
        self._acks.start()
        if not self._routes_given:
            self._routes = RouteCache.shared(self._shared_key, self._new_routes)
        self._presence = Presence.joined(self._shared_key, self._new_routes,
                                         self.consumer_id, self._heartbeat_fields(),
                                         self.heartbeat_interval_ms)
        self._heartbeat_task = asyncio.get_running_loop().create_task(
            self._heartbeat_loop(), name="qmq-heartbeat"
        )
        for spec in self._handlers:
            self._start_handler(spec)

    async def run(self) -> None:
        """Start (if needed) and serve the registered handlers until ``close()``; closes the
        consumer when it returns or is cancelled."""
        self._start()
        try:
            await self._closed.wait()
        finally:
            await self.close()

    async def close(self) -> None:
        """Graceful close: stop pulling, wait up to ``close_timeout_ms`` for running handlers,
        send pending acks, leave (each broker hands what this consumer still holds, prefetched
        or unacked, to the group's other consumers at once), close connections. Iterators end."""
        if self._closing:
            await self._closed.wait()
            return
        self._closing = True
        try:
            await self._stop_pulling()
            await self._wait_handlers()
            if self._acks is not None:
                await self._acks.close()
            if self._heartbeat_task is not None:
                self._heartbeat_task.cancel()
                await asyncio.gather(self._heartbeat_task, return_exceptions=True)
            await self._leave()
        finally:
            self._threads.shutdown()
            await self._pool.close()
            await self._routes.close()
            self._closed.set()

    async def wait_closed(self) -> None:
        """Return once the consumer has closed."""
        await self._closed.wait()

    async def _stop_pulling(self) -> None:
        tasks: list[asyncio.Task[None]] = []
        for sub in self._subscriptions.values():
            tasks.extend(sub.route_tasks)
            tasks.extend(sub.pull_loops.values())
        tasks.extend(spec.task for spec in self._handlers if spec.task is not None)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for sub in self._subscriptions.values():
            sub._end()

    # -- subscribing ----------------------------------------------------------------------------

    def subscribe(self, subject: str, tags: list[str] | tuple[str, ...] | None = None) -> Subscription:
        """Start consuming ``subject`` (only messages with one of ``tags``, if given) and return
        the async iterator of its messages. One subscription per subject per consumer."""
        validate_subject(subject)
        tag_list = list(tags or [])
        validate_tags(tag_list, what="subscription tag filter")
        if subject in self._subscriptions:
            raise ValueError(f"subject {subject!r} is already subscribed by this consumer")
        self._start()
        sources = [subject] if self.broadcast else [subject, retry_subject(subject, self.group)]
        sub = Subscription(subject, tag_list,
                           PullSize(self.pull_batch, self.pull_batch_max, self._prefetch_given),
                           sources)
        self._subscriptions[subject] = sub
        if self._presence is not None:
            self._presence.update(self.consumer_id, self._heartbeat_fields(),
                                  self.heartbeat_interval_ms)
        loop = asyncio.get_running_loop()
        sub.route_tasks = [loop.create_task(self._route_loop(sub, source),
                                            name=f"qmq-route {source}") for source in sources]
        return sub

    # -- routes and pulls -----------------------------------------------------------------------

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
        await PullLoop(self, sub, source, broker_group).run()

    def _hand_over(self, answer: dict[str, Any], sub: Subscription, batch: _PulledBatch) -> bool:
        """A pull answer as it is read (``PullLoop._answered``, the ``on_answer`` of its
        ``Connection.request_nowait``): its messages into the prefetch buffer now if they all
        fit, so an application waiting on it runs in the next loop turn, before
        ``PullLoop._next`` writes the next pull. False: they do not fit (another of the
        subscription's pull loops filled the buffer meanwhile); the pull loop puts them in,
        waiting for room."""
        payloads = answer.get("payloads")
        prefetch = sub._prefetch
        if not payloads or prefetch.capacity - len(prefetch.items) < len(payloads):
            return False
        prefetch.put_fitting(self._received(answer, sub, batch))
        return True

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

    # -- acks, nacks, heartbeats ----------------------------------------------------------------

    @staticmethod
    def _ack_dropped(msg: ReceivedMessage) -> None:
        log.warning("ack of message %s after the consumer closed is dropped; the broker "
                    "will redeliver it", msg.id)

    async def flush_acks(self) -> None:
        """Send every recorded ack now (close does this too)."""
        if self._acks is not None:
            await self._acks.flush()

    async def _nack(self, msg: ReceivedMessage, retry_after_ms: int | None) -> None:
        await self._control(msg.address, {
            "op": "nack", "subject": msg._batch.ack_key[2], "pull_seqs": [msg.pull_seq],
            "retry_after_ms": retry_after_ms,
        })

    def _ack_address(self, key: tuple[str, str, str]) -> str:
        """Where acks of ``key`` go now: the address they were pulled from, unless the cached
        route names another master for that broker group (a failover: the new master holds a
        copy of the pull log, so the same pull sequences ack there)."""
        address, broker_group, subject = key
        route = self._routes.cached(subject, "consumer")
        group = route.group(broker_group) if route is not None else None
        if group is None or address in group.addresses:
            return address
        return group.addresses[0]

    async def _control(self, address: str, op: dict[str, Any]) -> dict[str, Any]:
        """An ack/nack request for this consumer (group and consumer_id filled in)."""
        op = {**op, "group": self.group, "consumer_id": self.consumer_id}
        return await self._pool.request(address, op, CONTROL_TIMEOUT_MS, None, False)


__all__ = ["ACK_ATTEMPTS_MAX", "Consumer", "HandlerT", "ReceivedMessage", "Subscription",
           "seqs_to_ranges"]
