"""pyqmq: ``import qmq`` gives the asyncio SDK (docs/SDK.md).

    async with qmq.Producer("http://127.0.0.1:8090") as producer:
        receipt = await producer.send("order.created", b"...")

``qmq.errors`` is ``wire.errors``; the CLI lives in ``qmq.cli``. The names are exactly the
SDK's public ones (``sdk.__all__``), so the two lists cannot drift apart.
"""

import sdk
from sdk import *  # noqa: F401,F403  (the re-export is the point of this module)

__all__ = list(sdk.__all__)
