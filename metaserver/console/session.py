"""Who is looking at the console: the cookie session, the login token check and CSRF.

The session cookie holds the token the person logged in with (``qmq_session``: HttpOnly,
SameSite=Strict, Secure over https, no expiry date, so it ends with the browser session). The
token is looked up again on every request through ``Tokens.check``, so a revoked token logs its
sessions out at once, and a session works on every MetaServer sharing the database (no session
table, nothing lost on a restart). Logging out deletes the cookie; the token itself stays valid.

CSRF: every form carries ``csrf``, an HMAC-SHA256 of a fixed label keyed with the session's
secret (the token; with auth off or before login, a random value in the ``qmq_csrf`` cookie).
Another site can neither read the cookie nor compute the value; a POST without the right value,
or whose ``Origin`` header names another host, is refused with 403 before it does anything.
The JSON API is not reachable with the cookie at all: it reads only ``Authorization: Bearer``.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from aiohttp import web

from metaserver.errors import ApiError, Forbidden
from metaserver.tokens import TOKENS_KEY
from serverkit.access import Grant

SESSION_COOKIE = "qmq_session"
ANON_COOKIE = "qmq_csrf"
CSRF_FIELD = "csrf"
# Random bytes of the anonymous CSRF secret.
ANON_SECRET_BYTES = 32
_CSRF_LABEL = b"qmq-console-csrf-v1"
# The request key under which a freshly made anonymous secret waits to be set as a cookie.
NEW_ANON_KEY = web.RequestKey("qmq_console_new_anon", str)


class LoginRequired(ApiError):
    """Auth is on and the request has no valid session: the console sends it to /login."""

    status = 401
    code = "unauthorized"


def csrf_for(secret: str) -> str:
    """The CSRF value of the session whose secret is ``secret``."""
    return hmac.new(secret.encode("utf-8"), _CSRF_LABEL, hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class Viewer:
    """The person behind a console request: what they may do and their form token."""

    auth_enabled: bool
    app: str | None  # None while auth is off
    admin: bool  # may change things (auth off: everyone)
    token: str | None = None  # the session's token, forwarded to brokers on their behalf
    csrf: str = ""
    grant: Grant | None = None  # None while auth is off (everything is allowed)

    @property
    def read_only(self) -> bool:
        """True for an app token: the console shows but does not act."""
        return not self.admin

    def may_see(self, subject: str) -> bool:
        """True when the viewer may see the messages of ``subject`` (an app token: those it may
        produce to or consume)."""
        grant = self.grant
        return grant is None or grant.may_produce(subject) or grant.may_consume(subject)

    @property
    def sees_everything(self) -> bool:
        """True when ``may_see`` holds for every subject (auth off, or an admin token), so a
        page of thousands of rows need not ask it row by row."""
        return self.grant is None or self.grant.admin

    def visible(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The rows whose ``subject`` the viewer may see (``rows`` itself when all of them)."""
        if self.sees_everything:
            return rows
        return [row for row in rows if self.may_see(row["subject"])]


def _anon_secret(request: web.Request) -> str:
    secret = request.cookies.get(ANON_COOKIE, "")
    if len(secret) < 2 * ANON_SECRET_BYTES:
        secret = request.get(NEW_ANON_KEY) or secrets.token_hex(ANON_SECRET_BYTES)
        request[NEW_ANON_KEY] = secret
    return secret


async def current_viewer(request: web.Request) -> Viewer | None:
    """The viewer of ``request``, or None when auth is on and it has no valid session."""
    token = request.cookies.get(SESSION_COOKIE) or None
    checked = await request.app[TOKENS_KEY].check(token)
    if not checked.enabled:
        return Viewer(auth_enabled=False, app=None, admin=True,
                      csrf=csrf_for(_anon_secret(request)))
    grant = checked.grant
    if grant is None or token is None:
        return None
    return Viewer(auth_enabled=True, app=grant.app, admin=grant.admin, token=token,
                  csrf=csrf_for(token), grant=grant)


def anonymous_csrf(request: web.Request) -> str:
    """The CSRF value of a visitor who is not logged in (the login form's)."""
    return csrf_for(_anon_secret(request))


def check_post(request: web.Request, form: dict[str, str], expected: str) -> None:
    """Forbidden unless the form's CSRF value is ``expected`` and the Origin (when the browser
    sends one) is this host."""
    origin = request.headers.get("Origin")
    if origin is not None and origin != "null" and urlsplit(origin).netloc != request.host:
        raise Forbidden(f"a form posted from {origin!r} is refused: the console takes forms "
                        "only from its own pages")
    if not hmac.compare_digest(form.get(CSRF_FIELD, ""), expected):
        raise Forbidden("the form's CSRF token is missing or wrong: reload the page and "
                        "try again")


def set_cookies(request: web.Request, response: web.StreamResponse) -> None:
    """Set the anonymous CSRF cookie made while answering ``request``, if any."""
    secret = request.get(NEW_ANON_KEY)
    if secret:
        _set(request, response, ANON_COOKIE, secret)


def log_in(request: web.Request, response: web.StreamResponse, token: str) -> None:
    """Make ``response`` start a session for ``token``."""
    _set(request, response, SESSION_COOKIE, token)


def log_out(response: web.StreamResponse) -> None:
    """Make ``response`` end the session."""
    response.del_cookie(SESSION_COOKIE, path="/")


def _set(request: web.Request, response: web.StreamResponse, name: str, value: str) -> None:
    response.set_cookie(name, value, path="/", httponly=True, samesite="Strict",
                        secure=request.secure)


def safe_next(target: str | None) -> str:
    """A local path to go to after login: never another site (``//host``, ``http://``)."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    return target
