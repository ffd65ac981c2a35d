"""A server's registration with the MetaServer: register on start, heartbeat, re-register, and
keep the server's role (master or slave, epoch, lease) as the MetaServer's answers say.

Shared by the realtime and delay servers (neither may import the other). Every heartbeat is a
lease renewal for a master: ``ServerRole`` counts the lease from the moment the heartbeat was
*sent* (``CLOCK_BOOTTIME``), and learns from every answer its role, epoch, the master, the
in-sync set and any switchover (docs/REPLICATION.md 3-5). When the role changes, the data
plane's ``ReplicationStatus.on_role`` runs (one at a time, in order) and only then is a new
master activated. The answers also say whether auth is on, which the access cache needs to
fail closed.

``meta_url`` may list several MetaServers; each request goes to the one that answered last and
fails over to the next within the same heartbeat, with a per-request timeout of two heartbeat
intervals (so a hung MetaServer costs less than a lease). A 404 means the MetaServers forgot us
(a fresh database, or we were expired): we register again. While no MetaServer can be reached
the server keeps trying; a solo master keeps serving, a master of a replicated group stops at
the end of its lease. A request that meets a lease that alone ran out (the process stalled past
it) asks for a renewal at once (``renew_lease``) rather than waiting for the next interval.

A heartbeat is only the lease renewal and the data plane's report: it carries no backlog, so
it stays small and fast whatever the number of groups. The backlog goes in reports of its own
(``POST /api/brokers/backlog``, at most every STATS_INTERVAL_MS, from a task of its own) as
changes against what the MetaServer acknowledged (``serverkit.backlog.BacklogSync``); the
MetaServer writes them to tables of their own, apart from the row a renewal writes. A slow,
refused or lost report is logged with its reason and sent whole again later; it never delays a
heartbeat, so it never costs a master its lease nor expires a server. Every refused heartbeat
is logged with the MetaServer's reason too.

Heartbeats are sent one at a time (a lock), so answers reach ``ServerRole`` in order; reports
are sent one at a time (another lock), so a change list is only ever meaningful against the
answer before it. Everything here runs on the event loop's thread.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Sequence
from typing import Any, Awaitable, Callable

import aiohttp

from sdk.meta import MetaEndpoints, MetaUnavailable
from serverkit.backlog import BacklogSync
from serverkit.replication import NoReplication, ReplicationStatus
from serverkit.role import RoleGrant, RoleView, ServerRole, boottime_ms
from wire.http import bearer, http_ssl
from wire.tls import client_context

log = logging.getLogger(__name__)

# Longest wait for one MetaServer request, in milliseconds (a hung one costs at most this).
REQUEST_TIMEOUT_MS_MAX = 5_000
# Shortest per-request timeout, in milliseconds, however short the heartbeat interval.
REQUEST_TIMEOUT_MS_MIN = 500
# A backlog report goes at most this often, in milliseconds: renewals come every
# lease_ms // 4, and the backlog of thousands of (subject, group) pairs need not.
STATS_INTERVAL_MS = 3_000
# Shortest gap between two heartbeats asked for with heartbeat_soon(), in milliseconds.
HEARTBEAT_SOON_GAP_MS = 50


class Registration:
    """Keeps one server registered with the MetaServer(s) at ``meta_url`` and its role current."""

    def __init__(
        self,
        meta_url: str | Sequence[str],
        *,
        group: str,
        kind: str,
        address: str,
        heartbeat_interval_ms: int,
        report: Callable[[], Awaitable[Any]],
        on_state: Callable[[str], None],
        token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        role: ServerRole | None = None,
        replication: ReplicationStatus | None = None,
        settings: dict[str, Any] | None = None,
        on_auth: Callable[[bool], None] | None = None,
        on_role: Callable[[RoleView], None] | None = None,
        on_settled: Callable[[], None] | None = None,
        clock_ms: Callable[[], int] = boottime_ms,
    ) -> None:
        self.meta = MetaEndpoints(meta_url)
        self.meta_url = str(self.meta)
        self.group = group
        self.kind = kind
        self.address = address
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self._report = report
        self._on_state = on_state
        # Without a role (no server.id): known as the id the MetaServer gives a server that
        # sends none, ``addr:<group>/<address>``; not sent, as it is no valid server id.
        self.role = role or ServerRole(f"addr:{group}/{address}")
        self._sends_server_id = role is not None
        # The ``replica`` fields the MetaServer's last answer says it takes (``replica_fields``).
        self._replica_fields: frozenset[str] = frozenset()
        self.replication = replication or NoReplication()
        # Explicit --replication / --min-insync: sent at registration only (the last wins).
        self._settings = settings or None
        self._on_auth = on_auth
        self._on_role = on_role
        # Called after every answer and every activation, so work waiting for the role to
        # settle (a delay server's first dispatches) can look again.
        self._on_settled = on_settled
        self._clock_ms = clock_ms
        # Sent as Bearer on every call: an admin token when the MetaServer has auth on.
        self._headers = bearer(token)
        self._ssl = ssl_context
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._backlog_task: asyncio.Task[None] | None = None
        self._backlog_lock = asyncio.Lock()  # one report at a time (see the module docstring)
        self._role_task: asyncio.Task[None] | None = None
        # The renewal asked for by requests that met a lapsed lease (renew_lease): one at a time.
        self._renewal: asyncio.Task[None] | None = None
        self._renewal_next_ms = float("-inf")  # no renewal starts before (see _renew)
        self._lock = asyncio.Lock()
        self._soon = asyncio.Event()
        self.registered = False
        self.state = "rw"
        self._last_refresh_s = float("-inf")
        self.backlog = BacklogSync()  # what the MetaServer holds of our backlog

    @property
    def server_id(self) -> str:
        """This server's id, as sent to the MetaServer."""
        return self.role.server_id

    async def start(self) -> None:
        """Try to register now and keep heartbeating in the background. When the registration
        answers, the role it gives is taken (the data plane's ``on_role`` included) before this
        returns, so a master serves from the start."""
        self._session = aiohttp.ClientSession()
        async with self._lock:
            await self._register_quietly()
        if self._role_task is not None:
            await asyncio.gather(self._role_task, return_exceptions=True)
        self._task = asyncio.create_task(self._loop(), name=f"{self.kind}-registration")
        self._backlog_task = asyncio.create_task(self._backlog_loop(),
                                                 name=f"{self.kind}-backlog")

    async def stop(self, deregister: bool = True) -> bool:
        """Stop heartbeating and, on a graceful stop, tell the MetaServer we are gone; True if
        it confirmed the deregistration."""
        deregistered = False
        for task in (self._task, self._backlog_task, self._role_task, self._renewal):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._session is not None:
            if deregister and self.registered:
                body = {"group": self.group, "address": self.address}
                if self._sends_server_id:
                    body["server_id"] = self.server_id
                try:
                    status, _ = await self._post("/api/brokers/deregister", body, patient=True)
                    deregistered = status == 200
                    if not deregistered:
                        log.warning("deregister from %s answered HTTP %d", self.meta.url, status)
                except MetaUnavailable as exc:
                    log.warning("deregister failed: %s", exc.message)
            await self._session.close()
        return deregistered

    def heartbeat_soon(self) -> None:
        """Heartbeat now rather than at the next interval (an in-sync change, a handover ready,
        a slave whose fetch failed); rate-limited to one per HEARTBEAT_SOON_GAP_MS."""
        self._soon.set()

    @property
    def request_timeout_s(self) -> float:
        """How long one heartbeat waits for a MetaServer: two intervals (a hung MetaServer must
        cost less than a lease), within REQUEST_TIMEOUT_MS_MIN..REQUEST_TIMEOUT_MS_MAX."""
        return min(REQUEST_TIMEOUT_MS_MAX,
                   max(REQUEST_TIMEOUT_MS_MIN, 2 * self.heartbeat_interval_ms)) / 1000

    async def renew_lease(self) -> None:
        """The lease alone ran out (a process stalled past it): heartbeat at once rather than at
        the next interval, and return once that answer is taken (or the heartbeat failed). One
        renewal at a time: every caller waits for the same one, and after one that did not
        renew the next waits a heartbeat interval (MetaServers that fail at once are not asked
        once per request).
        Callers bound their wait; a renewal they stop waiting for goes on."""
        renewal = self._renewal
        if renewal is None or renewal.done():
            if self._clock_ms() < self._renewal_next_ms:
                return  # the last one did not renew: the caller refuses, the loop goes on
            renewal = self._renewal = asyncio.create_task(self._renew(),
                                                          name=f"{self.kind}-renewal")
        await asyncio.shield(renewal)

    async def _renew(self) -> None:
        try:
            async with self._lock:
                # The heartbeat the lock waited for may have renewed the lease already, if it
                # was sent after the stall; one sent before it renews nothing.
                if self.registered and self.role.only_lease_ran_out(self._clock_ms()):
                    await self._heartbeat_locked()
        except Exception:  # a bug: logged here, as the loop's; the callers refuse
            log.exception("lease renewal failed")
        if self.role.only_lease_ran_out(self._clock_ms()):
            # No renewal (the MetaServers failed, refused or answered too late): the next one
            # waits a heartbeat interval, so an outage under traffic costs at most one extra
            # heartbeat (and log line) per interval, not one per request (review rvc-L3).
            self._renewal_next_ms = self._clock_ms() + self.heartbeat_interval_ms

    async def _post(self, path: str, body: dict[str, Any], *,
                    patient: bool = False) -> tuple[int, Any]:
        """POST to the MetaServers; a heartbeat waits two intervals per MetaServer (a hung one
        must cost less than a lease), a ``patient`` call REQUEST_TIMEOUT_MS_MAX."""
        assert self._session is not None
        timeout_s = REQUEST_TIMEOUT_MS_MAX / 1000 if patient else self.request_timeout_s
        answer = await self.meta.request(self._session, "POST", path, timeout_s=timeout_s,
                                         headers=self._headers, ssl=http_ssl(self._ssl),
                                         json=body)
        return answer.status, answer.data

    def _identity(self) -> dict[str, Any]:
        view = self.role.view()
        out: dict[str, Any] = {"group": self.group, "kind": self.kind, "address": self.address,
                               "state": self.state, "epoch": view.epoch, "role": view.role}
        if self._sends_server_id:
            out["server_id"] = self.server_id
        if view.master_id is not None and view.master_id != self.server_id:
            out["master_id"] = view.master_id
        return out

    async def _register_quietly(self) -> None:
        """One registration attempt (the lock is held); its answer is a grant like any other."""
        body = self._identity()
        if self._settings:
            body["replication"] = self._settings
        sent_at = self.role.before_heartbeat(self._clock_ms(), proposes_slaves=False)
        try:
            status, data = await self._post("/api/brokers/register", body, patient=True)
        except MetaUnavailable as exc:
            log.warning("%s; will retry", exc.message)
            return
        if status != 200:
            log.warning("register refused by %s: %s %s", self.meta.url, status, data)
            return
        self.registered = True
        self.backlog.reset()  # a new registration: send the whole backlog again
        log.info("registered %s group %s at %s (server %s) with %s", self.kind, self.group,
                 self.address, self.server_id, self.meta.url)
        self._apply(sent_at, data, proposed_slaves=False)

    async def refresh_state(self, min_interval_ms: int = 250) -> None:
        """Heartbeat now to learn the state the MetaServer wants, at most once per
        ``min_interval_ms`` however often it is asked."""
        now_s = asyncio.get_running_loop().time()
        if now_s - self._last_refresh_s < min_interval_ms / 1000:
            return
        self._last_refresh_s = now_s
        await self.heartbeat_now()

    async def heartbeat_now(self) -> None:
        """Send one heartbeat (registering first if needed)."""
        async with self._lock:
            if not self.registered:
                await self._register_quietly()
                return
            await self._heartbeat_locked()

    async def _heartbeat_locked(self) -> None:
        """One heartbeat (the lock is held): identity and the data plane's report, no backlog."""
        report = self.replication.report()
        body = {**self._identity(), "replica": report.to_json(self._replica_fields)}
        proposes = bool(report.insync)
        sent_at = self.role.before_heartbeat(self._clock_ms(), proposes_slaves=proposes)
        try:
            status, data = await self._post("/api/brokers/heartbeat", body)
        except MetaUnavailable as exc:
            log.warning("heartbeat failed: %s", exc.message)
            return
        if status == 200:
            self._apply(sent_at, data, proposed_slaves=proposes)
        elif status == 404:
            self.registered = False
            await self._register_quietly()
        else:
            # What a MetaServer takes beyond the base fields was learnt from the one that
            # answered last; the one refusing may be an older release of the same list (a
            # rolling upgrade): the next heartbeat sends the base fields only, until a
            # register or heartbeat answer lists more again.
            self._replica_fields = frozenset()
            log.error("heartbeat refused by %s: HTTP %d: %s", self.meta.url, status,
                      _reason(data))

    async def report_backlog_now(self) -> None:
        """Send one backlog report (changes against what the MetaServer acknowledged), apart
        from the heartbeats: whatever it costs, no renewal waits for it."""
        async with self._backlog_lock:
            if not self.registered:
                return
            fields = self.backlog.fields(await self._report())
            body: dict[str, Any] = {"group": self.group, "kind": self.kind,
                                    "address": self.address, **fields}
            if self._sends_server_id:
                body["server_id"] = self.server_id
            try:
                status, data = await self._post("/api/brokers/backlog", body, patient=True)
            except MetaUnavailable as exc:
                self.backlog.reset()  # it may or may not have taken the changes
                log.warning("backlog report failed: %s", exc.message)
                return
            if status == 200:
                self.backlog.acknowledged(
                    data.get("backlog_version") if isinstance(data, dict) else None)
                return
            self.backlog.reset()  # the MetaServer's copy is unknown now
            if status == 404:
                self.heartbeat_soon()  # not registered (any more): the heartbeat finds out
            log.error("backlog report refused by %s: HTTP %d: %s", self.meta.url, status,
                      _reason(data))

    def _apply(self, sent_at_ms: int, data: Any, proposed_slaves: bool) -> None:
        """Take in a register or heartbeat answer: state, auth, interval and role."""
        if not isinstance(data, dict):
            return
        if data.get("state") in ("rw", "readonly") and data["state"] != self.state:
            self.state = data["state"]
            self._on_state(self.state)
        if isinstance(data.get("auth"), bool) and self._on_auth is not None:
            self._on_auth(data["auth"])
        fields = data.get("replica_fields")  # an older MetaServer: none beyond the first ones
        self._replica_fields = frozenset(
            f for f in fields if isinstance(f, str)) if isinstance(fields, list) else frozenset()
        told = data.get("heartbeat_interval_ms")
        if isinstance(told, int) and not isinstance(told, bool) and 0 < told:
            self.heartbeat_interval_ms = told
        grant = RoleGrant.from_answer(data)
        if grant is None:
            if "role" not in data and self.role.on_roleless_answer():
                log.warning("MetaServer %s says nothing of roles (an older version): serving "
                            "group %s as its only master", self.meta.url, self.group)
            self._settled()
            return
        change = self.role.on_answer(sent_at_ms, grant, proposed_slaves)
        if change.stale:
            log.error("MetaServer %s answered epoch %d for group %s, older than the epoch %d "
                      "this server knows; ignored", self.meta.url, grant.epoch, self.group,
                      self.role.epoch)
        elif change.changed:
            self._role_changed(change.view)
        self._settled()

    def _settled(self) -> None:
        if self._on_settled is not None:
            self._on_settled()

    def _role_changed(self, view: RoleView) -> None:
        """Run the data plane's ``on_role`` after any earlier one, then activate a master."""
        # The first role a server is given is news only at INFO; a change later is a warning.
        level = logging.INFO if self.role.changes <= 1 else logging.WARNING
        log.log(level, "group %s: server %s is %s at epoch %d (master %s at %s%s)", self.group,
                self.server_id, view.role, view.epoch, view.master_id, view.master_address,
                f", handing over to {view.switchover_to}" if view.switchover_to else "")
        if self._on_role is not None:
            self._on_role(view)
        previous = self._role_task

        async def run() -> None:
            if previous is not None:
                await asyncio.gather(previous, return_exceptions=True)
            try:
                await self.replication.on_role(view)
            except Exception:
                # The data plane could not take the role: stay refusing, try at the next change.
                log.exception("the data plane failed to take role %s at epoch %d", view.role,
                              view.epoch)
                return
            if view.role == "master" and self.role.activate(view.epoch):
                log.log(level, "group %s: server %s serves as master at epoch %d", self.group,
                        self.server_id, view.epoch)
            self._settled()

        self._role_task = asyncio.create_task(run(), name=f"{self.kind}-role")

    async def _loop(self) -> None:
        while True:
            try:
                # asyncio.timeout, not wait_for: 3.11's wait_for swallows a cancel that arrives
                # as the event is set, and the heartbeats would outlive the server's stop.
                async with asyncio.timeout(self.heartbeat_interval_ms / 1000):
                    await self._soon.wait()
                await asyncio.sleep(HEARTBEAT_SOON_GAP_MS / 1000)
            except TimeoutError:
                pass
            self._soon.clear()
            try:
                await self.heartbeat_now()
            except Exception:
                log.exception("heartbeat failed")


    async def _backlog_loop(self) -> None:
        while True:
            try:
                await self.report_backlog_now()
            except Exception:
                log.exception("backlog report failed")
            await asyncio.sleep(STATS_INTERVAL_MS / 1000)


def _reason(data: Any) -> str:
    """The MetaServer's reason in an error answer (``{"error": {"code", "message"}}``)."""
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        error = data["error"]
        return f"{error.get('code')}: {error.get('message')}"
    return repr(data)[:500]


def server_registration(config: Any, *, kind: str, address: str,
                        report: Callable[[], Awaitable[Any]], on_state: Callable[[str], None],
                        role: ServerRole, replication: ReplicationStatus,
                        on_auth: Callable[[bool], None],
                        on_role: Callable[[RoleView], None],
                        on_settled: Callable[[], None] | None = None) -> Registration:
    """The Registration of a realtime or delay server from its config (both have ``meta_url``,
    ``group``, ``heartbeat_interval_ms``, ``token``, ``tls_ca``, ``replication_settings``)."""
    return Registration(
        config.meta_url, group=config.group, kind=kind, address=address,
        heartbeat_interval_ms=config.heartbeat_interval_ms, report=report, on_state=on_state,
        token=config.token, ssl_context=client_context(config.tls_ca), role=role,
        replication=replication, settings=config.replication_settings, on_auth=on_auth,
        on_role=on_role, on_settled=on_settled)


__all__ = ["HEARTBEAT_SOON_GAP_MS", "REQUEST_TIMEOUT_MS_MAX", "Registration",
           "STATS_INTERVAL_MS", "server_registration"]
