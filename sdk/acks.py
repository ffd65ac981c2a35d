"""The consumer's ack batcher: acks are recorded locally and sent as pull-sequence ranges.

``msg.ack()`` only records the pull sequence here; the batcher sends the recorded sequences of
each (broker address, broker group, subject) as sorted [first, last] ranges every
``interval_ms``, or at once when ``pending_max`` are waiting. Acks may come in any order: one
slow message holds back neither the others' acks nor the iterator. A failed ack is retried with
the next flush, to the group's current master: at least ACK_ATTEMPTS_MAX times, and for a
retriable failure for as long as ACK_RETRY_MS from its first failure, which outlasts a
switchover or a failover of the broker group (acks are refused with not_master until the new
master serves). After that the broker's redelivery takes over (at-least-once, never loss).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from wire.errors import QmqError
from wire.limits import MAX_ACK_RANGES

log = logging.getLogger(__name__)

# A batch of acks that failed this many times is given up (the broker redelivers those
# messages), unless its failures are retriable and younger than ACK_RETRY_MS.
ACK_ATTEMPTS_MAX = 5
# How long retriable ack failures are retried, in milliseconds, counted from the first: longer
# than a planned switchover or a failover (a lease, ~3-5 s) so that the acks of messages handled
# meanwhile reach the new master before their ack timeout hands them out again.
ACK_RETRY_MS = 30_000
# Pause between tries of the last acks at close, in milliseconds (no later flush will come).
CLOSE_RETRY_PAUSE_MS = 100

# (broker address, broker group, subject)
AckKey = tuple[str, str, str]
# Sends one ack op to an address and returns the answer (raises the QmqError of a failure).
SendAck = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def seqs_to_ranges(seqs: set[int] | list[int]) -> list[list[int]]:
    """Sorted inclusive [first, last] ranges covering exactly ``seqs`` (duplicates allowed):
    {1, 2, 3, 7} -> [[1, 3], [7, 7]]."""
    ordered = sorted(set(seqs))
    if not ordered:
        return []
    if ordered[-1] - ordered[0] + 1 == len(ordered):
        return [[ordered[0], ordered[-1]]]  # the common case, one range, found in C
    ranges: list[list[int]] = []
    for seq in ordered:
        if ranges and ranges[-1][1] + 1 == seq:
            ranges[-1][1] = seq
        else:
            ranges.append([seq, seq])
    return ranges


class AckBatcher:
    """Collects acked pull sequences per ``AckKey`` and sends them as ranges every
    ``interval_ms`` or once ``pending_max`` are waiting."""

    def __init__(self, send: SendAck, interval_ms: int, pending_max: int,
                 resolve: Callable[[AckKey], str] | None = None,
                 monotonic_ms: Callable[[], float] = lambda: time.monotonic() * 1000) -> None:
        self._send_ack = send
        # Where a key's acks go now: the group's current master, which after a failover is
        # not the address the messages were pulled from (its pull log is a copy).
        self._resolve = resolve
        self.interval_ms = interval_ms
        self.pending_max = pending_max
        # Acked pull seqs per key, in the order recorded; duplicates are dropped when sent.
        self._pending: dict[AckKey, list[int]] = {}
        self._attempts: dict[AckKey, int] = {}
        self._failing_since_ms: dict[AckKey, float] = {}  # monotonic ms of a key's first failure
        self._monotonic_ms = monotonic_ms
        self._count = 0
        self._has_pending = asyncio.Event()
        self._full = asyncio.Event()
        self._lingering: asyncio.Future[None] | None = None  # the timer task's wait (_linger)
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self.closed = False

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="qmq-acks")

    def add(self, key: AckKey, pull_seq: int) -> None:
        """Record one ack (recording it twice is harmless: it is sent once)."""
        seqs = self._pending.get(key)
        if seqs is None:
            seqs = self._pending[key] = []
            self._has_pending.set()
        seqs.append(pull_seq)
        self._count += 1
        if self._count >= self.pending_max:
            self._set_full()

    def _set_full(self) -> None:
        """Send now: end the timer task's wait."""
        self._full.set()
        lingering = self._lingering
        if lingering is not None and not lingering.done():
            lingering.set_result(None)

    async def _run(self) -> None:
        while not self.closed:
            await self._has_pending.wait()
            if not self._full.is_set() and not self.closed:
                await self._linger()
            await self.flush()

    async def _linger(self) -> None:
        """Wait ``interval_ms``, or less if ``pending_max`` acks wait meanwhile or the batcher
        closes. One future and one timer: an ``asyncio.timeout`` round a wait on ``_full``
        expired at every flush of a low rate, and its expiry cancels the task and raises (issue
        18: ~4% of a consumer's CPU at 2,000 msg/s, one flush per 20 ms)."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        self._lingering = waiter
        timer = loop.call_later(self.interval_ms / 1000, _resolve, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._lingering = None

    async def flush(self) -> None:
        """Send every recorded ack now; failures are kept for the next flush (up to
        ACK_ATTEMPTS_MAX), after which the broker's redelivery takes over."""
        async with self._lock:
            pending, self._pending = self._pending, {}
            self._count = 0
            self._has_pending.clear()
            self._full.clear()
            if len(pending) == 1:  # the usual case: one broker group, no task to gather
                [(key, seqs)] = pending.items()
                await self._send(key, seqs)
            elif pending:
                await asyncio.gather(*(self._send(k, s) for k, s in pending.items()))

    async def _send(self, key: AckKey, seqs: list[int]) -> None:
        address, broker_group, subject = key
        if self._resolve is not None:
            address = self._resolve(key)
        ranges = seqs_to_ranges(seqs)
        for start in range(0, len(ranges), MAX_ACK_RANGES):
            chunk = ranges[start:start + MAX_ACK_RANGES]
            try:
                await self._send_ack(address, {"op": "ack", "subject": subject, "ranges": chunk})
            except QmqError as exc:
                attempts = self._attempts.get(key, 0) + 1
                since_ms = self._failing_since_ms.setdefault(key, self._monotonic_ms())
                left = {s for first, last in ranges[start:] for s in range(first, last + 1)}
                if exc.retriable and (attempts < ACK_ATTEMPTS_MAX
                                      or self._monotonic_ms() - since_ms < ACK_RETRY_MS):
                    self._attempts[key] = attempts
                    log.warning("ack of %d message(s) of %r to %s failed (%s); will retry",
                                len(left), subject, broker_group, exc)
                    for seq in left:
                        self.add(key, seq)
                else:
                    self._attempts.pop(key, None)
                    self._failing_since_ms.pop(key, None)
                    log.error("giving up acking %d message(s) of %r on %s after %d attempt(s) "
                              "(%s: %s); the broker will redeliver them after the ack timeout",
                              len(left), subject, broker_group, attempts, exc.code, exc.message)
                return
        self._attempts.pop(key, None)
        self._failing_since_ms.pop(key, None)

    async def close(self) -> None:
        """Stop the timer and send what is recorded; later acks are dropped by the caller.

        A flush in progress is waited for, never cancelled: a cancelled flush could drop acks it
        had taken but not yet written, and the consumer's leave, sent next, would then hand those
        messages to another consumer although the application had handled them. Acks that fail
        with a retriable error are tried again here (as in a flush: up to ACK_ATTEMPTS_MAX, and
        ACK_RETRY_MS for retriable failures), since no later flush will come."""
        self.closed = True
        self._has_pending.set()  # wake the timer task: it ends after its current flush
        self._set_full()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        # Taking the lock also waits out a flush_acks() in progress, whatever it has in flight.
        await self.flush()
        while self._pending:  # re-added after a retriable failure; _send gives up in time
            await asyncio.sleep(CLOSE_RETRY_PAUSE_MS / 1000)
            await self.flush()


__all__ = ["ACK_ATTEMPTS_MAX", "ACK_RETRY_MS", "AckBatcher", "AckKey", "seqs_to_ranges"]
