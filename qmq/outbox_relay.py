"""The outbox relay: sends what committed in ``qmq_outbox`` and then deletes or marks it.

    relay = Relay("postgresql+asyncpg://app@db/shop", "http://127.0.0.1:8090")
    await relay.run()                      # until cancelled; or ``qmq outbox relay --db URL``

One relay at a time per table: on PostgreSQL it holds a session advisory lock (key derived from
the table name) on a connection of its own for as long as it runs, and a second relay waits for
it; on SQLite it holds an exclusive ``flock`` on ``<database file>.qmq-relay.lock``. A pass:

1. reads up to ``batch_max`` pending rows in id order (cancels and sends alike);
2. a cancel first withdraws the sends of its key: those not yet relayed are dropped unsent,
   those relayed are cancelled at every delay group that may hold them (``cancel`` needs the
   group, and a resend after a crash may have gone to another one);
3. sends the rest with ``Producer.send_many`` under their own message ids, grouped by subject
   and common fields;
4. deletes what was sent (a delayed message with a key stays, marked ``sent``, until its time
   has passed, for a later cancel) and puts a failed row back with a backoff.

A crash between 3 and 4 sends those rows again with the same ids: the brokers de-duplicate a
resent id (a realtime broker within its 10-minute window; a delayed message's two copies are
dispatched with the same id and one is kept), as docs/OUTBOX.md explains.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import zlib
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from sqlalchemy import BigInteger, any_, bindparam, delete, select, text, update
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from qmq.outbox import CANCEL, ERROR_CHARS_MAX, PENDING, SENT, OutboxRow
from sdk.producer import Producer
from sdk.send_batch import Receipt
from wire.clock import wall_clock_ms
from wire.errors import QmqError
from wire.limits import MAX_SEND_BATCH_MESSAGES

log = logging.getLogger(__name__)

# Rows one pass reads at most.
BATCH_MAX_DEFAULT = 2_000
# Sleep when a pass found nothing, in ms.
POLL_INTERVAL_MS_DEFAULT = 50
# A failed row waits this long before its next try, doubling up to RETRY_BACKOFF_MS_MAX.
RETRY_BACKOFF_MS = 200
RETRY_BACKOFF_MS_MAX = 30_000
# A relayed delayed message with a key is kept this long past its due time (for a late cancel,
# which would then answer "already dispatched"), then pruned, in ms.
KEEP_AFTER_DUE_MS = 3_600_000
# Passes between two prunes.
PRUNE_EVERY_PASSES = 100
# How often a relay waiting for the lock tries again, in ms.
LOCK_RETRY_MS = 500


def async_url(url: str) -> str:
    """The async-driver form of a database URL (``postgresql://`` -> ``postgresql+asyncpg://``,
    ``sqlite:///`` -> ``sqlite+aiosqlite:///``): the relay is asyncio code."""
    parsed = make_url(url)
    driver = {"postgresql": "postgresql+asyncpg", "sqlite": "sqlite+aiosqlite"}.get(
        parsed.get_backend_name())
    if driver is None:
        raise ValueError(f"--db {url!r}: the outbox relay runs on PostgreSQL or SQLite")
    return parsed.set(drivername=driver).render_as_string(hide_password=False)


def lock_key(table: str) -> int:
    """The advisory-lock key of ``table``'s relay: a signed 64-bit number from its name."""
    return zlib.crc32(f"qmq-outbox-relay:{table}".encode()) | (0x716D71 << 32)


class Relay:
    """Relays one outbox table to the brokers of the MetaServer at ``meta_url``."""

    def __init__(self, db: str | AsyncEngine, meta_url: str, *, token: str | None = None,
                 tls: Any = None, batch_max: int = BATCH_MAX_DEFAULT,
                 poll_interval_ms: int = POLL_INTERVAL_MS_DEFAULT,
                 clock: Callable[[], int] = wall_clock_ms,
                 after_send: Callable[[list[OutboxRow]], Any] | None = None) -> None:
        self.engine = db if isinstance(db, AsyncEngine) else create_async_engine(async_url(db))
        self._own_engine = not isinstance(db, AsyncEngine)
        self.meta_url = meta_url
        self.batch_max = batch_max
        self.poll_interval_ms = poll_interval_ms
        self.clock = clock
        # Called with the rows just sent, before they are marked (tests stop a relay there).
        self.after_send = after_send
        self.producer = Producer(meta_url, app="qmq-outbox", token=token, tls=tls,
                                 batch_size_max=MAX_SEND_BATCH_MESSAGES)
        self.table = OutboxRow.__tablename__
        self.sent = 0  # messages handed to brokers (counting resends)
        self._passes = 0
        self._lock_connection: AsyncConnection | None = None
        self._lock_file: int | None = None
        self._prefetched: list[Any] | None = None

    async def close(self) -> None:
        """Release the lock, close the producer and (if it made it) the engine."""
        with contextlib.suppress(Exception):
            await self.producer.close()
        await self._release()
        if self._own_engine:
            await self.engine.dispose()

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Take the lock (waiting while another relay holds it), then relay until cancelled or
        ``stop`` is set."""
        stop = stop or asyncio.Event()
        try:
            await self.wait_lock(stop)
            while not stop.is_set():
                if await self.relay_once() == 0:
                    # asyncio.timeout: 3.11's wait_for can swallow a cancel (see _sleep of
                    # metaserver.schedule_runner).
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(self.poll_interval_ms / 1000):
                            await stop.wait()
        finally:
            await self.close()

    # -- the one-relay lock -----------------------------------------------------------------------

    async def wait_lock(self, stop: asyncio.Event | None = None) -> None:
        """Hold this table's relay lock; while another relay has it, try again every
        LOCK_RETRY_MS (logging once that it waits)."""
        said = False
        while not await self.try_lock():
            if not said:
                log.info("another relay holds the lock of %s; waiting for it", self.table)
                said = True
            if stop is not None and stop.is_set():
                raise asyncio.CancelledError
            await asyncio.sleep(LOCK_RETRY_MS / 1000)
        log.info("relay of %s holds the lock", self.table)

    async def try_lock(self) -> bool:
        """Take the lock if it is free; True when this relay holds it."""
        if self.engine.dialect.name == "postgresql":
            if self._lock_connection is None:
                self._lock_connection = await self.engine.connect()
            got = (await self._lock_connection.execute(
                text("SELECT pg_try_advisory_lock(:key)"), {"key": lock_key(self.table)})).scalar()
            await self._lock_connection.commit()  # the lock is the session's, not a transaction's
            return bool(got)
        path = self.engine.url.database
        if not path or path == ":memory:":
            return True  # a private database: nobody else can relay it
        if self._lock_file is None:
            self._lock_file = os.open(f"{path}.qmq-relay.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    async def _release(self) -> None:
        if self._lock_connection is not None:
            with contextlib.suppress(Exception):
                await self._lock_connection.close()  # ends the session: the lock goes with it
            self._lock_connection = None
        if self._lock_file is not None:
            os.close(self._lock_file)
            self._lock_file = None

    async def _check_lock(self) -> None:
        """Fail the pass if the lock's connection is gone (PostgreSQL restarted): another relay
        may hold the lock now."""
        if self._lock_connection is not None:
            await self._lock_connection.execute(text("SELECT 1"))
            await self._lock_connection.commit()

    # -- a pass ---------------------------------------------------------------------------------

    async def relay_once(self) -> int:
        """One pass (see the module doc); returns the number of rows it handled. After a full
        batch, the next batch is read while this one is sent."""
        await self._check_lock()
        now_ms = self.clock()
        rows, self._prefetched = self._prefetched or await self._read(now_ms, 0), None
        self._passes += 1
        if self._passes % PRUNE_EVERY_PASSES == 0:
            await self._prune(now_ms)
        if not rows:
            return 0
        # Rows after this batch's last id, all later than it: a cancel among them is handled
        # once this batch is marked. Failed rows of this batch come back in a pass from id 0.
        ahead = (asyncio.create_task(self._read(now_ms, rows[-1].id))
                 if len(rows) == self.batch_max else None)
        try:
            sends = [row for row in rows if row.kind != CANCEL]
            cancels = [row for row in rows if row.kind == CANCEL]
            done: list[int] = []  # row ids finished: deleted
            kept: dict[str, list[int]] = defaultdict(list)  # delay group -> ids kept as sent
            failed: dict[int, str] = {}
            if cancels:
                sends = await self._cancel(cancels, sends, done, failed)
            await self._send(sends, done, kept, failed)
            await self._mark(rows, done, kept, failed, now_ms)
        except BaseException:
            if ahead is not None:
                ahead.cancel()
                with contextlib.suppress(BaseException):
                    await ahead
            raise
        if ahead is not None:
            self._prefetched = await ahead
        return len(rows)

    async def _read(self, now_ms: int, after_id: int) -> list[Any]:
        """Up to ``batch_max`` pending rows due now, with ids above ``after_id``, in id order."""
        async with self.engine.connect() as connection:
            rows = (await connection.execute(
                select(OutboxRow.__table__).where(OutboxRow.state == PENDING,
                                                  OutboxRow.next_attempt_ms <= now_ms,
                                                  OutboxRow.id > after_id)
                .order_by(OutboxRow.id).limit(self.batch_max))).all()
            await connection.rollback()
        return list(rows)

    async def _send(self, sends: list[Any], done: list[int], kept: dict[str, list[int]],
                    failed: dict[int, str]) -> None:
        groups: dict[tuple[Any, ...], list[Any]] = defaultdict(list)
        for row in sends:
            groups[(row.subject, json.dumps(row.tags), json.dumps(row.properties, sort_keys=True),
                    row.expire_at_ms, row.deliver_at_ms is not None)].append(row)
        results = await asyncio.gather(*(self._send_group(rows) for rows in groups.values()))
        for rows, receipts in zip(groups.values(), results):
            for row, receipt in zip(rows, receipts):
                if not isinstance(receipt, Receipt):
                    failed[row.id] = f"{type(receipt).__name__}: {receipt}"
                elif row.key is not None and row.deliver_at_ms is not None:
                    kept[receipt.broker_group].append(row.id)
                else:
                    done.append(row.id)
        if self.after_send is not None:
            self.after_send(sends)

    async def _send_group(self, rows: list[Any]) -> list[Any]:
        first = rows[0]
        try:
            return await self.producer.send_many(
                first.subject, [row.body for row in rows], tags=first.tags,
                properties=first.properties, expire_at=first.expire_at_ms,
                deliver_at=None if first.deliver_at_ms is None
                else [row.deliver_at_ms for row in rows],
                message_ids=[row.message_id for row in rows], return_exceptions=True)
        except QmqError as exc:  # refused before sending: every row of the group failed
            return [exc] * len(rows)
        finally:
            self.sent += len(rows)

    async def _cancel(self, cancels: list[Any], sends: list[Any], done: list[int],
                      failed: dict[int, str]) -> list[Any]:
        """Withdraw the sends of each cancel's key written before it; returns the sends of this
        pass still to send. Unsent ones are dropped, relayed ones cancelled at the brokers."""
        keys = {row.key for row in cancels}
        async with self.engine.connect() as connection:
            keyed = (await connection.execute(
                select(OutboxRow.__table__).where(OutboxRow.key.in_(keys),
                                                  OutboxRow.kind != CANCEL))).all()
            await connection.rollback()
        withdrawn: set[int] = set()
        for cancel in cancels:
            try:
                for row in keyed:
                    if row.key != cancel.key or row.id > cancel.id or row.id in withdrawn:
                        continue
                    if row.state == SENT:
                        await self._withdraw(row)
                    withdrawn.add(row.id)
                done.append(cancel.id)
            except QmqError as exc:
                failed[cancel.id] = f"cancel of {cancel.key!r}: {exc.code}: {exc.message}"
        done += sorted(withdrawn)
        return [row for row in sends if row.id not in withdrawn]

    async def _withdraw(self, row: Any) -> None:
        """Cancel a relayed delayed message at its delay group and every other one."""
        route = await self.producer._delay_routes.refresh(row.subject, "producer")
        groups = [row.delay_group] + [g.group for g in route.groups if g.group != row.delay_group]
        for group in groups:
            receipt = Receipt(row.message_id, row.subject, group, "stored", row.deliver_at_ms)
            try:
                status = await self.producer.cancel(receipt)
            except QmqError as exc:
                if group == row.delay_group:
                    raise
                log.info("cancel of %s at %s failed (%s); the recorded group answered",
                         row.message_id, group, exc)
                continue
            log.info("outbox key %r: message %s %s at %s", row.key, row.message_id, status, group)

    async def _mark(self, rows: list[Any], done: list[int], kept: dict[str, list[int]],
                    failed: dict[int, str], now_ms: int) -> None:
        attempts = {row.id: row.attempts for row in rows}
        async with self.engine.begin() as connection:
            table = OutboxRow.__table__
            if done:
                await connection.execute(delete(table).where(self._among(table.c.id, done)))
            for group, ids in kept.items():
                await connection.execute(update(table).where(self._among(table.c.id, ids)).values(
                    state=SENT, sent_at_ms=now_ms, delay_group=group, last_error=None))
            for row_id, error in failed.items():
                tries = attempts[row_id] + 1
                backoff_ms = min(RETRY_BACKOFF_MS << min(tries - 1, 20), RETRY_BACKOFF_MS_MAX)
                log.warning("outbox row %d failed (try %d), retrying in %d ms: %s", row_id,
                            tries, backoff_ms, error)
                await connection.execute(update(table).where(table.c.id == row_id).values(
                    attempts=tries, next_attempt_ms=now_ms + backoff_ms,
                    last_error=error[:ERROR_CHARS_MAX]))

    def _among(self, column: Any, ids: list[int]) -> Any:
        """``column IN ids``; on PostgreSQL as ``= ANY(array)``: one parameter, not thousands."""
        if self.engine.dialect.name == "postgresql":
            return column == any_(bindparam("ids", ids, type_=ARRAY(BigInteger)))
        return column.in_(ids)

    async def _prune(self, now_ms: int) -> None:
        """Drop relayed delayed messages whose time is long past (no cancel can matter)."""
        table = OutboxRow.__table__
        async with self.engine.begin() as connection:
            await connection.execute(delete(table).where(
                table.c.state == SENT, table.c.deliver_at_ms < now_ms - KEEP_AFTER_DUE_MS))


def _say(as_json: bool, text: str, **fields: Any) -> None:
    """One status line of the relay: ``text``, or ``fields`` as one JSON object."""
    print(json.dumps(fields) if as_json else text, flush=True)


async def run_relay_command(db_url: str, meta_url: str, *, token: str | None, tls: Any,
                            batch_max: int, as_json: bool = False) -> int:
    """``qmq outbox relay``: relay until SIGTERM/SIGINT, saying when it holds the lock (each
    status line a JSON object with ``--json``)."""
    import signal

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    relay = Relay(db_url, meta_url, token=token, tls=tls, batch_max=batch_max)
    _say(as_json, f"outbox relay of {relay.table} starting (db {relay.engine.url!r})",
         event="starting", table=relay.table, db=repr(relay.engine.url))
    try:
        await relay.wait_lock(stop)
        _say(as_json, f"outbox relay holds the lock of {relay.table}; relaying to {meta_url}",
             event="relaying", table=relay.table, meta=meta_url)
        await relay.run(stop)
    except asyncio.CancelledError:
        pass
    finally:
        await relay.close()
    _say(as_json, f"outbox relay stopped: {relay.sent} message(s) sent", event="stopped",
         table=relay.table, sent=relay.sent)
    return 0


__all__ = ["Relay", "async_url", "lock_key", "run_relay_command"]
