"""``Committed``: the event loop's view of what the message store has committed, and the
wake-ups of the long polls waiting for more.

The send path adds each commit's runs (``add``); retention moves the first sequences up
(``retained``); the pull path reads the ends and firsts, takes fresh messages from the tail and
waits on a subject's event. Keeping this on the loop means a pull of a caught-up group asks no
I/O thread at all.
"""

from __future__ import annotations

import asyncio

from realtime.tail import Entry, Tail


class Committed:
    """Committed ends and first sequences per subject, the tail of recent messages, and the
    events long polls wait on.

    Owner: the event loop, for every field (``tail``, ``ends``, ``firsts``, ``stopping``, the
    events). The store thread never sees it: what it reports comes back through the loop.
    """

    def __init__(self, tail: Tail, ends: dict[str, int], firsts: dict[str, int]) -> None:
        self.tail = tail
        self.ends = ends  # subject -> sequence after its last committed message
        self.firsts = firsts  # subject -> its first sequence retention kept
        self.stopping = False  # end_long_polls() was called: waiting pulls answer at once
        self._events: dict[str, asyncio.Event] = {}  # subject -> set by its next commit

    def restart(self, ends: dict[str, int], firsts: dict[str, int]) -> None:
        """A copy became the master: what is committed is what its store says now; the tail
        starts empty (pulls of older messages read the store)."""
        self.tail = Tail(self.tail.bytes_max)
        self.ends = ends
        self.firsts = firsts
        self.stopping = False

    def add(self, subject: str, first: int, entries: list[Entry], size_bytes: int) -> None:
        """A committed run of ``subject`` (sequences from ``first``): into the tail."""
        self.tail.add(subject, first, entries, size_bytes)
        end = first + len(entries)
        if end > self.ends.get(subject, 0):
            self.ends[subject] = end
        self.firsts.setdefault(subject, first)

    def retained(self, firsts: dict[str, int]) -> None:
        """Retention deleted what lies below these first sequences."""
        for subject, first in firsts.items():
            self.firsts[subject] = first
            self.tail.drop_below(subject, first)

    def event(self, subject: str) -> asyncio.Event:
        """The event the next ``notify(subject)`` sets: a long poll waits on it."""
        event = self._events.get(subject)
        if event is None:
            event = self._events[subject] = asyncio.Event()
        return event

    def notify(self, subject: str) -> None:
        """Wake every long poll of ``subject`` (something was committed or released)."""
        event = self._events.pop(subject, None)
        if event is not None:
            event.set()

    def end_long_polls(self) -> None:
        """Answer every waiting long poll now, and every later one at once (shutdown)."""
        self.stopping = True
        for subject in list(self._events):
            self.notify(subject)


__all__ = ["Committed"]
