"""The in-memory pull state and the one place actions change it.

Both the live path (``PullLogStore``) and replay call ``PullState.check`` then ``PullState.apply``,
so a replayed log rebuilds exactly the state the live calls built. ``check`` raises ValueError and
changes nothing; ``apply`` assumes ``check`` passed (assertions guard our own bugs).

Per (subject, group) the state holds the cursor, the redelivery queue (consumer-log seq ->
times released, in release order) and per consumer its next pull seq, its last pull time and its
held entries (pull seq -> ``Held`` tuple, ascending). Acked history is not kept: a consumer's ack
sequence is derived as (lowest held pull seq - 1), or (next pull seq - 1) when it holds nothing.

A pull of a batch is applied with a few bulk operations (C loops, no object per entry): held
entries are plain tuples, and the ``PulledEntry`` snapshots are built only when asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import repeat
from typing import Iterator, Sequence, overload

from pulllog.actions import (
    Ack,
    Action,
    Closed,
    ConsumerRemoved,
    EpochStarted,
    GroupCreated,
    Opened,
    Pull,
    Release,
)

# After an unclean shutdown every consumer's pull seqs continue at epoch << PULL_SEQ_EPOCH_SHIFT,
# above anything handed out before the crash, so a stale ack cannot hit a re-used pull seq.
PULL_SEQ_EPOCH_SHIFT = 32


@dataclass(frozen=True)
class PulledEntry:
    """One entry handed to a consumer."""

    pull_seq: int  # the consumer's pull sequence for this hand-out
    consumer_log_seq: int  # the subject's consumer-log sequence
    redelivered: int  # how many times it was released before this hand-out (0 = first delivery)
    pulled_at_ms: int  # when it was handed out


# A held entry: (consumer-log seq, times released before this hand-out, pulled at ms).
Held = tuple[int, int, int]


class PulledBatch(Sequence[PulledEntry]):
    """The entries one pull handed out: pull seqs ``first_pull_seq`` onwards, densely, for
    ``consumer_log_seqs``. A sequence of ``PulledEntry`` built on access; callers on the hot
    path read the columns instead (``redelivered`` is None when every entry is a first
    delivery)."""

    __slots__ = ("first_pull_seq", "consumer_log_seqs", "redelivered", "pulled_at_ms")

    def __init__(self, first_pull_seq: int, consumer_log_seqs: tuple[int, ...],
                 redelivered: list[int] | None, pulled_at_ms: int) -> None:
        self.first_pull_seq = first_pull_seq
        self.consumer_log_seqs = consumer_log_seqs
        self.redelivered = redelivered
        self.pulled_at_ms = pulled_at_ms

    def __len__(self) -> int:
        return len(self.consumer_log_seqs)

    @overload
    def __getitem__(self, index: int) -> PulledEntry: ...
    @overload
    def __getitem__(self, index: slice) -> list[PulledEntry]: ...

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        seqs = self.consumer_log_seqs
        if index < 0:
            index += len(seqs)
        if not 0 <= index < len(seqs):
            raise IndexError(index)
        redelivered = self.redelivered[index] if self.redelivered is not None else 0
        return PulledEntry(self.first_pull_seq + index, seqs[index], redelivered,
                           self.pulled_at_ms)

    def __iter__(self) -> Iterator[PulledEntry]:
        return (self[i] for i in range(len(self.consumer_log_seqs)))

    def __add__(self, other: Sequence[PulledEntry]) -> list[PulledEntry]:
        return list(self) + list(other)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (PulledBatch, list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to lists, which are unhashable

    def __repr__(self) -> str:
        return f"PulledBatch({list(self)!r})"


@dataclass(frozen=True)
class ConsumerState:
    """A snapshot of one consumer of a group."""

    consumer: str
    next_pull_seq: int  # pull seq the next hand-out gets
    ack_sequence: int  # every pull seq <= this is acked or released (-1: none yet)
    unacked_count: int  # entries held and not acked
    last_pull_ms: int  # time of the last recorded pull


@dataclass(frozen=True)
class GroupState:
    """A snapshot of one (subject, group)."""

    subject: str
    group: str
    start_sequence: int  # the cursor the group was created with
    created_ms: int
    cursor: int  # next consumer-log seq to hand out


@dataclass
class ConsumerData:
    next_pull_seq: int
    last_pull_ms: int
    held: dict[int, Held] = field(default_factory=dict)  # by pull seq, ascending

    def ack_sequence(self) -> int:
        if self.held:
            return next(iter(self.held)) - 1
        return self.next_pull_seq - 1


@dataclass
class GroupData:
    subject: str
    group: str
    start_sequence: int
    created_ms: int
    cursor: int
    queue: dict[int, int] = field(default_factory=dict)  # consumer-log seq -> times released
    consumers: dict[str, ConsumerData] = field(default_factory=dict)
    held_total: int = 0


class PullState:
    """Every group's cursor, queue and consumers; changed only through ``apply``."""

    def __init__(self) -> None:
        self.epoch = 0
        self.groups: dict[tuple[str, str], GroupData] = {}

    # ------------------------------------------------------------------ checking

    def check(self, action: Action) -> None:
        """Raise ValueError if ``action`` cannot apply to this state; changes nothing."""
        if isinstance(action, GroupCreated):
            if (action.subject, action.group) in self.groups:
                raise ValueError(f"group {action.group!r} of {action.subject!r} already exists")
        elif isinstance(action, Pull):
            self._check_pull(action)
        elif isinstance(action, (Ack, Release, ConsumerRemoved)):
            self._group(action.subject, action.group)
        elif isinstance(action, EpochStarted):
            if action.epoch <= self.epoch:
                raise ValueError(f"epoch {action.epoch} does not follow epoch {self.epoch}")

    def _group(self, subject: str, group: str) -> GroupData:
        data = self.groups.get((subject, group))
        if data is None:
            raise ValueError(f"unknown group {group!r} of subject {subject!r}")
        return data

    def _check_pull(self, action: Pull) -> None:
        data = self._group(action.subject, action.group)
        if action.new_cursor < data.cursor:
            raise ValueError(f"new_cursor {action.new_cursor} is below the cursor {data.cursor}")
        consumer = data.consumers.get(action.consumer)
        expected_first = (consumer.next_pull_seq if consumer is not None
                          else self.epoch << PULL_SEQ_EPOCH_SHIFT)
        if action.first_pull_seq != expected_first:
            raise ValueError(
                f"first pull seq {action.first_pull_seq} is not the consumer's next {expected_first}"
            )
        seqs = action.consumer_log_seqs
        if not seqs:
            return
        if len(set(seqs)) != len(seqs):
            seen: set[int] = set()
            for seq in seqs:
                if seq in seen:
                    raise ValueError(f"consumer-log seq {seq} appears twice in one pull")
                seen.add(seq)
        queue = data.queue
        if not queue and data.cursor <= min(seqs) and max(seqs) < action.new_cursor:
            return  # the common case, checked in C: every seq new and in [cursor, new_cursor)
        for seq in seqs:
            if seq in queue:
                continue
            if seq < data.cursor:
                raise ValueError(
                    f"consumer-log seq {seq} is below the cursor {data.cursor} and not waiting for "
                    f"redelivery: handing it out again would be a double hand-out"
                )
            if seq >= action.new_cursor:
                raise ValueError(
                    f"consumer-log seq {seq} is at or above new_cursor {action.new_cursor}"
                )

    # ------------------------------------------------------------------ applying

    def apply(self, action: Action) -> object:
        """Apply a checked action; returns what the live call returns."""
        if isinstance(action, Pull):
            return self._apply_pull(action)
        if isinstance(action, Ack):
            return self._apply_ack(action)
        if isinstance(action, Release):
            data = self.groups[(action.subject, action.group)]
            return self._release(data, action.consumer, action.pull_seqs)
        if isinstance(action, ConsumerRemoved):
            data = self.groups[(action.subject, action.group)]
            consumer = data.consumers.get(action.consumer)
            if consumer is None:
                return []
            released = self._release(data, action.consumer, list(consumer.held))
            del data.consumers[action.consumer]
            return released
        if isinstance(action, GroupCreated):
            self.groups[(action.subject, action.group)] = GroupData(
                action.subject, action.group, action.start_sequence, action.now_ms,
                action.start_sequence,
            )
            return None
        if isinstance(action, EpochStarted):
            self.epoch = action.epoch
            floor = action.epoch << PULL_SEQ_EPOCH_SHIFT
            for data in self.groups.values():
                for consumer in data.consumers.values():
                    consumer.next_pull_seq = max(consumer.next_pull_seq, floor)
            return None
        assert isinstance(action, (Closed, Opened)), action
        return None

    def _apply_pull(self, action: Pull) -> PulledBatch:
        return self.apply_pull_fields(self.groups[(action.subject, action.group)],
                                      action.consumer, action.first_pull_seq,
                                      action.consumer_log_seqs, action.new_cursor, action.now_ms)

    def apply_pull_fields(self, data: GroupData, consumer_name: str, first: int,
                          seqs: tuple[int, ...], new_cursor: int, now_ms: int) -> PulledBatch:
        """``apply`` of a checked PULL given as its fields, with the group already found (a
        pull from the tail builds no Pull: ``PullLogStore.record_tail_pull``)."""
        consumer = data.consumers.get(consumer_name)
        if consumer is None:
            consumer = data.consumers[consumer_name] = ConsumerData(first, now_ms)
        assert consumer.next_pull_seq == first
        count = len(seqs)
        queue = data.queue
        redelivered: list[int] | None = None
        if queue:
            redelivered = [queue.pop(seq, 0) for seq in seqs]
            times = redelivered
        else:
            times = repeat(0)
        consumer.held.update(zip(range(first, first + count), zip(seqs, times, repeat(now_ms))))
        consumer.next_pull_seq = first + count
        consumer.last_pull_ms = now_ms
        data.held_total += count
        data.cursor = new_cursor
        if redelivered is not None and not any(redelivered):
            redelivered = None
        return PulledBatch(first, seqs, redelivered, now_ms)

    def ack_targets(self, action: Ack) -> list[int]:
        """The held pull seqs ``action`` would ack (a range may hit none)."""
        data = self.groups[(action.subject, action.group)]
        consumer = data.consumers.get(action.consumer)
        if consumer is None:
            return []
        held = consumer.held
        targets: list[int] = []
        contains = held.__contains__
        for lo, hi in action.ranges:
            # Walk whichever is shorter: the range or the held entries.
            if hi - lo + 1 <= len(held):
                targets.extend(filter(contains, range(lo, hi + 1)))
            else:
                targets.extend(s for s in held if lo <= s <= hi)
        if len(action.ranges) > 1:
            targets = sorted(set(targets))  # ranges may overlap or come in any order
        return targets

    def _apply_ack(self, action: Ack) -> int:
        targets = self.ack_targets(action)
        if not targets:
            return 0
        data = self.groups[(action.subject, action.group)]
        held = data.consumers[action.consumer].held
        for pull_seq in targets:
            del held[pull_seq]
        data.held_total -= len(targets)
        return len(targets)

    def _release(self, data: GroupData, consumer_id: str, pull_seqs) -> list[int]:
        consumer = data.consumers.get(consumer_id)
        if consumer is None:
            return []
        released = []
        for pull_seq in pull_seqs:
            entry = consumer.held.pop(pull_seq, None)
            if entry is None:
                continue
            log_seq, redelivered, _pulled_at_ms = entry
            assert log_seq not in data.queue, entry
            data.queue[log_seq] = redelivered + 1
            released.append(log_seq)
        data.held_total -= len(released)
        return released

    # ------------------------------------------------------------------ plain form

    def to_plain(self) -> list:
        """The whole state as msgpack-able lists, in a canonical order (see ``pulllog.snapshot``)."""
        groups = []
        for (subject, group), data in sorted(self.groups.items()):
            consumers = []
            for consumer_id, consumer in sorted(data.consumers.items()):
                held = [[pull_seq, log_seq, redelivered, pulled_at_ms]
                        for pull_seq, (log_seq, redelivered, pulled_at_ms)
                        in consumer.held.items()]
                consumers.append([consumer_id, consumer.next_pull_seq, consumer.last_pull_ms, held])
            queue = [[seq, count] for seq, count in data.queue.items()]
            groups.append([subject, group, data.start_sequence, data.created_ms, data.cursor,
                           queue, consumers])
        return [self.epoch, groups]

    @classmethod
    def from_plain(cls, plain: list) -> "PullState":
        """Rebuild a state from ``to_plain`` output; raises ValueError on a malformed structure."""
        try:
            epoch, groups = plain
            state = cls()
            state.epoch = _uint(epoch)
            for subject, group, start, created_ms, cursor, queue, consumers in groups:
                if type(subject) is not str or type(group) is not str:
                    raise ValueError("group names must be strings")
                data = GroupData(subject, group, _uint(start), _uint(created_ms), _uint(cursor))
                for seq, count in queue:
                    data.queue[_uint(seq)] = _uint(count)
                for consumer_id, next_pull_seq, last_pull_ms, held in consumers:
                    if type(consumer_id) is not str:
                        raise ValueError("consumer ids must be strings")
                    consumer = ConsumerData(_uint(next_pull_seq), _uint(last_pull_ms))
                    for pull_seq, seq, redelivered, pulled_at_ms in held:
                        consumer.held[_uint(pull_seq)] = (
                            _uint(seq), _uint(redelivered), _uint(pulled_at_ms))
                    data.consumers[consumer_id] = consumer
                    data.held_total += len(consumer.held)
                state.groups[(subject, group)] = data
        except (TypeError, ValueError) as exc:
            raise ValueError(f"malformed pull state: {exc}") from exc
        return state


def _uint(value: object) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"expected an unsigned integer, got {value!r}")
    return value
