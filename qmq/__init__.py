"""pyqmq: ``import qmq`` gives the asyncio SDK (docs/SDK.md), and ``qmq.sync`` its blocking
twin for Django, Flask and scripts.

    async with qmq.Producer("http://127.0.0.1:8090") as producer:
        receipt = await producer.send("order.created", b"...")

    with qmq.sync.Producer("http://127.0.0.1:8090") as producer:
        receipt = producer.send("order.created", b"...")

``qmq.errors`` is ``wire.errors``; the CLI lives in ``qmq.cli``. The names are the SDK's
public ones (``sdk.__all__``) and ``sync``, so the two lists cannot drift apart.

The SDK is imported on first use of one of its names, not by ``import
qmq`` itself: the ``qmq`` command imports this package, and ``qmq --help``, ``qmq --version`` or
a server command have no use for the client.
"""

import importlib
from typing import TYPE_CHECKING, Any

from wire import errors as _errors

if TYPE_CHECKING:  # what type checkers see: every name, as if imported here
    from sdk import *  # noqa: F401,F403
    from wire.errors import *  # noqa: F401,F403
    from qmq import sync

# sdk.__all__ without importing sdk: its own names, then the error classes (wire.errors is light).
# tests/unit/test_layout.py checks that this is sdk.__all__ exactly.
_SDK_NAMES = ["errors", "Producer", "Receipt", "Consumer", "ReceivedMessage", "Subscription",
              "Schedules", "Message", "RequestTimeout", "WrongEventLoop"]
__all__ = ["sync"]
__all__ += _SDK_NAMES
__all__ += _errors.__all__


def __getattr__(name: str) -> Any:
    """The SDK's names, loaded on first use (PEP 562)."""
    if name == "sync":  # importing the submodule binds it here (a from-import would recurse)
        return importlib.import_module("qmq.sync")
    if name in __all__:
        import sdk

        value = getattr(sdk, name)
        globals()[name] = value  # the next lookup does not come here
        return value
    raise AttributeError(f"module 'qmq' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
