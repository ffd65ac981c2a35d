"""SQLAlchemy 2 models of the MetaServer database.

The Alembic migrations in ``migrations/versions`` create exactly these tables; a test compares the
two. Times are integers in milliseconds since the Unix epoch (``*_ms``), never SQL timestamps, so
SQLite and PostgreSQL store and compare them the same way.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    ForeignKey,
    Integer,
    LargeBinary,
    MetaData,
    String,
    false,
    true,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Column widths. Internal subjects (%retry%<subject>%<group>) are longer than user subjects.
NAME_CHARS_MAX = 200
SUBJECT_CHARS_MAX = 512
ADDRESS_CHARS_MAX = 300
STATE_CHARS_MAX = 16
TOKEN_HINT_CHARS_MAX = 16
CRON_CHARS_MAX = 200
TZ_CHARS_MAX = 64
ERROR_CHARS_MAX = 500
# A server id: 16 hex digits from server.id, or "addr:<group>/<address>" for a server that sends
# none (older servers, tests), so it must hold a group name and an address.
SERVER_ID_CHARS_MAX = 512

# Named constraints so migrations can refer to them on every database.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    """Declarative base carrying the shared metadata and naming convention."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class BrokerGroup(Base):
    """A broker group: the unit a subject is routed to. ``readonly`` is the admin's switch.

    The replication columns (migration ``0004_replication``, docs/REPLICATION.md): ``epoch``
    goes up by one on every change of ``master_id``, only in a transaction holding this row's
    lock; ``lease_renewals`` counts the master's renewals (MetaServers watch it to know when a
    lease has surely expired); ``writable`` is false while the master refuses writes for want
    of in-sync slaves (producers are routed elsewhere).
    """

    __tablename__ = "broker_groups"

    name: Mapped[str] = mapped_column(String(NAME_CHARS_MAX), primary_key=True)
    kind: Mapped[str] = mapped_column(String(STATE_CHARS_MAX))  # realtime | delay
    readonly: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at_ms: Mapped[int] = mapped_column(BigInteger)
    epoch: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    master_id: Mapped[str | None] = mapped_column(String(SERVER_ID_CHARS_MAX), nullable=True)
    replication: Mapped[str] = mapped_column(String(STATE_CHARS_MAX), default="sync",
                                             server_default="sync")  # sync | async
    min_insync: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    lease_renewals: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    epoch_started_at_ms: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    switchover_to: Mapped[str | None] = mapped_column(String(SERVER_ID_CHARS_MAX), nullable=True)
    switchover_deadline_ms: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    writable: Mapped[bool] = mapped_column(Boolean, default=True, server_default=true())


class Broker(Base):
    """One server of a group, known by its server id (``server.id`` in its data dir).

    ``reported_state`` is what the broker says in its heartbeat (rw | readonly, shown to admins);
    ``state`` is what the MetaServer decides: offline once heartbeats stop, readonly when the admin
    made the group readonly, rw otherwise. ``stats`` is no longer written (until
    ``0005_backlog_table`` it held the backlog, now in ``backlog_heads`` and ``backlog_rows``).

    Replication (``0004_replication``): ``role`` is master or slave (the group row's
    ``master_id`` decides); ``in_sync`` is the database's in-sync set, written only from the
    current master's heartbeats and by promotions; ``position``, ``positions``, ``lag_bytes``
    and ``lag_ms`` are what the server last reported.
    """

    __tablename__ = "brokers"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    group_name: Mapped[str] = mapped_column(ForeignKey("broker_groups.name"), index=True)
    kind: Mapped[str] = mapped_column(String(STATE_CHARS_MAX))
    address: Mapped[str] = mapped_column(String(ADDRESS_CHARS_MAX))
    reported_state: Mapped[str] = mapped_column(String(STATE_CHARS_MAX))
    state: Mapped[str] = mapped_column(String(STATE_CHARS_MAX))
    last_heartbeat_ms: Mapped[int] = mapped_column(BigInteger)
    registered_at_ms: Mapped[int] = mapped_column(BigInteger)
    stats: Mapped[Any] = mapped_column(JSON, nullable=True)
    server_id: Mapped[str] = mapped_column(String(SERVER_ID_CHARS_MAX), unique=True)
    role: Mapped[str] = mapped_column(String(STATE_CHARS_MAX), default="slave",
                                      server_default="slave")
    reported_epoch: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    in_sync: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    position: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    positions: Mapped[Any] = mapped_column(JSON, nullable=True)
    lag_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    lag_ms: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # A slave's copy stopped at a record it cannot decode: {log, offset, kind, version,
    # reason}, as it last reported (``0006_undecodable_at``); None when it is not.
    undecodable_at: Mapped[Any] = mapped_column(JSON, nullable=True)


class BacklogHead(Base):
    """What the MetaServer holds of one server's backlog besides its rows (migration
    ``0005_backlog_table``): ``version`` of the rows in ``backlog_rows`` (None: a delay server,
    whose ``backlog`` is a stats object kept here whole), and the server's ``stats`` object.

    Apart from the ``brokers`` row on purpose: a backlog write never locks the row a lease
    renewal writes (metaserver/backlog.py).
    """

    __tablename__ = "backlog_heads"

    server_id: Mapped[str] = mapped_column(String(SERVER_ID_CHARS_MAX), primary_key=True)
    version: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    backlog: Mapped[Any] = mapped_column(JSON, nullable=True)
    stats: Mapped[Any] = mapped_column(JSON, nullable=True)


class BacklogRow(Base):
    """One (subject, group) row of a realtime server's backlog: only rows that changed are
    written (migration ``0005_backlog_table``; serverkit/backlog.py names the counts)."""

    __tablename__ = "backlog_rows"

    server_id: Mapped[str] = mapped_column(String(SERVER_ID_CHARS_MAX), primary_key=True)
    subject: Mapped[str] = mapped_column(String(SUBJECT_CHARS_MAX), primary_key=True)
    group_name: Mapped[str] = mapped_column(String(NAME_CHARS_MAX), primary_key=True)
    lag: Mapped[int] = mapped_column(BigInteger)
    consumers: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    redelivered: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    retried: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    dead: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")


class Subject(Base):
    """A subject with a realtime route; ``version`` goes up on every change of its route."""

    __tablename__ = "subjects"

    name: Mapped[str] = mapped_column(String(SUBJECT_CHARS_MAX), primary_key=True)
    version: Mapped[int] = mapped_column(BigInteger)
    created_at_ms: Mapped[int] = mapped_column(BigInteger)
    updated_at_ms: Mapped[int] = mapped_column(BigInteger)


class SubjectRoute(Base):
    """A broker group that is or was in a subject's route.

    ``active`` rows are where producers send. Rows are never deleted, so consumers can drain every
    group a subject has ever been routed to.
    """

    __tablename__ = "subject_routes"

    subject: Mapped[str] = mapped_column(ForeignKey("subjects.name"), primary_key=True)
    group_name: Mapped[str] = mapped_column(
        ForeignKey("broker_groups.name"), primary_key=True, index=True
    )
    active: Mapped[bool] = mapped_column(Boolean)
    added_at_ms: Mapped[int] = mapped_column(BigInteger)
    removed_at_ms: Mapped[int | None] = mapped_column(BigInteger, nullable=True)


class ConsumerGroup(Base):
    """A (consumer group, subject) pair some consumer has subscribed to."""

    __tablename__ = "consumer_groups"

    name: Mapped[str] = mapped_column(String(NAME_CHARS_MAX), primary_key=True)
    subject: Mapped[str] = mapped_column(String(SUBJECT_CHARS_MAX), primary_key=True)
    created_at_ms: Mapped[int] = mapped_column(BigInteger)


class Client(Base):
    """A producer or consumer process known from its heartbeats."""

    __tablename__ = "clients"

    client_id: Mapped[str] = mapped_column(String(NAME_CHARS_MAX), primary_key=True)
    app: Mapped[str] = mapped_column(String(NAME_CHARS_MAX))
    group_name: Mapped[str] = mapped_column(String(NAME_CHARS_MAX), index=True)  # "" = none
    role: Mapped[str] = mapped_column(String(STATE_CHARS_MAX))  # producer | consumer
    subjects: Mapped[Any] = mapped_column(JSON)  # list of subject names
    online: Mapped[bool] = mapped_column(Boolean)
    first_seen_ms: Mapped[int] = mapped_column(BigInteger)
    last_seen_ms: Mapped[int] = mapped_column(BigInteger)


class AppToken(Base):
    """An app's access token (only its hash is stored) with subject patterns it may use."""

    __tablename__ = "app_tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    app: Mapped[str] = mapped_column(String(NAME_CHARS_MAX), index=True)
    token_hash: Mapped[str] = mapped_column(String(128), unique=True)
    produce_patterns: Mapped[Any] = mapped_column(JSON)  # list of subject patterns
    consume_patterns: Mapped[Any] = mapped_column(JSON)  # list of subject patterns
    created_at_ms: Mapped[int] = mapped_column(BigInteger)
    revoked_at_ms: Mapped[int | None] = mapped_column(BigInteger, nullable=True)  # None = valid
    # Admin tokens may call the admin API, run brokers, and use every subject (0002_token_admin).
    admin: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # The first characters of the secret (not enough to guess the rest), so lists can name it.
    token_hint: Mapped[str] = mapped_column(String(TOKEN_HINT_CHARS_MAX), default="",
                                            server_default="")


class Schedule(Base):
    """A recurring (or one-off) schedule and how far the MetaServers got with it.

    The definition: ``subject``, ``body``, ``tags``, ``properties`` of each occurrence's message,
    when it fires (``kind`` cron | every | at with ``cron``/``every_ms``/``at_ms``, ``tz``,
    ``start_ms``, ``end_ms``) and the ``misfire`` policy (skip | once | all). ``state`` is
    active | paused | finished | deleted; a deleted row has no ``name`` (so the name is free
    again) and lives only until what it handed over is cancelled.

    The progress (``metaserver.schedule_runner``): every occurrence at or before ``after_ms``
    was handed to a delay server or skipped; ``pending_fire_ms`` is the latest handed over,
    held by delay group ``pending_group``. ``doubt`` lists ``[fire_ms, delay group]`` pairs
    whose hand-over is not confirmed (or, once the schedule is paused or deleted, that must be
    cancelled); ``doubt_owner`` is the MetaServer sending them until ``action_ms``, after which
    any MetaServer resolves them. ``action_ms`` is when a runner must look at the row next
    (None: never).
    """

    __tablename__ = "schedules"
    # AUTOINCREMENT on SQLite: ids go into message ids, so a deleted schedule's id is never
    # reused (PostgreSQL's sequence never reuses one either).
    __table_args__ = {"sqlite_autoincrement": True}

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str | None] = mapped_column(String(NAME_CHARS_MAX), unique=True, nullable=True)
    app: Mapped[str] = mapped_column(String(NAME_CHARS_MAX))  # of the token that made it
    subject: Mapped[str] = mapped_column(String(SUBJECT_CHARS_MAX))
    body: Mapped[bytes] = mapped_column(LargeBinary)
    tags: Mapped[Any] = mapped_column(JSON)  # list of str
    properties: Mapped[Any] = mapped_column(JSON)  # str -> str
    kind: Mapped[str] = mapped_column(String(STATE_CHARS_MAX))
    cron: Mapped[str | None] = mapped_column(String(CRON_CHARS_MAX), nullable=True)
    every_ms: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    at_ms: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    tz: Mapped[str] = mapped_column(String(TZ_CHARS_MAX))
    start_ms: Mapped[int] = mapped_column(BigInteger)
    end_ms: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    misfire: Mapped[str] = mapped_column(String(STATE_CHARS_MAX))
    state: Mapped[str] = mapped_column(String(STATE_CHARS_MAX))
    created_at_ms: Mapped[int] = mapped_column(BigInteger)
    updated_at_ms: Mapped[int] = mapped_column(BigInteger)
    after_ms: Mapped[int] = mapped_column(BigInteger)
    pending_fire_ms: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    pending_group: Mapped[str | None] = mapped_column(String(NAME_CHARS_MAX), nullable=True)
    sent_count: Mapped[int] = mapped_column(BigInteger, default=0)
    skipped_count: Mapped[int] = mapped_column(BigInteger, default=0)
    doubt: Mapped[Any] = mapped_column(JSON, nullable=True)  # [[fire_ms, group], ...]
    doubt_owner: Mapped[str | None] = mapped_column(String(NAME_CHARS_MAX), nullable=True)
    action_ms: Mapped[int | None] = mapped_column(BigInteger, nullable=True, index=True)
    last_error: Mapped[str | None] = mapped_column(String(ERROR_CHARS_MAX), nullable=True)
