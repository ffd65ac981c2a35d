"""pyqmq: ``import qmq`` gives the asyncio SDK (docs/SDK.md).

    async with qmq.Producer("http://127.0.0.1:8090") as producer:
        receipt = await producer.send("order.created", b"...")

``qmq.errors`` is ``sdk.errors``; the CLI lives in ``qmq.cli``.
"""

from sdk import (
    BadRequest,
    ConnectionLost,
    Consumer,
    DelayOutOfRange,
    Forbidden,
    Internal,
    Message,
    NoRoute,
    NotFound,
    NotSupported,
    Overloaded,
    Producer,
    QmqError,
    ReadOnly,
    Receipt,
    ReceivedMessage,
    RequestTimeout,
    Subscription,
    TooLarge,
    Unauthorized,
    errors,
)

__all__ = [
    "errors",
    "Producer",
    "Receipt",
    "Consumer",
    "ReceivedMessage",
    "Subscription",
    "Message",
    "QmqError",
    "BadRequest",
    "Unauthorized",
    "Forbidden",
    "TooLarge",
    "DelayOutOfRange",
    "ReadOnly",
    "Overloaded",
    "NotFound",
    "NotSupported",
    "Internal",
    "ConnectionLost",
    "NoRoute",
    "RequestTimeout",
]
