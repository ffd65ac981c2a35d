"""How a Producer's messages form batches (the module docstring of ``sdk.producer``, steps 2-3):
the open batch of each (subject, delayed) key, when it leaves (full, after the loop turn with
fewer than ``linger_in_flight_min`` batches of its key on the wire, else at ``linger_ms`` or when
a batch on the wire is answered (as its answer is read), or at half the peak of waiting sends with ``split_sends_min``),
and the count of batches on the wire.
A mixin of ``Producer``, which owns every field used here (event loop only)."""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from sdk.send_batch import Batch, Call, Part
from sdk.send_values import PAYLOAD_OVERHEAD_BYTES, fit_payloads
from wire.limits import MAX_FRAME_BYTES

# Room left in a send frame for the envelope around the payloads (op, rid, msgpack headers).
FRAME_ENVELOPE_BYTES = 64 * 1024

# Batches are kept per (subject, delayed): delayed messages go to delay servers.
Key = tuple[str, bool]


class WrongEventLoop(RuntimeError):
    """A Producer's send from an event loop other than the one of its first send: its batches,
    tasks and connections belong to that loop, so the send cannot travel on them. A
    RuntimeError, as the failed await it replaces was."""


class BatchingMixin:
    """The batching side of ``Producer`` (module docstring)."""

    # Producer's fields and method this side uses (declared for the type checker; Producer
    # sets them in __init__; event loop only).
    batch_size_max: int
    linger_ms: int
    linger_in_flight_min: int
    split_sends_min: int
    _sends_waiting_peak: int
    _open: dict[Key, Batch]
    _on_wire: dict[Key, int]
    _tasks: set[asyncio.Task[None]]
    _send_batch: Callable[[Batch], Coroutine[Any, Any, None]]
    _loop: asyncio.AbstractEventLoop | None
    _loop_thread: int | None

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        """The running event loop, which becomes the producer's at its first send; raises
        WrongEventLoop when it is another. ``send`` calls this only when its cheap test fails
        (first send, another thread, the producer's loop not running): asyncio.get_running_loop
        costs a getpid() system call on Python 3.11."""
        running = asyncio.get_running_loop()
        loop = self._loop
        if loop is None:
            loop = self._loop = running
        elif running is not loop:
            state = "closed" if loop.is_closed() else "running" if loop.is_running() else "stopped"
            raise WrongEventLoop(
                f"this Producer belongs to the event loop of its first send ({state}, id "
                f"{id(loop):#x}), and this send runs on another (id {id(running):#x}): its "
                "batches and connections cannot serve it. Make one Producer per event loop "
                "(each asyncio.run call makes a new loop).")
        self._loop_thread = threading.get_ident()
        return loop

    def _enqueue(self, subject: str, call: Call, ids: list[str], payloads: list[bytes],
                 dues: list[int] | None) -> None:
        """Put a call's messages (``dues`` None: realtime, else delayed) into the open batches
        of their subject, as runs (Parts) rather than one by one, sending every batch that
        fills up (``batch_size_max`` messages, or the frame limit)."""
        size_max = MAX_FRAME_BYTES - FRAME_ENVELOPE_BYTES
        key = (subject, dues is not None)
        batch = self._open.get(key)
        count = len(ids)
        pos = 0
        while pos < count:
            if batch is None:
                batch = self._open_batch(key)
            end = min(count, pos + self.batch_size_max - batch.count)
            run = payloads if end - pos == count else payloads[pos:end]
            size = sum(map(len, run)) + PAYLOAD_OVERHEAD_BYTES * len(run)
            if batch.size_bytes + size > size_max:
                end, size = fit_payloads(payloads, pos, end, size_max - batch.size_bytes)
                if end == pos and batch.count:  # not one more fits: this batch is full
                    self._dispatch(key)
                    batch = None
                    continue
                if end == pos:  # one message alone over the allowance still travels alone
                    end, size = pos + 1, len(payloads[pos]) + PAYLOAD_OVERHEAD_BYTES
                run = payloads[pos:end]
            whole = end - pos == count
            batch.parts.append(Part(call, pos, ids if whole else ids[pos:end], run,
                                    None if dues is None else dues if whole else dues[pos:end]))
            batch.count += end - pos
            batch.size_bytes += size
            pos = end
            if batch.count >= self.batch_size_max or pos < count:  # full by count or by size
                self._dispatch(key)
                batch = None

    def _enqueue_one(self, subject: str, future: asyncio.Future[Any], sent_id: str,
                     payload: bytes, due_ms: int | None) -> None:
        """Put one ``send``'s message (``due_ms`` None: realtime) into the open batch of its
        subject, as the batch's single-send columns (``future`` gets its Receipt or the
        exception that failed it); a message that does not fit the open batch's frame sends
        that batch first and opens the next."""
        key = (subject, due_ms is not None)
        batch = self._open.get(key)
        if batch is None:
            batch = self._open_batch(key)
        size = len(payload) + PAYLOAD_OVERHEAD_BYTES
        if batch.size_bytes + size > MAX_FRAME_BYTES - FRAME_ENVELOPE_BYTES and batch.count:
            self._dispatch(key)
            batch = self._open_batch(key)  # one message alone over the allowance still travels
        batch.one_futures.append(future)
        batch.one_ids.append(sent_id)
        batch.one_payloads.append(payload)
        if due_ms is not None:
            batch.one_dues.append(due_ms)
        batch.count += 1
        batch.size_bytes += size
        if batch.count >= self.batch_size_max or batch.count >= batch.split_at:
            self._dispatch(key)

    def _open_batch(self, key: Key) -> Batch:
        batch = self._open[key] = Batch(key[0], key[1])
        # The producer's loop, which its callers (send, send_many) have just found running
        # here: asyncio.get_running_loop() would cost a getpid() system call per batch.
        loop = self._loop
        assert loop is not None
        # With few batches of this subject on the wire (a low-rate sender) waiting would only
        # add the linger to its latency: the batch leaves after this loop turn (so sends
        # issued together still share it). Else it lingers for more, and leaves when a batch
        # on the wire is answered at latest (_answered, _left_wire).
        if self._on_wire.get(key, 0) >= self.linger_in_flight_min:
            batch.timer = loop.call_later(self.linger_ms / 1000, self._dispatch, key)
            batch.lingering = True
        else:
            # Its task now: the task's first step, in the next loop turn, closes the batch
            # (_send_batch) and writes it, a loop turn sooner than from a call_soon'd _dispatch
            # that would make the task then.
            self._start(key, batch)
        peak = self._sends_waiting_peak
        if self.split_sends_min and peak >= 2 * self.split_sends_min:  # module docstring 2
            batch.split_at = peak // 2
        return batch

    def _dispatch(self, key: Key) -> None:
        batch = self._open.pop(key, None)
        if batch is None:
            return
        if batch.timer is not None:
            batch.timer.cancel()
        if not batch.started:
            self._start(key, batch)

    def _start(self, key: Key, batch: Batch) -> None:
        """Make the task that sends ``batch``; it counts as on the wire from now."""
        batch.started = True
        task = asyncio.get_running_loop().create_task(
            self._send_batch(batch), name=f"qmq-send {batch.subject}"
        )
        self._tasks.add(task)
        self._on_wire[key] = self._on_wire.get(key, 0) + 1
        task.add_done_callback(functools.partial(self._batch_done, key, batch))

    def _answered(self, key: Key, answer: dict[str, Any]) -> None:
        """A send's answer as it is read (its request's ``on_answer``): a batch that lingers
        only because this one is on the wire leaves now, written in the next loop turn.
        Left to ``_left_wire`` it was written two turns after the read, behind the
        answered batch's task step."""
        batch = self._open.get(key)
        if (batch is not None and batch.lingering
                and self._on_wire.get(key, 0) - 1 < self.linger_in_flight_min):
            self._dispatch(key)

    def _left_wire(self, key: Key, batch: Batch) -> None:
        """``batch`` is settled (or failed): it no longer counts as on the wire. Called by its
        task as it ends (``Producer._send_batch``), in the step that settled its senders, so
        that a batch they open as they resume does not linger behind it; else (a task
        cancelled before its first step) by the task's done callback. Once per batch."""
        if batch.left_wire:
            return
        batch.left_wire = True
        left = self._on_wire[key] - 1
        if left:
            self._on_wire[key] = left
        else:
            del self._on_wire[key]
        open_batch = self._open.get(key)
        # A batch that lingers only because linger_in_flight_min were on the wire leaves now
        # that one is answered; one opened to leave after its loop turn keeps that turn, so
        # that the sends of the turn still share it.
        if (open_batch is not None and open_batch.lingering
                and left < self.linger_in_flight_min):
            self._dispatch(key)

    def _batch_done(self, key: Key, batch: Batch, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._left_wire(key, batch)
