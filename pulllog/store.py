"""``PullLogStore``: per-group cursors, per-consumer pull logs, acks and the redelivery queue.

Every change is an action (``pulllog.actions``) appended to a ``SegmentedLog`` under
``<directory>/actions/`` and then applied to the in-memory ``PullState``; opening replays the
actions after the newest checkpoint (``pulllog.snapshot``, stored by ``CheckpointStore`` in
``<directory>``). The invariant kept: every consumer-log seq in [start_sequence, cursor) of a group
is exactly one of acked (or passed over by a filter), held by exactly one consumer, or queued for
redelivery. Nothing on this path drops an entry.

Durability (``PullLogConfig.flush_mode``):
- ``"async"`` (default): appends are fsynced by ``tick(now_ms)`` every ``flush_interval_ms``. A
  crash loses the last unsynced actions. That is safe because pull state is recoverable by
  redelivery: a lost PULL puts the cursor back (its entries are handed out again), a lost ACK
  leaves the entry held (it is redelivered after its ack timeout), a lost RELEASE or
  CONSUMER_REMOVED happens again. So acked entries may be delivered again (at-least-once); none
  is lost. After such a crash (the log does not end with CLOSED; every open fsyncs an OPENED
  first) recovery starts a new pull-seq epoch, so that acks for pull seqs handed out before the
  crash and not recorded cannot ack a different entry.
- ``"sync"``: every mutating call fsyncs before it returns (no group commit here; the server can
  batch its calls between syncs with async mode and ``sync()``).

Flush, fsync, checkpoints, the clean close and what a full disk or a failed write does are in
``pulllog.durability`` (``DurabilityMixin``); replication in ``pulllog.copying``. Not
thread-safe: one owner calls it.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import os
from typing import Sequence

from logstore import (
    CheckpointStore,
    DiskFull,
    LogConfig,
    LogStoreError,
    Opener,
    OsFile,
    SegmentedLog,
)
from pulllog.actions import (
    RELEASE_REASON_ACK_TIMEOUT,
    U64_MAX,
    Ack,
    Action,
    Closed,
    ConsumerRemoved,
    EpochStarted,
    GroupCreated,
    Opened,
    Pull,
    Release,
    decode_action,
    encode_action,
    encode_checked_pull,
)
from pulllog.config import PullLogConfig, PullLogRecovery
from pulllog.copying import CopyingMixin
from pulllog.durability import DurabilityMixin
from pulllog.errors import ActionLogGap, CorruptAction, CorruptCheckpoint, UnknownGroup
from pulllog.snapshot import decode_snapshot
from pulllog.state import (
    PULL_SEQ_EPOCH_SHIFT,
    ConsumerState,
    GroupData,
    GroupState,
    PulledBatch,
    PulledEntry,
    PullState,
)

log = logging.getLogger(__name__)

ACTIONS_DIRECTORY = "actions"
CHECKPOINT_NAME = "pullstate"
# The room in the action log's write buffer under which ``writes_stay_in_memory`` says no: the
# largest pull (MAX_PULL_BATCH_MESSAGES entries, ~10 KB) or ack (MAX_ACK_RANGES ranges, ~20 KB
# per group) fits. A bigger one would only write the buffer to the OS early (no fsync).
IN_MEMORY_ROOM_BYTES_MIN = 64 << 10
# Actions one such call may record (an ack in each group of a consumer; a pull and the acks of
# entries it found unreadable): ``writes_stay_in_memory`` says no this close to a checkpoint.
IN_MEMORY_ACTIONS_MAX = 16


def _check_name(kind: str, value: object) -> None:
    if type(value) is not str or not value:
        raise ValueError(f"{kind} {value!r} must be a non-empty string")


def _all_uints(values: tuple) -> bool:
    """Every value an int in [0, U64_MAX], checked with C loops (no call per value)."""
    return set(map(type, values)) == {int} and min(values) >= 0 and max(values) <= U64_MAX


def _check_uint(kind: str, value: object) -> None:
    if type(value) is not int or not 0 <= value <= U64_MAX:
        raise ValueError(f"{kind} {value!r} must be an integer in [0, {U64_MAX}]")


class PullLogStore(CopyingMixin, DurabilityMixin):
    """Pull logs, acks and redelivery for every (subject, group) of one broker."""

    def __init__(self, directory: str, config: PullLogConfig = PullLogConfig(), *,
                 opener: Opener = OsFile, follower: bool = False) -> None:
        self.directory = directory
        self.config = config
        # A follower (a slave's copy, pulllog.copying) writes no action of its own: its action
        # log holds exactly the master's bytes. ``promote`` makes it a store that writes.
        self._follower = follower
        self._closed = False
        self._failed: LogStoreError | None = None
        self._unlogged: DiskFull | None = None  # the disk filled: changes live in memory only
        self._unlogged_retry_at_ms = 0
        os.makedirs(directory, exist_ok=True)
        self._checkpoints = CheckpointStore(directory, CHECKPOINT_NAME, keep=config.checkpoints_kept)
        checkpoint = self._checkpoints.load_latest()
        if checkpoint is None:
            state, offset, retained = PullState(), 0, []
        else:
            try:
                state, offset, retained = decode_snapshot(checkpoint.payload)
            except ValueError as exc:
                raise CorruptCheckpoint(checkpoint.path, str(exc)) from exc
        self._state = state
        self._log = self._open_log(opener, verify_from_offset=offset)
        lost_tail = offset > self._log.end_offset
        if lost_tail:
            # The log lost records the checkpoint covers, so nothing was verified; verify it all
            # (a torn record may sit at its end) before appending anything.
            self._log.close()
            self._log = self._open_log(opener, verify_from_offset=0)
        try:
            replayed, last = self._replay(offset)
        except BaseException:
            self._log.close()
            raise
        self._kept_offsets = retained + [offset] if checkpoint is not None else []
        self._actions_since_checkpoint = replayed
        untorn = self._log.recovery.truncation is None
        fresh = checkpoint is None and self._log.end_offset == 0
        # Whether the log ends as a clean close left it (or is new): then the pull seqs it
        # handed out are all recorded and the epoch may stay (``_begin_session``).
        self._clean_end = untorn and (fresh or isinstance(last, Closed))
        if lost_tail and follower:
            # The checkpoint covers copied actions the log lost: state and log disagree, so the
            # copy starts again (from the master's log start or its snapshot).
            self._state, self._kept_offsets, self._actions_since_checkpoint = PullState(), [], 0
            self._log.reset(0)
            self._checkpoints.delete_after(0)
        elif lost_tail:
            # The old checkpoint's offset may now fall inside a record: start over from here.
            self._kept_offsets = []
            self.checkpoint()
        clean = self._clean_end
        if not follower:
            self._begin_session()
        self.recovery = PullLogRecovery(
            checkpoint.sequence if checkpoint else None, offset, replayed, self._log.recovery,
            clean, self._state.epoch,
        )
        if not clean:
            log.warning("pull log %s: unclean shutdown; replayed %d actions, epoch %s",
                        directory, replayed,
                        "to be raised when it serves" if follower else self._state.epoch)

    def _begin_session(self) -> None:
        """Start writing: a new pull-seq epoch unless the log ends cleanly, then OPENED."""
        if not self._clean_end:
            # Pull seqs handed out in actions that did not survive (or, for a promoted copy,
            # were never copied) must never be reused. The new epoch goes into a checkpoint at
            # once, so no later torn tail can take it back.
            self._write(EpochStarted(self._state.epoch + 1))
            self.checkpoint()
        # Durable before anything is handed out: if this session crashes, the log no longer ends
        # with the last session's CLOSED, so the next open starts a new epoch.
        self._write(Opened())
        self._guarded(self._log.sync)
        self._clean_end = False

    def _open_log(self, opener: Opener, verify_from_offset: int) -> SegmentedLog:
        config = self.config
        return SegmentedLog(
            os.path.join(self.directory, ACTIONS_DIRECTORY),
            LogConfig(
                segment_size_bytes_max=config.segment_size_bytes_max,
                record_size_bytes_max=config.action_size_bytes_max,
                flush_mode=config.flush_mode,
                flush_interval_ms=config.flush_interval_ms,
            ),
            opener=opener,
            verify_from_offset=verify_from_offset,
        )

    def _replay(self, offset: int) -> tuple[int, Action | None]:
        if offset < self._log.first_offset:
            raise ActionLogGap(offset, self._log.first_offset)
        if offset >= self._log.end_offset:
            return 0, None
        count = 0
        last: Action | None = None
        for at, body in self._log.iterate(offset):
            try:
                action = decode_action(body)
                self._state.check(action)
            except ValueError as exc:
                raise CorruptAction(at, str(exc)) from exc
            self._state.apply(action)
            count += 1
            last = action
        return count, last

    # ------------------------------------------------------------------ writing

    def _write(self, action: Action) -> object:
        """Log ``action``, apply it, and sync / checkpoint as configured; returns apply's result."""
        assert not self._follower, "a follower's pull log records only what it copies"
        if self._failed is not None:
            raise self._failed
        self._state.check(action)
        if self._unlogged is None:
            self._append(encode_action(action))
        result = self._state.apply(action)
        self._written()
        return result

    def _append(self, body: bytes) -> None:
        """Append one action's record: a full disk goes unlogged, any other failure is sticky."""
        try:
            self._log.append(body)
        except DiskFull as exc:
            self._go_unlogged(exc)
        except LogStoreError as exc:
            self._fail(exc)

    def _written(self) -> None:
        """After an action is applied: count it, and sync / checkpoint as configured."""
        self._actions_since_checkpoint += 1
        if self._unlogged is None:
            if self.config.flush_mode == "sync":
                self._guarded(self._log.sync)
            if self._actions_since_checkpoint >= self.config.checkpoint_every_actions:
                self._checkpoint_unless_full()

    def _group(self, subject: str, group: str) -> GroupData:
        data = self._state.groups.get((subject, group))
        if data is None:
            raise UnknownGroup(subject, group)
        return data

    # ------------------------------------------------------------------ groups

    def ensure_group(self, subject: str, group: str, start_sequence: int, now_ms: int) -> GroupState:
        """The group's state, creating it with cursor = ``start_sequence`` if it is new."""
        _check_name("subject", subject)
        _check_name("group", group)
        _check_uint("start_sequence", start_sequence)
        _check_uint("now_ms", now_ms)
        if (subject, group) not in self._state.groups:
            self._write(GroupCreated(subject, group, start_sequence, now_ms))
        return self.group_state(subject, group)

    def group_state(self, subject: str, group: str) -> GroupState:
        """A snapshot of the group (raises UnknownGroup)."""
        data = self._group(subject, group)
        return GroupState(data.subject, data.group, data.start_sequence, data.created_ms,
                          data.cursor)

    def has_group(self, subject: str, group: str) -> bool:
        return (subject, group) in self._state.groups

    def groups(self) -> list[tuple[str, str]]:
        """Every (subject, group), sorted."""
        return sorted(self._state.groups)

    def cursor(self, subject: str, group: str) -> int:
        """The next consumer-log seq the group hands out from the log (not the queue)."""
        return self._group(subject, group).cursor

    @property
    def epoch(self) -> int:
        """The pull-seq epoch; a new consumer's first pull seq is ``epoch << 32``."""
        return self._state.epoch

    # ------------------------------------------------------------------ pull / ack / release

    def writes_stay_in_memory(self) -> bool:
        """True when the next pull or ack recorded does no I/O: async flush mode (``tick``
        fsyncs), not failed or unlogged, not a follower, no checkpoint due within
        IN_MEMORY_ACTIONS_MAX actions, and at least IN_MEMORY_ROOM_BYTES_MIN of room in the
        write buffer. A server may then make that call on its event loop rather than this
        store's thread, if the thread is idle (``realtime.broker.Broker.on_pulllog_quick``)."""
        return (self.config.flush_mode == "async" and self._failed is None
                and self._unlogged is None and not self._follower
                and (self._actions_since_checkpoint + IN_MEMORY_ACTIONS_MAX
                     < self.config.checkpoint_every_actions)
                and self._log.buffered_room_bytes >= IN_MEMORY_ROOM_BYTES_MIN)

    def tick_is_idle(self) -> bool:
        """True when ``tick`` would do nothing: not failed or unlogged, every action durable,
        the flush interval started (``Broker._flush_round`` then makes no hop for it)."""
        log_ = self._log
        return (self._failed is None and self._unlogged is None and log_.interval_started
                and log_.durable_offset == log_.end_offset)

    def take_redeliveries(self, subject: str, group: str, max_count: int) -> list[int]:
        """Peek at up to ``max_count`` queued consumer-log seqs, oldest release first."""
        _check_uint("max_count", max_count)
        return list(itertools.islice(self._group(subject, group).queue, max_count))

    def record_pull(self, subject: str, group: str, consumer: str,
                    consumer_log_seqs: Sequence[int], new_cursor: int,
                    now_ms: int) -> PulledBatch:
        """Record that ``consumer`` was handed ``consumer_log_seqs`` and the cursor moved on;
        returns the entries handed out (pull seqs follow densely from the batch's first).

        Each seq comes from the redelivery queue or lies in [cursor, new_cursor); seqs of that
        range not handed out were passed over (a tag filter) and count as handled. Raises
        ValueError for anything else, in particular a seq below the cursor that is not queued
        (a double hand-out). A pull of nothing that does not move the cursor records nothing.
        """
        _check_name("consumer", consumer)
        _check_uint("new_cursor", new_cursor)
        _check_uint("now_ms", now_ms)
        seqs = tuple(consumer_log_seqs)
        if seqs and not _all_uints(seqs):
            for seq in seqs:
                _check_uint("consumer-log seq", seq)
        data = self._group(subject, group)
        if not seqs and new_cursor == data.cursor:
            return PulledBatch(0, (), None, now_ms)
        held = data.consumers.get(consumer)
        first = held.next_pull_seq if held else self._state.epoch << PULL_SEQ_EPOCH_SHIFT
        return self._write(Pull(subject, group, consumer, first, seqs, new_cursor, now_ms))

    def record_tail_pull(self, subject: str, group: str, consumer: str, seqs: Sequence[int],
                         new_cursor: int, now_ms: int, expected_cursor: int,
                         ) -> PulledBatch | None:
        """``record_pull`` for a pull from the tail: None (nothing recorded) unless the group's
        cursor is ``expected_cursor`` and no entry waits for redelivery. The same record, state
        and errors as ``record_pull``.

        The common case (``seqs`` a run of consecutive ints from the cursor, below
        ``new_cursor``) is checked once, here, and logged and applied without building a Pull
        action (issue 18: this runs on the event loop for most pulls); anything else goes
        through ``record_pull``'s checks."""
        # The group's data read here; ``_group`` is called only to raise UnknownGroup (a
        # GroupData is never false): one call fewer per pull.
        data = self._state.groups.get((subject, group)) or self._group(subject, group)
        if data.cursor != expected_cursor or data.queue:
            return None
        count = len(seqs)
        if not (count and type(consumer) is str and consumer and type(subject) is str
                and type(group) is str and self._failed is None and not self._follower
                and type(new_cursor) is int and new_cursor <= U64_MAX
                and type(now_ms) is int and 0 <= now_ms <= U64_MAX):
            return self.record_pull(subject, group, consumer, seqs, new_cursor, now_ms)
        first_seq = seqs[0]
        # One check of the list, in C: equal to the run means consecutive, none twice, from the
        # cursor on, and ints but for a bool: True == 1 can only stand at seqs[1] of a run from
        # 0 (record_pull refuses it).
        run = tuple(range(first_seq, first_seq + count)) if type(first_seq) is int else ()
        if not (run and first_seq >= expected_cursor and run[-1] < new_cursor
                and tuple(seqs) == run and (first_seq or count == 1 or type(seqs[1]) is int)):
            return self.record_pull(subject, group, consumer, seqs, new_cursor, now_ms)
        held = data.consumers.get(consumer)
        first = held.next_pull_seq if held else self._state.epoch << PULL_SEQ_EPOCH_SHIFT
        # ``_append`` and ``_written`` written out for the usual pull (two calls fewer a pull:
        # issue 18); the same failures, order and sync / checkpoint rule as theirs.
        if self._unlogged is None:
            try:
                self._log.append(encode_checked_pull(subject, group, consumer, first, run,
                                                     new_cursor, now_ms))
            except DiskFull as exc:
                self._go_unlogged(exc)
            except LogStoreError as exc:
                self._fail(exc)
        batch = self._state.apply_pull_fields(data, consumer, first, run, new_cursor, now_ms)
        self._actions_since_checkpoint += 1
        if self._unlogged is None:
            if self.config.flush_mode == "sync":
                self._guarded(self._log.sync)
            if self._actions_since_checkpoint >= self.config.checkpoint_every_actions:
                self._checkpoint_unless_full()
        return batch

    def record_ack(self, subject: str, group: str, consumer: str,
                   ranges: Sequence[tuple[int, int]], now_ms: int) -> int:
        """Ack the inclusive pull-seq ``ranges`` of ``consumer``; returns how many became acked.

        Unknown, already acked or released pull seqs (and unknown consumers) count 0.
        """
        _check_uint("now_ms", now_ms)
        clean_ranges = []
        for item in ranges:
            lo, hi = item
            _check_uint("ack range start", lo)
            _check_uint("ack range end", hi)
            if lo > hi:
                raise ValueError(f"ack range ({lo}, {hi}) has its start above its end")
            clean_ranges.append((lo, hi))
        self._group(subject, group)
        action = Ack(subject, group, consumer, tuple(clean_ranges), now_ms)
        targets = self._state.ack_targets(action)
        if not targets:
            return 0
        # Log only ranges that ack something, so the log never grows on duplicate acks: a
        # range is useful if the first target at or above its start is within it.
        if len(clean_ranges) > 1:
            useful = tuple(r for r in clean_ranges
                           if (i := bisect.bisect_left(targets, r[0])) < len(targets)
                           and targets[i] <= r[1])
            action = Ack(subject, group, consumer, useful, now_ms)
        return self._write(action)

    def release_expired(self, subject: str, group: str, ack_timeout_ms: int,
                        now_ms: int) -> list[int]:
        """Release every unacked entry pulled at or before ``now_ms - ack_timeout_ms`` to the
        redelivery queue; returns the released consumer-log seqs."""
        _check_uint("ack_timeout_ms", ack_timeout_ms)
        _check_uint("now_ms", now_ms)
        data = self._group(subject, group)
        cutoff = now_ms - ack_timeout_ms
        released: list[int] = []
        for consumer_id in sorted(data.consumers):
            held = data.consumers[consumer_id].held
            expired = tuple(p for p, e in held.items() if e[2] <= cutoff)
            if expired:
                released += self._write(Release(subject, group, consumer_id, expired,
                                                RELEASE_REASON_ACK_TIMEOUT, now_ms))
        return released

    def remove_consumer(self, subject: str, group: str, consumer: str, now_ms: int) -> list[int]:
        """The consumer went offline or left: release all it holds and forget it."""
        _check_uint("now_ms", now_ms)
        data = self._group(subject, group)
        if consumer not in data.consumers:
            return []
        return self._write(ConsumerRemoved(subject, group, consumer, now_ms))

    # ------------------------------------------------------------------ queries

    def unacked(self, subject: str, group: str, consumer: str) -> list[PulledEntry]:
        """What ``consumer`` holds and has not acked, by pull seq."""
        held = self._group(subject, group).consumers.get(consumer)
        return [PulledEntry(pull_seq, *entry) for pull_seq, entry in held.held.items()] \
            if held else []

    def pulled_before(self, subject: str, group: str,
                      before_ms: int) -> list[tuple[str, PulledEntry]]:
        """Unacked entries pulled at or before ``before_ms``, with their consumer."""
        data = self._group(subject, group)
        return [(consumer_id, PulledEntry(pull_seq, *entry))
                for consumer_id in sorted(data.consumers)
                for pull_seq, entry in data.consumers[consumer_id].held.items()
                if entry[2] <= before_ms]

    def consumers(self, subject: str, group: str) -> list[ConsumerState]:
        """Every consumer the group knows, by id."""
        data = self._group(subject, group)
        return [ConsumerState(consumer_id, c.next_pull_seq, c.ack_sequence(), len(c.held),
                              c.last_pull_ms)
                for consumer_id, c in sorted(data.consumers.items())]

    def held_count(self, subject: str, group: str) -> int:
        """Entries held (pulled, not acked, not released) by the group's consumers."""
        return self._group(subject, group).held_total

    def redelivery_count(self, subject: str, group: str) -> int:
        """Entries waiting in the group's redelivery queue."""
        return len(self._group(subject, group).queue)

    def lowest_needed_sequence(self, subject: str, group: str) -> int:
        """The lowest consumer-log seq the group may still hand out: retention keeps from here."""
        data = self._group(subject, group)
        lowest = data.cursor
        if data.queue:
            lowest = min(lowest, min(data.queue))
        for consumer in data.consumers.values():
            if consumer.held:
                lowest = min(lowest, min(entry[0] for entry in consumer.held.values()))
        return lowest

    def export_state(self) -> list:
        """The whole state in its canonical plain form (the checkpoint's body), for tests/tools."""
        return self._state.to_plain()
