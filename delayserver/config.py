"""Configuration of one delay server, loaded once and frozen."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from serverkit.config import ServerConfig
from wire.limits import HOLD_AHEAD_MS_MAX, MAX_DELAY_MS


@dataclass(frozen=True)
class DelayConfig(ServerConfig):
    """Every setting of ``qmq delay``: the common ones of ``ServerConfig`` (data dir, MetaServer,
    listening, flush, trace, auth, TLS) and the delay server's below; a bad value fails at start
    naming the key and the value."""

    group: str = "delay-1"  # delay group name registered with the MetaServer
    port: int = 20801  # TCP port; 0 picks a free one
    bucket_ms: int = 60_000  # width of one on-disk schedule bucket, in ms
    preload_buckets: int = 2  # buckets ahead of now held in memory (the preload window)
    wheel_entries_max: int = 200_000  # most entries in the preload window (~600 B each: ~120 MB); a bucket with more is loaded in part, the rest as the window drains
    tick_ms: int = 5  # dispatch wake-up granularity, in ms (adds at most this much lateness)
    max_delay_ms: int = MAX_DELAY_MS  # furthest deliver_at ahead of now, in ms; later is refused
    dispatch_batch_max: int = 256  # most messages per dispatch request to a realtime broker
    dispatch_retry_ms_min: int = 100  # first retry delay after a failed dispatch, in ms
    dispatch_retry_ms_max: int = 5_000  # retry delay cap, in ms (doubles up to this)
    handoff_lead_ms: int = 3_000  # hand a hot slot's messages to a broker that holds (``hold``)
    # them this long before their due time, in ms (docs/REPLICATION.md 16); 0 = dispatch every
    # message at its due time
    handoff_min_messages: int = 1_000  # hand off only a hot slot: a 250 ms step of due times
    # holding at least this many messages; fewer are dispatched at their due time

    POSITIVE_INT_KEYS: ClassVar[tuple[str, ...]] = (
        "bucket_ms", "preload_buckets", "wheel_entries_max", "tick_ms", "max_delay_ms",
        "dispatch_batch_max", "dispatch_retry_ms_min", "dispatch_retry_ms_max",
        "handoff_min_messages",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_delay_ms > MAX_DELAY_MS:
            raise ValueError(f"max_delay_ms {self.max_delay_ms} exceeds MAX_DELAY_MS {MAX_DELAY_MS}")
        if type(self.handoff_lead_ms) is not int or not \
                0 <= self.handoff_lead_ms <= HOLD_AHEAD_MS_MAX // 2:
            raise ValueError(f"handoff_lead_ms {self.handoff_lead_ms!r} is outside [0, "
                             f"{HOLD_AHEAD_MS_MAX // 2}] (half of HOLD_AHEAD_MS_MAX "
                             f"{HOLD_AHEAD_MS_MAX}: room for clock skew and retries)")
