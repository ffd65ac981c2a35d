"""A pull that the pull log plans and records (``PullPlanning``, a mixin of ``Pulls``): the
group's redeliveries and cursor asked of the pull log, the entries taken from the tail or read
from the message store, and the pull recorded in the pulling consumer's pull log, answered as
the columns of the pull response (``Pulled``). ``Pulls`` (realtime/pulls.py) decides when a
pull runs, parks or wakes; this is what one attempt takes and records.
Owners as ``Pulls`` says: methods ending in ``_io`` run on the thread their first docstring
line names, every other one on the event loop.
"""

from __future__ import annotations

import logging
from typing import NamedTuple, Sequence

from realtime.context import BrokerContext
from realtime.pull_reads import read_for_pull_io
from wire.limits import MAX_BODY_BYTES, MAX_FRAME_BYTES
from wire.protocol import Pull

log = logging.getLogger("realtime.pulls")

# A pull response stops growing at this many payload bytes so the frame stays under
# MAX_FRAME_BYTES with room for the envelope; one message always fits (bodies <= MAX_BODY_BYTES).
PULL_RESPONSE_PAYLOAD_BYTES_MAX = MAX_FRAME_BYTES - MAX_BODY_BYTES // 2

# Consumer-log entries one pull looks at (after tag and expiry filtering) before it answers.
PULL_SCAN_ENTRIES_MAX = 10_000


class Pulled(NamedTuple):
    """What a pull hands out, as the columns of the pull response (docs/PROTOCOL.md): entry i
    is ``payloads[i]`` under pull seq ``pull_seqs[i]``, handed out ``redelivered[i]`` times
    before."""

    pull_seqs: Sequence[int]
    payloads: Sequence[bytes]
    redelivered: Sequence[int]


NOTHING_PULLED = Pulled((), (), ())


class PullPlanning:
    """The pull log's part of a pull (``Pulls`` owns every field used here)."""

    _ctx: BrokerContext

    async def _pull_planned(self, request: Pull, key: str, tags: frozenset[str],
                            ) -> tuple[Pulled, int, bool]:
        """Ask the pull log for the group's redeliveries and cursor, take the entries (tail or
        store) and record them. Returns them, the new cursor, and whether the redelivery queue
        was drained."""
        subject = request.subject
        ctx = self._ctx
        committed = ctx.committed
        start = (committed.ends if request.start == "latest" else committed.firsts).get(subject, 0)
        redeliveries, cursor = await ctx.on_pulllog_thread(
            self._plan_pull_io, subject, key, start, request.max_count, ctx.clock())
        drained = len(redeliveries) < request.max_count
        end = committed.ends.get(subject, 0)
        if not redeliveries and cursor >= end:
            return NOTHING_PULLED, cursor, drained
        now_ms = ctx.clock()
        payloads: dict[int, bytes] = {}
        missing = []
        for seq in redeliveries:
            cached = committed.tail.get(subject, seq)
            if cached is None:
                missing.append(seq)
            else:
                payloads[seq] = cached[0]
        remaining = request.max_count - len(redeliveries)
        tail = committed.tail.covering(subject, cursor) if remaining > 0 else None
        expired: list[bytes] | None = [] if ctx.tracer.enabled else None
        if missing or (remaining > 0 and cursor < end and tail is None):
            # Behind the tail: read the message store (queued behind any commit).
            unreadable: list[tuple[int, str | None]] = []
            found, new_cursor = await ctx.on_store_thread(
                read_for_pull_io, ctx.store, subject, missing, cursor if tail is None else end,
                end, remaining, tags, now_ms, PULL_RESPONSE_PAYLOAD_BYTES_MAX, expired,
                unreadable)
            if unreadable:  # passed over for good: a give-up, traced with its reason
                log.error("pull of %s for %s passed over %d unreadable records (sequences %s)",
                          subject, key, len(unreadable), [seq for seq, _ in unreadable][:10])
                ctx.tracer.records_unreadable(subject, key, unreadable, now_ms)
            payloads.update(found)
            scanned = [seq for seq in found if seq not in redeliveries]
        else:
            scanned, new_cursor = [], cursor
        chosen = list(redeliveries) + scanned
        if tail is not None:
            budget_bytes = PULL_RESPONSE_PAYLOAD_BYTES_MAX - sum(map(len, payloads.values()))
            new_cursor = tail.take(cursor, min(end, cursor + PULL_SCAN_ENTRIES_MAX), remaining,
                                   tags, now_ms, budget_bytes, payloads, chosen, expired)
        if not chosen and new_cursor == cursor:
            return NOTHING_PULLED, cursor, drained
        out = await ctx.on_pulllog_quick(self._record_pull_io, request, key, chosen,
                                          new_cursor, payloads, now_ms, None)
        assert out is not None  # no expected cursor: never refused
        if expired:
            ctx.tracer.expired(expired, key, now_ms)
        return out, new_cursor, drained

    def _plan_pull_io(self, subject: str, key: str, start: int, max_count: int,
                      now_ms: int) -> tuple[list[int], int]:
        """Pull-log thread: the group's redeliveries to take now (up to ``max_count``) and its
        cursor; a group pulling for the first time starts at ``start``."""
        pulllog = self._ctx.pulllog
        if not pulllog.has_group(subject, key):
            pulllog.ensure_group(subject, key, start, now_ms)
        return pulllog.take_redeliveries(subject, key, max_count), pulllog.cursor(subject, key)

    def _record_pull_io(self, request: Pull, key: str, chosen: list[int], new_cursor: int,
                        payloads: dict[int, bytes], now_ms: int,
                        expected_cursor: int | None) -> Pulled | None:
        """Pull log (``on_pulllog_quick``: its thread, or the event loop when that is idle):
        record the pull; None (nothing recorded) if ``expected_cursor`` is
        given and the group's cursor is not there or entries wait for redelivery. The answer is
        built as columns straight from the recorded batch: nothing is built per message."""
        ctx = self._ctx
        pulllog = ctx.pulllog
        subject = request.subject
        consumer_id = request.consumer_id
        if expected_cursor is None:
            batch = pulllog.record_pull(subject, key, consumer_id, chosen, new_cursor, now_ms)
        else:
            tail_batch = pulllog.record_tail_pull(subject, key, consumer_id, chosen, new_cursor,
                                                  now_ms, expected_cursor)
            if tail_batch is None:
                return None
            batch = tail_batch
        log_seqs = batch.consumer_log_seqs
        if not log_seqs:
            return NOTHING_PULLED
        first = batch.first_pull_seq
        count = len(log_seqs)  # of each column (the redelivered one too: one per entry)
        pull_seqs: list[int] = list(range(first, first + count))
        chosen_payloads = list(map(payloads.__getitem__, log_seqs))
        redelivered = batch.redelivered
        if b"" in chosen_payloads:
            # Not deliverable (a redelivery whose message is gone): ack it at once so it does
            # not come back forever. Rare: the columns are rebuilt without those entries.
            keep = [i for i, payload in enumerate(chosen_payloads) if payload]
            # One ack action for all of them, not one each: a quick call (on the event loop)
            # may record at most IN_MEMORY_ACTIONS_MAX actions, and a pull can find a whole
            # batch unreadable.
            pulllog.record_ack(subject, key, consumer_id,
                               [(pull_seqs[i], pull_seqs[i])
                                for i in range(len(log_seqs)) if not chosen_payloads[i]],
                               now_ms)
            ctx.tracer.redeliveries_unreadable(  # a give-up: traced with its reason
                subject, key, [s for s, p in zip(log_seqs, chosen_payloads) if not p], now_ms)
            pull_seqs = [pull_seqs[i] for i in keep]
            log_seqs = tuple(log_seqs[i] for i in keep)
            chosen_payloads = [chosen_payloads[i] for i in keep]
            if redelivered is not None:
                redelivered = [redelivered[i] for i in keep]
            count = len(keep)
            assert len(pull_seqs) == len(chosen_payloads) == count
        if redelivered is None:
            times = [0] * count
        else:
            times = redelivered
            assert len(redelivered) == count, (len(redelivered), count)
            again = count - redelivered.count(0)
            ctx.stats["redelivered"] += again
            if again:
                by_group = ctx.redelivered_by_group
                by_group[(subject, key)] = by_group.get((subject, key), 0) + again
        ctx.stats["pulled"] += count
        if ctx.tracer.enabled:
            ctx.tracer.pulled_columns(subject, key, consumer_id, pull_seqs, chosen_payloads,
                                      redelivered, now_ms, log_seqs)
        return Pulled(pull_seqs, chosen_payloads, times)


__all__ = ["NOTHING_PULLED", "PULL_RESPONSE_PAYLOAD_BYTES_MAX", "PULL_SCAN_ENTRIES_MAX",
           "PullPlanning", "Pulled"]
