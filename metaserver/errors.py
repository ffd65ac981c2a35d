"""Errors the MetaServer API answers with.

Hierarchy::

    ApiError                 (status, code, message) -> {"error": {"code", "message"}}
    +-- BadRequest           400 bad_request: bad JSON, unknown field, wrong type, bad value
    +-- Unauthorized         401 unauthorized: auth is on and the request has no valid token
    +-- Forbidden            403 forbidden: the token is valid but not an admin token
    +-- NotFound             404 not_found: unknown broker, broker group, schedule or path
    +-- Conflict             409 conflict: the name is taken, or the state forbids the change
                             (a schedule, a switchover that cannot start, an unclean promotion)
    +-- TooLarge             413 too_large: request body over BODY_SIZE_BYTES_MAX
    +-- NoRoute              503 no_route: no live broker group can serve the subject (retriable)
    +-- BrokerUnreachable    503 broker_unavailable: no broker that could answer an admin
                             request did (retriable)
    +-- InternalError        500 internal: our bug or the database failed (retriable)
"""

from __future__ import annotations


class ApiError(Exception):
    """An error with an HTTP status and a stable code, sent back as JSON."""

    status = 500
    code = "internal"
    retriable = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def to_json(self) -> dict[str, dict[str, str]]:
        """Return the JSON body of this error."""
        return {"error": {"code": self.code, "message": self.message}}


class BadRequest(ApiError):
    """The request is malformed: bad JSON, unknown fields, wrong types or values."""

    status = 400
    code = "bad_request"


class Unauthorized(ApiError):
    """Auth is on and the request carries no token, or one that is unknown or revoked."""

    status = 401
    code = "unauthorized"


class Forbidden(ApiError):
    """The token is valid but may not make this request (an admin token is needed)."""

    status = 403
    code = "forbidden"


class NotFound(ApiError):
    """The broker, group or path does not exist."""

    status = 404
    code = "not_found"


class Conflict(ApiError):
    """The request clashes with what is stored: a name already taken, or a change the current
    state does not allow (pausing a finished schedule, a switchover to a slave that is not in
    sync, an unclean promotion before the master's lease surely expired)."""

    status = 409
    code = "conflict"


class TooLarge(ApiError):
    """The request body is larger than the server accepts."""

    status = 413
    code = "too_large"


class NoRoute(ApiError):
    """No live broker group can serve the subject now; retry later."""

    status = 503
    code = "no_route"
    retriable = True

    def __init__(self, message: str, subject: str) -> None:
        super().__init__(message)
        self.subject = subject


class BrokerUnreachable(ApiError):
    """An admin request needed a broker and none of those that could answer did; retry later."""

    status = 503
    code = "broker_unavailable"
    retriable = True


class InternalError(ApiError):
    """Something failed on the server side."""

    status = 500
    code = "internal"
    retriable = True
