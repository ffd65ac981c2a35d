"""A consumer's handlers: ``@consumer.handler`` registration, one dispatch loop per handled
subject that runs at most ``concurrency`` handlers at once, ack on return and nack on raise, and
close's wait for the handlers still running; the ``HandlerMixin`` part of
``sdk.consumer.Consumer`` (split from it). Plain-function handlers run in worker threads
(``sdk.threaded``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

from sdk.received import ReceivedMessage, Subscription
from sdk.threaded import SyncHandler, ThreadedHandlers, is_async_callable
from wire.errors import QmqError

log = logging.getLogger("sdk.consumer")  # the consumer's logger: these lines are its own

Handler = Callable[[ReceivedMessage], Awaitable[Any]]
# What ``@consumer.handler`` takes: an async function of a ReceivedMessage, or a plain one of
# a BlockingMessage (run in a worker thread).
HandlerT = TypeVar("HandlerT", bound=Callable[[ReceivedMessage], Awaitable[object]]
                   | SyncHandler)


@dataclass
class _HandlerSpec:
    """One registered handler: its subject and tag filter, the call (a plain function already
    wrapped to run in a worker thread), its concurrency and its dispatch loop's task."""

    subject: str
    tags: list[str] | None
    fn: Handler
    concurrency: int
    task: asyncio.Task[None] | None = None


class HandlerMixin:
    """Handlers of ``Consumer``, which sets these fields (event loop)."""

    concurrency: int
    close_timeout_ms: int
    _started: bool
    _handlers: list[_HandlerSpec]
    _handler_tasks: set[asyncio.Task[None]]
    _threads: ThreadedHandlers

    if TYPE_CHECKING:
        def subscribe(self, subject: str,
                      tags: list[str] | tuple[str, ...] | None = None) -> Subscription: ...

    def handler(
        self, subject: str, tags: list[str] | None = None, concurrency: int | None = None
    ) -> Callable[[HandlerT], HandlerT]:
        """Register ``fn(msg)`` for ``subject``: returns -> ack, raises -> nack (see the module
        docstring). At most ``concurrency`` (default: the consumer's) run at once.

        ``async def fn(msg)`` runs on the event loop with a ``ReceivedMessage``; a plain
        ``def fn(msg)`` runs in a worker thread of the consumer's pool (``handler_threads``
        threads, default ``concurrency``) with a ``sdk.threaded.BlockingMessage``, whose
        ``ack()``/``nack()`` block; so Django or Flask code can be a handler as it is."""
        limit = self.concurrency if concurrency is None else concurrency
        if type(limit) is not int or limit < 1:
            raise ValueError(f"handler concurrency must be an int >= 1, got {limit!r}")

        def register(fn: HandlerT) -> HandlerT:
            if not callable(fn):
                raise TypeError(f"handler {fn!r} must be a function")
            call = (cast(Handler, fn) if is_async_callable(fn)
                    else self._threads.wrap(cast(SyncHandler, fn)))
            spec = _HandlerSpec(subject, list(tags) if tags else None, call, limit)
            self._handlers.append(spec)
            if self._started:
                self._start_handler(spec)
            return fn

        return register

    def _start_handler(self, spec: _HandlerSpec) -> None:
        sub = self.subscribe(spec.subject, spec.tags)
        sub.handler_driven = True
        spec.task = asyncio.get_running_loop().create_task(
            self._dispatch_loop(spec, sub), name=f"qmq-handler {spec.subject}"
        )

    async def _dispatch_loop(self, spec: _HandlerSpec, sub: Subscription) -> None:
        slots = asyncio.Semaphore(spec.concurrency)
        while True:
            try:
                msg = await sub.__anext__()
            except StopAsyncIteration:
                return
            except QmqError as exc:
                log.error("handler subscription of %r: %s: %s", spec.subject, exc.code, exc.message)
                continue
            await slots.acquire()
            task = asyncio.get_running_loop().create_task(self._handle(spec, msg, slots))
            self._handler_tasks.add(task)
            task.add_done_callback(self._handler_tasks.discard)

    async def _handle(self, spec: _HandlerSpec, msg: ReceivedMessage, slots: asyncio.Semaphore) -> None:
        try:
            try:
                await spec.fn(msg)
            except Exception:
                log.exception("handler %s raised on %r", getattr(spec.fn, "__qualname__", spec.fn), msg)
                await self._nack_after_failure(msg)
            else:
                await msg.ack()
        finally:
            slots.release()

    async def _nack_after_failure(self, msg: ReceivedMessage) -> None:
        try:
            await msg.nack()
        except QmqError as exc:
            log.warning("nack of message %s failed (%s: %s); it stays unacked and is redelivered "
                        "after the group's ack timeout", msg.id, exc.code, exc.message)

    async def _wait_handlers(self) -> None:
        """Close's wait for the running handlers: up to ``close_timeout_ms``, then cancel the
        rest (their messages stay unacked and are redelivered)."""
        if not self._handler_tasks:
            return
        done, still_running = await asyncio.wait(
            set(self._handler_tasks), timeout=self.close_timeout_ms / 1000
        )
        if still_running:
            log.warning("%d handler(s) still running after close_timeout_ms %d; cancelling them, "
                        "their messages stay unacked and are redelivered",
                        len(still_running), self.close_timeout_ms)
            for task in still_running:
                task.cancel()
            await asyncio.gather(*still_running, return_exceptions=True)
