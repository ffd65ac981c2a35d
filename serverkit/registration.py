"""A server's registration with the MetaServer: register on start, heartbeat, re-register.

Shared by the realtime and delay servers (neither may import the other). The MetaServer's answer
to a heartbeat carries the state it wants (``rw`` or ``readonly``); a 404 means it forgot us
(restarted on a fresh database, or expired us) and we register again. While the MetaServer is
down the server keeps serving and keeps trying.

The backlog rides on heartbeats as changes against what the MetaServer acknowledged
(``serverkit.backlog.BacklogSync``), so a heartbeat does not grow with the number of groups.
Every other answer is logged with the MetaServer's reason; a refused heartbeat (400) is
followed at once by one that only says we are alive, so a backlog the MetaServer will not take
never expires the broker (nor makes it cycle through registering again). Heartbeats are sent
one at a time (a lock): a change list is only meaningful against the answer before it.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import Any, Awaitable, Callable

import aiohttp

from serverkit.backlog import BacklogSync
from wire.http import bearer, http_ssl

log = logging.getLogger(__name__)

_REQUEST_TIMEOUT_S = 5


class Registration:
    """Keeps one broker registered with the MetaServer at ``meta_url``."""

    def __init__(
        self,
        meta_url: str,
        *,
        group: str,
        kind: str,
        address: str,
        heartbeat_interval_ms: int,
        report: Callable[[], Awaitable[Any]],
        on_state: Callable[[str], None],
        token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.meta_url = meta_url.rstrip("/")
        self.group = group
        self.kind = kind
        self.address = address
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self._report = report
        self._on_state = on_state
        # Sent as Bearer on every call: an admin token when the MetaServer has auth on.
        self._headers = bearer(token)
        self._ssl = ssl_context
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self.registered = False
        self.state = "rw"
        self._last_refresh_s = float("-inf")
        self.backlog = BacklogSync()  # what the MetaServer holds of our backlog
        self._lock = asyncio.Lock()  # one heartbeat at a time

    async def start(self) -> None:
        """Try to register now and keep heartbeating in the background."""
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=_REQUEST_TIMEOUT_S)
        )
        await self._register_quietly()
        self._task = asyncio.create_task(self._loop(), name=f"{self.kind}-registration")

    async def stop(self, deregister: bool = True) -> bool:
        """Stop heartbeating and, on a graceful stop, tell the MetaServer we are gone; True if
        the MetaServer confirmed the deregistration."""
        deregistered = False
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._session is not None:
            if deregister and self.registered:
                try:
                    status, _ = await self._post("/api/brokers/deregister",
                                                 {"group": self.group, "address": self.address})
                    deregistered = status == 200
                    if not deregistered:
                        log.warning("deregister from %s answered HTTP %d", self.meta_url, status)
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
                    log.warning("deregister from %s failed: %s", self.meta_url, exc)
            await self._session.close()
        return deregistered

    async def _post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        assert self._session is not None
        async with self._session.post(self.meta_url + path, json=body, headers=self._headers,
                                      ssl=http_ssl(self._ssl)) as response:
            try:
                data = await response.json(content_type=None)
            except ValueError:
                data = None
            return response.status, data

    async def _register_quietly(self) -> None:
        try:
            status, data = await self._post(
                "/api/brokers/register",
                {"group": self.group, "kind": self.kind, "address": self.address,
                 "state": self.state},
            )
            if status == 200:
                self.registered = True
                self.backlog.reset()  # a new registration: send the whole backlog again
                log.info("registered %s group %s at %s with %s", self.kind, self.group,
                         self.address, self.meta_url)
            else:
                log.warning("register refused by %s: %s %s", self.meta_url, status, data)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            log.warning("MetaServer %s unreachable, will retry: %s", self.meta_url, exc)

    async def refresh_state(self, min_interval_ms: int = 250) -> None:
        """Heartbeat now to learn the state the MetaServer wants, at most once per
        ``min_interval_ms`` however often it is asked."""
        now_s = asyncio.get_running_loop().time()
        if now_s - self._last_refresh_s < min_interval_ms / 1000:
            return
        self._last_refresh_s = now_s
        await self.heartbeat_now()

    async def heartbeat_now(self) -> None:
        """Send one heartbeat (registering first if needed), after any in flight."""
        async with self._lock:
            if not self.registered:
                await self._register_quietly()
                if not self.registered:
                    return
            identity = {"group": self.group, "kind": self.kind, "address": self.address,
                        "state": self.state}
            body = {**identity, **self.backlog.fields(await self._report())}
            answer = await self._send_heartbeat(body)
            if answer is None:
                return
            status, data = answer
            if status == 200:
                self.backlog.acknowledged(
                    data.get("backlog_version") if isinstance(data, dict) else None)
                self._take_state(data)
                return
            self.backlog.reset()  # the MetaServer's copy is unknown now
            if status == 404:
                self.registered = False
                await self._register_quietly()
                return
            log.error("heartbeat refused by %s: HTTP %d: %s", self.meta_url, status,
                      _reason(data))
            if status == 400:
                # Say we are alive without the backlog, so a refused backlog is logged at every
                # heartbeat but never lets the MetaServer expire us.
                answer = await self._send_heartbeat(identity)
                if answer is not None and answer[0] == 200:
                    self._take_state(answer[1])
                elif answer is not None:
                    log.error("heartbeat without backlog refused by %s: HTTP %d: %s",
                              self.meta_url, answer[0], _reason(answer[1]))

    async def _send_heartbeat(self, body: dict[str, Any]) -> tuple[int, Any] | None:
        """POST one heartbeat; None (logged) when the MetaServer could not be reached."""
        try:
            return await self._post("/api/brokers/heartbeat", body)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            self.backlog.reset()  # it may or may not have taken the changes
            log.warning("heartbeat to %s failed: %s", self.meta_url, exc)
            return None

    def _take_state(self, data: Any) -> None:
        """The state a heartbeat's answer asks for (``rw`` or ``readonly``)."""
        if isinstance(data, dict) and data.get("state") in ("rw", "readonly"):
            if data["state"] != self.state:
                self.state = data["state"]
                self._on_state(self.state)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval_ms / 1000)
            try:
                await self.heartbeat_now()
            except Exception:
                log.exception("heartbeat failed")


def _reason(data: Any) -> str:
    """The MetaServer's reason in an error answer (``{"error": {"code", "message"}}``)."""
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        error = data["error"]
        return f"{error.get('code')}: {error.get('message')}"
    return repr(data)[:500]
