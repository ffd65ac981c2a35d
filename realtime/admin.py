"""Admin reads and purges over a realtime broker's storage: the ``subjects``, ``browse`` and
``purge`` ops (docs/PROTOCOL.md), used by the MetaServer's dead-letter API.

Nothing here consumes: ``browse`` reads stored messages without a group and without touching any
pull log, so it can show dead letters (``%dead%<subject>%<group>``) or any other subject as they
are.

The purge watermark of a subject is the cursor of a reserved pull-log group, ``%admin``
(``ADMIN_GROUP``; ``%`` never starts a consumer group name, so it cannot collide). Sequences
below the watermark are purged: ``browse`` does not show them and ``subjects`` reports the
watermark as ``purged_before``. Because the broker's retention keeps everything a pull-log group
still needs, a subject whose ``%admin`` group exists keeps its unpurged messages until a purge
moves the watermark on (or retention's hard cap strikes). What this does NOT do: delete bytes.
Purged messages stay on disk until retention removes their segments, and a subject that never
got an ``%admin`` group is kept only as long as time retention allows.

Two layers, as everywhere in the broker:

* ``StorageAdmin`` holds synchronous steps over the two stores. The broker calls the
  ``MessageStore`` only on its store thread and the ``PullLogStore`` only on its pull-log thread,
  so each step touches exactly one store; the step names say which (``*_store`` / ``*_pulllog``).
  ``subjects``/``browse``/``purge`` chain the steps for a caller that owns both stores on one
  thread (tests, tools).
* ``BrokerAdmin`` chains the same steps through the broker's two I/O runners and answers the
  requests for the server.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, TypeVar

from pulllog import PullLogStore
from realtime.pulls import PULL_RESPONSE_PAYLOAD_BYTES_MAX
from realtime.storage import CorruptEntry, MessageStore, SequenceOutOfRange
from wire.errors import BadRequest, NotFound
from wire.message import DEAD_PREFIX
from wire.protocol import Browse, Purge, Subjects, browsed_message

log = logging.getLogger(__name__)
T = TypeVar("T")

# The reserved pull-log group (and its one consumer) whose cursor is a subject's purge watermark.
ADMIN_GROUP = "%admin"

# A ``subjects`` answer lists at most this many subjects (sorted), then says ``truncated``.
# 10,000 entries of the longest subject name stay far below MAX_FRAME_BYTES.
SUBJECTS_LISTED_MAX = 10_000

# Consumer-log entries one ``browse`` looks at, so a long run of holes cannot stall the thread.
BROWSE_SCAN_ENTRIES_MAX = 10_000

Runner = Callable[..., Awaitable[Any]]


@dataclass(frozen=True)
class SubjectRange:
    """A stored subject: readable sequences are [first_sequence, end_sequence)."""

    subject: str
    first_sequence: int
    end_sequence: int


@dataclass(frozen=True)
class BrowseResult:
    """What one browse read: ``(sequence, payload)`` pairs and where the next browse starts."""

    messages: list[tuple[int, bytes]]
    next_sequence: int
    first_sequence: int
    end_sequence: int
    purged_before: int
    unreadable: list[int]  # sequences whose stored bytes failed verification (logged)


def purged_before(first_sequence: int, watermark: int | None) -> int:
    """The effective watermark: never below what retention already deleted."""
    return first_sequence if watermark is None else max(first_sequence, watermark)


class StorageAdmin:
    """Admin steps over one broker's ``MessageStore`` and ``PullLogStore`` (see the module doc).

    ``payload_bytes_max`` is the browse answer's payload budget: the same one pulls use, so a
    browse answer always fits in a frame; one message is always returned even if it alone is
    larger (a body is at most MAX_BODY_BYTES, below the budget).
    """

    def __init__(self, store: MessageStore, pulllog: PullLogStore,
                 payload_bytes_max: int = PULL_RESPONSE_PAYLOAD_BYTES_MAX) -> None:
        assert payload_bytes_max > 0, payload_bytes_max
        self.store = store
        self.pulllog = pulllog
        self.payload_bytes_max = payload_bytes_max

    # ------------------------------------------------------------------ store thread

    def ranges_store(self, prefix: str) -> tuple[list[SubjectRange], bool]:
        """Stored subjects starting with ``prefix`` (sorted, at most SUBJECTS_LISTED_MAX) and
        whether more were left out."""
        store = self.store
        names = [s for s in store.subjects() if s.startswith(prefix)]
        truncated = len(names) > SUBJECTS_LISTED_MAX
        return [SubjectRange(s, store.first_sequence(s), store.end_sequence(s))
                for s in names[:SUBJECTS_LISTED_MAX]], truncated

    def range_store(self, subject: str) -> SubjectRange:
        """The subject's stored range; NotFound when this broker never stored a message of it."""
        store = self.store
        end = store.end_sequence(subject)
        if end == 0:
            raise NotFound(f"subject {subject!r} is not stored on this broker")
        return SubjectRange(subject, store.first_sequence(subject), end)

    def read_store(self, subject: str, from_sequence: int | None, watermark: int | None,
                   max_count: int) -> BrowseResult:
        """Up to ``max_count`` readable messages from ``from_sequence`` (None: the watermark),
        never below the watermark, within the payload budget."""
        assert max_count >= 1, max_count
        span = self.range_store(subject)
        floor = purged_before(span.first_sequence, watermark)
        sequence = floor if from_sequence is None else max(from_sequence, floor)
        stop = min(span.end_sequence, sequence + BROWSE_SCAN_ENTRIES_MAX)
        budget_bytes = self.payload_bytes_max
        messages: list[tuple[int, bytes]] = []
        unreadable: list[int] = []
        while sequence < stop and len(messages) < max_count:
            try:
                payload = self.store.read(subject, sequence).payload
            except SequenceOutOfRange:
                sequence += 1  # a hole: nothing was ever stored at this sequence
                continue
            except CorruptEntry as exc:
                log.error("browse of %s skips sequence %d: %s", subject, sequence, exc)
                unreadable.append(sequence)
                sequence += 1
                continue
            if messages and len(payload) > budget_bytes:
                break  # the rest comes with the next browse
            messages.append((sequence, payload))
            budget_bytes -= len(payload)
            sequence += 1
        return BrowseResult(messages, sequence, span.first_sequence, span.end_sequence, floor,
                            unreadable)

    # ------------------------------------------------------------------ pull-log thread

    def watermarks_pulllog(self, subjects: list[str]) -> dict[str, int]:
        """The purge watermark of each subject that has one."""
        pulllog = self.pulllog
        return {s: pulllog.cursor(s, ADMIN_GROUP) for s in subjects
                if pulllog.has_group(s, ADMIN_GROUP)}

    def watermark_pulllog(self, subject: str) -> int | None:
        """The subject's purge watermark, None when it was never purged or protected."""
        return self.watermarks_pulllog([subject]).get(subject)

    def ensure_watermark_pulllog(self, subject: str, first_sequence: int, now_ms: int) -> int:
        """Create the subject's ``%admin`` group at ``first_sequence`` if it has none, so that
        retention keeps its messages from there on; returns the watermark."""
        return self.pulllog.ensure_group(subject, ADMIN_GROUP, first_sequence, now_ms).cursor

    def advance_pulllog(self, span: SubjectRange, through_sequence: int,
                        now_ms: int) -> tuple[int, int]:
        """Move the watermark to ``through_sequence + 1``, capped at the end, never backwards;
        returns (purged_before before, purged_before after)."""
        check_purgeable(span.subject)
        cursor = self.ensure_watermark_pulllog(span.subject, span.first_sequence, now_ms)
        target = min(through_sequence + 1, span.end_sequence)
        if target > cursor:
            self.pulllog.record_pull(span.subject, ADMIN_GROUP, ADMIN_GROUP, [], target, now_ms)
        before = purged_before(span.first_sequence, cursor)
        return before, max(before, target)

    def retention_floor_pulllog(self, subject: str) -> int | None:
        """The lowest sequence of ``subject`` some pull-log group (``%admin`` included) still
        needs, i.e. where retention must keep it from; None when no group reads it."""
        needed = [self.pulllog.lowest_needed_sequence(s, g)
                  for s, g in self.pulllog.groups() if s == subject]
        return min(needed) if needed else None

    # ------------------------------------------------------------------ both, one owner

    def subjects(self, prefix: str) -> dict[str, Any]:
        """The ``subjects`` answer, for a caller owning both stores on one thread."""
        spans, truncated = self.ranges_store(prefix)
        return subjects_answer(spans, truncated,
                               self.watermarks_pulllog([s.subject for s in spans]))

    def browse(self, subject: str, from_sequence: int | None, max_count: int) -> dict[str, Any]:
        """The ``browse`` answer, for a caller owning both stores on one thread."""
        watermark = self.watermark_pulllog(subject)
        return browse_answer(self.read_store(subject, from_sequence, watermark, max_count))

    def purge(self, subject: str, through_sequence: int, now_ms: int) -> dict[str, Any]:
        """The ``purge`` answer, for a caller owning both stores on one thread."""
        check_purgeable(subject)
        before, after = self.advance_pulllog(self.range_store(subject), through_sequence, now_ms)
        return purge_answer(before, after)


def check_purgeable(subject: str) -> None:
    """BadRequest unless ``subject`` is a dead-letter subject (only those may be purged)."""
    if not subject.startswith(DEAD_PREFIX):
        raise BadRequest(f"subject {subject!r} is not a dead-letter subject: only "
                         f"{DEAD_PREFIX}<subject>%<group> subjects can be purged")


def subjects_answer(spans: list[SubjectRange], truncated: bool,
                    watermarks: dict[str, int]) -> dict[str, Any]:
    """``{subjects: [{subject, first_sequence, end_sequence, purged_before}], truncated}``."""
    return {
        "subjects": [{"subject": s.subject, "first_sequence": s.first_sequence,
                      "end_sequence": s.end_sequence,
                      "purged_before": purged_before(s.first_sequence, watermarks.get(s.subject))}
                     for s in spans],
        "truncated": truncated,
    }


def browse_answer(result: BrowseResult) -> dict[str, Any]:
    """``{messages: [{sequence, payload}], next_sequence, first_sequence, end_sequence,
    purged_before, unreadable}``."""
    return {
        "messages": [browsed_message(seq, payload) for seq, payload in result.messages],
        "next_sequence": result.next_sequence,
        "first_sequence": result.first_sequence,
        "end_sequence": result.end_sequence,
        "purged_before": result.purged_before,
        "unreadable": result.unreadable,
    }


def purge_answer(before: int, after: int) -> dict[str, Any]:
    """``{purged_before, purged}``: the new watermark and how many sequences it passed."""
    return {"purged_before": after, "purged": after - before}


class BrokerAdmin:
    """Answers ``subjects``/``browse``/``purge`` for a running broker, running each
    ``StorageAdmin`` step on the thread that owns its store."""

    def __init__(self, storage: StorageAdmin, *, on_store_thread: Runner,
                 on_pulllog_thread: Runner, clock: Callable[[], int]) -> None:
        self.storage = storage
        self._on_store_thread = on_store_thread
        self._on_pulllog_thread = on_pulllog_thread
        self.clock = clock

    async def answer(self, request: Subjects | Browse | Purge) -> dict[str, Any]:
        """The response map of one admin request."""
        if isinstance(request, Subjects):
            return await self.subjects(request.prefix)
        if isinstance(request, Browse):
            return await self.browse(request.subject, request.from_sequence, request.max_count)
        return await self.purge(request.subject, request.through_sequence)

    async def subjects(self, prefix: str) -> dict[str, Any]:
        spans, truncated = await self._on_store_thread(self.storage.ranges_store, prefix)
        watermarks = await self._on_pulllog_thread(self.storage.watermarks_pulllog,
                                                   [s.subject for s in spans])
        return subjects_answer(spans, truncated, watermarks)

    async def browse(self, subject: str, from_sequence: int | None,
                     max_count: int) -> dict[str, Any]:
        watermark = await self._on_pulllog_thread(self.storage.watermark_pulllog, subject)
        result = await self._on_store_thread(self.storage.read_store, subject, from_sequence,
                                             watermark, max_count)
        return browse_answer(result)

    async def purge(self, subject: str, through_sequence: int) -> dict[str, Any]:
        check_purgeable(subject)
        span = await self._on_store_thread(self.storage.range_store, subject)
        before, after = await self._on_pulllog_thread(self.storage.advance_pulllog, span,
                                                      through_sequence, self.clock())
        return purge_answer(before, after)

    async def protect(self, subject: str) -> int:
        """Give ``subject`` a purge watermark at its first sequence (if it has none), so that
        retention keeps its messages until they are purged; returns the watermark."""
        span = await self._on_store_thread(self.storage.range_store, subject)
        return await self._on_pulllog_thread(self.storage.ensure_watermark_pulllog, subject,
                                             span.first_sequence, self.clock())

    async def retention_floor(self, subject: str) -> int | None:
        """Where retention must keep ``subject`` from, as the pull log says (None: anywhere)."""
        return await self._on_pulllog_thread(self.storage.retention_floor_pulllog, subject)


__all__ = [
    "ADMIN_GROUP", "BROWSE_SCAN_ENTRIES_MAX", "BrokerAdmin", "BrowseResult", "SUBJECTS_LISTED_MAX",
    "StorageAdmin", "SubjectRange", "check_purgeable", "purged_before",
]
