"""The idempotent consumer: a handler's writes and the record that the message was handled go
into the application's database in one transaction, so a redelivered message (the consumer died
after its commit and before its ack) does not run the handler twice.

    from qmq.idempotent import Idempotent

    once = Idempotent(async_sessionmaker(engine), scope="billing")

    @consumer.handler("order.timeout")
    @once.handler
    async def cancel_unpaid(session, msg):          # runs inside the transaction
        order = await session.get(Order, int(msg.body))
        if order.state == "unpaid":
            order.state = "cancelled"

Sync code (a Django/Flask worker) uses ``Idempotent(sessionmaker(engine))`` and ``handle``.
The record is the row (scope, message key) in ``qmq_handled`` (``outbox.metadata``); the key is
the message's origin id (``qmq-origin-id``, set on retry copies) or else its id, so a retry copy of
a message whose handling committed is recognised too. Rows older than ``keep`` are pruned every
``prune_every`` handled messages (docs/OUTBOX.md).
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

from sqlalchemy import BigInteger, String, delete, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Mapped, mapped_column

from qmq.outbox import MESSAGE_ID_CHARS_MAX, OutboxBase
from wire.clock import wall_clock_ms
from wire.message import ORIGIN_ID_PROPERTY

SCOPE_CHARS_MAX = 200
# How long handled ids are kept by default: longer than any redelivery or retry chain can last
# (16 retries of up to 2 h each come to about a day and a half).
KEEP_DEFAULT = timedelta(days=7)
# Handled messages between two prunes, per Idempotent object.
PRUNE_EVERY_DEFAULT = 1_000


class HandledMessage(OutboxBase):
    """One handled message: (scope, key) and when it was handled."""

    __tablename__ = "qmq_handled"

    scope: Mapped[str] = mapped_column(String(SCOPE_CHARS_MAX), primary_key=True)
    message_key: Mapped[str] = mapped_column(String(MESSAGE_ID_CHARS_MAX), primary_key=True)
    handled_at_ms: Mapped[int] = mapped_column(BigInteger, index=True)


def message_key(msg: Any) -> str:
    """What identifies a message across redeliveries and retry copies: its origin id, else its
    id."""
    properties = getattr(msg, "properties", None) or {}
    return properties.get(ORIGIN_ID_PROPERTY) or msg.id


def _insert_once(dialect: str, scope: str, key: str, now_ms: int) -> Any:
    """An INSERT that does nothing when the row exists (PostgreSQL and SQLite both say ON
    CONFLICT DO NOTHING; on PostgreSQL a concurrent insert of the same key waits for the other
    transaction and then does nothing)."""
    values = {"scope": scope, "message_key": key, "handled_at_ms": now_ms}
    module = {"postgresql": postgresql, "sqlite": sqlite}.get(dialect)
    if module is None:
        raise NotImplementedError(f"the idempotent consumer runs on PostgreSQL or SQLite, not "
                                  f"{dialect}")
    return module.insert(HandledMessage).values(**values).on_conflict_do_nothing()


def claim(session: Any, msg: Any, scope: str = "default", now_ms: int | None = None) -> bool:
    """Record ``msg`` as handled in ``session``'s transaction (a sync Session); True the first
    time, False when it was handled (and committed) before."""
    statement = _insert_once(session.get_bind().dialect.name, scope, message_key(msg),
                             wall_clock_ms() if now_ms is None else now_ms)
    return session.execute(statement).rowcount == 1


async def claim_async(session: Any, msg: Any, scope: str = "default",
                      now_ms: int | None = None) -> bool:
    """``claim`` for an AsyncSession."""
    statement = _insert_once(session.bind.dialect.name, scope, message_key(msg),
                             wall_clock_ms() if now_ms is None else now_ms)
    return (await session.execute(statement)).rowcount == 1


class Idempotent:
    """Runs handlers at most once per message (per ``scope``) with the handled record in the
    handler's own transaction. ``sessions`` is a ``sessionmaker`` or an ``async_sessionmaker``.
    """

    def __init__(self, sessions: Callable[[], Any], scope: str = "default",
                 keep: timedelta = KEEP_DEFAULT, prune_every: int = PRUNE_EVERY_DEFAULT,
                 clock: Callable[[], int] = wall_clock_ms) -> None:
        if not 1 <= len(scope) <= SCOPE_CHARS_MAX:
            raise ValueError(f"scope {scope!r} must be 1 to {SCOPE_CHARS_MAX} characters")
        self.sessions = sessions
        self.scope = scope
        self.keep_ms = int(keep / timedelta(milliseconds=1))
        self.prune_every = prune_every
        self.clock = clock
        self._since_prune = 0

    def handle(self, msg: Any, fn: Callable[[Any, Any], Any]) -> bool:
        """Run ``fn(session, msg)`` in a transaction unless ``msg`` was handled; True if it ran.
        An exception rolls back both the handler's writes and the record."""
        with self.sessions() as session, session.begin():
            if not claim(session, msg, self.scope, self.clock()):
                return False
            fn(session, msg)
        self._count()
        if self._due_prune():
            with self.sessions() as session, session.begin():
                self.prune(session)
        return True

    async def handle_async(self, msg: Any, fn: Callable[[Any, Any], Awaitable[Any]]) -> bool:
        """``handle`` for async code: ``await fn(session, msg)`` in an AsyncSession."""
        async with self.sessions() as session, session.begin():
            if not await claim_async(session, msg, self.scope, self.clock()):
                return False
            await fn(session, msg)
        self._count()
        if self._due_prune():
            async with self.sessions() as session, session.begin():
                await self.prune_async(session)
        return True

    def handler(self, fn: Callable[[Any, Any], Any]) -> Callable[[Any], Any]:
        """Decorate ``fn(session, msg)`` into ``fn(msg)`` that runs it once per message (an
        ``async def`` gives an ``async def``, for ``Consumer.handler``)."""
        if inspect.iscoroutinefunction(fn):
            async def run_async(msg: Any) -> bool:
                return await self.handle_async(msg, fn)
            run_async.__name__ = getattr(fn, "__name__", "handler")
            return run_async

        def run(msg: Any) -> bool:
            return self.handle(msg, fn)
        run.__name__ = getattr(fn, "__name__", "handler")
        return run

    def prune(self, session: Any) -> int:
        """Delete this scope's records older than ``keep`` (sync Session); returns how many."""
        return session.execute(self._prune_statement()).rowcount or 0

    async def prune_async(self, session: Any) -> int:
        """``prune`` for an AsyncSession."""
        return (await session.execute(self._prune_statement())).rowcount or 0

    def _prune_statement(self) -> Any:
        return delete(HandledMessage).where(
            HandledMessage.scope == self.scope,
            HandledMessage.handled_at_ms < self.clock() - self.keep_ms)

    def _count(self) -> None:
        self._since_prune += 1

    def _due_prune(self) -> bool:
        if self._since_prune < self.prune_every:
            return False
        self._since_prune = 0
        return True

    def was_handled(self, session: Any, msg: Any) -> bool:
        """True when ``msg`` is recorded as handled (sync Session)."""
        return session.execute(select(HandledMessage.message_key).where(
            HandledMessage.scope == self.scope,
            HandledMessage.message_key == message_key(msg))).first() is not None


__all__ = ["HandledMessage", "Idempotent", "claim", "claim_async", "message_key"]
