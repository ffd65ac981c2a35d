"""``Resumed``: a coroutine already stepped once by hand, for a task to go on with
(``FrameServer._dispatch`` steps a request's handler inline and makes a task only when the
handler waits). Apart from serverkit/frame_server.py for its size.
"""

from __future__ import annotations

import collections.abc
from typing import Any, Coroutine, Generator

_NOT_YET = object()


class Resumed(collections.abc.Coroutine):  # type: ignore[type-arg]
    """A coroutine already stepped once by hand (``FrameServer._dispatch``), for a task to go
    on with: the task's first step gets what the coroutine yielded then (the future it waits
    on), as if the task had made that step itself; every later step is the coroutine's own.
    A task cancelled before its first step throws the cancel into the coroutine, where it
    stopped."""

    __slots__ = ("_coro", "_yielded")

    def __init__(self, coro: Coroutine[Any, Any, None], yielded: Any) -> None:
        self._coro = coro
        self._yielded = yielded

    def send(self, value: Any) -> Any:
        """The task's step: the first hands back what the hand-made step yielded."""
        yielded = self._yielded
        if yielded is not _NOT_YET:
            self._yielded = _NOT_YET
            return yielded
        return self._coro.send(value)

    def throw(self, *args: Any) -> Any:  # type: ignore[override]
        """A cancel (or another exception) thrown into the task."""
        self._yielded = _NOT_YET
        return self._coro.throw(*args)

    def close(self) -> None:
        """Close the coroutine (a task never stepped is closed when collected)."""
        self._yielded = _NOT_YET
        self._coro.close()

    def __await__(self) -> Generator[Any, None, None]:
        raise TypeError("Resumed is run by a task, not awaited")


__all__ = ["Resumed"]
