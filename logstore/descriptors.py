"""``DescriptorCache``: a bounded, least-recently-used set of open file handles, shared by every
file of one store that is opened on demand (a broker's consumer logs: one file per subject).

Why: a broker with 10,000 subjects would otherwise keep 10,000 descriptors open, past the usual
limit of 1024 for a service, and every commit then fails with ``EMFILE``. Kafka and the NATS
server bound the open files of a store the same way: files are opened on use and the least
recently used one is closed when the budget is spent; the budget is sized from the process's
open-files limit by the server (``serverkit.open_files``), not read here.

What it does:

- ``get(path)`` returns the open handle of ``path``, opening it (and closing the least recently
  used one beyond ``capacity``) when needed. A handle is only valid until the next ``get``: the
  owner never keeps one across calls.
- A handle closed by eviction may hold written data not yet fsynced. That is safe because fsync
  works on the file, not the descriptor: the owner remembers which files it wrote and fsyncs
  them later through a fresh ``get`` (Linux reports a writeback error to a descriptor opened
  after it, as long as nobody has seen it yet; see fsync(2) and the kernel's errseq).
- **No EMFILE fails an operation that one descriptor could do.** Every open goes through
  ``retry_on_emfile``: on ``EMFILE``/``ENFILE`` it closes every handle the cache holds and, if
  it held none, the one spare descriptor it keeps in reserve, then tries once more. So a store
  whose process ran out of descriptors (sockets of many clients, say) still indexes a commit:
  one file at a time, each opened and soon closed again. ``opener()`` wraps any opener the same
  way, for the store's other files (message-log segments, checkpoints).

What it does NOT do: it is not thread-safe (the store's one thread owns it), it does not fsync
on eviction (see above), and it cannot help when the process holds no descriptor it may close.
"""

from __future__ import annotations

import errno
import os
from collections import OrderedDict
from typing import Callable, TypeVar

from logstore.fileio import FileHandle, Opener

T = TypeVar("T")

# Fewest handles a cache may be given: below this a scan across a file boundary thrashes.
CAPACITY_MIN = 2
# errnos that mean "no descriptor left" (this process's limit, or the system's).
_OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE)


def out_of_descriptors(exc: BaseException) -> bool:
    """True when ``exc`` is an OSError saying the process (or system) has no descriptor left."""
    return isinstance(exc, OSError) and exc.errno in _OUT_OF_DESCRIPTORS


class DescriptorCache:
    """Open handles by path, at most ``capacity`` of them, least recently used closed first.

    Owner: the one thread that calls the store it belongs to (every field).
    """

    def __init__(self, opener: Opener, capacity: int) -> None:
        if type(capacity) is not int or capacity < CAPACITY_MIN:
            raise ValueError(f"descriptor cache capacity {capacity!r} is below its minimum "
                             f"CAPACITY_MIN {CAPACITY_MIN}")
        self._opener = opener
        self.capacity = capacity
        self._handles: OrderedDict[str, FileHandle] = OrderedDict()
        self._spare = self._take_spare()  # -1 when none could be had
        self.opened = 0  # files opened so far (a miss)
        self.evicted = 0  # handles closed to stay within capacity
        self.relieved = 0  # times an open ran out of descriptors and the cache let go of its own

    @property
    def open_count(self) -> int:
        """Handles open now (the spare descriptor not counted)."""
        return len(self._handles)

    def get(self, path: str) -> FileHandle:
        """The open handle of ``path``: valid until the next call on this cache."""
        handles = self._handles
        handle = handles.get(path)
        if handle is not None:
            handles.move_to_end(path)
            return handle
        while len(handles) >= self.capacity:
            _, old = handles.popitem(last=False)
            old.close()
            self.evicted += 1
        handle = self.retry_on_emfile(self._opener, path)
        self.opened += 1
        handles[path] = handle
        assert len(handles) <= self.capacity, (len(handles), self.capacity)
        return handle

    def cached(self, path: str) -> FileHandle | None:
        """``get(path)`` when its handle is open already, else None (nothing is opened)."""
        handle = self._handles.get(path)
        if handle is not None:
            self._handles.move_to_end(path)
        return handle

    def discard(self, path: str) -> None:
        """Close ``path``'s handle if open (before the file is deleted or renamed)."""
        handle = self._handles.pop(path, None)
        if handle is not None:
            handle.close()

    def opener(self, inner: Opener) -> Opener:
        """``inner``, with an open that ran out of descriptors retried after ``relieve``."""

        def open_relieved(path: str) -> FileHandle:
            return self.retry_on_emfile(inner, path)

        return open_relieved

    def retry_on_emfile(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)``; when it fails for want of a descriptor, ``relieve`` and call it once
        more (a second failure propagates)."""
        try:
            result = fn(*args)
        except OSError as exc:
            if not out_of_descriptors(exc):
                raise
            self.relieve()
            result = fn(*args)
        if self._spare < 0:
            self._spare = self._take_spare()  # got one back since: keep it for the next time
        return result

    def relieve(self) -> None:
        """Give descriptors back to the process: close every cached handle, and the spare one
        when there was none to close."""
        self.relieved += 1
        if self._handles:
            for handle in self._handles.values():
                handle.close()
            self.evicted += len(self._handles)
            self._handles.clear()
        elif self._spare >= 0:
            os.close(self._spare)
            self._spare = -1

    def close(self) -> None:
        """Close every handle and the spare descriptor (idempotent)."""
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()
        if self._spare >= 0:
            os.close(self._spare)
            self._spare = -1

    @staticmethod
    def _take_spare() -> int:
        """One descriptor held in reserve for the moment the process has none left."""
        try:
            return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return -1


__all__ = ["CAPACITY_MIN", "DescriptorCache", "out_of_descriptors"]
