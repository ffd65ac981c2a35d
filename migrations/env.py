"""Alembic environment of the MetaServer database.

Two ways in:

* the MetaServer (``metaserver.db.upgrade_database``) opens its async engine, starts a transaction
  and passes the synchronous connection in ``config.attributes["connection"]``; the migrations run
  inside that transaction (and under an advisory lock on PostgreSQL);
* by hand: ``alembic -c migrations/alembic.ini -x db_url=... upgrade head`` (or
  ``sqlalchemy.url`` in the ini file) builds its own async engine.

The models' metadata (only ``--autogenerate`` needs it) is handed in, never imported here: the
MetaServer passes ``config.attributes["target_metadata"]``, and by hand ``-x models=MODULE`` names
a module whose ``Base.metadata`` is used. So ``metaserver`` imports ``migrations`` and not the
other way round (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import asyncio
import importlib
from typing import Any

from alembic import context
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine



def _target_metadata() -> Any:
    """The models' metadata: handed in by the MetaServer, or named with ``-x models=MODULE``."""
    metadata = context.config.attributes.get("target_metadata")
    if metadata is None:
        module = context.get_x_argument(as_dictionary=True).get("models")
        if module:
            metadata = importlib.import_module(module).Base.metadata
    return metadata


target_metadata = _target_metadata()


def _run(connection: Connection) -> None:
    """Run the pending migrations on ``connection``."""
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things in place; batch mode copies the table instead.
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def _db_url() -> str:
    """Return the database URL given with ``-x db_url=...`` or ``sqlalchemy.url``."""
    url = context.get_x_argument(as_dictionary=True).get("db_url") or context.config.get_main_option(
        "sqlalchemy.url"
    )
    if not url:
        raise RuntimeError("no database URL: pass -x db_url=... or set sqlalchemy.url")
    return url


async def _run_own_engine() -> None:
    """Open an engine of our own, migrate, and close it."""
    engine = create_async_engine(_db_url())
    try:
        async with engine.begin() as connection:
            await connection.run_sync(_run)
    finally:
        await engine.dispose()


def _main() -> None:
    """Pick the way in: a connection handed over by the MetaServer, offline SQL, or our own engine."""
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _run(connection)
    elif context.is_offline_mode():
        context.configure(url=_db_url(), target_metadata=target_metadata, literal_binds=True)
        with context.begin_transaction():
            context.run_migrations()
    else:
        asyncio.run(_run_own_engine())


_main()
