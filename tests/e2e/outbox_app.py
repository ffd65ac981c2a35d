"""A small application for the outbox and idempotent-consumer kill -9 tests, run as a process.

    python -m tests.e2e.outbox_app --db URL --meta URL MODE [options]

Modes:
  write N        commit N orders, each with its outbox message to --subject (one transaction
                 each), print
                 "committed N", then, with --hang, wait to be killed without relaying anything
  relay          relay in-process until the outbox is empty, print "drained", exit
  relay-die      relay one pass and SIGKILL itself after sending, before the rows are marked
  consume        consume "payments" with the idempotent helper writing a ledger row per message;
                 --hang-before-commit / --hang-after-commit make it print "holding ID" and wait
                 to be killed inside the handler's transaction, or after its commit but before
                 the ack
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

from sqlalchemy import Integer, String, func, select
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

import qmq
from qmq import outbox
from qmq.idempotent import Idempotent
from qmq.outbox_relay import Relay, async_url


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    state: Mapped[str] = mapped_column(String(16))


class Ledger(Base):
    __tablename__ = "ledger"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    payment: Mapped[str] = mapped_column(String(64))


def say(line: str) -> None:
    print(line, flush=True)


async def setup(db_url: str):
    engine = create_async_engine(async_url(db_url))
    async with engine.begin() as connection:
        await connection.run_sync(Base.metadata.create_all)
        await connection.run_sync(outbox.create_tables)
    return engine


async def write(engine, count: int, hang: bool, subject: str) -> None:
    sessions = async_sessionmaker(engine)
    async with sessions() as session:
        first = (await session.scalar(select(func.coalesce(func.max(Order.id), 0)))) + 1
    for order in range(first, first + count):
        async with sessions() as session, session.begin():
            session.add(Order(id=order, state="new"))
            outbox.send(session, subject, str(order).encode(), key=f"order-{order}")
    say(f"committed {count}")
    if hang:
        await asyncio.Event().wait()


async def relay(engine, meta_url: str, die: bool) -> None:
    def kill_myself(rows) -> None:
        say(f"sent {len(rows)}, dying before marking them")
        os.kill(os.getpid(), signal.SIGKILL)

    relayer = Relay(engine, meta_url, after_send=kill_myself if die else None)
    await relayer.wait_lock()
    try:
        while await relayer.relay_once():
            pass
    finally:
        await relayer.close()
    say("drained")


async def consume(engine, meta_url: str, hang_before: bool, hang_after: bool) -> None:
    once = Idempotent(async_sessionmaker(engine), scope="ledger")

    async def book(session, msg) -> None:
        session.add(Ledger(payment=msg.body.decode()))
        await session.flush()
        if hang_before:
            say(f"holding {msg.body.decode()} before commit")
            await asyncio.Event().wait()

    async with qmq.Consumer(meta_url, group="ledger", start="earliest") as consumer:
        say("ready")
        async for msg in consumer.subscribe("payments"):
            ran = await once.handle_async(msg, book)
            say(f"{'booked' if ran else 'already booked'} {msg.body.decode()}")
            if hang_after and ran:
                say(f"holding {msg.body.decode()} after commit")
                await asyncio.Event().wait()
            await msg.ack()


async def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db", required=True)
    parser.add_argument("--meta", required=True)
    parser.add_argument("mode", choices=["write", "relay", "relay-die", "consume"])
    parser.add_argument("count", type=int, nargs="?", default=1)
    parser.add_argument("--hang", action="store_true")
    parser.add_argument("--subject", default="order.created")
    parser.add_argument("--hang-before-commit", action="store_true")
    parser.add_argument("--hang-after-commit", action="store_true")
    args = parser.parse_args()
    engine = await setup(args.db)
    try:
        if args.mode == "write":
            await write(engine, args.count, args.hang, args.subject)
        elif args.mode in ("relay", "relay-die"):
            await relay(engine, args.meta, args.mode == "relay-die")
        else:
            await consume(engine, args.meta, args.hang_before_commit, args.hang_after_commit)
    finally:
        await engine.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
