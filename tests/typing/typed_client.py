"""A client written against the public API, checked by mypy with ``disallow_any_expr``
(tests/unit/test_typing.py): any field or method of the public API typed ``Any`` fails it.

Never run; only type-checked.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import qmq
import qmq.sync


async def produce() -> None:
    async with qmq.Producer(("http://10.0.0.1:8090", "http://10.0.0.2:8090"),
                            app="shop") as producer:
        receipt: qmq.Receipt = await producer.send("order.created", b"42", tags=["vip"],
                                                   properties={"id": "42"})
        message_id: str = receipt.message_id
        group: str = receipt.broker_group
        timeout = await producer.send("order.timeout", b"42", delay=timedelta(minutes=30))
        due: int | None = timeout.deliver_at_ms
        status: str = await producer.cancel(timeout)
        await producer.send("reminder", b"renew", deliver_at=datetime(2027, 1, 1, tzinfo=UTC))
        many = await producer.send_many("order.created", [b"1", b"2"])
        first: qmq.Receipt = many[0]
        print(message_id, group, due, status, first)


async def consume() -> None:
    async with qmq.Consumer("http://127.0.0.1:8090", group="billing") as consumer:
        async for msg in consumer.subscribe("order.created", tags=["vip"]):
            body: bytes = msg.body
            props: dict[str, str] = msg.properties
            tags: tuple[str, ...] = msg.tags
            ids: list[str] = [msg.id, msg.subject, msg.wire_subject, msg.broker_group]
            times: list[int | None] = [msg.created_at_ms, msg.deliver_at_ms, msg.expire_at_ms]
            counts: list[int] = [msg.retries, msg.redelivered, msg.pull_seq]
            whole: qmq.Message = msg.message
            print(body, props, tags, ids, times, counts, whole)
            await msg.ack()
            await msg.nack(retry_after=timedelta(seconds=10))

    handlers = qmq.Consumer("http://127.0.0.1:8090", group="billing", concurrency=4)

    @handlers.handler("order.created")
    async def on_order(msg: qmq.ReceivedMessage) -> None:
        print(msg.body)

    @handlers.handler("order.paid")
    def on_paid(msg: qmq.sync.BlockingMessage) -> None:
        print(msg.body)
        msg.nack(retry_after=timedelta(seconds=1))

    await handlers.run()


def blocking() -> None:
    with qmq.sync.Producer("http://127.0.0.1:8090") as producer:
        receipt: qmq.Receipt = producer.send("order.timeout", b"42", delay=60_000)
        status: str = producer.cancel(receipt)
        print(status)
    # Several MetaServers: a list, as the async clients take (or one comma-separated string).
    with qmq.sync.Consumer(["http://10.0.0.1:8090", "http://10.0.0.2:8090"],
                           group="billing") as consumer:
        for msg in consumer.subscribe("order.created"):
            body: bytes = msg.body
            retries: int = msg.retries
            print(body, retries)
            msg.ack()
    errors: tuple[type[qmq.QmqError], ...] = (qmq.Forbidden, qmq.NoRoute, qmq.DelayOutOfRange,
                                              qmq.NotMaster, qmq.Unavailable)
    print(errors)
