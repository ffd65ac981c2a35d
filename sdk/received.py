"""What a Consumer hands the application: ``ReceivedMessage`` (a pulled message and its ack and
nack), the ``Subscription`` iterator of one subject, and the bounded prefetch buffer between the
pull loops and that iterator.

The seam with ``sdk.consumer``: a ``ReceivedMessage`` reaches its consumer only through the
``_PulledBatch`` it came in (the consumer's ``_acks``, ``_ack_dropped`` and ``_nack``), and a
``Subscription`` is filled by the consumer's pull loops (``_prefetch``, ``pull_loops``,
``addresses``, ``pull_sent_at``, ``pulls_out``, ``route_tasks``, ``refresh_wanted``) and ended by
its close (``_end``). Everything here runs on the consumer's event loop.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from sdk.send_values import duration_ms
from wire.message import (
    KEY_BODY,
    KEY_CREATED_AT_MS,
    KEY_DELIVER_AT_MS,
    KEY_EXPIRE_AT_MS,
    KEY_ID,
    KEY_PROPERTIES,
    KEY_RETRIES,
    KEY_SUBJECT,
    KEY_TAGS,
    Message,
    message_from_fields,
    parse_internal_subject,
)

if TYPE_CHECKING:
    from sdk.consumer import Consumer


class _PulledBatch:
    """What the messages of one pull share: where they came from and where their acks go."""

    __slots__ = ("consumer", "broker_group", "address", "ack_key")

    def __init__(self, consumer: Consumer, broker_group: str, address: str,
                 ack_key: tuple[str, str, str]) -> None:
        self.consumer = consumer
        self.broker_group = broker_group
        self.address = address
        # (address, broker group, wire subject): the AckBatcher's key for these messages.
        self.ack_key = ack_key


class ReceivedMessage:
    """A pulled message and what is needed to ack or nack it.

    Built once per message on the receive path, so it is kept light: the fields are read
    straight from the checked payload map (``wire.message.decode_message_fields``), what the
    messages of one pull share lives in one ``_PulledBatch``, and the ``Message`` object is
    only built if ``.message`` is asked for."""

    __slots__ = ("_fields", "pull_seq", "redelivered", "_batch", "_settled", "_message")

    def __init__(self, fields: dict[str, Any], pull_seq: int, redelivered: int,
                 batch: _PulledBatch) -> None:
        self._fields = fields
        self.pull_seq = pull_seq
        # How many times the broker handed this message out before (0 on first delivery).
        self.redelivered = redelivered
        self._batch = batch
        self._settled = False
        self._message: Message | None = None

    @property
    def message(self) -> Message:
        """The message as an ``sdk.Message`` (built on first use)."""
        if self._message is None:
            self._message = message_from_fields(self._fields)
        return self._message

    @property
    def id(self) -> str:
        """The message id."""
        return self._fields[KEY_ID]

    @property
    def retries(self) -> int:
        """How many times it was nacked and retried before (0 on first try)."""
        return self._fields.get(KEY_RETRIES, 0)

    @property
    def wire_subject(self) -> str:
        """The subject it was pulled from (``%retry%...`` for a retry)."""
        return self._fields[KEY_SUBJECT]

    @property
    def body(self) -> bytes:
        """The body bytes."""
        return self._fields[KEY_BODY]

    @property
    def tags(self) -> tuple[str, ...]:
        """The tags."""
        return tuple(self._fields.get(KEY_TAGS) or ())

    @property
    def properties(self) -> dict[str, str]:
        """The str -> str properties."""
        return self._fields.setdefault(KEY_PROPERTIES, {})

    @property
    def created_at_ms(self) -> int:
        """When the producer made it, epoch ms."""
        return self._fields[KEY_CREATED_AT_MS]

    @property
    def deliver_at_ms(self) -> int | None:
        """When it was due, epoch ms (None: sent to be delivered at once)."""
        return self._fields.get(KEY_DELIVER_AT_MS)

    @property
    def expire_at_ms(self) -> int | None:
        """After this epoch ms it is not delivered (None: never expires)."""
        return self._fields.get(KEY_EXPIRE_AT_MS)

    @property
    def broker_group(self) -> str:
        """The broker group it was pulled from."""
        return self._batch.broker_group

    @property
    def address(self) -> str:
        """The broker address it was pulled from (acks go there)."""
        return self._batch.address

    @property
    def subject(self) -> str:
        """The user subject (for a retry copy, the subject it was first sent to)."""
        wire = self._fields[KEY_SUBJECT]
        if wire[:1] != "%":
            return wire
        internal = parse_internal_subject(wire)
        return internal.subject if internal is not None else wire

    @property
    def settled(self) -> bool:
        """True once acked or successfully nacked."""
        return self._settled

    async def ack(self) -> None:
        """Record the ack; it reaches the broker with the next ack batch (within
        ``ack_interval_ms``). Acking twice is harmless. Never blocks behind other messages."""
        if self._settled:
            return
        self._settled = True
        batch = self._batch
        acks = batch.consumer._acks
        if acks is None or acks.closed:
            batch.consumer._ack_dropped(self)
        else:
            acks.add(batch.ack_key, self.pull_seq)

    async def nack(self, retry_after: timedelta | int | None = None) -> None:
        """Hand the message back for a retry after ``retry_after`` (timedelta or ms; None = the
        group's backoff schedule). When the broker cannot hand it to a delay server it raises
        (Overloaded, ...) and the message stays unacked: it comes back after the ack timeout."""
        if self._settled:
            return
        retry_after_ms = None if retry_after is None else duration_ms(retry_after, "retry_after")
        await self._batch.consumer._nack(self, retry_after_ms)
        self._settled = True

    def __repr__(self) -> str:
        return (
            f"ReceivedMessage(id={self.id!r}, subject={self.subject!r}, "
            f"broker_group={self.broker_group!r}, pull_seq={self.pull_seq})"
        )


class _Prefetch:
    """The bounded buffer between a subscription's pull loops and its iterator: like an
    ``asyncio.Queue`` of ``capacity``, but a pulled batch goes in with one call, and pull loops
    wait (``wait_room``) until ``refill_min`` slots are free, so that they pull sizeable
    batches instead of one message each time the application takes one."""

    def __init__(self, capacity: int, refill_min: int = 1) -> None:
        self.capacity = capacity
        self.refill_min = max(1, min(refill_min, capacity))
        self.items: deque[Any] = deque()
        self.handed = 0  # items handed to the application so far (PullSize's evidence)
        self._getters: deque[asyncio.Future[None]] = deque()
        self._putters: deque[asyncio.Future[None]] = deque()

    async def put_all(self, items: list[Any]) -> None:
        """Append ``items`` in order, waiting for room whenever the buffer is full."""
        done = 0
        while done < len(items):
            room = self.capacity - len(self.items)
            if room <= 0:
                await self._wait(self._putters)
                continue
            self.items.extend(items[done:done + room])
            done += room
            self._wake(self._getters)

    def put_fitting(self, items: list[Any]) -> None:
        """Append ``items``, which the caller checked fit, without waiting."""
        assert self.capacity - len(self.items) >= len(items), (self.capacity, len(items))
        self.items.extend(items)
        self._wake(self._getters)

    async def wait_room(self) -> None:
        """Return once at least ``refill_min`` slots are free."""
        while self.capacity - len(self.items) < self.refill_min:
            await self._wait(self._putters)

    def taken(self) -> None:
        """An item was taken: once ``refill_min`` slots are free, wake every waiting pull loop
        (each checks the room itself; waking one only could leave another asleep forever
        behind a loop whose pulls come back empty)."""
        if self._putters and self.capacity - len(self.items) >= self.refill_min:
            putters, self._putters = self._putters, deque()
            for waiter in putters:
                if not waiter.done():
                    waiter.set_result(None)

    def put_nowait(self, item: Any) -> None:
        """Append ignoring the capacity (the end marker, an error)."""
        self.items.append(item)
        self._wake(self._getters)

    async def get(self) -> Any:
        """The next item, waiting for one."""
        while not self.items:
            await self._wait(self._getters)
        return self.take()

    def take(self) -> Any:
        """The next item, which the caller saw is there (``items`` is not empty)."""
        items = self.items
        item = items.popleft()
        self.handed += 1
        if self._putters:
            self.taken()
        if items and self._getters:
            self._wake(self._getters)  # pass the turn on: another getter may take the next
        return item

    @classmethod
    async def _wait(cls, waiters: deque[asyncio.Future[None]]) -> None:
        waiter = asyncio.get_running_loop().create_future()
        waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                cls._wake(waiters)  # woken, then cancelled: pass the wake-up on
            raise
        finally:
            if waiter in waiters:
                waiters.remove(waiter)

    @staticmethod
    def _wake(waiters: deque[asyncio.Future[None]]) -> None:
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return


class PullSize:
    """How many messages a subscription's pulls ask for, adapting to the backlog (a pure state
    machine; the pull loops tell it each answer).

    At rest it is ``floor`` (the consumer's ``pull_batch``). A pull that comes back full (it
    got all it asked for, and asked for at least half the size) while the application keeps up
    (it took at least half a pull since the previous answer) doubles it, up to ``ceiling``
    (``pull_batch_max``): a lone consumer behind a backlog drains it in a few large pulls
    instead of many round trips. A consumer stuck from its first message never grows: it
    holds what it held at rest. A pull that comes back less than half full halves it, not
    below ``floor``: a long poll answered by a trickle, or a pull the broker cut to its even
    share of a burst because others of the group wait (``realtime.pulls.burst_share``), so a
    group of many consumers stays at ``floor`` and the burst still spreads over all of them.

    The prefetch buffer's capacity: a given ``prefetch`` is the bound, fixed. Without one
    (None) it follows the size: ``floor`` at rest, exactly the fixed default it replaces, and
    two pulls' worth once grown, so the next pull is on the wire while the application works
    through the last. So a consumer holds at most ``2 * ceiling`` that others could have taken,
    and only while its pulls come back full, that is while the group has more than that
    waiting for it.
    """

    def __init__(self, floor: int, ceiling: int, prefetch: int | None) -> None:
        self.floor = floor
        # A pull never asks for more than a given prefetch holds.
        self.ceiling = max(floor, ceiling if prefetch is None else min(ceiling, prefetch))
        self.prefetch = prefetch
        self.size = floor

    def capacity(self) -> int:
        """The prefetch buffer's capacity now."""
        if self.prefetch is not None:
            return self.prefetch
        return self.size if self.size == self.floor else 2 * self.size

    def refill_min(self) -> int:
        """Free slots a pull loop waits for before it pulls: half a pull (with a given
        ``prefetch``, half of ``floor``, as before pulls adapted)."""
        return max(1, min(self.size if self.prefetch is None else self.floor,
                          self.capacity()) // 2)

    def answered(self, asked: int, got: int, handed: int) -> bool:
        """A pull that asked for ``asked`` messages brought ``got``, and the application took
        ``handed`` since the previous answer; True when the size (and so maybe the capacity)
        changed."""
        size = self.size
        if asked and got >= asked and 2 * asked >= size and 2 * handed >= size:
            new = min(self.ceiling, 2 * size)
        elif 2 * got < asked or not asked:
            new = max(self.floor, size // 2)
        else:
            return False
        self.size = new
        return new != size


class Subscription:
    """The async iterator of one subscribed subject. Ends when the consumer closes; raises a
    non-retriable pull error (Forbidden, ...) once, then goes on with the other broker groups."""

    def __init__(self, subject: str, tags: list[str], pull_size: PullSize,
                 sources: list[str] | None = None) -> None:
        self.subject = subject
        self.tags = tags
        # Wire subjects pulled into this iterator: the subject and, unless broadcast, its
        # group's retry subject.
        self.sources = sources or [subject]
        # Shared by the subscription's pull loops (the event loop's): what they ask for.
        self.pull_size = pull_size
        self._prefetch = _Prefetch(pull_size.capacity(), pull_size.refill_min())
        self._handed_at_answer = 0  # _prefetch.handed when the last pull answered
        self._ended = False
        self.pull_loops: dict[tuple[str, str], asyncio.Task[None]] = {}
        # (wire subject, broker group) -> address its pull loop uses now (heartbeats go there).
        self.addresses: dict[tuple[str, str], str] = {}
        # (wire subject, broker group) -> loop time its last pull was sent (the broker notes
        # the consumer as seen when a pull begins: a heartbeat soon after adds nothing).
        self.pull_sent_at: dict[tuple[str, str], float] = {}
        # (wire subject, broker group) whose pull is out now: the broker counts the consumer
        # as present while it is (parked or not), so no heartbeat goes for it.
        self.pulls_out: set[tuple[str, str]] = set()
        self.route_tasks: list[asyncio.Task[None]] = []
        self.refresh_wanted = asyncio.Event()
        # Read by a handler's dispatch loop (``Consumer.handler``), not the application.
        self.handler_driven = False

    def pulled(self, asked: int, got: int) -> None:
        """A pull loop's answer: adapt the pull size, and the buffer's capacity with it (pull
        loops waiting for room re-check it)."""
        size, prefetch = self.pull_size, self._prefetch
        handed, self._handed_at_answer = (prefetch.handed - self._handed_at_answer,
                                          prefetch.handed)
        if size.answered(asked, got, handed):
            prefetch.capacity = size.capacity()
            prefetch.refill_min = size.refill_min()
            prefetch.taken()

    def __aiter__(self) -> AsyncIterator[ReceivedMessage]:
        return self

    async def __anext__(self) -> ReceivedMessage:
        if self._ended:
            raise StopAsyncIteration
        prefetch = self._prefetch
        items = prefetch.items
        # _Prefetch.get without its coroutine: waiting for a pull's answer (most waits at a
        # low rate) steps no get() coroutine, and an item already there no trip through it.
        while not items:
            await prefetch._wait(prefetch._getters)
        # _Prefetch.take, written out: one call fewer a message (issue 18, the consumer's
        # CPU per message in W2's drain and end to end).
        item = items.popleft()
        prefetch.handed += 1
        if prefetch._putters:
            prefetch.taken()
        if items and prefetch._getters:
            prefetch._wake(prefetch._getters)  # pass the turn on: another getter may take it
        if type(item) is ReceivedMessage:
            return item  # the usual item (never subclassed): no test for the others
        if item is _END:
            self._ended = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    @property
    def prefetched(self) -> int:
        """Messages pulled and waiting to be handed to the application."""
        return len(self._prefetch.items)

    def _end(self) -> None:
        # Prefetched messages are dropped unacked (redelivered by the broker); pull loops are
        # stopped before this.
        self._prefetch.items.clear()
        self._prefetch.put_nowait(_END)


_END = object()


__all__ = ["ReceivedMessage", "Subscription"]
