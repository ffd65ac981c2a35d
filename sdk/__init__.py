"""The pyqmq client SDK (asyncio): Producer, Consumer, Message and the errors they raise.

The wire codec (sdk.protocol, sdk.message, sdk.limits, sdk.errors) is shared with the servers;
the client parts (sdk.connection, sdk.routes, sdk.producer, sdk.consumer) are used by applications.
docs/SDK.md describes the API.
"""

from sdk import errors
from sdk.consumer import Consumer, ReceivedMessage, Subscription
from sdk.errors import (
    BadRequest,
    ConnectionLost,
    DelayOutOfRange,
    Forbidden,
    Internal,
    NoRoute,
    NotFound,
    NotSupported,
    Overloaded,
    QmqError,
    ReadOnly,
    TooLarge,
    Unauthorized,
)
from sdk.connection import RequestTimeout
from sdk.message import Message
from sdk.producer import Producer, Receipt

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
