"""Access control shared by the servers and the MetaServer: what a token may do, and the
brokers' cache of the MetaServer's answers.

A token grants an app two lists of subject patterns, fnmatch-style globs (``order.*``,
``billing.??``, ``*``): ``produce`` covers ``send`` (and ``cancel``), ``consume`` covers
``pull``, ``ack``, ``nack`` and ``heartbeat`` subscriptions. ``*`` matches dots too, so
``order.*`` covers ``order.a.b``. Internal subjects count as the subject they belong to:
``%retry%order.created%billing`` and ``%dead%order.created%billing`` are ``order.created``.
An admin token may do everything (including the broker admin ops ``subjects``/``browse``/
``purge``); brokers and the MetaServer's own broker calls use one.

``AccessCache`` is how realtime and delay servers learn what a token grants: it asks the
MetaServer (``POST /api/auth/check``, authenticated with the broker's own token; any MetaServer
of its list) and keeps each answer for ``ttl_ms`` (10 s), so a revoked token stops working
within that time. Every register and heartbeat answer also says whether auth is on
(``note_auth``). When no MetaServer can be reached, cached answers (even expired ones) keep
being used; a token never seen before is refused with a retriable ``internal`` error, unless the
last word the broker got said auth is off (then it is let in). A broker that has had no word at
all since it started fails closed: it refuses with a retriable ``unavailable`` error until a
MetaServer answers, whether or not it holds a token of its own (docs/SECURITY.md).

This module imports no server code: it sits in ``sdk`` beside the frame server for the same
reason (both servers need it and neither may import the other).
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
import re
import ssl
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, Protocol

import aiohttp

from sdk.meta import MetaEndpoints, MetaUnavailable
from wire.errors import BadRequest, Forbidden, Internal, QmqError, Unauthorized, Unavailable
from wire.message import peek_subject
from wire.http import bearer, http_ssl

log = logging.getLogger(__name__)

# Longest subject pattern, in characters (a subject is at most 200).
PATTERN_CHARS_MAX = 200
# Most patterns of one kind (produce or consume) on one token.
PATTERNS_PER_TOKEN_MAX = 64
# How long a broker trusts the MetaServer's answer about a token, in milliseconds.
ACCESS_TTL_MS_DEFAULT = 10_000
# After a failed check, how long a stale answer is used before asking again, in milliseconds.
ACCESS_RETRY_MS_DEFAULT = 1_000
# Tokens remembered by one broker; the oldest answer is forgotten past this count.
ACCESS_ENTRIES_MAX = 10_000
# Subjects whose produce/consume decision one grant remembers.
DECIDED_SUBJECTS_MAX = 1024
# Longest wait for one check request to the MetaServer, in milliseconds.
ACCESS_REQUEST_TIMEOUT_MS = 5_000

_SUBJECT_OF = attrgetter("subject")  # a quick check's Checked: the subject it read
# What a pattern may contain: the characters of a subject name plus the glob characters * ? [ ] !.
_PATTERN_RE = re.compile(r"[A-Za-z0-9._\-*?\[\]!]+")


def check_pattern(pattern: object) -> str:
    """Return ``pattern`` if it is a valid subject pattern, else raise BadRequest naming it."""
    if not isinstance(pattern, str) or not pattern:
        raise BadRequest(f"subject pattern {pattern!r} must be a non-empty string")
    if len(pattern) > PATTERN_CHARS_MAX:
        raise BadRequest(f"subject pattern of {len(pattern)} characters exceeds "
                         f"PATTERN_CHARS_MAX {PATTERN_CHARS_MAX}")
    if not _PATTERN_RE.fullmatch(pattern):
        raise BadRequest(f"subject pattern {pattern!r} may hold only letters, digits, '.', '_', "
                         "'-' and the glob characters * ? [ ] !")
    return pattern


def check_patterns(kind: str, patterns: object) -> tuple[str, ...]:
    """Return the checked patterns of ``kind`` (produce/consume) as a tuple; BadRequest if not a
    list of at most PATTERNS_PER_TOKEN_MAX valid patterns."""
    if not isinstance(patterns, (list, tuple)):
        raise BadRequest(f"{kind} patterns must be a list, got {type(patterns).__name__}")
    if len(patterns) > PATTERNS_PER_TOKEN_MAX:
        raise BadRequest(f"{len(patterns)} {kind} patterns exceed PATTERNS_PER_TOKEN_MAX "
                         f"{PATTERNS_PER_TOKEN_MAX}")
    return tuple(check_pattern(p) for p in patterns)


def subject_of(name: str) -> str:
    """The user subject a name is checked as: ``%retry%S%G`` and ``%dead%S%G`` are ``S``."""
    if name.startswith("%"):
        parts = name.split("%")
        if len(parts) == 4 and parts[1] in ("retry", "dead"):
            return parts[2]
    return name


def covers(patterns: Iterable[str], name: str) -> bool:
    """True when one of ``patterns`` matches the (user) subject of ``name``."""
    subject = subject_of(name)
    return any(fnmatch.fnmatchcase(subject, pattern) for pattern in patterns)


def token_hint(token: str | None) -> str:
    """A printable, non-secret name of a token for messages: its first 8 characters."""
    if not token:
        return "(none)"
    return f"{token[:8]}..."


@dataclass(frozen=True)
class Grant:
    """What one token allows: its app, its produce and consume patterns, and whether it is admin."""

    app: str
    produce: tuple[str, ...]
    consume: tuple[str, ...]
    admin: bool = False
    # (kind, subject) -> covered, so a busy subject is matched against the globs once (about
    # 1.3 us per fnmatch) rather than once per message; emptied when it reaches the bound.
    _decided: dict[tuple[str, str], bool] = field(default_factory=dict, compare=False,
                                                  repr=False)

    def may_produce(self, subject: str) -> bool:
        """True when this grant covers sending to ``subject``."""
        return self.admin or self._covers("produce", self.produce, subject)

    def may_consume(self, subject: str) -> bool:
        """True when this grant covers pulling, acking or nacking ``subject``."""
        return self.admin or self._covers("consume", self.consume, subject)

    def _covers(self, kind: str, patterns: tuple[str, ...], subject: str) -> bool:
        key = (kind, subject)
        decided = self._decided.get(key)
        if decided is None:
            if len(self._decided) >= DECIDED_SUBJECTS_MAX:
                self._decided.clear()
            decided = self._decided[key] = covers(patterns, subject)
        return decided

    def check_produce(self, subject: str) -> None:
        """Raise Forbidden (naming app, subject and patterns) unless ``may_produce(subject)``."""
        if not self.may_produce(subject):
            # Named as the user knows it: a retry or dead subject is its user subject's.
            raise Forbidden(f"app {self.app!r} may not produce to subject {subject_of(subject)!r} "
                            f"(its produce patterns: {list(self.produce)})")

    def check_consume(self, subject: str) -> None:
        """Raise Forbidden (naming app, subject and patterns) unless ``may_consume(subject)``."""
        # may_consume's test itself, not a call of it: this is asked for every pull and ack.
        if not self.admin and not self._covers("consume", self.consume, subject):
            raise Forbidden(f"app {self.app!r} may not consume subject {subject_of(subject)!r} "
                            f"(its consume patterns: {list(self.consume)})")

    def check_admin(self, op: str) -> None:
        """Raise Forbidden unless this is an admin grant."""
        if not self.admin:
            raise Forbidden(f"app {self.app!r} may not use the admin op {op}: "
                            "it needs an admin token")


# The grant of everyone while auth is off.
OPEN = Grant(app="*", produce=("*",), consume=("*",), admin=True)


def _open_grant(_token: str | None) -> Grant:
    """``Gate.grant_now`` without a MetaServer: everyone gets OPEN."""
    return OPEN


@dataclass
class _Answer:
    """A cached answer: a Grant, or the Unauthorized error a missing/unknown token gets."""

    decision: Grant | Unauthorized
    expires_at: int  # in AccessCache._clock's ticks


class AccessCache:
    """Grants per token from the MetaServer at ``meta_url``, cached ``ttl_ms`` (see module doc).

    ``token`` is the broker's own token, sent as Bearer on every check; ``clock_ms`` is a
    monotonic clock in ms (tests pass a fake one); ``ssl`` verifies an https MetaServer.
    """

    def __init__(
        self,
        meta_url: str | Sequence[str],
        *,
        token: str | None,
        ttl_ms: int = ACCESS_TTL_MS_DEFAULT,
        retry_ms: int = ACCESS_RETRY_MS_DEFAULT,
        clock_ms: Callable[[], int] | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        if ttl_ms <= 0 or retry_ms <= 0:
            raise ValueError(f"ttl_ms {ttl_ms} and retry_ms {retry_ms} must be > 0")
        self.meta = MetaEndpoints(meta_url)
        self.meta_url = str(self.meta)
        self.token = token
        self.ttl_ms = ttl_ms
        self.retry_ms = retry_ms
        # The clock of expiries, and its ticks per ms: monotonic_ns by default (a C call per
        # request's check, where a ms wrapper over it was a Python call too), else the given
        # clock in ms.
        self._clock, self._ticks_per_ms = ((time.monotonic_ns, 1_000_000) if clock_ms is None
                                           else (clock_ms, 1))
        self._ssl = ssl_context
        self._answers: dict[str, _Answer] = {}
        self._fetches: dict[str, asyncio.Future[_Answer]] = {}
        # What the last answer said about auth as a whole: None until one arrives.
        self.enabled: bool | None = None
        self._session: aiohttp.ClientSession | None = None

    async def grant(self, token: str | None, app: str | None = None) -> Grant:
        """The grant of ``token`` (``app`` only words errors); raises Unauthorized for a missing,
        unknown or revoked token while auth is on, Internal (retriable) when the MetaServer
        cannot be asked and nothing is known of this token."""
        key = token or ""
        answer = self._answers.get(key)
        if answer is None or self._clock() >= answer.expires_at:
            answer = await self._refresh(key, answer, app)
        if isinstance(answer.decision, Unauthorized):
            raise Unauthorized(f"{answer.decision.message} (app {app!r})")
        return answer.decision

    def grant_now(self, token: str | None) -> Grant | None:
        """The grant of ``token`` if a fresh answer for it is cached, else None (then ``grant``
        asks, and words a refusal): the check of every request, with no coroutine."""
        answer = self._answers.get(token or "")
        if answer is not None and type(answer.decision) is Grant \
                and self._clock() < answer.expires_at:
            return answer.decision
        return None

    async def close(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    def note_auth(self, enabled: bool) -> None:
        """A MetaServer said (in a register or heartbeat answer) whether auth is on."""
        self.enabled = bool(enabled)

    # -- internals ------------------------------------------------------------------------------

    async def _refresh(self, key: str, stale: _Answer | None, app: str | None) -> _Answer:
        """Ask the MetaServer about ``key`` (one request however many callers wait for it)."""
        fetch = self._fetches.get(key)
        if fetch is None:
            fetch = asyncio.ensure_future(self._fetch_or_fallback(key, stale, app))
            self._fetches[key] = fetch
            fetch.add_done_callback(lambda _f: self._fetches.pop(key, None))
        return await asyncio.shield(fetch)

    async def _fetch_or_fallback(self, key: str, stale: _Answer | None,
                                 app: str | None) -> _Answer:
        try:
            answer = await self._fetch(key)
        except QmqError as exc:
            if stale is not None:
                log.warning("%s; using the cached answer for token %s for %d ms more",
                            exc.message, token_hint(key), self.retry_ms)
                stale.expires_at = self._clock() + self.retry_ms * self._ticks_per_ms
                return stale
            if self.enabled is False:
                # Auth was off when we last heard: nothing to check a token against.
                return _Answer(OPEN, self._clock() + self.retry_ms * self._ticks_per_ms)
            if self.enabled is None:
                # Never heard: auth may be on, so fail closed rather than open (issue 13).
                raise Unavailable(f"this server has heard from no MetaServer since it started, "
                                  f"so it does not know whether auth is on ({exc.message}); "
                                  "retry later") from None
            raise Internal(f"cannot check the token {token_hint(key)} of app {app!r}: "
                           f"{exc.message}; retry later") from None
        if len(self._answers) >= ACCESS_ENTRIES_MAX and key not in self._answers:
            self._answers.pop(next(iter(self._answers)))
        self._answers[key] = answer
        return answer

    async def _fetch(self, key: str) -> _Answer:
        """One ``POST /api/auth/check``; QmqError if the MetaServer cannot give an answer."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=ACCESS_REQUEST_TIMEOUT_MS / 1000))
        try:
            answer = await self.meta.request(
                self._session, "POST", "/api/auth/check",
                timeout_s=ACCESS_REQUEST_TIMEOUT_MS / 1000, json={"token": key or None},
                headers=bearer(self.token), ssl=http_ssl(self._ssl))
        except MetaUnavailable as exc:
            raise Internal(exc.message) from None
        status, data = answer.status, answer.data
        if status in (401, 403):
            raise Internal(f"MetaServer {answer.url} refused this broker's own token "
                           f"{token_hint(self.token)} (HTTP {status}); start the broker with "
                           "--token of an admin token")
        if status != 200 or not isinstance(data, dict):
            raise Internal(f"MetaServer {answer.url} answered HTTP {status} to a token check")
        return self._answer_of(data, key)

    def _answer_of(self, data: dict[str, Any], key: str) -> _Answer:
        expires_at = self._clock() + self.ttl_ms * self._ticks_per_ms
        self.enabled = bool(data.get("enabled"))
        if not self.enabled:
            return _Answer(OPEN, expires_at)
        if not data.get("valid"):
            reason = "no token given" if not key else f"token {token_hint(key)} is unknown or revoked"
            return _Answer(Unauthorized(f"auth is on and {reason}"), expires_at)
        try:
            grant = Grant(app=str(data["app"]),
                          produce=check_patterns("produce", data.get("produce", [])),
                          consume=check_patterns("consume", data.get("consume", [])),
                          admin=bool(data.get("admin")))
        except (KeyError, BadRequest) as exc:
            raise Internal(f"MetaServer token check answer is malformed: {exc}") from None
        return _Answer(grant, expires_at)


class SubjectRead(Protocol):
    """What ``Gate.check_send`` takes of a quick check's answer (serverkit.send_check's
    ``Checked``, not imported here: the MetaServer loads this module, and no C twin)."""

    @property
    def subject(self) -> str:
        """The subject the check read from the payload."""


class Gate:
    """A server's access checks: every request asks ``grant_now`` first, and ``grant`` when
    that has no fresh answer. Without a MetaServer (a server run alone in tests) there is
    nobody to ask and everyone gets OPEN."""

    def __init__(self, cache: AccessCache | None) -> None:
        self.cache = cache
        # ``grant_now(token)``: the cached grant of a connection's hello token, or None when it
        # must be asked (``grant``). The cache's own method, so a request's check is one call.
        self.grant_now: Callable[[str | None], Grant | None] = (
            _open_grant if cache is None else cache.grant_now)

    async def grant(self, token: str | None, app: str | None) -> Grant:
        """The grant of a connection's hello ``token`` (see ``AccessCache.grant``)."""
        if self.cache is None:
            return OPEN
        return await self.cache.grant(token, app)

    def note_auth(self, enabled: bool) -> None:
        """A register or heartbeat answer said whether auth is on (see AccessCache)."""
        if self.cache is not None:
            self.cache.note_auth(enabled)

    def check_send(self, grant: Grant, payloads: list[bytes],
                   checks: Sequence[SubjectRead | None] | None = None) -> None:
        """Raise Forbidden unless ``grant`` covers the subject of every payload (a payload whose
        subject cannot be read is left to the server's own validation), naming the first
        payload's subject that it does not cover. ``checks``: the quick check's answer per
        payload when the caller has it (serverkit.send_check), whose subjects are taken as
        read; only a payload it left open (None) is read here."""
        if grant.admin:
            return
        if checks is None:
            subjects: Iterable[str | None] = map(peek_subject, payloads)
        elif None in checks:
            subjects = [peek_subject(payload) if checked is None else checked.subject
                        for payload, checked in zip(payloads, checks)]
        else:  # the usual batch: every subject read already, no Python code per payload
            subjects = map(_SUBJECT_OF, checks)
        # Each subject once, in payload order: the first one not covered is named.
        for subject in dict.fromkeys(subjects):
            if subject is not None:
                grant.check_produce(subject)

    async def close(self) -> None:
        """Close the cache's HTTP session."""
        if self.cache is not None:
            await self.cache.close()


__all__ = [
    "Gate",
    "ACCESS_TTL_MS_DEFAULT",
    "AccessCache",
    "Grant",
    "OPEN",
    "PATTERNS_PER_TOKEN_MAX",
    "PATTERN_CHARS_MAX",
    "check_pattern",
    "check_patterns",
    "covers",
    "subject_of",
    "token_hint",
]
