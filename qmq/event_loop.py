"""The event loop a server command runs on: ``--event-loop auto|uvloop|asyncio``.

uvloop (MagicStack's libuv-based loop, a dependency everywhere but Windows) runs the loop's own
work (polling, callbacks, socket reads and writes, timers) in C where asyncio runs it in
Python: on ``bench.path_cpu`` it took the event loop thread's CPU per message down by the share
docs/BENCHMARKS.md ("Session 21: uvloop") records. ``auto``, the default, takes uvloop when it
can be imported and asyncio's own loop otherwise. ``QMQ_NO_EXTENSIONS=1`` does not choose the
loop: it picks the Python twins of our own C functions (logstore.twins), which uvloop is not,
and CI's pass with it runs in-process unit tests on pytest's asyncio loop only; the asyncio
fallback is proven by those tests and by the end-to-end tests of ``--event-loop asyncio``.

Only the server commands choose: the SDK and the client commands run on whatever loop the
caller runs (a user picks theirs).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

EVENT_LOOPS = ("auto", "uvloop", "asyncio")
# The default of --event-loop when set (bench harnesses A/B the two loops with it).
EVENT_LOOP_ENV = "QMQ_EVENT_LOOP"


class EventLoopUnavailable(ValueError):
    """``--event-loop`` names a loop this process cannot run (unknown, or not installed)."""


def default_choice() -> str:
    """``--event-loop``'s default: ``$QMQ_EVENT_LOOP``, else ``auto``."""
    return os.environ.get(EVENT_LOOP_ENV) or "auto"


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The loop factory ``choice`` means for ``asyncio.Runner``: uvloop's, or None for asyncio's
    own. EventLoopUnavailable for an unknown choice, or ``uvloop`` when it cannot be imported."""
    if choice not in EVENT_LOOPS:
        raise EventLoopUnavailable(f"event loop {choice!r} is unknown "
                                   f"(choose one of {', '.join(EVENT_LOOPS)})")
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError as exc:
        if choice == "uvloop":
            raise EventLoopUnavailable(f"event loop 'uvloop' cannot be imported ({exc}): "
                                       "pip install uvloop, or choose auto or asyncio") from None
        return None
    return uvloop.new_event_loop


def loop_name(loop: asyncio.AbstractEventLoop) -> str:
    """``uvloop`` or ``asyncio``: which loop ``loop`` is (for the ready line and tests)."""
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


__all__ = ["EVENT_LOOPS", "EVENT_LOOP_ENV", "EventLoopUnavailable", "default_choice",
           "loop_factory", "loop_name"]
