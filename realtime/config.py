"""Configuration of one realtime server, loaded once and frozen."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from logstore.segment_log import FLUSH_MODES
from realtime.retries import DEFAULT_BACKOFF_MS, DEFAULT_RETRIES_MAX


@dataclass(frozen=True)
class RealtimeConfig:
    """Every setting of ``qmq realtime``; a bad value fails at start naming the key and value."""

    data_dir: str  # the broker's data directory (message log, consumer logs, pull log)
    meta_url: str | None = None  # MetaServer base URL; None runs without registration (tests)
    group: str = "realtime-1"  # broker group name registered with the MetaServer
    host: str = "127.0.0.1"  # address to listen on (loopback by default)
    port: int = 20881  # TCP port; 0 picks a free one
    advertise_host: str | None = None  # address clients are told; defaults to host
    metrics_port: int | None = None  # HTTP port of GET /metrics on host; 0 = a free one; None = off
    flush: str = "sync"  # "sync": ack a send after fsync (group commit); "async": fsync on interval
    flush_interval_ms: int = 100  # async flush: longest time between fsyncs
    segment_size_bytes_max: int = 64 << 20  # message-log segment size
    consumer_log_entries_per_file: int = 1 << 20  # consumer-log file size, in 32-byte entries
    ack_timeout_ms: int = 60_000  # a pulled message not acked in this time is handed out again
    ack_timeout_ms_by_group: dict[str, int] = field(default_factory=dict)  # per-group overrides
    consumer_expiry_ms: int = 30_000  # a consumer silent this long is offline; its holdings move
    expiry_check_interval_ms: int = 1_000  # how often ack timeouts and expiry are checked
    heartbeat_interval_ms: int = 3_000  # MetaServer heartbeat period
    dedup_window_ms: int = 10 * 60_000  # a resent message id is de-duplicated within this window
    retention_ms: int = 72 * 3_600_000  # message-log segments older than this may be deleted
    retention_check_interval_ms: int = 60_000  # how often retention runs
    shutdown_grace_ms: int = 5_000  # SIGTERM: time given to in-flight requests
    clock_offset_ms: int = 0  # TEST ONLY: added to the wall clock (paired with a delay server's)
    retry_backoff_ms: tuple[int, ...] = DEFAULT_BACKOFF_MS  # delay before retry n: [n-1], last repeats
    retries_max: int = DEFAULT_RETRIES_MAX  # after this many retries a nacked message is dead
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
            "flush_interval_ms", "segment_size_bytes_max", "consumer_log_entries_per_file",
            "ack_timeout_ms", "consumer_expiry_ms", "expiry_check_interval_ms",
            "heartbeat_interval_ms", "dedup_window_ms", "retention_ms",
            "retention_check_interval_ms", "auth_ttl_ms",
        ):
            value = getattr(self, key)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{key} must be a positive integer, got {value!r}")
        if not self.retry_backoff_ms or any(
            not isinstance(v, int) or v < 0 for v in self.retry_backoff_ms
        ):
            raise ValueError(f"retry_backoff_ms must be non-negative integers, got "
                             f"{self.retry_backoff_ms!r}")
        if not isinstance(self.retries_max, int) or self.retries_max < 0:
            raise ValueError(f"retries_max must be an integer >= 0, got {self.retries_max!r}")
        for group, value in self.ack_timeout_ms_by_group.items():
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ack_timeout_ms_by_group[{group!r}] must be > 0, got {value!r}")

    @property
    def advertised_address(self) -> str:
        """``host:port`` told to the MetaServer (valid once the port is bound)."""
        return f"{self.advertise_host or self.host}:{self.port}"

    def ack_timeout_ms_for(self, group: str) -> int:
        """The ack timeout of ``group``."""
        return self.ack_timeout_ms_by_group.get(group, self.ack_timeout_ms)
