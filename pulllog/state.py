"""The in-memory pull state and the one place actions change it.

Both the live path (``PullLogStore``) and replay call ``PullState.check`` then ``PullState.apply``,
so a replayed log rebuilds exactly the state the live calls built. ``check`` raises ValueError and
changes nothing; ``apply`` assumes ``check`` passed (assertions guard our own bugs).

Per (subject, group) the state holds the cursor, the redelivery queue (consumer-log seq ->
times released, in release order) and per consumer its next pull seq, its last pull time and its
held entries (pull seq -> entry, ascending). Acked history is not kept: a consumer's ack sequence
is derived as (lowest held pull seq - 1), or (next pull seq - 1) when it holds nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    held: dict[int, PulledEntry] = field(default_factory=dict)  # by pull seq, ascending

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
        seen: set[int] = set()
        for seq in action.consumer_log_seqs:
            if seq in seen:
                raise ValueError(f"consumer-log seq {seq} appears twice in one pull")
            seen.add(seq)
            if seq in data.queue:
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

    def _apply_pull(self, action: Pull) -> list[PulledEntry]:
        data = self.groups[(action.subject, action.group)]
        consumer = data.consumers.get(action.consumer)
        if consumer is None:
            consumer = data.consumers[action.consumer] = ConsumerData(
                action.first_pull_seq, action.now_ms
            )
        assert consumer.next_pull_seq == action.first_pull_seq
        pulled = []
        pull_seq = action.first_pull_seq
        for seq in action.consumer_log_seqs:
            redelivered = data.queue.pop(seq, 0)
            entry = PulledEntry(pull_seq, seq, redelivered, action.now_ms)
            consumer.held[pull_seq] = entry
            pulled.append(entry)
            pull_seq += 1
        consumer.next_pull_seq = pull_seq
        consumer.last_pull_ms = action.now_ms
        data.held_total += len(pulled)
        data.cursor = action.new_cursor
        return pulled

    def ack_targets(self, action: Ack) -> list[int]:
        """The held pull seqs ``action`` would ack (a range may hit none)."""
        data = self.groups[(action.subject, action.group)]
        consumer = data.consumers.get(action.consumer)
        if consumer is None:
            return []
        held = consumer.held
        targets: list[int] = []
        for lo, hi in action.ranges:
            # Walk whichever is shorter: the range or the held entries.
            if hi - lo + 1 <= len(held):
                targets.extend(s for s in range(lo, hi + 1) if s in held)
            else:
                targets.extend(s for s in held if lo <= s <= hi)
        return sorted(set(targets))

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
            assert entry.consumer_log_seq not in data.queue, entry
            data.queue[entry.consumer_log_seq] = entry.redelivered + 1
            released.append(entry.consumer_log_seq)
        data.held_total -= len(released)
        return released

    # ------------------------------------------------------------------ plain form

    def to_plain(self) -> list:
        """The whole state as msgpack-able lists, in a canonical order (see ``pulllog.snapshot``)."""
        groups = []
        for (subject, group), data in sorted(self.groups.items()):
            consumers = []
            for consumer_id, consumer in sorted(data.consumers.items()):
                held = [[e.pull_seq, e.consumer_log_seq, e.redelivered, e.pulled_at_ms]
                        for e in consumer.held.values()]
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
                        consumer.held[_uint(pull_seq)] = PulledEntry(
                            pull_seq, _uint(seq), _uint(redelivered), _uint(pulled_at_ms)
                        )
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
