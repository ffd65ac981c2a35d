"""The transactional outbox: messages written in the application's own database transaction.

    from qmq import outbox

    with Session(engine) as session, session.begin():            # or an AsyncSession
        session.add(Order(id=42, state="unpaid"))
        outbox.send(session, "order.timeout", b"42", delay=timedelta(minutes=30),
                    key="order-42-timeout")
    # committed: the relay sends it; rolled back: it never existed

    with Session(engine) as session, session.begin():
        session.get(Order, 42).state = "paid"
        outbox.cancel(session, "order-42-timeout")                 # even if already relayed

``send`` and ``cancel`` only add a row to the ``qmq_outbox`` table (``outbox.metadata``, to be
created with the application's other tables); they work the same on ``Session`` and
``AsyncSession`` (``add`` is synchronous on both). The relay (``qmq.outbox_relay``, ``qmq outbox
relay --db URL`` or in-process) sends committed rows and then deletes or marks them. Each row
carries a message id made at ``send`` time, so a resend after a crash is the same message to the
broker (docs/OUTBOX.md).

This module needs SQLAlchemy; ``import qmq`` does not load it, so it is imported by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import JSON, BigInteger, Index, Integer, LargeBinary, MetaData, String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from sdk.send_values import due_ms, epoch_ms
from wire.clock import wall_clock_ms
from wire.errors import BadRequest
from wire.limits import MAX_DELAY_MS
from wire.message import Message, new_message_id, validate_message

# Column widths, in characters.
KEY_CHARS_MAX = 200
SUBJECT_CHARS_MAX = 200
MESSAGE_ID_CHARS_MAX = 128
GROUP_CHARS_MAX = 200
ERROR_CHARS_MAX = 500

SEND, CANCEL = "send", "cancel"
PENDING, SENT = "pending", "sent"

# SQLite only numbers rows itself for an INTEGER PRIMARY KEY; PostgreSQL gets a bigint.
_ROW_ID = BigInteger().with_variant(Integer(), "sqlite")


class OutboxBase(DeclarativeBase):
    """The outbox's own declarative base: its tables live in ``outbox.metadata``, apart from
    the application's models (a session handles both)."""

    metadata = MetaData()


metadata = OutboxBase.metadata


class OutboxRow(OutboxBase):
    """One outbox entry: a message to send (``kind`` send) or a cancel by key (``kind`` cancel).

    The relay sends ``pending`` rows in ``id`` order. A sent row is deleted, unless it is a
    delayed message with a ``key``: that one stays ``sent`` with its ``delay_group`` until its
    ``deliver_at_ms`` has passed, so a later cancel by key can find it.
    """

    __tablename__ = "qmq_outbox"
    __table_args__ = (Index("ix_qmq_outbox_state_id", "state", "id"),)

    id: Mapped[int] = mapped_column(_ROW_ID, primary_key=True, autoincrement=True)
    kind: Mapped[str] = mapped_column(String(8))
    key: Mapped[str | None] = mapped_column(String(KEY_CHARS_MAX), nullable=True, index=True)
    message_id: Mapped[str] = mapped_column(String(MESSAGE_ID_CHARS_MAX))
    subject: Mapped[str] = mapped_column(String(SUBJECT_CHARS_MAX))
    body: Mapped[bytes] = mapped_column(LargeBinary)
    tags: Mapped[Any] = mapped_column(JSON)
    properties: Mapped[Any] = mapped_column(JSON)
    deliver_at_ms: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    expire_at_ms: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    created_at_ms: Mapped[int] = mapped_column(BigInteger)
    state: Mapped[str] = mapped_column(String(16))
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_ms: Mapped[int] = mapped_column(BigInteger, default=0)
    sent_at_ms: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    delay_group: Mapped[str | None] = mapped_column(String(GROUP_CHARS_MAX), nullable=True)
    last_error: Mapped[str | None] = mapped_column(String(ERROR_CHARS_MAX), nullable=True)


def send(session: Any, subject: str, body: bytes, *, delay: timedelta | int | None = None,
         deliver_at: datetime | int | None = None, key: str | None = None,
         tags: Sequence[str] = (), properties: dict[str, str] | None = None,
         expire_at: datetime | int | None = None, message_id: str | None = None,
         now_ms: int | None = None) -> str:
    """Add a message to the outbox in ``session``'s transaction; returns its message id.

    Nothing is sent before the transaction commits, and nothing ever if it rolls back.
    ``delay`` (a timedelta or ms) or ``deliver_at`` (an aware datetime or epoch ms) make it a
    delayed message, counted from now (the write), not from when the relay sends it. ``key``
    names it for ``cancel``. The message is checked here, as ``Producer.send`` checks one, so a
    bad one fails in the caller's transaction, not in the relay.
    """
    now_ms = wall_clock_ms() if now_ms is None else now_ms
    deliver_at_ms = due_ms(now_ms, delay, deliver_at)
    _check_key(key)
    message = Message.create(subject, body, now_ms=now_ms, tags=tuple(tags),
                             properties=dict(properties or {}), deliver_at_ms=deliver_at_ms,
                             expire_at_ms=None if expire_at is None
                             else epoch_ms(expire_at, "expire_at"),
                             id=message_id or new_message_id())
    validate_message(message, now_ms=now_ms)
    if deliver_at_ms is not None and deliver_at_ms - now_ms > MAX_DELAY_MS:
        raise BadRequest(f"deliver_at_ms is {deliver_at_ms - now_ms} ms ahead, exceeds "
                         f"MAX_DELAY_MS {MAX_DELAY_MS}")
    session.add(OutboxRow(kind=SEND, key=key, message_id=message.id, subject=subject,
                          body=bytes(body), tags=list(tags), properties=dict(message.properties),
                          deliver_at_ms=deliver_at_ms, expire_at_ms=message.expire_at_ms,
                          created_at_ms=now_ms, state=PENDING, attempts=0, next_attempt_ms=0))
    return message.id


def cancel(session: Any, key: str, *, now_ms: int | None = None) -> None:
    """Cancel, in ``session``'s transaction, every delayed outbox message sent with ``key``.

    Once the transaction commits, the relay withdraws them: one not yet relayed is never sent;
    one already relayed is cancelled at the delay servers (too late once it was delivered).
    """
    _check_key(key)
    if key is None:
        raise BadRequest("cancel needs a key")
    now_ms = wall_clock_ms() if now_ms is None else now_ms
    session.add(OutboxRow(kind=CANCEL, key=key, message_id="", subject="", body=b"", tags=[],
                          properties={}, created_at_ms=now_ms, state=PENDING, attempts=0,
                          next_attempt_ms=0))


def _check_key(key: str | None) -> None:
    if key is not None and (not isinstance(key, str) or not 1 <= len(key) <= KEY_CHARS_MAX):
        raise BadRequest(f"outbox key {key!r} must be a string of 1 to {KEY_CHARS_MAX} "
                         "characters")


def create_tables(connection: Any) -> None:
    """Create the outbox tables (``qmq_outbox``, ``qmq_handled``) on a synchronous connection or
    engine if they do not exist (for tests and small apps; otherwise migrate them with the
    application's own tables: ``outbox.metadata``)."""
    import qmq.idempotent  # noqa: F401  (its table joins the same metadata)

    metadata.create_all(connection)


__all__ = ["OutboxRow", "cancel", "create_tables", "metadata", "send"]
