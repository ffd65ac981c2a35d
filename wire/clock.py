"""The wall clock in epoch milliseconds: the one definition every process uses as its default
clock (servers, the SDK's producer, the MetaServer, the trace writer). Code that decides on
time is handed a clock or a ``now_ms`` instead of calling this, so tests can use a fake one."""

from __future__ import annotations

import time


def wall_clock_ms() -> int:
    """Milliseconds since the epoch, from the system clock."""
    return time.time_ns() // 1_000_000


__all__ = ["wall_clock_ms"]
