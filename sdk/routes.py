"""Routes from the MetaServer: which broker groups serve a subject, cached by the client.

``meta_url`` may name several MetaServers (a list, or URLs separated by commas); requests go to
the one that answered last and move on to the next when it cannot answer (``sdk/meta.py``).

``GET {meta}/api/route?subject=S&role=producer|consumer&kind=realtime`` answers
``{subject, version, groups: [{group, kind, state, addresses}]}``, or HTTP 503 with error code
``no_route`` when no live broker group can serve the subject.

Caching rules:

* a route is reused for ``ttl_ms`` (30 s), then fetched again; ``refresh`` fetches at once (the
  producer and consumer call it after a broker failure). Concurrent refreshes of one route share
  one HTTP request.
* the MetaServer being unreachable (connection refused, timeout, HTTP 5xx other than no_route,
  an answer we cannot read) does not stop the client: the cached route keeps being served with a
  warning in the log, and the MetaServer is asked again after ``stale_retry_ms``. Only with no
  cached route at all does the caller get NoRoute.
* an explicit ``no_route`` answer is the MetaServer's word that the brokers we knew are gone: the
  cached route is dropped and NoRoute raised.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from sdk.meta import MetaEndpoints, MetaUnavailable, error_code
from wire.http import bearer, http_ssl
from wire.errors import NoRoute, error_from_wire

if TYPE_CHECKING:  # a caller may pass its own session; the cache itself never loads aiohttp
    import aiohttp

log = logging.getLogger(__name__)

Role = Literal["producer", "consumer"]

# How long a fetched route is reused before asking the MetaServer again, in milliseconds.
ROUTE_TTL_MS_DEFAULT = 30_000

# After a failed fetch, how long the stale cached route is served before trying again, in ms.
STALE_RETRY_MS_DEFAULT = 5_000

# Longest wait for one MetaServer HTTP request, in milliseconds.
META_REQUEST_TIMEOUT_MS_DEFAULT = 5_000


def monotonic_ms() -> int:
    """Milliseconds of the monotonic clock (for ages and deadlines, never for timestamps)."""
    return time.monotonic_ns() // 1_000_000


@dataclass(frozen=True)
class RouteGroup:
    """One broker group of a route: ``state`` is "rw" or "readonly"; addresses are "host:port"."""

    group: str
    kind: str
    state: str
    addresses: tuple[str, ...]


@dataclass(frozen=True)
class Route:
    """The broker groups serving ``subject`` for one role, as of route ``version``."""

    subject: str
    role: str
    version: int
    groups: tuple[RouteGroup, ...]

    def group(self, name: str) -> RouteGroup | None:
        """The group called ``name``, or None if it is not in this route."""
        for group in self.groups:
            if group.group == name:
                return group
        return None


@dataclass
class _Entry:
    route: Route
    expires_at_ms: int
    generation: int
    fetched_at_ms: int  # when the MetaServer last answered it (a stale one keeps its time)


# One event loop's RouteCaches shared by its consumers (``RouteCache.shared``).
_shared: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Hashable, RouteCache]] = (
    weakref.WeakKeyDictionary())


def parse_route(data: object, subject: str, role: str) -> Route:
    """The Route of a MetaServer answer; MetaUnavailable if it is not shaped like one."""

    def malformed(what: str) -> MetaUnavailable:
        return MetaUnavailable(f"MetaServer route answer for {subject!r} is malformed: {what}")

    if not isinstance(data, dict) or not isinstance(data.get("groups"), list):
        raise malformed("no groups list")
    version = data.get("version", 0)
    if type(version) is not int:
        raise malformed(f"version must be int, got {type(version).__name__}")
    groups = []
    for item in data["groups"]:
        if not isinstance(item, dict) or not isinstance(item.get("group"), str):
            raise malformed(f"group entry {item!r:.100}")
        addresses = item.get("addresses")
        if not isinstance(addresses, list) or not all(isinstance(a, str) for a in addresses):
            raise malformed(f"addresses of group {item['group']!r} must be a list of str")
        # A group without an address cannot be used; skipping it here saves every caller a check.
        if addresses:
            groups.append(
                RouteGroup(
                    group=item["group"],
                    kind=str(item.get("kind", "realtime")),
                    state=str(item.get("state", "rw")),
                    addresses=tuple(addresses),
                )
            )
    return Route(subject=subject, role=role, version=version, groups=tuple(groups))


class RouteCache:
    """Routes per (subject, role) from the MetaServer at ``meta_url``, cached as described above.

    Asks through ``sdk.http1`` (no aiohttp loaded) unless an aiohttp session is passed in, which
    it then uses and never closes.
    """

    def __init__(
        self,
        meta_url: str | Sequence[str],
        *,
        kind: str = "realtime",
        ttl_ms: int = ROUTE_TTL_MS_DEFAULT,
        stale_retry_ms: int = STALE_RETRY_MS_DEFAULT,
        request_timeout_ms: int = META_REQUEST_TIMEOUT_MS_DEFAULT,
        session: aiohttp.ClientSession | None = None,
        clock_ms: Callable[[], int] = monotonic_ms,
        token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.meta = MetaEndpoints(meta_url)
        self.meta_url = str(self.meta)
        self.kind = kind
        self.ttl_ms = ttl_ms
        self.stale_retry_ms = stale_retry_ms
        self.request_timeout_ms = request_timeout_ms
        self._session = session
        self._clock_ms = clock_ms
        # The app's token, sent as Bearer: the MetaServer wants one when auth is on.
        self._headers = bearer(token)
        self._ssl = ssl_context
        self._entries: dict[tuple[str, str], _Entry] = {}
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._generation = 0

    @staticmethod
    def shared(key: Hashable, make: Callable[[], RouteCache]) -> RouteCache:
        """The running loop's cache for ``key`` (made by ``make()`` the first time): the
        consumers of a process with the same MetaServers, token and TLS share one, so their
        periodic refreshes of a subject cost the MetaServer one request, not one each."""
        caches = _shared.setdefault(asyncio.get_running_loop(), {})
        cache = caches.get(key)
        if cache is None:
            cache = caches[key] = make()
        return cache

    def cached(self, subject: str, role: Role) -> Route | None:
        """The cached route, fresh or stale, without asking anyone."""
        entry = self._entries.get((subject, role))
        return entry.route if entry is not None else None

    async def get(self, subject: str, role: Role) -> Route:
        """The cached route while fresh, else a fetched one (see ``refresh``)."""
        entry = self._entries.get((subject, role))
        if entry is not None and self._clock_ms() < entry.expires_at_ms:
            return entry.route
        return await self.refresh(subject, role)

    async def refresh(self, subject: str, role: Role, max_age_ms: int = 0) -> Route:
        """Ask the MetaServer now, unless the MetaServer answered this route less than
        ``max_age_ms`` ago (a periodic refresh of a cache shared by many consumers). Falls back
        to the cached route if the MetaServer cannot be reached; NoRoute if it says there is
        none or if there is nothing cached to fall back on. A refresh that waited for another
        one in progress takes that one's answer."""
        key = (subject, role)
        seen = self._entries.get(key)
        if seen is not None and self._clock_ms() - seen.fetched_at_ms < max_age_ms:
            return seen.route
        seen_generation = seen.generation if seen is not None else -1
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            entry = self._entries.get(key)
            if entry is not None and entry.generation != seen_generation:
                return entry.route
            try:
                route = await self._fetch(subject, role)
            except NoRoute:
                self._entries.pop(key, None)
                raise
            except MetaUnavailable as exc:
                if entry is None:
                    raise NoRoute(
                        f"no route for subject {subject!r}: {exc.message}; nothing cached"
                    ) from None
                log.warning(
                    "%s; serving the cached %s route of %r (version %d) and asking again in %d ms",
                    exc.message, role, subject, entry.route.version, self.stale_retry_ms,
                )
                self._generation += 1
                entry.generation = self._generation
                entry.expires_at_ms = self._clock_ms() + min(self.stale_retry_ms, self.ttl_ms)
                return entry.route
            self._generation += 1
            now_ms = self._clock_ms()
            self._entries[key] = _Entry(route, now_ms + self.ttl_ms, self._generation, now_ms)
            return route

    async def client_heartbeat(
        self, *, client_id: str, app: str, group: str, subjects: list[str], role: Role
    ) -> None:
        """``POST /api/clients/heartbeat``; raises MetaUnavailable or the MetaServer's error."""
        body = {"client_id": client_id, "app": app, "group": group, "subjects": subjects,
                "role": role}
        await self._call("POST", "/api/clients/heartbeat", json=body)

    async def client_heartbeats(self, *, clients: list[dict[str, Any]], left: list[str]) -> None:
        """``POST /api/clients/heartbeats``: the heartbeat of many clients (each a
        ``client_heartbeat``'s fields) and the ids of those that closed, in one request
        (sdk.presence); raises MetaUnavailable or the MetaServer's error (``not_found`` from a
        MetaServer without it)."""
        await self._call("POST", "/api/clients/heartbeats", json={"clients": clients,
                                                                  "left": left})

    async def client_leave(self, *, client_id: str) -> None:
        """``POST /api/clients/leave`` (the client is closing: offline at once); raises
        MetaUnavailable or the MetaServer's error."""
        await self._call("POST", "/api/clients/leave", json={"client_id": client_id})

    async def close(self) -> None:
        """Forget the session passed in (its owner closes it); nothing else stays open."""
        self._session = None

    # -- internals ------------------------------------------------------------------------------

    async def _fetch(self, subject: str, role: Role) -> Route:
        params = {"subject": subject, "role": role, "kind": self.kind}
        data = await self._call("GET", "/api/route", params=params)
        return parse_route(data, subject, role)

    async def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        answer = await self.meta.request(self._session, method, path,
                                         timeout_s=self.request_timeout_ms / 1000,
                                         headers=self._headers, ssl=http_ssl(self._ssl), **kwargs)
        status, data = answer.status, answer.data
        code = error_code(data)
        error = data.get("error") if isinstance(data, dict) else None
        message = str(error.get("message", "")) if isinstance(error, dict) else ""
        if status == 200 and error is None:
            return data
        if code == "no_route":
            raise NoRoute(message or f"MetaServer has no route ({method} {path})")
        if status >= 500 or code is None:
            raise MetaUnavailable(f"MetaServer {answer.url} answered HTTP {status} to {method} "
                                  f"{path}")
        # A 4xx with a code is the MetaServer rejecting what we asked: the caller's fault.
        raise error_from_wire(code, f"MetaServer {method} {path}: {message}")


__all__ = [
    "META_REQUEST_TIMEOUT_MS_DEFAULT",
    "ROUTE_TTL_MS_DEFAULT",
    "STALE_RETRY_MS_DEFAULT",
    "MetaUnavailable",
    "Route",
    "RouteCache",
    "RouteGroup",
    "monotonic_ms",
    "parse_route",
]
