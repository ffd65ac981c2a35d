"""The web console over HTTP, in process (no browser: tests/e2e/test_console_browser.py has
that): every page, login and logout, CSRF, the read-only view of app tokens, and the forms."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest

from metaserver import MetaConfig, sqlite_url, start_metaserver
from metaserver.app import RunningMetaServer
from metaserver.console.render import CONTENT_SECURITY_POLICY
from tracelog.events import HOUR_MS

ADMIN = "console-admin-secret-0123456789"
PAGES = ["/", "/subjects", "/delay", "/dead", "/messages", "/schedules", "/tokens"]
CSRF = re.compile(r'name="csrf" value="([0-9a-f]+)"')


class Browser:
    """An HTTP client that keeps cookies (for 127.0.0.1 too) and reads the forms' CSRF."""

    def __init__(self, meta: RunningMetaServer) -> None:
        self.meta = meta
        self.http = aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True))
        self.csrf = ""

    async def get(self, path: str) -> tuple[int, str, Any]:
        async with self.http.get(self.meta.url + path, allow_redirects=False) as resp:
            text = await resp.text()
            found = CSRF.search(text)
            if found:
                self.csrf = found.group(1)
            return resp.status, text, resp.headers

    async def post(self, path: str, form: dict[str, str], csrf: str | None = None,
                   headers: dict[str, str] | None = None) -> tuple[int, str, Any]:
        data = {"csrf": self.csrf if csrf is None else csrf, **form}
        async with self.http.post(self.meta.url + path, data=data, allow_redirects=False,
                                  headers=headers or {}) as resp:
            return resp.status, await resp.text(), resp.headers

    async def login(self, token: str) -> int:
        await self.get("/login")
        status, _, _ = await self.post("/login", {"token": token, "next": "/"})
        return status

    async def api(self, method: str, path: str, body: Any = None,
                  token: str | None = ADMIN) -> Any:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with aiohttp.ClientSession() as http:
            async with http.request(method, self.meta.url + path, json=body,
                                    headers=headers) as resp:
                assert resp.status in (200, 201), await resp.text()
                return await resp.json()


@asynccontextmanager
async def browser_on(tmp_path: Any, **config: Any) -> AsyncIterator[Browser]:
    """A MetaServer on SQLite with ``config`` and a Browser on it."""
    meta_config = MetaConfig(db_url=sqlite_url(tmp_path / "meta.db"), port=0, **config)
    async with start_metaserver(meta_config) as meta:
        browser = Browser(meta)
        try:
            yield browser
        finally:
            await browser.http.close()


@pytest.fixture
async def open_console(tmp_path: Any) -> AsyncIterator[Browser]:
    async with browser_on(tmp_path, trace_dirs=(str(tmp_path),)) as browser:
        yield browser


@pytest.fixture
async def console(tmp_path: Any) -> AsyncIterator[Browser]:
    async with browser_on(tmp_path, admin_token=ADMIN) as browser:
        yield browser


async def test_every_page_answers_html_with_the_security_headers_while_auth_is_off(
        open_console):
    for path in PAGES + ["/messages?id=abc"]:
        status, text, headers = await open_console.get(path)
        assert status == 200, (path, text[:500])
        assert text.startswith("<!doctype html>") and "auth off" in text
        assert headers["Content-Security-Policy"] == CONTENT_SECURITY_POLICY
        assert headers["X-Frame-Options"] == "DENY"
        assert "<script" not in text
    status, css, _ = await open_console.get("/static/console.css")
    assert status == 200 and "table.grid" in css
    status, _, headers = await open_console.get("/login")
    assert (status, headers["Location"]) == (303, "/")


async def test_the_overview_and_delay_pages_show_registered_servers_and_their_figures(
        open_console):
    api = open_console.api
    await api("POST", "/api/brokers/register", {"group": "rt1", "kind": "realtime",
                                                "address": "127.0.0.1:1"}, None)
    await api("POST", "/api/brokers/heartbeat", {
        "group": "rt1", "kind": "realtime", "address": "127.0.0.1:1",
        "backlog": [{"subject": "orders", "group": "billing", "lag": 1234, "redelivered": 5}]},
        None)
    hour = open_console.meta.registry.clock() // HOUR_MS * HOUR_MS
    await api("POST", "/api/brokers/register", {"group": "d1", "kind": "delay",
                                                "address": "127.0.0.1:2"}, None)
    await api("POST", "/api/brokers/heartbeat", {
        "group": "d1", "kind": "delay", "address": "127.0.0.1:2",
        "backlog": {"pending_total": 777, "dispatch_rate_per_s": 12.5,
                    "pending_per_hour": {str(hour + HOUR_MS): 777},
                    "pending_per_subject": {"orders": 777}}}, None)
    _, overview, _ = await open_console.get("/")
    assert "127.0.0.1:1" in overview and "1,234" in overview and "777" in overview
    assert "12.5/s" in overview
    _, delay, _ = await open_console.get("/delay")
    bars = re.findall(r'<rect class="bar"[^>]*height="([0-9.]+)"', delay)
    assert len(bars) == 48 and sum(float(h) > 0 for h in bars) == 1
    assert "777" in delay
    _, subjects, _ = await open_console.get("/subjects")
    assert "billing" in subjects and "1,234" in subjects


async def test_without_a_session_pages_send_to_login_and_forms_are_refused(console):
    status, _, headers = await console.get("/")
    assert (status, headers["Location"]) == (303, "/login")
    status, _, headers = await console.get("/dead?subject=a")
    assert status == 303 and headers["Location"] == "/login?next=%2Fdead%3Fsubject%3Da"
    status, text, _ = await console.post("/tokens", {"app": "x", "admin": "on"}, csrf="x")
    assert status == 401 and "log in" in text
    assert (await console.api("GET", "/api/admin/tokens"))["tokens"] == []


async def test_a_wrong_token_is_refused_and_the_admin_token_logs_in_and_out(console):
    assert await console.login("qmq_not-a-token") == 401
    status, text, _ = await console.post("/login", {"token": "wrong"})
    assert status == 401 and "unknown or revoked" in text
    assert await console.login(ADMIN) == 303
    for path in PAGES:
        status, text, _ = await console.get(path)
        assert status == 200 and ">admin<" in text, path
    status, _, headers = await console.post("/logout", {})
    assert (status, headers["Location"]) == (303, "/login")
    status, _, headers = await console.get("/")
    assert (status, headers["Location"]) == (303, "/login")


async def test_a_login_form_without_its_csrf_value_is_refused(console):
    await console.get("/login")
    status, text, _ = await console.post("/login", {"token": ADMIN}, csrf="0" * 64)
    assert status == 403 and "CSRF" in text


async def test_forms_need_the_sessions_csrf_value_and_an_origin_of_this_host(console):
    await console.login(ADMIN)
    await console.get("/tokens")
    status, text, _ = await console.post("/tokens", {"app": "shop", "admin": "on"},
                                         csrf="0" * 64)
    assert status == 403 and "CSRF" in text
    status, text, _ = await console.post("/tokens", {"app": "shop", "admin": "on"},
                                         headers={"Origin": "http://evil.example"})
    assert status == 403 and "evil.example" in text
    assert (await console.api("GET", "/api/admin/tokens"))["tokens"] == []


async def test_tokens_are_created_with_the_secret_shown_once_and_revoked_from_the_console(
        console):
    await console.login(ADMIN)
    await console.get("/tokens")
    status, text, _ = await console.post("/tokens", {"app": "shop", "produce": "order.*, pay",
                                                     "consume": "order.*"})
    assert status == 200
    secret = re.search(r'<pre id="new-secret">(qmq_[^<]+)</pre>', text).group(1)
    (row,) = (await console.api("GET", "/api/admin/tokens"))["tokens"]
    assert (row["app"], row["produce"], row["consume"], row["admin"]) == (
        "shop", ["order.*", "pay"], ["order.*"], False)
    _, again, _ = await console.get("/tokens")
    assert secret not in again
    status, text, _ = await console.post("/tokens/revoke", {"id": str(row["id"])})
    assert status == 200 and "revoked" in text
    assert (await console.api("GET", "/api/admin/tokens"))["tokens"][0]["revoked_at_ms"]


async def test_an_app_token_sees_a_read_only_console_of_its_subjects(console):
    created = await console.api("POST", "/api/admin/tokens", {
        "app": "shop", "produce": ["order.*"], "consume": ["order.*"]})
    assert await console.login(created["token"]) == 303
    _, text, _ = await console.get("/")
    assert "read-only" in text and 'href="/tokens"' not in text
    status, text, _ = await console.get("/tokens")
    assert status == 403 and "read-only" in text
    status, _, _ = await console.post("/tokens/revoke", {"id": str(created["id"])})
    assert status == 403
    status, text, _ = await console.get("/dead")
    assert status == 200 and "Re-drive" not in text
    await console.api("POST", "/api/admin/tokens/revoke", {"id": created["id"]})
    status, _, headers = await console.get("/")
    assert (status, headers["Location"]) == (303, "/login")


async def test_a_schedule_is_paused_and_resumed_from_the_console(console):
    await console.api("POST", "/api/schedules", {"name": "nightly", "subject": "reports",
                                                 "body": "run", "cron": "0 3 * * *"})
    await console.login(ADMIN)
    _, text, _ = await console.get("/schedules")
    assert "nightly" in text and ">Pause<" in text
    status, text, _ = await console.post("/schedules/pause", {"name": "nightly"})
    assert status == 200 and "is paused" in text
    assert (await console.api("GET", "/api/schedules/nightly"))["state"] == "paused"
    status, text, _ = await console.post("/schedules/resume", {"name": "nightly"})
    assert status == 200 and "is active" in text


async def test_a_schedules_next_fire_is_shown_in_utc_like_every_page_with_its_zones_time_below(
    console,
):
    from metaserver.console.render import format_ms

    await console.api("POST", "/api/schedules", {"name": "berlin", "subject": "reports",
                                                 "body": "run", "cron": "0 3 * * *",
                                                 "tz": "Europe/Berlin"})
    shown = await console.api("GET", "/api/schedules/berlin")
    await console.login(ADMIN)
    _, text, _ = await console.get("/schedules")
    assert "Next fire (UTC)" in text
    assert format_ms(shown["next_fire_ms"]) in text  # 01:00 or 02:00 UTC, not 03:00
    assert shown["next_fire"] in text and "T03:00:00" in shown["next_fire"]


async def test_a_bad_query_parameter_is_an_error_page_not_a_crash(open_console):
    for path in ("/subjects?page=x", "/delay?hours=999", "/dead?subject=%25bad",
                 "/dead/message?broker_group=a&dead_subject=x&sequence=1",
                 "/messages?hours=0&id=x"):
        status, text, _ = await open_console.get(path)
        assert status == 400 and "bad_request" in text, path


async def test_the_trace_api_needs_an_admin_token_when_auth_is_on(console):
    async with aiohttp.ClientSession() as http:
        async with http.get(console.meta.url + "/api/admin/trace?id=m1") as resp:
            assert resp.status == 401
    answer = await console.api("GET", "/api/admin/trace?id=m1")
    assert answer["events"] == [] and answer["configured"] == []


async def test_the_overview_shows_each_servers_replication_role_epoch_lag_and_stopped_copy(
        open_console):
    api = open_console.api
    for address, server_id in (("127.0.0.1:1", "aaaa"), ("127.0.0.1:2", "bbbb")):
        await api("POST", "/api/brokers/register", {"group": "rt1", "kind": "realtime",
                                                    "address": address, "server_id": server_id},
                  None)
    await api("POST", "/api/brokers/heartbeat", {
        "group": "rt1", "kind": "realtime", "address": "127.0.0.1:2", "server_id": "bbbb",
        "role": "slave", "epoch": 1, "replica": {
            "lag_bytes": 4096, "lag_ms": 1200, "undecodable_at": {
                "log": "message", "offset": 64, "kind": 1, "version": 2,
                "reason": "<version 2>"}}}, None)
    _, overview, _ = await open_console.get("/")
    rows = {address: re.sub(r"<[^>]+>|\s+", " ", row) for row in
            re.findall(r"<tr class=[^>]*>(.*?)</tr>", overview, re.S)
            for address in ("127.0.0.1:1", "127.0.0.1:2") if address in row}
    master, slave = rows["127.0.0.1:1"], rows["127.0.0.1:2"]
    assert " master " in master and " 1 " in master
    assert " slave " in slave and "1,200 ms / 4,096 B" in slave and " 1 " in slave
    # A slave stopped at a record it cannot decode says where (its reason in the title).
    assert "copy stopped" not in master and "copy stopped at message@64 v2" in slave
    assert 'title="&lt;version 2&gt;"' in overview, "the reason is escaped"
