"""``run_every``: a server's background round (expiry, retention, a flush), run at a fixed
interval until cancelled, surviving a failed round."""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable


async def run_every(interval_ms: int, step: Callable[[], Awaitable[object]],
                    logger: logging.Logger, what: str) -> None:
    """Await ``step()`` every ``interval_ms`` (after each sleep) until cancelled. A round that
    raises is logged with its traceback on ``logger`` (``what`` names it) and the next round
    runs as usual: a passing fault (a database hiccup, a full disk) must not end it for good."""
    assert interval_ms > 0, interval_ms
    interval_s = interval_ms / 1000
    while True:
        await asyncio.sleep(interval_s)
        try:
            await step()
        except Exception:
            logger.exception("%s failed; next round in %.3f s", what, interval_s)


__all__ = ["run_every"]
