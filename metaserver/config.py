"""MetaServer configuration: one frozen dataclass, validated when it is built."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from wire.limits import MAX_TOKEN_CHARS

# Database URL schemes the MetaServer runs on. Both are async SQLAlchemy drivers.
SQLITE_URL_PREFIX = "sqlite+aiosqlite://"
POSTGRES_URL_PREFIX = "postgresql+asyncpg://"
DB_URL_PREFIXES = (SQLITE_URL_PREFIX, POSTGRES_URL_PREFIX)

DEFAULT_PORT = 8090
PORT_MAX = 65_535
# Shortest configured admin or internal token, in characters: it is compared, not hashed, so
# it must be hard to guess on its own.
ADMIN_TOKEN_CHARS_MIN = 16


def sqlite_url(path: str | os.PathLike[str]) -> str:
    """Return the ``sqlite+aiosqlite`` URL of the SQLite database file at ``path`` (made absolute)."""
    return f"{SQLITE_URL_PREFIX}/{os.path.abspath(os.fspath(path))}"


@dataclass(frozen=True)
class MetaConfig:
    """Everything a MetaServer needs; a bad value raises ValueError naming the key and the value."""

    # SQLAlchemy async URL: sqlite+aiosqlite:///path/to/file.db or postgresql+asyncpg://user@host/db.
    db_url: str
    # Interface the HTTP server binds to (loopback unless told otherwise).
    host: str = "127.0.0.1"
    # TCP port of the HTTP server; 0 = any free port (the bound port is reported after start).
    port: int = DEFAULT_PORT
    # Milliseconds without a broker heartbeat after which the broker is marked offline.
    broker_expiry_ms: int = 15_000
    # Milliseconds without a client heartbeat after which the client is marked offline.
    client_expiry_ms: int = 30_000
    # Number of realtime broker groups a subject is routed to (fewer when fewer are live); a count.
    route_groups_default: int = 2
    # Milliseconds between two runs of the background expiry check.
    expiry_check_interval_ms: int = 1000
    # Milliseconds a master may accept writes after it sent a heartbeat the MetaServer answered
    # "master" (docs/REPLICATION.md 5). Shorter: faster failover, fewer lost heartbeats ridden out.
    lease_ms: int = 3000
    # Milliseconds a MetaServer waits beyond lease_ms without seeing a renewal before it may
    # promote a slave: covers clock rate error (2 * 1000 ppm * lease) and stalls of the master.
    lease_margin_ms: int = 500
    # Milliseconds between two runs of the failover check (lease watch, promotions, switchovers).
    failover_check_interval_ms: int = 250
    # Milliseconds a planned switchover may take before it is cancelled.
    switchover_timeout_ms: int = 30_000
    # A secret accepted as an admin token (--admin-token / QMQ_ADMIN_TOKEN); setting it turns
    # auth on even before any token is stored. At least ADMIN_TOKEN_CHARS_MIN characters.
    admin_token: str | None = field(default=None, repr=False)
    # A secret accepted as an admin token that does NOT turn auth on: ``qmq up`` gives it to its
    # own brokers so they keep working if someone turns auth on by creating tokens.
    internal_token: str | None = field(default=None, repr=False)
    # PEM certificate chain and key: serve https instead of http (both or neither).
    tls_cert: str | None = None
    tls_key: str | None = None
    # PEM CA bundle trusted when the MetaServer calls TLS brokers (dead-letter admin).
    tls_ca: str | None = None
    # Directories whose trace files the console's message lookup reads (each a trace directory
    # or a directory above some, e.g. a data dir); empty: the lookup has nothing to read.
    trace_dirs: tuple[str, ...] = ()
    # Milliseconds an occurrence of a recurring schedule may be handed over late and still count
    # as on time; an older one is a misfire, and the schedule's misfire policy decides.
    schedule_misfire_grace_ms: int = 60_000
    # Longest sleep of the schedule runner between two looks at the database, in ms (another
    # MetaServer may have created a schedule).
    schedule_poll_interval_ms: int = 1_000
    # Milliseconds a MetaServer's claim on a schedule's occurrences is its own; if it dies
    # holding one, another MetaServer resolves the claim once this has passed.
    schedule_lease_ms: int = 30_000

    def __post_init__(self) -> None:
        """Validate every field; raise ValueError quoting the key and the offending value."""
        if not isinstance(self.db_url, str) or not self.db_url.startswith(DB_URL_PREFIXES):
            raise ValueError(
                f"db_url {self.db_url!r} must start with one of {', '.join(DB_URL_PREFIXES)}"
            )
        if not isinstance(self.host, str) or not self.host:
            raise ValueError(f"host {self.host!r} must be a non-empty string")
        _check_int("port", self.port, 0, PORT_MAX)
        _check_int("broker_expiry_ms", self.broker_expiry_ms, 1)
        _check_int("client_expiry_ms", self.client_expiry_ms, 1)
        _check_int("route_groups_default", self.route_groups_default, 1)
        _check_int("expiry_check_interval_ms", self.expiry_check_interval_ms, 1)
        _check_int("schedule_misfire_grace_ms", self.schedule_misfire_grace_ms, 1)
        _check_int("schedule_poll_interval_ms", self.schedule_poll_interval_ms, 1)
        if not isinstance(self.trace_dirs, tuple) or not all(
                isinstance(d, str) and d for d in self.trace_dirs):
            raise ValueError(f"trace_dirs {self.trace_dirs!r} must be a tuple of directory paths")
        _check_int("schedule_lease_ms", self.schedule_lease_ms, 1)
        # Four renewals per lease at least: the heartbeat interval is lease_ms // 4.
        _check_int("lease_ms", self.lease_ms, 4)
        _check_int("lease_margin_ms", self.lease_margin_ms, 0)
        _check_int("failover_check_interval_ms", self.failover_check_interval_ms, 1)
        _check_int("switchover_timeout_ms", self.switchover_timeout_ms, 1)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError(f"tls_cert {self.tls_cert!r} and tls_key {self.tls_key!r} go "
                             "together: give both or neither")
        for key in ("admin_token", "internal_token"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str)
                                      or len(value) < ADMIN_TOKEN_CHARS_MIN):
                # The value is a secret: say how long it is, never what it is.
                length = len(value) if isinstance(value, str) else type(value).__name__
                raise ValueError(f"{key} of {length} characters is too short: it needs at "
                                 f"least {ADMIN_TOKEN_CHARS_MIN}")
            if isinstance(value, str) and len(value) > MAX_TOKEN_CHARS:
                # Brokers and clients carry it in hello, which refuses a longer one.
                raise ValueError(f"{key} of {len(value)} characters exceeds MAX_TOKEN_CHARS "
                                 f"{MAX_TOKEN_CHARS}")

    @property
    def heartbeat_interval_ms(self) -> int:
        """Milliseconds between broker heartbeats: a third of the expiry, so two may be lost, and
        a quarter of the lease, so a master rides out three lost renewals."""
        return max(1, min(self.broker_expiry_ms // 3, self.lease_ms // 4))


def _check_int(key: str, value: object, minimum: int, maximum: int | None = None) -> None:
    """Raise ValueError unless ``value`` is an int (not a bool) in ``[minimum, maximum]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key} {value!r} must be an integer")
    if value < minimum:
        raise ValueError(f"{key} {value} is below the minimum {minimum}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{key} {value} is above the maximum {maximum}")
