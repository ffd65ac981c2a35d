"""Order timeouts with the transactional outbox and an idempotent consumer.

    qmq up &                                   # in another terminal
    python examples/order_timeout.py           # --meta URL, --db URL, --timeout-s S

1. Two orders are placed. Each order's row and its "cancel this order in 30 minutes" message
   (``order.timeout``, delayed, keyed by the order) are written in ONE transaction through the
   outbox: if the transaction rolls back there is no timeout; once it commits, the relay sends it.
2. Order 1 is paid: the order row and ``outbox.cancel`` of its timeout go in one transaction; the
   relay withdraws the timeout at the delay server.
3. A consumer of ``order.timeout`` cancels the orders still unpaid, with the idempotent helper:
   the state change and the "handled" record commit together, so a redelivered timeout does not
   act twice.

The delay is 30 minutes by default; ``--timeout-s 2`` shows the whole story in seconds (the test
``tests/e2e/test_examples.py`` runs it so). The database is SQLite in a temporary directory unless
``--db`` names one (``sqlite:///shop.db``, ``postgresql://user@host/shop``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from datetime import timedelta

from sqlalchemy import Integer, String, select
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
    state: Mapped[str] = mapped_column(String(16))  # unpaid | paid | cancelled


async def place_order(sessions, order_id: int, timeout: timedelta) -> None:
    """The order and its timeout, in one transaction."""
    async with sessions() as session, session.begin():
        session.add(Order(id=order_id, state="unpaid"))
        outbox.send(session, "order.timeout", str(order_id).encode(), delay=timeout,
                    key=f"order-{order_id}-timeout")


async def pay(sessions, order_id: int) -> None:
    """The payment and the withdrawal of the timeout, in one transaction."""
    async with sessions() as session, session.begin():
        (await session.get(Order, order_id)).state = "paid"
        outbox.cancel(session, f"order-{order_id}-timeout")


async def cancel_if_unpaid(session, msg) -> None:
    """The timeout handler; runs inside the idempotent helper's transaction."""
    order = await session.get(Order, int(msg.body))
    if order is not None and order.state == "unpaid":
        order.state = "cancelled"
        print(f"order {order.id}: unpaid at its timeout, cancelled", flush=True)


async def main(meta_url: str, db_url: str, timeout_s: float) -> int:
    engine = create_async_engine(async_url(db_url))
    async with engine.begin() as connection:
        await connection.run_sync(Base.metadata.create_all)
        await connection.run_sync(outbox.create_tables)
    sessions = async_sessionmaker(engine, expire_on_commit=False)
    stop = asyncio.Event()
    relay = Relay(engine, meta_url, poll_interval_ms=20)  # in-process; or `qmq outbox relay`
    relaying = asyncio.create_task(relay.run(stop))
    once = Idempotent(sessions, scope="order-timeouts")
    handled = asyncio.Event()
    async with qmq.Consumer(meta_url, group="order-timeouts", start="earliest") as consumer:

        @consumer.handler("order.timeout")
        @once.handler
        async def on_timeout(session, msg) -> None:
            await cancel_if_unpaid(session, msg)
            handled.set()

        await place_order(sessions, 1, timedelta(seconds=timeout_s))
        await place_order(sessions, 2, timedelta(seconds=timeout_s))
        print(f"orders 1 and 2 placed; each times out in {timeout_s:g} s unless paid", flush=True)
        await pay(sessions, 1)
        print("order 1 paid; its timeout withdrawn", flush=True)
        await asyncio.wait_for(handled.wait(), timeout_s + 60)
        await asyncio.sleep(1.0)  # order 1's timeout, had it not been withdrawn, comes now too
    stop.set()
    await relaying
    async with sessions() as session:
        states = {o.id: o.state for o in (await session.scalars(select(Order))).all()}
    await engine.dispose()
    print(f"final states: {states}", flush=True)
    return 0 if states == {1: "paid", 2: "cancelled"} else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--meta", default=os.environ.get("QMQ_META", "http://127.0.0.1:8090"))
    parser.add_argument("--db", default=None, help="the shop's database (default: a temp file)")
    parser.add_argument("--timeout-s", type=float, default=1800.0,
                        help="order timeout in seconds (default 1800: 30 minutes)")
    options = parser.parse_args()
    database = options.db or f"sqlite:///{tempfile.mkdtemp(prefix='shop-')}/shop.db"
    sys.exit(asyncio.run(main(options.meta, database, options.timeout_s)))
