"""The pyqmq client SDK (asyncio): Producer, Consumer, Message and the errors they raise.

The client only: connections (``sdk.connection``), routes from the MetaServer (``sdk.routes``,
over ``sdk.http1``), batching (``sdk.send_batch``), acks (``sdk.acks``), ``sdk.producer`` and
``sdk.consumer``, and the schedule API client (``sdk.schedules``). What it shares with the
servers (message codec, protocol frames, errors, limits, TLS) is ``wire``, the only other package
of ours it imports. docs/SDK.md describes the API.

The classes are loaded on first use (PEP 562), so ``import sdk.producer`` (what ``qmq send``
needs) does not also load the consumer and the schedule client.
"""

from typing import TYPE_CHECKING, Any

from wire import errors
from wire.errors import *  # noqa: F401,F403  (every error a client may catch: errors.ERRORS)
from wire.message import Message

if TYPE_CHECKING:  # what type checkers see: every name, as if imported here
    from sdk.batching import WrongEventLoop
    from sdk.connection import RequestTimeout
    from sdk.consumer import Consumer, ReceivedMessage, Subscription
    from sdk.producer import Producer, Receipt
    from sdk.schedules import Schedules

# Where each lazily loaded name lives.
_LAZY = {
    "Producer": "sdk.producer", "Receipt": "sdk.producer", "Consumer": "sdk.consumer",
    "ReceivedMessage": "sdk.consumer", "Subscription": "sdk.consumer",
    "Schedules": "sdk.schedules", "RequestTimeout": "sdk.connection",
    "WrongEventLoop": "sdk.batching",
}

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
    "WrongEventLoop",
]
# The error classes (wire.errors.ERRORS), in a form type checkers follow.
__all__ += errors.__all__


def __getattr__(name: str) -> Any:
    """A class of the SDK, imported on first use."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'sdk' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup does not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
