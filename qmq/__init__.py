"""pyqmq: ``import qmq`` gives the asyncio SDK (docs/SDK.md), and ``qmq.sync`` its blocking
twin for Django, Flask and scripts.

    async with qmq.Producer("http://127.0.0.1:8090") as producer:
        receipt = await producer.send("order.created", b"...")

    with qmq.sync.Producer("http://127.0.0.1:8090") as producer:
        receipt = producer.send("order.created", b"...")

``qmq.errors`` is ``wire.errors``; the CLI lives in ``qmq.cli``. The names are the SDK's
public ones (``sdk.__all__``) and ``sync``, so the two lists cannot drift apart.
"""

import sdk
from sdk import *  # noqa: F401,F403  (the re-export is the point of this module)
# The same error classes sdk exports, imported from their module too: type checkers follow a
# star import through one module's literal __all__, not through sdk's.
from wire.errors import *  # noqa: F401,F403
from qmq import sync

__all__ = ["sync"]
__all__ += sdk.__all__
