"""The transactional outbox and the idempotent consumer in one process: a MetaServer, a realtime
broker and a delay server on port 0; the application's database is SQLite (sync and async
sessions) here, PostgreSQL in tests/e2e/test_outbox_e2e.py."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Integer, String, create_engine, func, select
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

import qmq
from qmq import outbox
from qmq.idempotent import HandledMessage, Idempotent
from qmq.outbox_relay import Relay
from tests.harness import wait_for
from tests.integration.test_schedules import cluster, consuming
from metaserver import sqlite_url


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    state: Mapped[str] = mapped_column(String(16))


def app_db(tmp_path: Any) -> tuple[Any, str]:
    """A sync engine on a fresh SQLite file with the app's and the outbox's tables."""
    path = tmp_path / "app.db"
    engine = create_engine(f"sqlite:///{path}")
    Base.metadata.create_all(engine)
    outbox.create_tables(engine)
    return engine, f"sqlite:///{path}"


def outbox_rows(engine: Any) -> list[Any]:
    with Session(engine) as session:
        return list(session.scalars(select(outbox.OutboxRow).order_by(outbox.OutboxRow.id)))


@asynccontextmanager
async def running(tmp_path: Any) -> AsyncIterator[Any]:
    async with cluster(tmp_path, sqlite_url(tmp_path / "meta.db")) as c:
        yield c


async def test_committed_messages_are_relayed_once_and_their_rows_deleted(tmp_path: Any) -> None:
    engine, url = app_db(tmp_path)
    async with running(tmp_path) as c, consuming(c.meta.url, "order.created") as inbox:
        with Session(engine) as session, session.begin():
            session.add(Order(id=1, state="new"))
            ids = [outbox.send(session, "order.created", f"order {i}".encode(),
                               properties={"n": str(i)}) for i in range(3)]
        relay = Relay(url, c.meta.url)
        try:
            assert await relay.wait_lock() is None
            assert await relay.relay_once() == 3
        finally:
            await relay.close()
        await wait_for(lambda: len(inbox.items) == 3, 20, "three messages")
        assert sorted(inbox.ids) == sorted(ids)
        assert outbox_rows(engine) == []


async def test_a_rolled_back_transaction_never_sends(tmp_path: Any) -> None:
    engine, url = app_db(tmp_path)
    async with running(tmp_path) as c, consuming(c.meta.url, "order.created") as inbox:
        with pytest.raises(RuntimeError), Session(engine) as session, session.begin():
            session.add(Order(id=1, state="new"))
            outbox.send(session, "order.created", b"ghost")
            raise RuntimeError("the order failed")
        with Session(engine) as session, session.begin():
            outbox.send(session, "order.created", b"real")
        relay = Relay(url, c.meta.url)
        try:
            await relay.wait_lock()
            assert await relay.relay_once() == 1
        finally:
            await relay.close()
        await wait_for(lambda: len(inbox.items) == 1, 20, "the committed message")
        await asyncio.sleep(0.5)
        assert [m.body for _, m in inbox.items] == [b"real"]


async def test_a_delayed_message_is_cancelled_by_key_before_or_after_it_was_relayed(
        tmp_path: Any) -> None:
    _engine, url = app_db(tmp_path)
    engine = create_async_engine(url.replace("sqlite://", "sqlite+aiosqlite://"))
    sessions = async_sessionmaker(engine)
    async with running(tmp_path) as c, consuming(c.meta.url, "order.timeout") as inbox:
        relay = Relay(engine, c.meta.url)
        await relay.wait_lock()
        async with sessions() as session, session.begin():  # an AsyncSession
            for order in (1, 2, 3):
                outbox.send(session, "order.timeout", str(order).encode(),
                            delay=timedelta(milliseconds=1_500), key=f"order-{order}")
        assert await relay.relay_once() == 3  # all three are with the delay server now
        async with sessions() as session, session.begin():
            outbox.cancel(session, "order-1")  # paid: cancelled after it was relayed
            outbox.send(session, "order.timeout", b"4", delay=1_500, key="order-4")
            outbox.cancel(session, "order-4")  # paid at once: never even relayed
        assert await relay.relay_once() == 3
        await wait_for(lambda: len(inbox.items) >= 2, 20, "the two unpaid orders")
        await asyncio.sleep(1.0)
        assert sorted(m.body for _, m in inbox.items) == [b"2", b"3"]
        async with sessions() as session:
            left = (await session.scalars(select(outbox.OutboxRow))).all()
        assert {(r.key, r.state) for r in left} == {("order-2", "sent"), ("order-3", "sent")}
        await relay.close()
        await engine.dispose()


async def test_a_failed_send_is_retried_and_a_resend_after_a_crash_is_deduplicated(
        tmp_path: Any) -> None:
    engine, url = app_db(tmp_path)
    async with running(tmp_path) as c:
        with Session(engine) as session, session.begin():
            ids = [outbox.send(session, "jobs", f"job {i}".encode()) for i in range(5)]

        def crash(rows: list[Any]) -> None:
            raise SystemExit("the relay dies after sending, before deleting the rows")

        dying = Relay(url, c.meta.url, after_send=crash)
        await dying.wait_lock()
        with pytest.raises(SystemExit):
            await dying.relay_once()
        await dying.close()
        assert len(outbox_rows(engine)) == 5  # still pending: they will be sent again
        lost = Relay(url, "http://127.0.0.1:9")  # no MetaServer there: every send fails
        await lost.wait_lock()
        await lost.relay_once()
        await lost.close()
        failed = outbox_rows(engine)
        assert len(failed) == 5 and all(r.attempts == 1 and r.last_error for r in failed)
        async with consuming(c.meta.url, "jobs") as inbox:
            relay = Relay(url, c.meta.url)
            await relay.wait_lock()
            await wait_for(functools.partial(_relayed, relay, engine), 30, "the rows resent")
            await relay.close()
            await wait_for(lambda: len(inbox.items) >= 5, 20, "the five jobs")
            await asyncio.sleep(0.5)
            assert sorted(inbox.ids) == sorted(ids)  # each once: the resends were duplicates


async def _relayed(relay: Relay, engine: Any) -> bool:
    await relay.relay_once()
    return outbox_rows(engine) == []


async def test_a_second_relay_waits_while_the_first_holds_the_sqlite_lock(tmp_path: Any) -> None:
    _engine, url = app_db(tmp_path)
    first, second = Relay(url, "http://127.0.0.1:9"), Relay(url, "http://127.0.0.1:9")
    try:
        assert await first.try_lock()
        assert not await second.try_lock()
        await first.close()
        assert await second.try_lock()
    finally:
        await second.close()


async def test_the_idempotent_helper_runs_a_handler_once_per_message_and_prunes(
        tmp_path: Any) -> None:
    engine, _url = app_db(tmp_path)
    clock = [1_000_000]
    once = Idempotent(sessionmaker(engine), scope="billing", keep=timedelta(seconds=10),
                      prune_every=2, clock=lambda: clock[0])

    @once.handler
    def pay(session: Session, msg: Any) -> None:
        session.add(Order(id=int(msg.body), state="paid"))

    class Msg:
        def __init__(self, id: str, body: bytes, properties: dict[str, str] | None = None):
            self.id, self.body, self.properties = id, body, properties or {}

    assert pay(Msg("m1", b"1")) is True
    assert pay(Msg("m1", b"1")) is False  # redelivered: not run again
    # A retry copy of a message whose handling committed is the same message.
    assert pay(Msg("m1.r1", b"1", {"qmq-origin-id": "m1"})) is False

    def fails(session: Session, msg: Any) -> None:
        session.add(Order(id=2, state="paid"))
        raise ValueError("the handler failed")

    with pytest.raises(ValueError):
        once.handle(Msg("m2", b"2"), fails)
    assert pay(Msg("m2", b"2")) is True  # nothing of the failed try was kept
    with Session(engine) as session:
        assert session.scalar(select(func.count()).select_from(Order)) == 2
        assert session.scalar(select(func.count()).select_from(HandledMessage)) == 2
    clock[0] += 11_000
    assert pay(Msg("m3", b"3")) and pay(Msg("m4", b"4"))  # the second one prunes
    with Session(engine) as session:
        keys = set(session.scalars(select(HandledMessage.message_key)))
    assert keys == {"m3", "m4"}


async def test_the_outbox_refuses_a_bad_message_in_the_callers_transaction(tmp_path: Any) -> None:
    engine, _url = app_db(tmp_path)
    with Session(engine) as session:
        with pytest.raises(qmq.BadRequest):
            outbox.send(session, "bad subject!", b"x")
        with pytest.raises(qmq.TooLarge):
            outbox.send(session, "ok", b"x" * (4 * 1024 * 1024 + 1))
        with pytest.raises(qmq.BadRequest):
            outbox.send(session, "ok", b"x", delay=-1)
        with pytest.raises(qmq.BadRequest):
            outbox.cancel(session, "")
