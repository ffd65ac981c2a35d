"""``ParkedPull``: a long poll of the realtime broker parked with no task, until the commit that
wakes it (or its deadline) lets ``Pulls`` go on with it and answer it (docs/ARCHITECTURE.md,
"Pulls without a task"). It is also the pull's ``serverkit.frame_server.Later``: the server
returns it as the request's answer, and the frame server writes the answer given to it: one
object per parked pull, no ``Later`` and no reply callable made for each (issue 18)."""

from __future__ import annotations

from typing import Callable, Iterable, Protocol

from realtime.committed import Wake, Waiter
from realtime.consumers import ConsumerKey
from serverkit.frame_server import Later
from wire.protocol import Pull


class Connection(Protocol):
    """The pulling consumer's connection as a pull sees it (the server's ``Session``):
    ``closed`` once it has ended. Read as an attribute, not asked through a callable made per
    pull (issue 18: a lambda made and called twice per message)."""

    closed: bool


class ParkedPull(Later):
    """A long poll parked with no task (``Pulls.pull`` with ``direct``): its state, kept until
    it is answered (owner: the event loop). ``Committed`` tells it its outcome like a future's
    (``done`` / ``set_result``: True woken, False its deadline passed); that only queues it,
    and ``Pulls._run_due`` goes on with it in one loop callback for all polls woken together.
    Its end goes to ``Pulls.parked_answered`` (the server's, which answers this ``Later``)."""

    __slots__ = ("request", "key", "tags", "deadline", "leave_key", "mark", "connection",
                 "group", "woken", "wake", "slot", "ended", "_queue")

    def __init__(self, queue: Callable[[Iterable[ParkedPull], bool], None], request: Pull,
                 key: str, tags: frozenset[str], deadline: float, leave_key: ConsumerKey,
                 mark: int, connection: Connection | None) -> None:
        # The Later's own fields, unbound and not answered (as ``Later.__init__`` sets them),
        # set here: no second __init__ call per pull.
        self._server = self._connection = self._request = self._outcome = None
        self._given_once = False
        self.request = request
        self.key = key
        self.tags = tags
        self.deadline = deadline
        self.leave_key = leave_key
        self.mark = mark
        self.connection = connection
        self.group = (request.subject, key)
        self.woken: bool | None = None  # the outcome of the park in progress (None: waiting)
        self.wake: Wake | None = None  # the Wake and deadline slot it is parked on
        self.slot: set[Waiter] | None = None
        self.ended = False  # its pull ended (Pulls._finish): never twice
        self._queue = queue  # Pulls._tell_due

    def done(self) -> bool:
        """Told its outcome already (as ``asyncio.Future.done``)."""
        return self.woken is not None

    def set_result(self, woken: bool) -> None:
        """Woken (True) or past its deadline (False): queued for ``Pulls._run_due``. Called
        while ``Committed`` iterates its waiters: it changes none of them. (A commit tells the
        polls it wakes all together, through ``Pulls._tell_due``, with no call to this.)"""
        self._queue((self,), woken)


__all__ = ["Connection", "ParkedPull"]
