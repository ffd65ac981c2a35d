"""Configuration of one realtime server, loaded once and frozen."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from logstore.descriptors import CAPACITY_MIN
from realtime.retries import DEFAULT_BACKOFF_MS, DEFAULT_RETRIES_MAX
from serverkit.config import ServerConfig


@dataclass(frozen=True)
class RealtimeConfig(ServerConfig):
    """Every setting of ``qmq realtime``: the common ones of ``ServerConfig`` (data dir,
    MetaServer, listening, flush, trace, auth, TLS) and the broker's below; a bad value fails at
    start naming the key and value."""

    group: str = "realtime-1"  # broker group name registered with the MetaServer
    port: int = 20881  # TCP port; 0 picks a free one
    segment_size_bytes_max: int = 64 << 20  # message-log segment size, in bytes
    consumer_log_entries_per_file: int = 1 << 20  # consumer-log file size, in 32-byte entries
    # Consumer-log files kept open at once, all subjects; None: a share of the open-files limit
    # (serverkit.open_files.files_cached_budget).
    consumer_log_files_open_max: int | None = None
    ack_timeout_ms: int = 60_000  # a pulled message not acked in this time (ms) is handed out again
    ack_timeout_ms_by_group: dict[str, int] = field(default_factory=dict)  # per-group overrides, in ms
    consumer_expiry_ms: int = 30_000  # a consumer silent this long (ms) is offline; its holdings move
    expiry_check_interval_ms: int = 1_000  # how often ack timeouts and expiry are checked, in ms
    dedup_window_ms: int = 10 * 60_000  # a resent message id is de-duplicated within this window, in ms
    retention_ms: int = 72 * 3_600_000  # message-log segments older than this (ms) may be deleted
    retention_check_interval_ms: int = 60_000  # how often retention runs, in ms
    retry_backoff_ms: tuple[int, ...] = DEFAULT_BACKOFF_MS  # delay (ms) before retry n: [n-1], last repeats
    retries_max: int = DEFAULT_RETRIES_MAX  # after this many retries a nacked message is dead
    # Per-group retry policy: a group's own backoff schedule (ms) and retries before the dead
    # letters; what a group's entry does not set comes from the two above.
    retry_backoff_ms_by_group: dict[str, tuple[int, ...]] = field(default_factory=dict)
    retries_max_by_group: dict[str, int] = field(default_factory=dict)
    # A pull while other consumers of its group have long polls parked (idle) takes at most
    # its fair share of the group's backlog, backlog / (parked + 1), but at least this many
    # messages, so a burst reaches the idle consumers instead of the first few (0: no sharing,
    # every pull takes up to what it asks for). See docs/SDK.md "How a burst spreads".
    burst_share_min_messages: int = 16
    # Messages a delay server handed off ahead of their due time (``hold``) held at once, about
    # 0.5 kB of broker memory each (100 MB at the default); a hold past it is refused
    # ``too_large`` and the delay server sends that message at its due time instead.
    held_messages_max: int = 200_000

    POSITIVE_INT_KEYS: ClassVar[tuple[str, ...]] = (
        "segment_size_bytes_max", "consumer_log_entries_per_file", "ack_timeout_ms",
        "consumer_expiry_ms", "expiry_check_interval_ms", "dedup_window_ms", "retention_ms",
        "retention_check_interval_ms", "held_messages_max",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.retry_backoff_ms or any(
            not isinstance(v, int) or v < 0 for v in self.retry_backoff_ms
        ):
            raise ValueError(f"retry_backoff_ms must be non-negative integers, got "
                             f"{self.retry_backoff_ms!r}")
        if not isinstance(self.retries_max, int) or self.retries_max < 0:
            raise ValueError(f"retries_max must be an integer >= 0, got {self.retries_max!r}")
        files = self.consumer_log_files_open_max
        if files is not None and (type(files) is not int or files < CAPACITY_MIN):
            raise ValueError(f"consumer_log_files_open_max must be an integer >= {CAPACITY_MIN} "
                             f"or None, got {files!r}")
        share = self.burst_share_min_messages
        if type(share) is not int or share < 0:
            raise ValueError(f"burst_share_min_messages must be an integer >= 0, got {share!r}")
        for group, value in self.ack_timeout_ms_by_group.items():
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ack_timeout_ms_by_group[{group!r}] must be > 0, got {value!r}")
        for group, backoff in self.retry_backoff_ms_by_group.items():
            if not isinstance(backoff, tuple) or not backoff or any(
                    type(v) is not int or v < 0 for v in backoff):
                raise ValueError(f"retry_backoff_ms_by_group[{group!r}] must be non-negative "
                                 f"integers, at least one, got {backoff!r}")
        for group, value in self.retries_max_by_group.items():
            if type(value) is not int or value < 0:
                raise ValueError(f"retries_max_by_group[{group!r}] must be an integer >= 0, "
                                 f"got {value!r}")

    def ack_timeout_ms_for(self, group: str) -> int:
        """The ack timeout of ``group``, in ms."""
        return self.ack_timeout_ms_by_group.get(group, self.ack_timeout_ms)
