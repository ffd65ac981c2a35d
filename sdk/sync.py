"""The blocking SDK (``qmq.sync``): Producer and Consumer for Django, Flask and scripts.

    producer = qmq.sync.Producer("http://127.0.0.1:8090")
    receipt = producer.send("order.timeout", b"42", delay=timedelta(minutes=30))
    producer.cancel(receipt)

    consumer = qmq.sync.Consumer("http://127.0.0.1:8090", group="billing")

    @consumer.handler("order.created")
    def on_order(msg):            # a plain function, in a worker thread: returns -> ack
        bill(msg.body)

    consumer.run()                # blocks; or consumer.start() and go on

Each sync client runs its asyncio twin (``qmq.Producer``, ``qmq.Consumer``) on an event loop of
its own, in a daemon thread (``qmq-sync-...``); every method hands a coroutine to that loop and
waits for its answer. So one client may be shared by every thread of a web process: concurrent
``send`` calls from request threads meet on the loop and travel in the same batches. Make the
clients after a server forks its workers (gunicorn's ``post_fork``, uWSGI's ``lazy-apps``): a
thread does not survive a fork. A client not closed is flushed and closed when the interpreter
exits.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import threading
import weakref
from collections.abc import Callable, Coroutine, Iterator, Sequence
from datetime import datetime, timedelta
from typing import Any, Literal, TypeVar, overload

from sdk.consumer import Consumer as AsyncConsumer
from sdk.consumer import Subscription as AsyncSubscription
from sdk.consumer_handlers import HandlerT
from sdk.producer import Producer as AsyncProducer
from sdk.send_batch import Receipt
from sdk.threaded import BlockingMessage, run_on_loop
from wire.errors import QmqError

T = TypeVar("T")

# Longest wait for a client's loop thread to stop after close, in seconds.
THREAD_JOIN_TIMEOUT_S = 30.0

_names = itertools.count(1)
_open_clients: weakref.WeakSet[_LoopClient] = weakref.WeakSet()


class _LoopClient:
    """An event loop in a daemon thread of its own, and the blocking calls into it.

    Threads: the loop thread owns the loop and every asyncio object made on it; other threads
    only submit coroutines (``_call``) and wait for them."""

    def __init__(self, kind: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name=f"qmq-sync-{kind}-{next(_names)}",
                                        daemon=True)
        self._thread.start()
        _open_clients.add(self)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for its result (its exception is raised here)."""
        if self._closed:
            coro.close()
            raise RuntimeError(f"{type(self).__name__} is closed")
        return run_on_loop(self._loop, coro, timeout_s=None)

    def _make(self, factory: Callable[[], T]) -> T:
        """Build an asyncio object on the loop thread (so it belongs to that loop)."""
        async def build() -> T:
            return factory()

        return self._call(build())

    def _stop(self) -> None:
        """Stop the loop and wait for its thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        _open_clients.discard(self)
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not threading.current_thread():
            self._thread.join(THREAD_JOIN_TIMEOUT_S)

    def close(self) -> None:
        """Close the client (subclasses close their async twin first)."""
        self._stop()


@atexit.register
def _close_open_clients() -> None:
    """At interpreter exit, close (so flush) every sync client the program did not close."""
    for client in list(_open_clients):
        try:
            client.close()
        except Exception:  # exiting anyway: one failed close must not keep the others open
            pass


class Producer(_LoopClient):
    """The blocking ``qmq.Producer``: the same options (``app``, ``token``, ``linger_ms``,
    ``linger_in_flight_min``, ``batch_size_max``, ``in_flight_max``, ``send_timeout_ms``,
    ``retries_max``, ``tls``, ...) and methods, which return once the async producer's would
    have. Thread-safe."""

    def __init__(self, meta_url: str | Sequence[str], **options: Any) -> None:
        super().__init__("producer")
        try:
            self._producer = self._make(lambda: AsyncProducer(meta_url, **options))
        except BaseException:
            self._stop()
            raise

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def send(self, subject: str, body: bytes, *, tags: Sequence[str] = (),
             properties: dict[str, str] | None = None, message_id: str | None = None,
             expire_at: datetime | int | None = None, delay: timedelta | int | None = None,
             deliver_at: datetime | int | None = None) -> Receipt:
        """Send one message and return its Receipt once a broker has it (``qmq.Producer.send``)."""
        return self._call(self._producer.send(
            subject, body, tags=list(tags), properties=properties, message_id=message_id,
            expire_at=expire_at, delay=delay, deliver_at=deliver_at))

    @overload
    def send_many(self, subject: str, bodies: Sequence[bytes], *, tags: Sequence[str] = (),
                  properties: dict[str, str] | None = None,
                  expire_at: datetime | int | None = None,
                  delay: timedelta | int | Sequence[timedelta | int] | None = None,
                  deliver_at: datetime | int | Sequence[datetime | int] | None = None,
                  return_exceptions: Literal[False] = False,
                  message_ids: Sequence[str] | None = None) -> list[Receipt]: ...

    @overload
    def send_many(self, subject: str, bodies: Sequence[bytes], *, tags: Sequence[str] = (),
                  properties: dict[str, str] | None = None,
                  expire_at: datetime | int | None = None,
                  delay: timedelta | int | Sequence[timedelta | int] | None = None,
                  deliver_at: datetime | int | Sequence[datetime | int] | None = None,
                  return_exceptions: Literal[True],
                  message_ids: Sequence[str] | None = None) -> list[Receipt | QmqError]: ...

    def send_many(self, subject: str, bodies: Sequence[bytes], *, tags: Sequence[str] = (),
                  properties: dict[str, str] | None = None,
                  expire_at: datetime | int | None = None,
                  delay: timedelta | int | Sequence[timedelta | int] | None = None,
                  deliver_at: datetime | int | Sequence[datetime | int] | None = None,
                  return_exceptions: bool = False,
                  message_ids: Sequence[str] | None = None,
                  ) -> list[Receipt] | list[Receipt | QmqError]:
        """One message per body, receipts in order (``qmq.Producer.send_many``)."""
        many = self._producer.send_many(
            subject, list(bodies), tags=list(tags), properties=properties, expire_at=expire_at,
            delay=delay, deliver_at=deliver_at, return_exceptions=True, message_ids=message_ids)
        results = self._call(many)
        if not return_exceptions:
            for result in results:
                if isinstance(result, QmqError):
                    raise result
        return results

    def cancel(self, receipt: Receipt) -> str:
        """Cancel a delayed message by its receipt; its status (``qmq.Producer.cancel``)."""
        return self._call(self._producer.cancel(receipt))

    def flush(self) -> None:
        """Send open batches now and wait for everything in flight."""
        self._call(self._producer.flush())

    def close(self) -> None:
        """Flush, close connections and stop the loop thread (idempotent)."""
        if not self._closed:
            try:
                self._call(self._producer.close())
            finally:
                self._stop()


class Subscription:
    """The blocking iterator of one subscribed subject: yields ``BlockingMessage``s and ends
    when the consumer closes (``qmq.Subscription``)."""

    def __init__(self, client: Consumer, subscription: AsyncSubscription) -> None:
        self._client = client
        self.subscription = subscription  # the async iterator this one reads

    def __iter__(self) -> Iterator[BlockingMessage]:
        return self

    def __next__(self) -> BlockingMessage:
        sub = self.subscription

        async def take() -> Any:
            try:
                return await sub.__anext__()
            except StopAsyncIteration:
                return None

        received = self._client._call(take())
        if received is None:
            raise StopIteration
        return BlockingMessage(received, self._client._loop)

    @property
    def subject(self) -> str:
        """The subscribed subject."""
        return self.subscription.subject


class Consumer(_LoopClient):
    """The blocking ``qmq.Consumer``: the same options (``group``, ``start``, ``broadcast``,
    ``prefetch``, ``concurrency``, ``handler_threads``, ``token``, ``tls``, ...).

    ``@consumer.handler(subject)`` takes a plain function (run in a worker thread with a
    ``BlockingMessage``) or an async one; ``run()`` serves them until ``close()`` (from another
    thread) or Ctrl-C, ``start()`` serves them in the background. ``subscribe(subject)`` is a
    blocking iterator. Thread-safe."""

    def __init__(self, meta_url: str | Sequence[str], *, group: str,
                 start: Literal["latest", "earliest"] = "latest", **options: Any) -> None:
        super().__init__("consumer")
        try:
            self._consumer = self._make(lambda: AsyncConsumer(meta_url, group=group, start=start,
                                                              **options))
        except BaseException:
            self._stop()
            raise

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def group(self) -> str:
        """The consumer group."""
        return self._consumer.group

    def handler(self, subject: str, tags: list[str] | None = None,
                concurrency: int | None = None) -> Callable[[HandlerT], HandlerT]:
        """Register a handler of ``subject`` (plain or async; see the class docstring): returns
        -> ack, raises -> nack with the group's backoff."""
        register = self._consumer.handler(subject, tags, concurrency)

        def on_loop(fn: HandlerT) -> HandlerT:
            async def add() -> HandlerT:
                return register(fn)

            return self._call(add())

        return on_loop

    def subscribe(self, subject: str, tags: list[str] | None = None) -> Subscription:
        """Start consuming ``subject`` and return its blocking iterator."""
        consumer = self._consumer

        async def subscribe() -> AsyncSubscription:
            return consumer.subscribe(subject, tags)

        return Subscription(self, self._call(subscribe()))

    def start(self) -> None:
        """Serve the registered handlers in the background and return at once."""
        async def start() -> None:
            await self._consumer.__aenter__()

        self._call(start())

    def run(self) -> None:
        """Serve the registered handlers until ``close()`` is called from another thread, or
        Ctrl-C (which closes the consumer gracefully, then returns)."""
        try:
            self._call(self._consumer.run())
        except KeyboardInterrupt:
            self.close()

    def flush_acks(self) -> None:
        """Send every recorded ack now."""
        self._call(self._consumer.flush_acks())

    def close(self) -> None:
        """Graceful close (``qmq.Consumer.close``), then stop the loop thread (idempotent)."""
        if not self._closed:
            try:
                self._call(self._consumer.close())
            finally:
                self._stop()


__all__ = ["BlockingMessage", "Consumer", "Producer", "Subscription"]
