"""Errors shared by the SDK and the servers.

Hierarchy (wire code in brackets; * = retriable, i.e. the same request may succeed later)::

    QmqError                    base; every error the codec or the SDK raises is one of these
    +-- BadRequest              [bad_request]        malformed bytes, wrong field type, bad name/id/tag
    +-- Unauthorized            [unauthorized]       missing or unknown token
    +-- Forbidden               [forbidden]          token may not produce/consume this subject
    +-- TooLarge                [too_large]          a size limit in wire.limits was exceeded
    +-- DelayOutOfRange         [delay_out_of_range] deliver_at_ms beyond now + MAX_DELAY_MS
    +-- ReadOnly              * [readonly]           broker group is draining; send elsewhere
    +-- Overloaded            * [overloaded]         server is shedding load; back off and retry
    +-- NotFound                [not_found]          unknown subject, group, message id, ...
    +-- NotSupported            [not_supported]      op or protocol version this server lacks
    +-- Internal              * [internal]           server bug or I/O failure
    +-- NotMaster             * [not_master]         not the leased master of its group; re-route
    +-- Unavailable           * [unavailable]        cannot serve yet (no MetaServer heard since start)
    +-- StaleEpoch              [stale_epoch]        replication request from an older epoch
    +-- NotEnoughReplicas     * [not_enough_replicas] fewer slaves in sync than min_insync
    +-- UnreadableRecord        [unreadable_record]  replicated record of a kind the slave lacks
    +-- ConnectionLost        * (client side only)   the connection closed before an answer
    +-- NoRoute               * (client side only)   the MetaServer knows no broker for a subject
    +-- Conflict                (MetaServer HTTP only) the name is taken, or the state forbids it

Every error has ``code`` (stable string, the wire code), ``retriable`` and, once it has come back
from a server, ``rid`` (the request id it answered). Messages quote the value and the limit with
units: "message body of 5242880 bytes exceeds MAX_BODY_BYTES 4194304".
"""

from __future__ import annotations

from typing import ClassVar


class QmqError(Exception):
    """Base of every pyqmq error; ``code`` is the stable wire code, ``retriable`` says retry may help."""

    code: ClassVar[str] = "error"
    retriable: ClassVar[bool] = False

    def __init__(self, message: str = "", *, rid: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        # The request id of the request this error answered, when it came back from a server.
        self.rid = rid

    def to_wire(self) -> dict[str, str]:
        """The ``error`` map of an error response: ``{"code": ..., "message": ...}``."""
        return {"code": self.code, "message": self.message}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r})"


class _UnknownCodeError(QmqError):
    """An error whose wire code this SDK does not know (a newer server); keeps the code it got."""

    def __init__(self, code: str, message: str, *, rid: int | None = None) -> None:
        super().__init__(message, rid=rid)
        self.code = code  # type: ignore[misc]  # instance value shadows the ClassVar on purpose


class BadRequest(QmqError):
    """Malformed bytes, a wrong field type, or an invalid name, id or tag."""

    code = "bad_request"


class Unauthorized(QmqError):
    """The connection has not said hello with a valid token."""

    code = "unauthorized"


class Forbidden(QmqError):
    """The token is valid but may not use this subject or operation."""

    code = "forbidden"


class TooLarge(QmqError):
    """A size limit from ``wire.limits`` was exceeded (frame, body, batch, properties, ranges)."""

    code = "too_large"


class DelayOutOfRange(QmqError):
    """A delivery time or retry delay further ahead than MAX_DELAY_MS; never clamped."""

    code = "delay_out_of_range"


class ReadOnly(QmqError):
    """The broker group is read-only (draining); the producer should use another route."""

    code = "readonly"
    retriable = True


class Overloaded(QmqError):
    """The server is shedding load; retry after a back-off."""

    code = "overloaded"
    retriable = True


class NotFound(QmqError):
    """The named subject, group, consumer or message does not exist."""

    code = "not_found"


class NotSupported(QmqError):
    """The op, option or protocol version is not supported by this server."""

    code = "not_supported"


class Internal(QmqError):
    """A server-side failure that is not the client's fault."""

    code = "internal"
    retriable = True


class NotMaster(QmqError):
    """The server is not the leased, active master of its group (a slave, a master whose lease
    ran out, one handing over to another server, or one that does not know its role yet).
    The client refreshes the route and resends (docs/REPLICATION.md)."""

    code = "not_master"
    retriable = True


class Unavailable(QmqError):
    """The server cannot serve yet: it has heard from no MetaServer since it started, so it does
    not know whether auth is on, and it fails closed rather than open."""

    code = "unavailable"
    retriable = True


class StaleEpoch(QmqError):
    """A replication request carries an epoch older than the server's: its sender must learn
    the group's new master before it asks again."""

    code = "stale_epoch"


class NotEnoughReplicas(QmqError):
    """Fewer slaves of the group are in sync than its ``min_insync``: the write is refused so it
    is never acknowledged by too few machines. The MetaServer routes producers elsewhere."""

    code = "not_enough_replicas"
    retriable = True


class UnreadableRecord(QmqError):
    """A master's answer to a slave's ``fetch`` whose next record is of a kind the slave did not
    announce it reads (``fetch.reads``): nothing is served from there, so the slave's copy stays
    as it is; it cannot go on until it is upgraded (docs/REPLICATION.md 8.2)."""

    code = "unreadable_record"


class ConnectionLost(QmqError):
    """Client side: the connection closed before the answer arrived (never sent on the wire)."""

    code = "connection_lost"
    retriable = True


class NoRoute(QmqError):
    """Client side: no broker is known for the subject (never sent on the wire)."""

    code = "no_route"
    retriable = True


class Conflict(QmqError):
    """MetaServer HTTP only (409): the name is taken (a schedule), or the current state does
    not allow the change (pausing a finished schedule). Never on the binary protocol."""

    code = "conflict"


# Every error a client may catch, the base first: the SDK exports exactly these (sdk.__all__
# adds this module's __all__, whose names type checkers read, so a new error class is named
# there too; tests/unit/test_typing.py holds the two lists equal).
ERRORS: tuple[type[QmqError], ...] = (
    QmqError,
    BadRequest,
    Unauthorized,
    Forbidden,
    TooLarge,
    DelayOutOfRange,
    ReadOnly,
    Overloaded,
    NotFound,
    NotSupported,
    Internal,
    NotMaster,
    Unavailable,
    StaleEpoch,
    NotEnoughReplicas,
    UnreadableRecord,
    ConnectionLost,
    NoRoute,
    Conflict,
)
# Only server errors travel on the wire; ConnectionLost and NoRoute are made by the client,
# Conflict comes only from the MetaServer's HTTP API.
WIRE_ERRORS: dict[str, type[QmqError]] = {
    cls.code: cls for cls in ERRORS if cls not in (QmqError, ConnectionLost, NoRoute, Conflict)
}


def error_from_wire(code: str, message: str, *, rid: int | None = None) -> QmqError:
    """The QmqError for a wire ``{code, message}``; an unknown code gives a non-retriable QmqError
    that keeps the code, so a newer server's errors still surface with their code."""
    cls = WIRE_ERRORS.get(code)
    if cls is None:
        return _UnknownCodeError(code, message, rid=rid)
    return cls(message, rid=rid)


def type_name(value: object) -> str:
    """A short type name for error messages ("int", "NoneType", ...)."""
    return type(value).__name__


# The names of ERRORS, in order, as a literal list: type checkers read it (a comprehension they
# cannot), and ``from wire.errors import *`` (the SDK) takes exactly the errors.
__all__ = [
    "QmqError",
    "BadRequest",
    "Unauthorized",
    "Forbidden",
    "TooLarge",
    "DelayOutOfRange",
    "ReadOnly",
    "Overloaded",
    "NotFound",
    "NotSupported",
    "Internal",
    "NotMaster",
    "Unavailable",
    "StaleEpoch",
    "NotEnoughReplicas",
    "UnreadableRecord",
    "ConnectionLost",
    "NoRoute",
    "Conflict",
]
