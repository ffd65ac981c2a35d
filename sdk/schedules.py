"""Recurring schedules from the client: create, list, show, pause, resume, delete, next fire times.

The MetaServer keeps the schedules and hands each occurrence to a delay server
(docs/SCHEDULES.md); this is a thin asyncio client of its ``/api/schedules`` paths::

    async with qmq.Schedules("http://127.0.0.1:8090", token=TOKEN) as schedules:
        await schedules.create("standup", "team.reminders", b"stand-up in 5",
                               cron="55 8 * * MON-FRI", tz="Europe/Berlin")
        for fire in await schedules.next("standup", 3):
            print(fire["local"])

Durations and times are converted to milliseconds here, at the edge: ``every`` is a timedelta
or ms; ``at``/``start``/``end`` an aware datetime, epoch ms, or an ISO 8601 string (one without
an offset is wall-clock time in ``tz``). Errors are the wire errors (BadRequest, Forbidden,
NotFound, Conflict, ...), raised from the MetaServer's answer.

``meta_url`` may name several MetaServers, as the Producer's does; a call that cannot reach one
goes to the next. A ``create`` whose answer was lost that way may have been made: tried again on
the next MetaServer, it finds the same definition there and returns that schedule.
"""

from __future__ import annotations

import base64
import builtins
from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import quote

from sdk.meta import MetaEndpoints, MetaUnavailable
from wire.errors import BadRequest, Conflict, ConnectionLost, QmqError, error_from_wire
from wire.http import bearer, http_ssl
from wire.tls import TlsOption, client_context

# Longest wait for one MetaServer answer, in milliseconds.
REQUEST_TIMEOUT_MS_DEFAULT = 10_000


def _time(value: datetime | int | str | None, name: str) -> int | str | None:
    """``at``/``start``/``end`` as the API takes them: epoch ms or an ISO 8601 string."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, datetime):
        if value.tzinfo is None:
            return value.isoformat()  # wall-clock time in the schedule's tz
        return int(value.timestamp() * 1000)
    if type(value) is int:
        return value
    raise BadRequest(f"{name} must be a datetime, epoch ms or ISO 8601 text, got "
                     f"{type(value).__name__}")


def _every_ms(every: timedelta | int | None) -> int | None:
    if every is None or type(every) is int:
        return every
    if isinstance(every, timedelta):
        return int(every / timedelta(milliseconds=1))
    raise BadRequest(f"every must be a timedelta or ms, got {type(every).__name__}")


class Schedules:
    """A client of the MetaServer's schedule API at ``meta_url``; see the module doc."""

    def __init__(self, meta_url: str | Sequence[str], *, token: str | None = None,
                 tls: TlsOption = None, timeout_ms: int = REQUEST_TIMEOUT_MS_DEFAULT) -> None:
        # One MetaServer or several (a list, or URLs separated by commas): each call goes to the
        # one that answered last and moves on to the next when it cannot be reached.
        self.meta = MetaEndpoints(meta_url)
        self.meta_url = str(self.meta)
        self._headers = bearer(token)
        self._ssl = http_ssl(client_context(tls))
        self._timeout_s = timeout_ms / 1000

    async def __aenter__(self) -> Schedules:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Nothing to release: each call opens and closes its own connection (``sdk.http1``);
        kept so ``async with Schedules(...)`` and ``close()`` stay the API."""

    async def create(self, name: str, subject: str, body: bytes | str, *,
                     cron: str | None = None, every: timedelta | int | None = None,
                     at: datetime | int | str | None = None, tz: str = "UTC",
                     start: datetime | int | str | None = None,
                     end: datetime | int | str | None = None, misfire: str = "skip",
                     tags: list[str] | tuple[str, ...] = (),
                     properties: dict[str, str] | None = None) -> dict[str, Any]:
        """Create schedule ``name``: each occurrence sends ``body`` to ``subject``.

        Exactly one of ``cron`` (5 fields, day-of-week by name: ``0 9 * * MON-FRI``),
        ``every`` (a timedelta or ms) or ``at`` (one occurrence). ``misfire`` (skip | once |
        all) decides what is sent for occurrences missed while no MetaServer ran. Returns the
        schedule as the MetaServer shows it (the existing one when that name already has this
        definition); Conflict when the name has another."""
        raw = body.encode("utf-8") if isinstance(body, str) else bytes(body)
        try:
            text, encoding = raw.decode("utf-8"), "utf-8"
        except UnicodeDecodeError:
            text, encoding = base64.b64encode(raw).decode("ascii"), "base64"
        request: dict[str, Any] = {
            "name": name, "subject": subject, "body": text, "encoding": encoding,
            "tags": list(tags), "properties": dict(properties or {}), "tz": tz,
            "misfire": misfire, "cron": cron, "every_ms": _every_ms(every),
            "at": _time(at, "at"), "start": _time(start, "start"), "end": _time(end, "end")}
        request = {key: value for key, value in request.items() if value is not None}
        return await self._call("POST", "/api/schedules", request)

    async def list(self) -> list[dict[str, Any]]:
        """Every schedule the token may see (those whose subject it may produce to)."""
        return (await self._call("GET", "/api/schedules"))["schedules"]

    async def get(self, name: str) -> dict[str, Any]:
        """One schedule: its definition, state, next fire time and counts."""
        return await self._call("GET", f"/api/schedules/{quote(name)}")

    async def pause(self, name: str) -> dict[str, Any]:
        """Stop sending; the occurrence already handed to a delay server is cancelled."""
        return await self._call("POST", f"/api/schedules/{quote(name)}/pause")

    async def resume(self, name: str) -> dict[str, Any]:
        """Send again from now on (occurrences that fell in the pause are not sent)."""
        return await self._call("POST", f"/api/schedules/{quote(name)}/resume")

    async def delete(self, name: str) -> dict[str, Any]:
        """Delete it; its pending occurrence is cancelled and the name is free again."""
        return await self._call("DELETE", f"/api/schedules/{quote(name)}")

    async def next(self, name: str, n: int = 10) -> builtins.list[dict[str, Any]]:
        """The next ``n`` fire times from now: ``[{fire_ms, local, utc}]``."""
        answer = await self._call("GET", f"/api/schedules/{quote(name)}/next",
                                  params={"n": str(n)})
        return answer["fires"]

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None,
                    params: dict[str, str] | None = None) -> Any:
        try:
            answer = await self.meta.request(None, method, path,
                                             timeout_s=self._timeout_s, headers=self._headers,
                                             ssl=self._ssl, json=body, params=params)
        except MetaUnavailable as exc:
            raise ConnectionLost(exc.message) from None
        status, data = answer.status, answer.data
        if data is None:
            raise ConnectionLost(f"{method} {path} at the MetaServer {answer.url}: HTTP {status} "
                                 "with no JSON body")
        if status >= 400:
            error = data.get("error", {}) if isinstance(data, dict) else {}
            code, message = str(error.get("code", "")), str(error.get("message", data))
            raise Conflict(message) if code == "conflict" else _error(code, message)
        return data


def _error(code: str, message: str) -> QmqError:
    return error_from_wire(code, message)


__all__ = ["Schedules"]
