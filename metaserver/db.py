"""Database plumbing: the async engine, SQLite settings, and applying the Alembic migrations."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import event, text
from sqlalchemy.engine import Connection, make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

import migrations
from metaserver.models import Base
from metaserver.sqlite_driver import one_hop_dbapi

# Key of the PostgreSQL advisory lock held while migrating, so MetaServers started together over
# one database do not both run the same migration. Any constant works; this one spells "qmqmeta".
MIGRATION_LOCK_KEY = 0x716D_716D_6574_61
# Milliseconds SQLite waits for another connection's write lock before failing.
SQLITE_BUSY_TIMEOUT_MS = 5000


def migrations_dir() -> Path:
    """Return the directory of the Alembic scripts, found next to the installed package."""
    return Path(migrations.__file__).resolve().parent


def alembic_config(db_url: str | None = None) -> Config:
    """Return an Alembic Config whose script location is the installed ``migrations`` package."""
    directory = migrations_dir()
    config = Config(str(directory / "alembic.ini"))
    config.set_main_option("script_location", str(directory))
    if db_url is not None:
        # ConfigParser interpolates %, which URL-encoded passwords contain.
        config.set_main_option("sqlalchemy.url", db_url.replace("%", "%%"))
    return config


def head_revision() -> str:
    """Return the newest migration revision shipped with this package."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, "the migrations package has no revision"
    return head


def make_engine(db_url: str) -> AsyncEngine:
    """Create the async engine; SQLite gets WAL, a busy timeout, enforced foreign keys and
    statements in one thread round trip each (``metaserver.sqlite_driver``)."""
    # A ping before each checkout finds a PostgreSQL connection the server or a proxy closed;
    # a SQLite file is never disconnected, and the ping cost each query a thread round trip.
    url = make_url(db_url)
    sqlite = url.get_backend_name() == "sqlite"
    options: dict[str, Any] = {}
    if sqlite and url.get_driver_name() == "aiosqlite":
        module = one_hop_dbapi()  # a statement in one thread round trip, not three or four
        if module is not None:
            options["module"] = module
    engine = create_async_engine(db_url, pool_pre_ping=not sqlite, **options)
    if engine.dialect.name == "sqlite":
        event.listen(engine.sync_engine, "connect", _sqlite_on_connect)
    return engine


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
    """Set the per-connection SQLite pragmas."""
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys=ON")
    finally:
        cursor.close()


async def upgrade_database(engine: AsyncEngine) -> str:
    """Apply every pending migration in one transaction and return the revision now in place.

    Safe to call on every start: a database at head is left as it is.
    """
    async with engine.begin() as connection:
        if engine.dialect.name == "postgresql":
            await connection.execute(
                text("SELECT pg_advisory_xact_lock(:key)"), {"key": MIGRATION_LOCK_KEY}
            )
        return await connection.run_sync(_upgrade_sync)


def _upgrade_sync(connection: Connection) -> str:
    """Run ``alembic upgrade head`` on a connection that is already in a transaction."""
    config = alembic_config()
    config.attributes["connection"] = connection
    config.attributes["target_metadata"] = Base.metadata
    command.upgrade(config, "head")
    revision = MigrationContext.configure(connection).get_current_revision()
    assert revision is not None, "alembic left no revision behind"
    return revision


async def current_revision(engine: AsyncEngine) -> str | None:
    """Return the migration revision of the database, or None when it was never migrated."""
    async with engine.connect() as connection:
        return await connection.run_sync(
            lambda sync: MigrationContext.configure(sync).get_current_revision()
        )
