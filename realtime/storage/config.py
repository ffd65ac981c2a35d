"""The message store's configuration and its input limits."""

from __future__ import annotations

from dataclasses import dataclass, fields

from logstore.descriptors import CAPACITY_MIN
from logstore.segment_log import FLUSH_MODES
from realtime.storage.message_record import OVERHEAD_SIZE_BYTES

SUBJECT_BYTES_MAX = 512  # UTF-8 bytes of a subject; internal ones are %retry%<subject>%<group>
MESSAGE_ID_BYTES_MAX = 512  # UTF-8 bytes of a message id
TAG_HASHES_MAX = 10  # tag hashes per message (a message has at most 10 tags)
TAG_HASH_MAX = (1 << 32) - 1  # tag hashes are 32-bit unsigned ints
U64_MAX = (1 << 64) - 1  # sequences, counts and timestamps are stored as u64
TIMESTAMP_MS_MAX = U64_MAX


@dataclass(frozen=True)
class StoreConfig:
    """Settings of one message store; a bad value fails at construction naming the key."""

    segment_size_bytes_max: int = 64 << 20  # bytes; a message-log segment rolls before this
    record_size_bytes_max: int = 16 << 20  # bytes; largest message-log record body (28 + subject
    # + message id + payload)
    flush_mode: str = "sync"  # "sync": commit() fsyncs (group commit); "async": tick() fsyncs
    flush_interval_ms: int = 100  # ms; async mode: longest time between fsyncs with data pending
    consumer_log_entries_per_file: int = 1 << 20  # entries (32 bytes each) per consumer-log file
    consumer_log_files_open_max: int = 256  # consumer-log files open at once, all subjects; the
    # server sizes it from its open-files limit (serverkit.open_files)
    dedup_window_ms: int = 10 * 60_000  # ms; a resent id within this is a duplicate
    dedup_ids_max: int = 1_000_000  # ids remembered in all; the oldest are forgotten first
    retention_ms: int = 72 * 3600_000  # ms; segments older than this go once no group needs them
    retention_hard_cap_ms: int = 7 * 24 * 3600_000  # ms; segments older than this go regardless
    retention_hard_cap_bytes: int = 512 << 30  # bytes of message log; above it the oldest
    # segments go regardless of age or of groups that still need them
    checkpoint_interval_bytes: int = 64 << 20  # bytes of message log between checkpoints; bounds
    # the replay at open
    write_buffer_bytes_max: int = 256 << 10  # bytes the message log buffers before a write(2)
    preallocate_step_bytes: int = 8 << 20  # bytes; the active message-log segment is allocated
    # this far ahead of its data, so a commit's fsync writes no new size (0: not at all;
    # logstore.segment_space)
    held_messages_max: int = 200_000  # messages held at once (the hand-off ahead of the due
    # time), about 0.5 kB of memory each; a hold past it is refused (``hold_many``)

    def __post_init__(self) -> None:
        minimums = {
            "segment_size_bytes_max": 64,
            "record_size_bytes_max": OVERHEAD_SIZE_BYTES,
            "flush_interval_ms": 1,
            "consumer_log_entries_per_file": 1,
            "consumer_log_files_open_max": CAPACITY_MIN,
            "dedup_window_ms": 0,
            "dedup_ids_max": 0,
            "retention_ms": 0,
            "retention_hard_cap_ms": 0,
            "retention_hard_cap_bytes": 0,
            "checkpoint_interval_bytes": 0,
            "write_buffer_bytes_max": 0,
            "preallocate_step_bytes": 0,
            "held_messages_max": 0,
        }
        for item in fields(self):
            value = getattr(self, item.name)
            if item.name == "flush_mode":
                if value not in FLUSH_MODES:
                    raise ValueError(f"flush_mode {value!r} is not one of {FLUSH_MODES}")
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{item.name} {value!r} must be an int")
            if value < minimums[item.name]:
                raise ValueError(f"{item.name} {value} is below its minimum {minimums[item.name]}")
        if self.retention_hard_cap_ms < self.retention_ms:
            raise ValueError(f"retention_hard_cap_ms {self.retention_hard_cap_ms} is below "
                             f"retention_ms {self.retention_ms}")
