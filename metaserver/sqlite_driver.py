"""SQLite statements in one thread round trip each (issue 18: the MetaServer's idle CPU).

SQLAlchemy's async engine reaches SQLite through aiosqlite, which runs every sqlite3 call on a
thread of its own and hands each result back to the event loop: a future, a self-pipe wake-up
and a greenlet switch per call. SQLAlchemy's adapter makes four such calls for a statement that
returns rows (make a cursor, execute, fetch every row, close the cursor) and three for one that
does not, and a ``commit`` or ``rollback`` is one more even when no transaction is open, as
after every commit when the pool resets the connection it takes back. The MetaServer's periodic
handlers (expiry check, backlog reports, full heartbeats, the failover check, the schedule
runner's idle read) spent most of their event-loop CPU on these round trips.

``one_hop_dbapi`` is SQLAlchemy's aiosqlite DBAPI adapter with two changes, passed to
``create_async_engine(module=...)`` by ``metaserver.db.make_engine``:

- a statement (``execute`` or ``executemany``) is one call on aiosqlite's thread: make the
  sqlite3 cursor, execute, fetch every row when there are any, keep the cursor's
  ``description``, ``rowcount`` and ``lastrowid``, close it. The rows are buffered as the stock
  adapter buffers them (it fetched them all too); the SQL sent is the same;
- ``commit`` and ``rollback`` make no call when sqlite3 says no transaction is open
  (``in_transaction``): sqlite3's own ``commit`` and ``rollback`` do nothing then (Python 3.11+
  resets no cursor on rollback), so only the round trip is saved.

Server-side cursors (``stream``), which the MetaServer does not use, stay the stock ones.
``one_hop_dbapi`` returns None when the installed SQLAlchemy or aiosqlite lack what it builds
on (their adapter classes and aiosqlite's ``Connection._execute``): the engine then uses the
stock adapter, slower but the same.

Owner: each adapted connection is used by one task at a time (SQLAlchemy's pool checks it out);
its statements run on its aiosqlite thread.
"""

from __future__ import annotations

import collections
import sqlite3
from typing import Any

try:
    import aiosqlite
    from sqlalchemy.dialects.sqlite.aiosqlite import (
        AsyncAdapt_aiosqlite_connection,
        AsyncAdapt_aiosqlite_cursor,
        AsyncAdapt_aiosqlite_dbapi,
    )
    from sqlalchemy.util import EMPTY_DICT
except ImportError:  # an older SQLAlchemy (its adapter classes elsewhere) or no aiosqlite
    aiosqlite = None  # type: ignore[assignment]


class _Ran:
    """What a closed sqlite3 cursor told of its statement: what SQLAlchemy reads from a
    cursor after ``execute`` (the rows are in the adapter's buffer)."""

    __slots__ = ("description", "rowcount", "lastrowid", "arraysize")

    def __init__(self, description: Any, rowcount: int, lastrowid: int | None,
                 arraysize: int) -> None:
        self.description = description
        self.rowcount = rowcount
        self.lastrowid = lastrowid
        self.arraysize = arraysize

    def close(self) -> None:
        """Nothing to close: the sqlite3 cursor was closed on the thread."""


# A cursor before its statement ran: no description, as sqlite3's is.
_NOT_RUN = _Ran(None, -1, None, 1)


def _run_statement(connection: sqlite3.Connection, operation: str, parameters: Any,
                   many: bool) -> tuple[_Ran, list[Any] | None]:
    """aiosqlite's thread: one statement on a cursor of its own, every row fetched (None when
    it returns none), the cursor closed whatever happens."""
    cursor = connection.cursor()
    try:
        if many:
            cursor.executemany(operation, parameters)
        elif parameters is None:
            cursor.execute(operation)
        else:
            cursor.execute(operation, parameters)
        rows = cursor.fetchall() if cursor.description else None
        return _Ran(cursor.description, cursor.rowcount, cursor.lastrowid,
                    cursor.arraysize), rows
    finally:
        cursor.close()


def _shape_known() -> bool:
    """Whether the installed SQLAlchemy and aiosqlite have what the adapter below overrides."""
    if aiosqlite is None:
        return False
    return (hasattr(aiosqlite.Connection, "_execute")
            and hasattr(AsyncAdapt_aiosqlite_cursor, "_execute_async")
            and hasattr(AsyncAdapt_aiosqlite_cursor, "_awaitable_cursor_close")
            and "_cursor_cls" in vars(AsyncAdapt_aiosqlite_connection))


if _shape_known():

    class OneHopCursor(AsyncAdapt_aiosqlite_cursor):  # type: ignore[misc,valid-type]
        """A cursor whose statement is one call on the connection's thread (module doc)."""

        __slots__ = ()
        _awaitable_cursor_close = False  # close() has nothing to await

        def __init__(self, adapt_connection: Any) -> None:
            # The stock cursor makes its sqlite3 cursor here (a round trip); ours is made with
            # the statement, on the thread.
            self._adapt_connection = adapt_connection
            self._connection = adapt_connection._connection
            self._cursor = _NOT_RUN
            self._soft_closed_memoized = EMPTY_DICT
            self._rows = collections.deque()

        async def _execute_async(self, operation: Any, parameters: Any) -> Any:
            async with self._adapt_connection._execute_mutex:
                ran, rows = await self._connection._execute(
                    _run_statement, self._connection._conn, operation, parameters, False)
                self._cursor = ran
                if rows is not None:
                    self._rows = collections.deque(rows)
                return self

        async def _executemany_async(self, operation: Any, seq_of_parameters: Any) -> Any:
            async with self._adapt_connection._execute_mutex:
                ran, _ = await self._connection._execute(
                    _run_statement, self._connection._conn, operation, seq_of_parameters, True)
                self._cursor = ran
                return self

    class OneHopConnection(AsyncAdapt_aiosqlite_connection):  # type: ignore[misc,valid-type]
        """An adapted connection whose statements are one round trip and whose commit and
        rollback make none outside a transaction (module doc)."""

        __slots__ = ()
        _cursor_cls = OneHopCursor

        def _in_transaction(self) -> bool:
            # aiosqlite's sqlite3 connection (None once closed); the flag is a plain read of
            # sqlite3_get_autocommit, and no call of ours runs on the thread meanwhile.
            connection = self._connection._connection
            return connection is None or connection.in_transaction

        def rollback(self) -> None:
            if self._in_transaction():
                super().rollback()

        def commit(self) -> None:
            if self._in_transaction():
                super().commit()

    class OneHopDbapi(AsyncAdapt_aiosqlite_dbapi):  # type: ignore[misc,valid-type]
        """SQLAlchemy's aiosqlite DBAPI adapter whose connections are ``OneHopConnection``."""

        def connect(self, *arg: Any, **kw: Any) -> Any:
            stock = super().connect(*arg, **kw)
            return OneHopConnection(self, stock._connection)


def one_hop_dbapi() -> Any:
    """The adapter to pass as ``create_async_engine(module=...)`` for a sqlite+aiosqlite URL, or
    None when the installed versions lack what it needs (the stock adapter is used then)."""
    if not _shape_known():
        return None
    return OneHopDbapi(aiosqlite, sqlite3)


__all__ = ["one_hop_dbapi"]
