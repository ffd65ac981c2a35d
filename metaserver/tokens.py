"""App tokens: making, listing, revoking and checking them, and the HTTP auth middleware.

A token's secret is ``qmq_`` + 43 URL-safe characters from ``secrets`` (256 random bits). The
database keeps only its SHA-256 (hex) and its first 8 characters (a hint for listings). A plain,
fast, unsalted hash is enough here because the secret is random and long: salting and slow
hashes (bcrypt, scrypt) defend low-entropy passwords against dictionary attacks, and there is no
dictionary for 256 random bits, so a stolen database does not give the secrets away. It also lets
a lookup be one indexed query on the hash.

Auth is ON when the MetaServer was started with an admin token (``MetaConfig.admin_token``) or
its database holds at least one live (unrevoked) token; otherwise every request is let in, which
is how ``qmq up`` runs by default and how the first admin token is made. With auth on:

* ``/api/admin/*``, ``/api/brokers/*`` and ``/api/auth/check`` need an admin token;
* every other ``/api/*`` path (routes, client heartbeats) needs a valid token;
* paths outside ``/api/`` (``/health``, metrics) stay open.

A missing, unknown or revoked token gets 401 ``unauthorized``; a valid non-admin token on an
admin path gets 403 ``forbidden``.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from metaserver import validation as v
from metaserver.errors import BadRequest, Forbidden, NotFound, Unauthorized
from metaserver.models import AppToken
from serverkit.access import Grant, check_patterns
from wire.errors import QmqError

if TYPE_CHECKING:
    from metaserver.registry import Registry

# Prefix of every secret we make, so a leaked one is recognisable (secret scanners, logs).
SECRET_PREFIX = "qmq_"
# Random bytes in a secret: 256 bits.
SECRET_RANDOM_BYTES = 32
# Characters of the secret kept in the database to name a token in listings.
HINT_CHARS = 8
# How long the database's answer about a token (and whether auth is on) is reused, in ms, and
# how many tokens' answers are kept at most (all are dropped when that is reached).
CHECK_CACHE_MS = 1_000
CHECK_CACHE_ENTRIES_MAX = 10_000
# App names of the configured tokens, as /api/auth/check reports them.
CONFIG_ADMIN_APP = "admin"
INTERNAL_APP = "qmq-internal"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def new_secret() -> str:
    """A fresh token secret: ``qmq_`` + 256 random bits, URL-safe base64."""
    return SECRET_PREFIX + secrets.token_urlsafe(SECRET_RANDOM_BYTES)


def hash_secret(secret: str) -> str:
    """The SHA-256 hex digest stored for ``secret`` (see the module doc for why it suffices)."""
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def bearer_token(request: web.Request) -> str | None:
    """The token of an ``Authorization: Bearer ...`` header, or None without one."""
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


CREATE = {
    "app": v.Field(str, check=v.check_name),
    "produce": v.Field(list, required=False, default=list),
    "consume": v.Field(list, required=False, default=list),
    "admin": v.Field(bool, required=False, default=False),
}

REVOKE = {
    "id": v.Field(int, check=v.check_count),
}


@dataclass(frozen=True)
class Checked:
    """The outcome of looking a bearer token up: whether auth is on, and its grant if valid."""

    enabled: bool
    grant: Grant | None


def _row_view(row: AppToken) -> dict[str, Any]:
    """A token as the admin API lists it: never the secret nor its hash."""
    return {
        "id": row.id,
        "app": row.app,
        "hint": row.token_hint,
        "produce": list(row.produce_patterns),
        "consume": list(row.consume_patterns),
        "admin": row.admin,
        "created_at_ms": row.created_at_ms,
        "revoked_at_ms": row.revoked_at_ms,
    }


class Tokens:
    """The app tokens in the database behind ``registry`` plus the configured ones."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        config = registry.config
        # Configured secrets, compared in constant time; both count as admin tokens.
        self._configured = [(secret, app) for secret, app in
                            ((config.admin_token, CONFIG_ADMIN_APP),
                             (config.internal_token, INTERNAL_APP)) if secret]
        # Answers of the database, kept CHECK_CACHE_MS so a busy gateway does not ask it once
        # per request: whether auth is on, and each stored token's grant (None: unknown or
        # revoked), by hash. Emptied by create and revoke, so on this MetaServer they take
        # effect at once; on others sharing the database within CHECK_CACHE_MS. Event loop only.
        self._enabled: tuple[bool, float] | None = None
        self._grants: dict[str, tuple[Grant | None, float]] = {}
        # The database look-ups running now, by what they look up ("enabled" or a token's
        # hash): a burst of requests at a cache expiry shares one instead of each asking (at
        # 32 gateway requests in flight they queued for connections and the MetaServer spent
        # a quarter of its CPU here). A look-up finishing after _forget caches nothing
        # (``_generation`` moved). Event loop only.
        self._looking_up: dict[str, asyncio.Future[Any]] = {}
        self._generation = 0

    async def create(self, app: str, produce: list[Any], consume: list[Any],
                     admin: bool) -> dict[str, Any]:
        """Store a new token and return its view plus ``token``, the secret (shown only here)."""
        try:
            produce_patterns = list(check_patterns("produce", produce))
            consume_patterns = list(check_patterns("consume", consume))
        except QmqError as exc:  # the SDK's pattern check speaks wire errors; answer 400
            raise BadRequest(exc.message) from None
        if not admin and not produce_patterns and not consume_patterns:
            raise BadRequest(f"a token for app {app!r} needs produce or consume patterns, "
                             "or admin")
        secret = new_secret()

        async def body(session: AsyncSession) -> dict[str, Any]:
            row = AppToken(app=app, token_hash=hash_secret(secret),
                           token_hint=secret[:HINT_CHARS], produce_patterns=produce_patterns,
                           consume_patterns=consume_patterns, admin=admin,
                           created_at_ms=self.registry.clock(), revoked_at_ms=None)
            session.add(row)
            await session.flush()
            return {**_row_view(row), "token": secret}

        # Sharing the registry's write path keeps SQLite writes of this process serialized.
        try:
            return await self.registry._write(body)
        finally:
            self._forget()

    async def list(self) -> list[dict[str, Any]]:
        """Every token, revoked ones included, oldest first; never a secret."""
        async with self.registry._read() as session:
            rows = (await session.execute(select(AppToken).order_by(AppToken.id))).scalars()
            return [_row_view(row) for row in rows]

    async def revoke(self, token_id: int) -> dict[str, Any]:
        """Mark token ``token_id`` revoked (again is harmless); NotFound for an unknown id."""

        async def body(session: AsyncSession) -> dict[str, Any]:
            row = await session.get(AppToken, token_id)
            if row is None:
                raise NotFound(f"no token with id {token_id}")
            if row.revoked_at_ms is None:
                row.revoked_at_ms = self.registry.clock()
            return _row_view(row)

        try:
            return await self.registry._write(body)
        finally:
            self._forget()

    def _forget(self) -> None:
        """Drop the cached answers and disown the look-ups running: the tokens changed."""
        self._enabled = None
        self._grants.clear()
        self._looking_up.clear()
        self._generation += 1

    async def _look_up_once(self, key: str, fetch: Callable[[], Awaitable[Any]]) -> Any:
        """``fetch()``, shared by every caller asking for ``key`` while it runs; a caller that
        is cancelled leaves it running for the others."""
        running = self._looking_up.get(key)
        if running is None:
            running = asyncio.ensure_future(fetch())
            self._looking_up[key] = running

            def done(future: asyncio.Future[Any], key: str = key) -> None:
                if self._looking_up.get(key) is future:
                    del self._looking_up[key]
                if not future.cancelled():
                    future.exception()  # retrieved: every waiter gets it raised

            running.add_done_callback(done)
        return await asyncio.shield(running)

    async def enabled(self) -> bool:
        """True when auth is on: an admin token is configured or a live token is stored."""
        if self.registry.config.admin_token:
            return True
        now = time.monotonic()
        if self._enabled is not None and self._enabled[1] > now:
            return self._enabled[0]
        return bool(await self._look_up_once("enabled", self._fetch_enabled))

    async def _fetch_enabled(self) -> bool:
        generation = self._generation
        async with self.registry._read() as session:
            live = await session.execute(
                select(AppToken.id).where(AppToken.revoked_at_ms.is_(None)).limit(1))
            enabled = live.first() is not None
        if generation == self._generation:
            self._enabled = (enabled, time.monotonic() + CHECK_CACHE_MS / 1000)
        return enabled

    async def check(self, secret: str | None) -> Checked:
        """Look ``secret`` up: its grant if it is a configured or live stored token."""
        grant = await self._grant(secret) if secret else None
        if grant is not None:
            return Checked(enabled=True, grant=grant)
        return Checked(enabled=await self.enabled(), grant=None)

    async def _grant(self, secret: str) -> Grant | None:
        for configured, app in self._configured:
            if hmac.compare_digest(secret.encode("utf-8"), configured.encode("utf-8")):
                return Grant(app=app, produce=("*",), consume=("*",), admin=True)
        digest = hash_secret(secret)
        now = time.monotonic()
        cached = self._grants.get(digest)
        if cached is not None and cached[1] > now:
            return cached[0]
        grant: Grant | None = await self._look_up_once(
            f"grant:{digest}", lambda: self._fetch_grant(digest))
        return grant

    async def _fetch_grant(self, digest: str) -> Grant | None:
        generation = self._generation
        async with self.registry._read() as session:
            row = (await session.execute(
                select(AppToken).where(AppToken.token_hash == digest)
            )).scalar_one_or_none()
        grant = None if row is None or row.revoked_at_ms is not None else Grant(
            app=row.app, produce=tuple(row.produce_patterns),
            consume=tuple(row.consume_patterns), admin=row.admin)
        if generation == self._generation:
            if len(self._grants) >= CHECK_CACHE_ENTRIES_MAX:
                self._grants.clear()
            self._grants[digest] = (grant, time.monotonic() + CHECK_CACHE_MS / 1000)
        return grant


def needs_admin(path: str) -> bool:
    """True for the paths only admin tokens may use while auth is on."""
    return path.startswith(("/api/admin/", "/api/brokers/")) or path == "/api/auth/check"


TOKENS_KEY = web.AppKey("metaserver_tokens", Tokens)
# Paths under /api/ open to everyone: the gateway's OpenAPI document describes, it grants nothing.
OPEN_API_PATHS = frozenset({"/api/openapi.json"})
# Where the middleware leaves the request's token for handlers that call brokers on its behalf.
TOKEN_KEY = web.RequestKey("qmq_token", str)
# Where it leaves the token's grant for handlers that check subjects (schedules): None while
# auth is off, when everyone may do everything.
GRANT_KEY = web.RequestKey("qmq_grant", object)
# Where it leaves whether auth is on (it looked that up anyway), for the broker answers.
AUTH_ENABLED_KEY = web.RequestKey("qmq_auth_enabled", bool)


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Let a request through only with the token its path needs (see the module doc)."""
    token = bearer_token(request)
    request[TOKEN_KEY] = token
    request[GRANT_KEY] = None
    if not request.path.startswith("/api/") or request.path in OPEN_API_PATHS:
        return await handler(request)
    checked = await request.app[TOKENS_KEY].check(token)
    request[GRANT_KEY] = checked.grant
    request[AUTH_ENABLED_KEY] = checked.enabled
    if not checked.enabled:
        return await handler(request)
    if checked.grant is None:
        reason = "no Authorization: Bearer token" if token is None else \
            f"token {token[:HINT_CHARS]}... is unknown or revoked"
        raise Unauthorized(f"auth is on and {request.method} {request.path} has {reason}")
    if needs_admin(request.path) and not checked.grant.admin:
        raise Forbidden(f"app {checked.grant.app!r} may not call {request.method} "
                        f"{request.path}: it needs an admin token")
    return await handler(request)
