"""metaserver.sqlite_driver: a SQLite statement in one aiosqlite round trip, and no round trip
for a commit or rollback outside a transaction; what SQLAlchemy reads of a statement
(rows, rowcount, lastrowid, errors) is as the stock adapter gives it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiosqlite
import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from metaserver.db import make_engine
from metaserver.sqlite_driver import one_hop_dbapi


class Hops:
    """Counts the calls handed to aiosqlite's thread (every one goes through ``_execute``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        stock = aiosqlite.Connection._execute

        async def counted(connection: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return await stock(connection, fn, *args, **kwargs)

        monkeypatch.setattr(aiosqlite.Connection, "_execute", counted)

    def since(self, start: int) -> int:
        return self.count - start


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[AsyncEngine]:
    engine = make_engine(f"sqlite+aiosqlite:///{tmp_path / 'meta.db'}")
    async with engine.begin() as conn:
        await conn.execute(text("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT UNIQUE)"))
    yield engine
    await engine.dispose()


def test_the_installed_versions_get_the_one_hop_adapter(tmp_path: Path) -> None:
    assert one_hop_dbapi() is not None
    engine = make_engine(f"sqlite+aiosqlite:///{tmp_path / 'x.db'}")
    assert type(engine.dialect.dbapi).__name__ == "OneHopDbapi"


async def test_a_read_is_one_round_trip_and_its_connection_returns_without_one(
        engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    async with engine.begin() as conn:
        await conn.execute(text("INSERT INTO t (v) VALUES ('a'), ('b')"))
    hops = Hops(monkeypatch)
    async with engine.connect() as conn:
        result = await conn.execute(text("SELECT id, v FROM t ORDER BY id"))
        assert list(result.keys()) == ["id", "v"]
        assert result.all() == [(1, "a"), (2, "b")]
    # The stock adapter: cursor, execute, fetchall, close, and the pool's rollback: 5.
    assert hops.since(0) == 1


async def test_a_write_transaction_is_one_trip_per_statement_and_one_for_its_commit(
        engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    hops = Hops(monkeypatch)
    async with engine.begin() as conn:
        result = await conn.execute(text("INSERT INTO t (v) VALUES ('a')"))
        assert result.lastrowid == 1 and result.rowcount == 1
        result = await conn.execute(text("INSERT INTO t (v) VALUES (:v)"), [{"v": "b"}, {"v": "c"}])
        assert result.rowcount == 2
        result = await conn.execute(text("UPDATE t SET v = v || '!' WHERE id > 1"))
        assert result.rowcount == 2
    assert hops.since(0) == 4  # three statements and the commit; the pool's reset makes none
    async with engine.connect() as conn:
        assert (await conn.execute(text("SELECT v FROM t ORDER BY id"))).scalars().all() == [
            "a", "b!", "c!"]


async def test_a_failed_statement_raises_as_before_and_its_transaction_rolls_back(
        engine: AsyncEngine) -> None:
    with pytest.raises(IntegrityError, match="UNIQUE"):
        async with engine.begin() as conn:
            await conn.execute(text("INSERT INTO t (v) VALUES ('a')"))
            await conn.execute(text("INSERT INTO t (v) VALUES ('a')"))
    async with engine.connect() as conn:
        assert (await conn.execute(text("SELECT count(*) FROM t"))).scalar() == 0
        # The connection went back to the pool usable: a statement after the failure works.
        assert (await conn.execute(text("SELECT 1"))).scalar() == 1


async def test_an_open_transaction_is_rolled_back_when_its_connection_closes(
        engine: AsyncEngine) -> None:
    conn = await engine.connect()
    await conn.execute(text("INSERT INTO t (v) VALUES ('kept?')"))
    await conn.close()  # no commit: the insert must not stay
    async with engine.connect() as conn:
        assert (await conn.execute(text("SELECT count(*) FROM t"))).scalar() == 0
