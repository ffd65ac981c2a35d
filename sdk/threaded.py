"""Plain-function handlers: ``@consumer.handler`` on a ``def`` runs it in a bounded thread pool.

Django and Flask code, and any library that blocks, cannot run on the event loop. A handler
that is a plain function is therefore called in a worker thread of its consumer's pool
(``ThreadedHandlers``, at most ``handler_threads`` threads), while the consumer's pulls, acks
and heartbeats go on on the loop. The handler gets a ``BlockingMessage``: the same fields as the
async ``ReceivedMessage``, and ``ack()``/``nack()`` that block the worker thread until the loop
has done them. As for an async handler, returning acks the message and raising nacks it.

A plain handler still running when the consumer's ``close_timeout_ms`` runs out cannot be
stopped (Python cannot cancel a thread): its message is left unacked, so the broker hands it
out again after the group's ack timeout, and the thread finishes on its own.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from wire.message import Message

if TYPE_CHECKING:
    from sdk.consumer import ReceivedMessage

T = TypeVar("T")

# Longest wait of a worker thread for the event loop to record an ack or answer a nack, in
# seconds: far above a nack's own request timeout (5 s), so only a stopped loop reaches it.
LOOP_CALL_TIMEOUT_S = 60.0


def is_async_callable(fn: object) -> bool:
    """True for ``async def`` functions, and for objects whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None))


def run_on_loop(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T],
                timeout_s: float | None = LOOP_CALL_TIMEOUT_S) -> T:
    """Run ``coro`` on ``loop`` (running in another thread) and wait for its result here.

    RuntimeError when called on the loop's own thread, where waiting would deadlock."""
    try:
        running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        coro.close()
        raise RuntimeError("a blocking qmq call was made on the event loop's own thread; "
                           "use the async API there (await msg.ack(), await producer.send())")
    return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout_s)


class BlockingMessage:
    """A received message for code that blocks: the fields of ``qmq.ReceivedMessage``, and
    ``ack()``/``nack()`` that return once the event loop has done them. Safe to use from any
    thread but the loop's own."""

    __slots__ = ("received", "_loop")

    def __init__(self, received: ReceivedMessage, loop: asyncio.AbstractEventLoop) -> None:
        # The async message this one stands for (its ack and nack run on ``_loop``).
        self.received = received
        self._loop = loop

    def ack(self) -> None:
        """Record the ack (it reaches the broker with the next ack batch). Acking twice is
        harmless."""
        run_on_loop(self._loop, self.received.ack())

    def nack(self, retry_after: timedelta | int | None = None) -> None:
        """Hand the message back for a retry after ``retry_after`` (timedelta or ms; None: the
        group's backoff schedule); raises as ``ReceivedMessage.nack`` does."""
        run_on_loop(self._loop, self.received.nack(retry_after))

    @property
    def message(self) -> Message:
        """The message as a ``qmq.Message``."""
        return self.received.message

    @property
    def id(self) -> str:
        """The message id."""
        return self.received.id

    @property
    def subject(self) -> str:
        """The user subject (for a retry copy, the subject it was first sent to)."""
        return self.received.subject

    @property
    def wire_subject(self) -> str:
        """The subject it was pulled from (``%retry%...`` for a retry)."""
        return self.received.wire_subject

    @property
    def body(self) -> bytes:
        """The body bytes."""
        return self.received.body

    @property
    def tags(self) -> tuple[str, ...]:
        """The tags."""
        return self.received.tags

    @property
    def properties(self) -> dict[str, str]:
        """The str -> str properties."""
        return self.received.properties

    @property
    def created_at_ms(self) -> int:
        """When the producer made it, epoch ms."""
        return self.received.created_at_ms

    @property
    def deliver_at_ms(self) -> int | None:
        """When it was due, epoch ms (None: sent to be delivered at once)."""
        return self.received.deliver_at_ms

    @property
    def expire_at_ms(self) -> int | None:
        """After this epoch ms it is not delivered (None: never expires)."""
        return self.received.expire_at_ms

    @property
    def retries(self) -> int:
        """How many times it was nacked and retried before."""
        return self.received.retries

    @property
    def redelivered(self) -> int:
        """How many times the broker handed it out before."""
        return self.received.redelivered

    @property
    def broker_group(self) -> str:
        """The broker group it was pulled from."""
        return self.received.broker_group

    @property
    def settled(self) -> bool:
        """True once acked or successfully nacked."""
        return self.received.settled

    def __repr__(self) -> str:
        return f"Blocking{self.received!r}"


SyncHandler = Callable[[BlockingMessage], object]


class ThreadedHandlers:
    """The worker threads of one consumer's plain-function handlers (``qmq-handler-N``), made
    on first use. Owned by the consumer's event loop: ``wrap`` and ``shutdown`` run there."""

    def __init__(self, threads_max: int) -> None:
        self.threads_max = threads_max
        self._pool: ThreadPoolExecutor | None = None

    def wrap(self, fn: SyncHandler) -> Callable[[ReceivedMessage], Awaitable[None]]:
        """An async handler that runs ``fn`` in a worker thread with a ``BlockingMessage``."""

        async def in_thread(msg: ReceivedMessage) -> None:
            loop = asyncio.get_running_loop()
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads_max, "qmq-handler")
            result = await loop.run_in_executor(self._pool, fn, BlockingMessage(msg, loop))
            if inspect.isawaitable(result):  # a def that returned a coroutine: run it here
                await result

        in_thread.__qualname__ = getattr(fn, "__qualname__", repr(fn))
        return in_thread

    def shutdown(self) -> None:
        """Stop taking work; threads still running a handler finish on their own."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


__all__ = ["BlockingMessage", "SyncHandler", "ThreadedHandlers", "is_async_callable",
           "run_on_loop"]
