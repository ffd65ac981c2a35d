"""``PayloadPrefetch``: the payloads of messages due soon, read from the delay log before their
due time, so a hot slot's dispatch starts sending at the due instant instead of first reading
every payload (20,000 of them took ~50-110 ms of the delay-io thread and the GIL, with nothing
sent meanwhile: docs/BENCHMARKS.md "Where a hot slot's time goes").

The scheduler's timer hands it the waiting entries due within ``PREFETCH_AHEAD_MS``
(``start``); the dispatcher takes what it holds for a chunk (``take``), waiting for a read
still running rather than reading the same records again, and reads the rest itself. It only
ever holds copies of stored records: a payload is never sent before its entry is taken as due
by the timer (the dispatcher, not this, decides when to send), and what it holds is forgotten
when taken, cancelled (``drop``) or when its dispatcher is replaced. A failed read here is
logged and left to the dispatcher's own read, which retries and reports a bad record alone.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable, Iterable, Sequence

from delayserver.storage import DelayStore, ScheduleEntry

log = logging.getLogger(__name__)

Io = Callable[..., Awaitable[Any]]  # runs fn(*args) on the store's delay-io thread

# How far ahead of its due time a message's payload is read: long enough for a 20,000-message
# slot's reads on a loaded machine, short enough that little is held. The timer looks again at
# least every PREFETCH_AHEAD_MS // PREFETCH_LOOKS_PER_AHEAD while something waits that close.
PREFETCH_AHEAD_MS = 400
PREFETCH_LOOKS_PER_AHEAD = 4
# Most record bytes held read ahead (a record's size: its payload plus ~40 bytes); past this,
# later entries are read at their due time as before.
PREFETCH_BYTES_MAX = 32 * 1024 * 1024
# Entries read per store call, so the delay-io thread serves group commits between reads.
PREFETCH_READ_ENTRIES = 8_192


class PayloadPrefetch:
    """Read-ahead payloads of one dispatcher, keyed by delay-log offset.

    Threads: every field is owned by the event loop; the store is called only through ``io``.
    ``held``: offset -> (subject, payload) read; ``_reading``: offset -> the read (a future)
    that will fill it; ``held_bytes``: the record bytes of both (bounded by ``bytes_max``).
    """

    def __init__(self, store: DelayStore, io: Io, bytes_max: int = PREFETCH_BYTES_MAX) -> None:
        self.store = store
        self._io = io
        self.bytes_max = bytes_max
        self.held: dict[int, tuple[str, bytes]] = {}
        self._sizes: dict[int, int] = {}  # offset -> record bytes, for held and reading ones
        self._reading: dict[int, asyncio.Future[None]] = {}
        self.held_bytes = 0
        self._tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        """Entries held or being read."""
        return len(self._sizes)

    def start(self, entries: Iterable[ScheduleEntry]) -> int:
        """Begin reading the payloads of ``entries`` (waiting, due soon) that are not held or
        being read already, while under ``bytes_max``; returns how many reads were started."""
        sizes = self._sizes
        chosen: list[ScheduleEntry] = []
        room = self.bytes_max - self.held_bytes
        for entry in entries:
            key = entry.delay_log_offset
            if key in sizes:
                continue
            if entry.size_bytes > room:
                break
            room -= entry.size_bytes
            sizes[key] = entry.size_bytes
            chosen.append(entry)
        self.held_bytes = self.bytes_max - room
        for start in range(0, len(chosen), PREFETCH_READ_ENTRIES):
            part = chosen[start:start + PREFETCH_READ_ENTRIES]
            done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            for entry in part:
                self._reading[entry.delay_log_offset] = done
            task = asyncio.create_task(self._read(part, done), name="delay-prefetch")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return len(chosen)

    async def _read(self, part: list[ScheduleEntry], done: asyncio.Future[None]) -> None:
        try:
            subjects, payloads = await self._io(self.store.read_payloads, part)
        except Exception as exc:  # the dispatcher reads them again and reports each bad one
            log.info("reading %d payloads ahead of their due time failed: %s", len(part), exc)
            subjects, payloads = [], []
        finally:
            if not done.done():
                done.set_result(None)
        reading, held = self._reading, self.held
        for entry, subject, payload in zip(part, subjects, payloads):
            key = entry.delay_log_offset
            if reading.get(key) is done:  # not taken or dropped meanwhile
                del reading[key]
                held[key] = (subject, payload)
        for entry in part:  # a failed read: these are read at their due time
            key = entry.delay_log_offset
            if reading.get(key) is done:
                del reading[key]
                self._forget_size(key)

    async def take(self, chunk: Sequence[ScheduleEntry]) -> dict[int, tuple[str, bytes]]:
        """What is held for the entries of ``chunk`` (waiting for a read of them still
        running), as offset -> (subject, payload); those are no longer held. An entry missing
        from the answer is for the caller to read."""
        if not self._sizes:
            return {}
        waits = {id(f): f for e in chunk if (f := self._reading.get(e.delay_log_offset))}
        if waits:
            await asyncio.gather(*waits.values())
        got: dict[int, tuple[str, bytes]] = {}
        held_pop = self.held.pop
        for entry in chunk:
            key = entry.delay_log_offset
            pair = held_pop(key, None)
            if pair is not None:
                got[key] = pair
                self._forget_size(key)
        return got

    def drop(self, keys: Iterable[int]) -> None:
        """Forget what is held or being read for these delay-log offsets (cancelled)."""
        for key in keys:
            self.held.pop(key, None)
            self._reading.pop(key, None)
            self._forget_size(key)

    def _forget_size(self, key: int) -> None:
        size = self._sizes.pop(key, None)
        if size is not None:
            self.held_bytes -= size

    async def stop(self) -> None:
        """Cancel reads still running and forget everything held."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for done in set(self._reading.values()):
            if not done.done():
                done.set_result(None)
        self.held.clear()
        self._reading.clear()
        self._sizes.clear()
        self.held_bytes = 0


__all__ = ["PREFETCH_AHEAD_MS", "PREFETCH_BYTES_MAX", "PayloadPrefetch"]
