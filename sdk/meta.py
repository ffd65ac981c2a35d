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
import logging
import ssl as ssl_module
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from wire.errors import QmqError
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

    async def request(self, session: aiohttp.ClientSession, method: str, path: str, *,
                      timeout_s: float, headers: dict[str, str] | None = None,
                      ssl: ssl_module.SSLContext | bool = True, json: Any = None,
                      params: dict[str, str] | None = None) -> MetaAnswer:
        """``method path`` on the first MetaServer that answers (see the module doc)."""
        failures: list[str] = []
        count = len(self.urls)
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        for step in range(count):
            index = (self._preferred + step) % count
            url = self.urls[index]
            try:
                async with session.request(method, url + path, timeout=timeout, headers=headers,
                                           ssl=ssl, json=json, params=params) as response:
                    status = response.status
                    try:
                        data = await response.json(content_type=None)
                    except ValueError:
                        data = None
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
                failures.append(f"{url} is unreachable: {str(exc) or type(exc).__name__}")
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


__all__ = ["MetaAnswer", "MetaEndpoints", "MetaUnavailable", "SERVICE_ERROR_CODES", "error_code"]
