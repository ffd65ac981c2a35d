"""Configuration of one delay server, loaded once and frozen."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from logstore.segment_log import FLUSH_MODES
from wire.limits import MAX_DELAY_MS


@dataclass(frozen=True)
class DelayConfig:
    """Every setting of ``qmq delay``; a bad value fails at start naming the key and the value."""

    data_dir: str  # the delay server's data directory (delay log, schedule buckets, done logs)
    meta_url: str | None = None  # MetaServer base URL (also used to find realtime brokers)
    group: str = "delay-1"  # delay group name registered with the MetaServer
    host: str = "127.0.0.1"  # address to listen on (loopback by default)
    port: int = 20801  # TCP port; 0 picks a free one
    advertise_host: str | None = None  # address clients are told; defaults to host
    metrics_port: int | None = None  # HTTP port of GET /metrics on host; 0 = a free one; None = off
    flush: str = "sync"  # "sync": ack a delayed send after fsync (group commit); "async": interval
    flush_interval_ms: int = 100  # async flush: longest time between fsyncs
    bucket_ms: int = 60_000  # width of one on-disk schedule bucket
    preload_buckets: int = 2  # buckets ahead of now held in memory (the preload window)
    wheel_entries_max: int = 200_000  # most entries in the preload window (~600 B each: ~120 MB); a bucket with more is loaded in part, the rest as the window drains
    tick_ms: int = 5  # dispatch wake-up granularity (adds at most this much lateness)
    max_delay_ms: int = MAX_DELAY_MS  # furthest deliver_at ahead of now; later is refused
    dispatch_batch_max: int = 256  # most messages per dispatch request to a realtime broker
    dispatch_retry_ms_min: int = 100  # first retry delay after a failed dispatch
    dispatch_retry_ms_max: int = 5_000  # retry delay cap (doubles up to this)
    heartbeat_interval_ms: int = 3_000  # MetaServer heartbeat period
    clock_offset_ms: int = 0  # TEST ONLY: added to the wall clock to prove long delays quickly
    shutdown_grace_ms: int = 5_000  # SIGTERM: time given to in-flight requests
    trace: bool = True  # write trace events (docs/AUDIT.md); best effort, off the hot path
    trace_dir: str | None = None  # where trace files go; default <data_dir>/trace
    token: str | None = field(default=None, repr=False)  # this server's own (admin) token: sent to the MetaServer and peers
    auth_ttl_ms: int = 10_000  # how long a token check answer is trusted (a revoked token works at most this long)
    tls_cert: str | None = None  # PEM certificate chain: serve TLS (with tls_key)
    tls_key: str | None = None  # PEM private key of tls_cert
    tls_ca: str | None = None  # PEM CA bundle to verify TLS peers (https MetaServer, TLS brokers)

    @property
    def trace_directory(self) -> str:
        """Where this server's hourly trace files go."""
        return self.trace_dir or os.path.join(self.data_dir, "trace")

    def __post_init__(self) -> None:
        if self.flush not in FLUSH_MODES:
            raise ValueError(f"flush {self.flush!r} is not one of {FLUSH_MODES}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port {self.port} is not in 0..65535")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port {self.metrics_port} is not in 0..65535")
        for key in (
            "flush_interval_ms", "bucket_ms", "preload_buckets", "wheel_entries_max", "tick_ms",
            "max_delay_ms", "dispatch_batch_max", "dispatch_retry_ms_min",
            "dispatch_retry_ms_max", "heartbeat_interval_ms", "auth_ttl_ms",
        ):
            value = getattr(self, key)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{key} must be a positive integer, got {value!r}")
        if self.max_delay_ms > MAX_DELAY_MS:
            raise ValueError(f"max_delay_ms {self.max_delay_ms} exceeds MAX_DELAY_MS {MAX_DELAY_MS}")
