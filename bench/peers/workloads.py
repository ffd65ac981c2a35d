"""The client side of every peers workload, written once for all systems: what is sent, how
many calls are in flight, and what the receiving end measures.

Each system supplies a ``Driver`` (bench/peers/drivers_*.py) that sends and receives with its
own client library in its idiomatic way; everything else (bodies, windows, clocks, figures) is
here, so the systems differ only in the calls the driver makes. Standard library only: this
module runs in the project's venv (pyqmq) and in the peers' venv (NATS, Redis) alike.

Every body is 256 bytes: sequence number, send time (``time.monotonic_ns()``, system-wide on
Linux, so comparable across processes) and due time (epoch ms, 0 for a realtime message),
then padding. Lateness is measured against the due time in the body, latency against the send
time, both when the consumer's loop is handed the message, before it acks.
"""

from __future__ import annotations

import asyncio
import random
import struct
import time
from typing import Any, Callable, Protocol

from bench._cluster import paced, percentile, process_cpu_s

BODY_BYTES = 256
_HEADER = struct.Struct(">QQq")  # sequence number, send time (monotonic ns), due (epoch ms or 0)
_PAD = b"\x00" * (BODY_BYTES - _HEADER.size)
BATCH_MESSAGES = 1_024  # throughput producer: messages per batch call (as bench/realtime.py)
BATCHES_IN_FLIGHT = 4  # throughput producer: batch calls in flight at once (as bench/realtime.py)
DELAYED_IN_FLIGHT = 32  # W1/W2: send(deliver_at=...) calls in flight (issue 18)
CONSUMER_STOP_TIMEOUT_S = 5.0  # a consumer loop told to stop has this long before it is cancelled
DELAY_SEED = 1  # W1's delays come from random.Random(DELAY_SEED): the same for every system


def make_body(seq: int, due_ms: int = 0) -> bytes:
    """A 256-byte body carrying ``seq``, the send time now and ``due_ms``."""
    return _HEADER.pack(seq, time.monotonic_ns(), due_ms) + _PAD


def read_body(body: bytes) -> tuple[int, int, int]:
    """(sequence number, send time in monotonic ns, due time in epoch ms) of a body."""
    return _HEADER.unpack_from(body)


def wall_ms() -> int:
    """The wall clock in epoch ms (what due times are in)."""
    return time.time_ns() // 1_000_000


class Driver(Protocol):
    """One system's client calls. ``open``/``close`` bracket a worker process's use of it."""

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def prepare_consumer(self, subject: str, delayed: bool) -> None:
        """Make what a consumer of ``subject`` needs (stream, group, durable consumer) so that
        every message sent from now on, and any already there, will be received."""

    async def consume(self, subject: str, on_message: Callable[[bytes], None],
                      stop: asyncio.Event) -> None:
        """Receive from ``subject`` until ``stop`` is set: call ``on_message(body)`` for each
        message, then ack it."""

    async def send(self, subject: str, body: bytes) -> None:
        """Send one message and wait for the system to confirm it."""

    async def send_many(self, subject: str, bodies: list[bytes]) -> None:
        """Send a batch with the system's batch call; return when all are confirmed."""

    async def send_at(self, subject: str, body: bytes, due_ms: int) -> None:
        """Send one message to be delivered at ``due_ms`` (epoch ms); wait for confirmation."""


# ---------------------------------------------------------------------------- producers


def servers_cpu_s(pids: list[int]) -> float:
    """CPU seconds the server processes ``pids`` used so far (read from /proc)."""
    return sum(process_cpu_s(pid) for pid in pids)


async def produce_batched(driver: Driver, subject: str, count: int,
                          cpu_pids: list[int]) -> dict[str, Any]:
    """``count`` messages in batches of BATCH_MESSAGES, BATCHES_IN_FLIGHT batches at a time,
    after one warm-up message (sequence ``count``, not counted). ``server_cpu_s``: what the
    processes ``cpu_pids`` used from the first send to the last confirmation."""
    await driver.send(subject, make_body(count))
    server_cpu_s = servers_cpu_s(cpu_pids)
    start_ns, cpu_start_s = time.monotonic_ns(), time.process_time()
    slots = asyncio.Semaphore(BATCHES_IN_FLIGHT)

    async def batch(first: int) -> None:
        try:
            last = min(count, first + BATCH_MESSAGES)
            await driver.send_many(subject, [make_body(seq) for seq in range(first, last)])
        finally:
            slots.release()

    async with asyncio.TaskGroup() as group:
        for first in range(0, count, BATCH_MESSAGES):
            await slots.acquire()
            group.create_task(batch(first))
    return {"start_ns": start_ns, "end_ns": time.monotonic_ns(),
            "cpu_s": time.process_time() - cpu_start_s,
            "server_cpu_s": servers_cpu_s(cpu_pids) - server_cpu_s}


async def produce_at_rate(driver: Driver, subject: str, count: int, rate_per_s: int,
                          cpu_pids: list[int]) -> dict[str, Any]:
    """``count`` single sends started on a fixed schedule of ``rate_per_s`` (each its own task,
    so a slow confirmation does not hold back the next send), after one warm-up message.
    ``server_cpu_s``: what the processes ``cpu_pids`` used from the first send to the last
    confirmation."""
    await driver.send(subject, make_body(count))
    confirm_ns: list[int] = []
    failed: list[str] = []

    async def send_one(seq: int) -> None:
        sent_ns = time.monotonic_ns()
        try:
            await driver.send(subject, make_body(seq))
        except Exception as exc:  # counted and reported, never silently lost
            failed.append(f"{type(exc).__name__}: {exc}")
            return
        confirm_ns.append(time.monotonic_ns() - sent_ns)

    server_cpu_s = servers_cpu_s(cpu_pids)
    start, last_started = await paced(count, rate_per_s, send_one)
    elapsed_s, server_cpu_s = time.monotonic() - start, servers_cpu_s(cpu_pids) - server_cpu_s
    confirm_ns.sort()
    return {"offered_per_s": count / max(1e-9, last_started - start),
            "confirmed_per_s": count / elapsed_s,
            "server_cpu_s": server_cpu_s, "failed": len(failed),
            "first_failure": failed[0] if failed else "",
            "confirm_p50_ms": percentile(confirm_ns, 0.5) / 1e6,
            "confirm_p99_ms": percentile(confirm_ns, 0.99) / 1e6}


async def produce_delayed(driver: Driver, subject: str, count: int, *, lead_ms: int = 0,
                          delay_low_ms: int = 0, delay_high_ms: int = 0,
                          cpu_pids: tuple[int, ...] = ()) -> dict[str, Any]:
    """``count`` delayed sends, DELAYED_IN_FLIGHT in flight (that many tasks, each sending its
    next message as soon as the last is confirmed). With ``lead_ms`` (W2) every message is due
    at the same instant: the first whole second at least ``lead_ms`` from now (returned as
    ``due_at_ms``); else each is due at its send time plus a delay drawn uniformly from
    [low, high] ms (W1). First one warm-up message (sequence ``count``, not counted; due with
    the others), as the other producers send, so the timed part holds no route lookup or
    connection set-up. ``server_cpu_s``: what the processes ``cpu_pids`` used from the first
    send to the last confirmation."""
    due_at_ms = -(-(wall_ms() + lead_ms) // 1000) * 1000 if lead_ms else 0
    rng = random.Random(DELAY_SEED)
    delays = [rng.randint(delay_low_ms, delay_high_ms) for _ in range(count)]
    next_seq = iter(range(count))
    failed: list[str] = []
    warm_up_due_ms = due_at_ms or wall_ms() + delay_low_ms
    await driver.send_at(subject, make_body(count, warm_up_due_ms), warm_up_due_ms)

    async def sender() -> None:
        for seq in next_seq:
            due_ms = due_at_ms or wall_ms() + delays[seq]
            try:
                await driver.send_at(subject, make_body(seq, due_ms), due_ms)
            except Exception as exc:  # counted and reported, never silently lost
                failed.append(f"{type(exc).__name__}: {exc}")

    server_cpu_s = servers_cpu_s(list(cpu_pids))
    started_ns, cpu_start_s = time.monotonic_ns(), time.process_time()
    await asyncio.gather(*(sender() for _ in range(DELAYED_IN_FLIGHT)))
    return {"start_ns": started_ns, "end_ns": time.monotonic_ns(), "end_wall_ms": wall_ms(),
            "due_at_ms": due_at_ms,
            "server_cpu_s": servers_cpu_s(list(cpu_pids)) - server_cpu_s,
            "cpu_s": time.process_time() - cpu_start_s, "failed": len(failed),
            "first_failure": failed[0] if failed else ""}


# ---------------------------------------------------------------------------- consumer


class Receiver:
    """What one consumer saw: first receipts by sequence number, duplicates, latencies (ns,
    from the send time in the body) and lateness (ms, from the due time in the body)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.seen = bytearray(count + 1)  # one more: the producer's warm-up message
        self.received = 0
        self.duplicates = 0
        self.latencies_ns: list[int] = []
        self.lateness_ms: list[int] = []
        self.first_wall_ms = 0
        self.last_wall_ms = 0
        self.last_ns = 0
        self.done = asyncio.Event()

    def on_message(self, body: bytes) -> None:
        """Record one delivery (before the driver acks it)."""
        now_ns, now_ms = time.monotonic_ns(), wall_ms()
        seq, sent_ns, due_ms = read_body(body)
        if seq >= self.count:
            return  # the warm-up message
        if self.seen[seq]:
            self.duplicates += 1
            return
        self.seen[seq] = 1
        self.received += 1
        self.latencies_ns.append(now_ns - sent_ns)
        if due_ms:
            self.lateness_ms.append(now_ms - due_ms)
        self.first_wall_ms = self.first_wall_ms or now_ms
        self.last_wall_ms, self.last_ns = now_ms, now_ns
        if self.received == self.count:
            self.done.set()

    def figures(self) -> dict[str, Any]:
        """Everything the orchestrator needs, JSON-ready."""
        latencies_ms = sorted(ns / 1e6 for ns in self.latencies_ns)
        lateness = sorted(self.lateness_ms)
        return {
            "received": self.received, "duplicates": self.duplicates,
            "missing": self.count - self.received,
            "missing_seqs": [seq for seq in range(self.count) if not self.seen[seq]][:100],
            "first_wall_ms": self.first_wall_ms, "last_wall_ms": self.last_wall_ms,
            "last_ns": self.last_ns,
            "latency_p50_ms": percentile(latencies_ms, 0.5),
            "latency_p99_ms": percentile(latencies_ms, 0.99),
            "latency_max_ms": latencies_ms[-1] if latencies_ms else float("nan"),
            "lateness_p50_ms": percentile(lateness, 0.5),
            "lateness_p99_ms": percentile(lateness, 0.99),
            "lateness_max_ms": lateness[-1] if lateness else float("nan"),
            "early": sum(1 for value in lateness if value < 0),
        }


async def consume(driver: Driver, subject: str, count: int, timeout_s: float, delayed: bool,
                  ready: Callable[[], None]) -> dict[str, Any]:
    """Receive ``count`` messages (or give up after ``timeout_s``); ``ready()`` is called once
    the consumer is set up and receiving, so the producer can start."""
    receiver = Receiver(count)
    stop = asyncio.Event()
    await driver.prepare_consumer(subject, delayed)
    task = asyncio.create_task(driver.consume(subject, receiver.on_message, stop))
    await asyncio.sleep(0.3)  # let the first pull or subscription reach the server
    if task.done():
        task.result()  # raises what went wrong
    ready()
    cpu_start_s = time.process_time()
    done = asyncio.create_task(receiver.done.wait())
    await asyncio.wait((task, done), timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    cpu_s = time.process_time() - cpu_start_s
    if task.done():
        task.result()  # the driver failed: raise its error rather than report missing messages
    done.cancel()
    # Stopped by asking, cancelled only if it does not stop: redis-py was seen to lose a
    # cancellation, its loop reading on as if nothing had happened.
    stop.set()
    await asyncio.wait((task,), timeout=CONSUMER_STOP_TIMEOUT_S)
    if not task.done():
        task.cancel()
        await asyncio.wait((task,), timeout=CONSUMER_STOP_TIMEOUT_S)
    await asyncio.gather(done, return_exceptions=True)
    return {**receiver.figures(), "cpu_s": cpu_s}
