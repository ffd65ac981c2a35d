"""Talking to one of several MetaServers: clients and servers are given a list (``--meta
http://a:8090,http://b:8090``, or ``Producer(["http://a:8090", "http://b:8090"])``) and fail
over between them, like RocketMQ clients over their NameServer list.

A request goes to the MetaServer that answered last. When it cannot be reached, times out, or
answers 5xx for a reason of its own (a 500 because its database connection failed), the next URL
is tried at once, each at most once per request. A 5xx that is the service's answer
(``no_route``, ``broker_unavailable``) is the same from every MetaServer over the same
database, so it is returned, not retried elsewhere. Only when every URL failed does the caller
get ``MetaUnavailable`` (retriable), naming each failure.

MetaServers over one PostgreSQL database are interchangeable: they share every row, and the
promotions they make are row-locked transactions (docs/REPLICATION.md 6).
"""

from __future__ import annotations

import asyncio
import json as json_module
import logging
import ssl as ssl_module
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sdk import http1
from wire.errors import QmqError

if TYPE_CHECKING:  # the servers pass their aiohttp sessions; the client never imports aiohttp
    import aiohttp
from wire.http import parse_meta_urls

log = logging.getLogger(__name__)

# 5xx error codes that are the service's answer, identical from every MetaServer: not retried
# on another one.
SERVICE_ERROR_CODES = ("no_route", "broker_unavailable")


class MetaUnavailable(QmqError):
    """No MetaServer of the list could be asked (down, timing out, answering 5xx or garbage)."""

    code = "meta_unavailable"
    retriable = True


@dataclass(frozen=True)
class MetaAnswer:
    """An HTTP answer of one MetaServer: its status, its decoded JSON (None if not JSON), and
    which MetaServer gave it."""

    status: int
    data: Any
    url: str


def error_code(data: Any) -> str | None:
    """The ``error.code`` of a JSON error body, or None."""
    error = data.get("error") if isinstance(data, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None


class MetaEndpoints:
    """The MetaServer URLs of one client or server and which answered last. Event-loop only."""

    def __init__(self, meta_url: str | Sequence[str]) -> None:
        self.urls = parse_meta_urls(meta_url)
        self._preferred = 0

    @property
    def url(self) -> str:
        """The URL tried first now (the last one that answered)."""
        return self.urls[self._preferred]

    def __str__(self) -> str:
        return ",".join(self.urls)

    async def request(self, session: aiohttp.ClientSession | None, method: str, path: str, *,
                      timeout_s: float, headers: dict[str, str] | None = None,
                      ssl: ssl_module.SSLContext | bool = True, json: Any = None,
                      params: dict[str, str] | None = None) -> MetaAnswer:
        """``method path`` on the first MetaServer that answers (see the module doc). With an
        aiohttp ``session`` (the servers', kept alive) it goes through that; with None through
        ``sdk.http1``, so a client loads no aiohttp."""
        failures: list[str] = []
        count = len(self.urls)
        for step in range(count):
            index = (self._preferred + step) % count
            url = self.urls[index]
            try:
                if session is None:
                    status, data = await _ask_http1(method, url + path, timeout_s=timeout_s,
                                                    headers=headers, ssl=ssl, json=json,
                                                    params=params)
                else:
                    status, data = await _ask_aiohttp(session, method, url + path,
                                                      timeout_s=timeout_s, headers=headers,
                                                      ssl=ssl, json=json, params=params)
            except _Unreachable as exc:
                failures.append(f"{url} is unreachable: {exc}")
                continue
            if status >= 500 and error_code(data) not in SERVICE_ERROR_CODES:
                failures.append(f"{url} answered HTTP {status}")
                continue
            if index != self._preferred:
                log.warning("MetaServer %s answers %s %s; moving to it (%s)", url, method, path,
                            "; ".join(failures) or "preferred")
                self._preferred = index
            return MetaAnswer(status, data, url)
        where = "MetaServer" if count == 1 else f"any of {count} MetaServers"
        raise MetaUnavailable(f"cannot ask {where} ({method} {path}): {'; '.join(failures)}")


class _Unreachable(Exception):
    """One MetaServer could not be asked; the message says why."""


async def _ask_http1(method: str, url: str, **kwargs: Any) -> tuple[int, Any]:
    """Status and decoded JSON (None if not JSON) of one request through ``sdk.http1``."""
    try:
        answer = await http1.request(method, url, **kwargs)
    except (OSError, asyncio.TimeoutError, http1.HttpProtocolError) as exc:
        raise _Unreachable(_reason(exc)) from None
    try:
        return answer.status, json_module.loads(answer.body) if answer.body else None
    except ValueError:
        return answer.status, None


async def _ask_aiohttp(session: aiohttp.ClientSession, method: str, url: str, *,
                       timeout_s: float, **kwargs: Any) -> tuple[int, Any]:
    """Status and decoded JSON (None if not JSON) of one request through a server's session."""
    import aiohttp  # already loaded by the server that made the session

    try:
        async with session.request(method, url, timeout=aiohttp.ClientTimeout(total=timeout_s),
                                   **kwargs) as response:
            try:
                return response.status, await response.json(content_type=None)
            except ValueError:
                return response.status, None
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
        raise _Unreachable(_reason(exc)) from None


def _reason(exc: BaseException) -> str:
    """Why a request failed, for the MetaUnavailable message."""
    if isinstance(exc, asyncio.TimeoutError):
        return "no answer in time (timeout)"
    return str(exc) or type(exc).__name__


__all__ = ["MetaAnswer", "MetaEndpoints", "MetaUnavailable", "SERVICE_ERROR_CODES", "error_code"]
