"""The pyqmq client SDK (asyncio): Producer, Consumer, Message and the errors they raise.

The client only: connections (``sdk.connection``), routes from the MetaServer (``sdk.routes``),
batching (``sdk.send_batch``), acks (``sdk.acks``), ``sdk.producer`` and ``sdk.consumer``, and the
schedule API client (``sdk.schedules``). What it
shares with the servers (message codec, protocol frames, errors, limits, TLS) is ``wire``, the
only other package of ours it imports. docs/SDK.md describes the API.
"""

from wire import errors
from sdk.consumer import Consumer, ReceivedMessage, Subscription
from wire.errors import *  # noqa: F401,F403  (every error a client may catch: errors.ERRORS)
from sdk.connection import RequestTimeout
from wire.message import Message
from sdk.producer import Producer, Receipt
from sdk.schedules import Schedules

__all__ = [
    "errors",
    "Producer",
    "Receipt",
    "Consumer",
    "ReceivedMessage",
    "Subscription",
    "Schedules",
    "Message",
    "RequestTimeout",
]
# The error classes (wire.errors.ERRORS), in a form type checkers follow.
__all__ += errors.__all__
