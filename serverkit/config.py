"""``ServerConfig``: the settings every server process has (a realtime broker, a delay server),
frozen, checked once at start. Each server's config extends it with its own fields and checks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import ClassVar

from logstore.segment_log import FLUSH_MODES
from serverkit.role import check_settings, settings_of
from wire.http import parse_meta_urls

PORT_MAX = 65535  # highest TCP port number
# A slave's background scrub (docs/REPLICATION.md 8.2): a pass re-reads the whole copy at this
# pace, then rests, so bit rot is found within about a pass and a pause while the disk mostly
# serves the live work (a 100 GB copy: a pass of about 7 hours, once every 8 hours).
SCRUB_BYTES_PER_S_DEFAULT = 4 << 20
SCRUB_PAUSE_MS_DEFAULT = 3_600_000
# 8 MiB: at most 16 MiB ahead per server (two logs), where the whole 64 MiB segment would be 128
# (docs/BENCHMARKS.md, session 21, "prealloc").
PREALLOCATE_STEP_BYTES_DEFAULT = 8 << 20
# Hosts that mean "every address" to listen on: no client can connect to one, so a server that
# registers with the MetaServer must advertise another (advertise_host).
WILDCARD_HOSTS = ("0.0.0.0", "::", "", "[::]")


@dataclass(frozen=True)
class ServerConfig:
    """The common settings of a server; a bad value fails at start naming the key and value.

    A subclass gives ``group`` and ``port`` its own defaults, adds its fields and names its
    positive-integer fields in ``POSITIVE_INT_KEYS`` (the ones here are checked too).
    """

    data_dir: str  # the server's data directory (its logs, checkpoints and trace files)
    meta_url: str | None = None  # MetaServer base URL(s), comma-separated; None runs without registration (tests)
    group: str = ""  # group name registered with the MetaServer (each server has a default)
    host: str = "127.0.0.1"  # address to listen on (loopback by default)
    port: int = 0  # TCP port of the frame protocol; 0 picks a free one
    advertise_host: str | None = None  # address registered and told to clients; default host (a wildcard host needs one)
    metrics_port: int | None = None  # HTTP port of GET /metrics on host; 0 = a free one; None = off
    flush: str = "sync"  # "sync": answer a send after fsync (group commit); "async": fsync on interval
    flush_interval_ms: int = 100  # async flush: longest time between fsyncs, in ms
    heartbeat_interval_ms: int = 3_000  # MetaServer heartbeat period, in ms
    shutdown_grace_ms: int = 5_000  # SIGTERM: time given to in-flight requests, in ms
    clock_offset_ms: int = 0  # TEST ONLY: ms added to the wall clock to prove long delays quickly
    trace: bool = True  # write trace events (docs/AUDIT.md); best effort, off the hot path
    trace_dir: str | None = None  # where trace files go; default <data_dir>/trace
    token: str | None = field(default=None, repr=False)  # this server's own (admin) token: sent to the MetaServer and peers
    auth_ttl_ms: int = 10_000  # how long a token check answer is trusted, in ms (a revoked token works at most this long)
    tls_cert: str | None = None  # PEM certificate chain file: serve TLS (with tls_key)
    tls_key: str | None = None  # PEM private key file of tls_cert
    tls_ca: str | None = None  # PEM CA bundle file to verify TLS peers (https MetaServer, TLS brokers)
    replication: str | None = None  # "sync" | "async": set the group's mode (None: keep the group's)
    min_insync: int | None = None  # set the group's fewest in-sync slaves (None: keep the group's)
    scrub_bytes_per_s: int = SCRUB_BYTES_PER_S_DEFAULT  # a slave re-reads its copy at this pace to find bit rot; 0 = never
    scrub_pause_ms: int = SCRUB_PAUSE_MS_DEFAULT  # rest between two scrub passes over the whole copy, in ms
    # The active segment of the server's main log (the message log, the delay log, and a
    # slave's copy of either) is allocated this far ahead of its data, in bytes, so a commit's
    # fsync writes no new size or block map (docs/FORMATS.md, "Space allocated ahead"); 0: not
    # at all, the segment grows as it is written (a filesystem where allocating costs).
    preallocate_step_bytes: int = PREALLOCATE_STEP_BYTES_DEFAULT

    # Fields that must be positive integers: these and the subclass's POSITIVE_INT_KEYS.
    COMMON_POSITIVE_INT_KEYS: ClassVar[tuple[str, ...]] = (
        "flush_interval_ms", "heartbeat_interval_ms", "auth_ttl_ms")
    POSITIVE_INT_KEYS: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        if self.meta_url is not None:
            parse_meta_urls(self.meta_url)  # ValueError naming the bad URL
        check_settings(self.replication, self.min_insync)
        if self.flush not in FLUSH_MODES:
            raise ValueError(f"flush {self.flush!r} is not one of {FLUSH_MODES}")
        if not 0 <= self.port <= PORT_MAX:
            raise ValueError(f"port {self.port} is not in 0..{PORT_MAX}")
        advertised = self.advertise_host if self.advertise_host is not None else self.host
        if self.meta_url is not None and advertised in WILDCARD_HOSTS:
            key = "advertise_host" if self.advertise_host is not None else "host"
            raise ValueError(
                f"{key} {advertised!r} cannot be registered with the MetaServer: clients cannot "
                f"connect to it; give advertise_host (--advertise-host), the address clients "
                f"reach this server at (host {self.host!r} may stay, to listen on every address)")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= PORT_MAX:
            raise ValueError(f"metrics_port {self.metrics_port} is not in 0..{PORT_MAX}")
        for key in ("scrub_bytes_per_s", "scrub_pause_ms", "preallocate_step_bytes"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{key} must be an integer >= 0, got {value!r}")
        for key in self.COMMON_POSITIVE_INT_KEYS + self.POSITIVE_INT_KEYS:
            value = getattr(self, key)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{key} must be a positive integer, got {value!r}")

    @property
    def replication_settings(self) -> dict[str, object] | None:
        """The explicit replication settings sent at registration, or None."""
        return settings_of(self.replication, self.min_insync)

    @property
    def trace_directory(self) -> str:
        """Where this server's hourly trace files go."""
        return self.trace_dir or os.path.join(self.data_dir, "trace")

    @property
    def advertised_address(self) -> str:
        """``host:port`` told to clients and the MetaServer (valid once the port is bound)."""
        return f"{self.advertise_host or self.host}:{self.port}"


__all__ = ["PORT_MAX", "PREALLOCATE_STEP_BYTES_DEFAULT", "SCRUB_BYTES_PER_S_DEFAULT", "SCRUB_PAUSE_MS_DEFAULT", "WILDCARD_HOSTS",
           "ServerConfig"]
