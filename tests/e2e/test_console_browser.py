"""The console in a real browser: headless Chromium (Debian's) driven by Playwright
(tests/browser.py), against ``qmq up`` and ``qmq metaserver`` subprocesses.

Every page loads with no console error and no failed request, and a screenshot of each is saved
(``test-artifacts/console-*.png``); a dead letter is re-driven from the UI and a consumer then
gets it; with auth on, people log in and out and are refused without a token; and the pages
stay right with 1,000 subjects and 100 brokers.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import qmq
from bench.console import seeded
from tests import harness
from tests.browser import artifact_path, open_page

ADMIN = "browser-admin-secret-0123456789"
WAIT_S = 30


@contextmanager
def watched_page() -> Iterator[tuple[Any, list[str]]]:
    """A page and the list of its problems: console errors, page errors, failed requests and
    answers of 400 or more."""
    with open_page() as (page, errors):
        page.on("requestfailed", lambda r: None if _dropped_favicon(r.url, r.failure)
                else errors.append(f"request failed: {r.url} {r.failure}"))
        page.on("response", lambda r: errors.append(f"HTTP {r.status}: {r.url}")
                if r.status >= 400 else None)
        yield page, errors


def _dropped_favicon(url: str, failure: str | None) -> bool:
    """The browser fetches the favicon on its own after a page loads and cancels it
    (net::ERR_ABORTED) when the test goes to the next page first: not a problem of the page."""
    return url.endswith("/favicon.svg") and failure is not None and "ERR_ABORTED" in failure


def shot(page: Any, name: str) -> None:
    page.screenshot(path=str(artifact_path(f"console-{name}.png")), full_page=True)


def post_json(url: str, body: dict[str, Any], token: str | None = None) -> Any:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(url, json.dumps(body).encode(), headers)
    with urllib.request.urlopen(request, timeout=30) as resp:
        return json.load(resp)


async def _seed(meta_url: str) -> str:
    """Messages, a delayed one, a schedule, and one dead letter (retries_max 0): its id."""
    async with qmq.Producer(meta_url) as producer:
        for i in range(3):
            await producer.send("orders", f'{{"order": {i}}}'.encode(), tags=["vip"],
                                properties={"shop": "eu"}, message_id=f"order-{i}")
        await producer.send("reminders", b"call Ann", delay=3_600_000 * 5)
    async with qmq.Consumer(meta_url, group="billing", start="earliest",
                            wait_ms=500) as consumer:
        seen = 0
        async for message in consumer.subscribe("orders"):
            await (message.nack() if message.id == "order-0" else message.ack())
            seen += 1
            if seen == 3:
                break
    return "order-0"


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[harness.UpProcess]:
    server = harness.start_up(str(Path(tmp_path_factory.mktemp("console")) / "up"),
                              "--retries-max", "0")
    try:
        asyncio.run(_seed(server.meta_url))
        post_json(server.meta_url + "/api/schedules", {
            "name": "nightly-report", "subject": "reports", "body": "run", "cron": "0 3 * * *"})
        yield server
    finally:
        server.terminate()


def wait_for_text(page: Any, url: str, text: str) -> None:
    """Reload ``url`` until it shows ``text`` (figures refresh with heartbeats)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        page.goto(url)
        if text in page.content() or time.monotonic() > deadline:
            break
        page.wait_for_timeout(500)
    assert text in page.content(), f"{url} never showed {text!r}"


def test_every_page_loads_without_errors_and_is_screenshotted(up):
    base = up.meta_url
    with watched_page() as (page, errors):
        wait_for_text(page, base + "/", "realtime-1")
        assert page.locator("#delay tbody tr").count() == 1
        shot(page, "overview")
        wait_for_text(page, base + "/subjects", "billing")
        shot(page, "subjects")
        wait_for_text(page, base + "/delay", "reminders")
        assert page.locator("svg.chart rect.bar").count() == 48
        shot(page, "delay")
        wait_for_text(page, base + "/dead", "order-0.r1")
        shot(page, "dead")
        page.click("#dead a >> text=order-0.r1")
        page.wait_for_selector("#body")
        assert '{"order": 0}' in page.inner_text("#body")
        assert page.locator("#trace tbody tr").count() >= 4  # produced, stored, pulled, nacked
        shot(page, "dead-message")
        page.goto(base + "/messages?id=order-1")
        assert "acked" in page.inner_text("#trace")
        shot(page, "message-lookup")
        page.goto(base + "/schedules")
        assert "nightly-report" in page.inner_text("#schedules")
        shot(page, "schedules")
        page.goto(base + "/tokens")
        shot(page, "tokens")
        page.goto(base + "/dead/purge?subject=orders&group=billing")
        assert "purges 1 dead letter on every broker" in page.inner_text(".warn-box")
        shot(page, "purge-confirm")
        assert errors == []


def test_a_dead_letter_is_redriven_from_the_ui_and_a_consumer_gets_it(up):
    base = up.meta_url
    with watched_page() as (page, errors):
        wait_for_text(page, base + "/dead", "order-0.r1")
        row = page.locator("#dead tbody tr", has_text="order-0.r1")
        row.get_by_role("button", name="Re-drive").click()
        page.wait_for_selector("ul.result")
        assert "re-driven: 1" in page.inner_text("ul.result")
        shot(page, "redriven")
        assert errors == []

    async def receive() -> qmq.ReceivedMessage:
        async with asyncio.timeout(WAIT_S), \
                qmq.Consumer(base, group="billing", wait_ms=500) as consumer:
            async for message in consumer.subscribe("orders"):
                await message.ack()
                return message
        raise AssertionError("the subscription ended")

    message = asyncio.run(receive())
    assert (message.id, message.body) == ("order-0.redrive1", b'{"order": 0}')
    assert message.properties["qmq-redriven-from"] == "order-0.r1"

    with watched_page() as (page, errors):  # then purge it, after typing the confirmation
        page.goto(base + "/dead/purge?subject=orders&group=billing")
        page.fill("#confirm", "orders/billing")
        page.click("button.danger")
        page.wait_for_selector("ul.result")
        assert "purged: 1" in page.inner_text("ul.result")
        page.goto(base + "/dead")
        assert "order-0.r1" not in page.content()
        assert errors == []


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[harness.ServerProcess]:
    db = Path(tmp_path_factory.mktemp("secured")) / "meta.db"
    server = harness.start_server("metaserver", [
        "metaserver", "--db", f"sqlite+aiosqlite:///{db}", "--port", "0",
        "--admin-token", ADMIN])
    try:
        yield server
    finally:
        server.terminate()


def log_in(page: Any, base: str, token: str) -> None:
    page.goto(base + "/")
    assert page.url.endswith("/login")
    page.fill("#token", token)
    page.click("button[type=submit]")


def test_with_auth_on_people_log_in_and_out_and_are_refused_without_a_token(secured):
    base = secured.url
    with open_page() as (page, errors):
        log_in(page, base, "qmq_wrong")
        assert "unknown or revoked" in page.inner_text(".error")
        shot(page, "login-refused")
        log_in(page, base, ADMIN)
        page.wait_for_url(base + "/")
        assert page.inner_text(".who .badge") == "admin"
        page.goto(base + "/tokens")
        page.fill("#app", "shop")
        page.fill("#produce", "order.*")
        page.fill("#consume", "order.*")
        page.click("form.stacked button[type=submit]")
        secret = page.inner_text("#new-secret").strip()
        assert secret.startswith("qmq_")
        shot(page, "token-created")
        page.click("text=Log out")
        page.wait_for_url(base + "/login")
        shot(page, "login")
        page.goto(base + "/tokens")
        assert page.url.startswith(base + "/login?next=")
        refused = page.request.post(base + "/tokens/revoke", form={"id": "1", "csrf": "x"})
        assert refused.status == 401
        log_in(page, base, secret)
        page.wait_for_url(base + "/")
        assert page.inner_text(".who .badge") == "read-only"
        assert page.locator('nav a[href="/tokens"]').count() == 0
        shot(page, "read-only")
        page.goto(base + "/tokens")
        assert "read-only view" in page.inner_text(".error")
        assert [e for e in errors if "401" not in e and "403" not in e] == []


@contextmanager
def seeded_in_background(meta_url: str, db_url: str) -> Iterator[None]:
    """``bench.console.seeded`` on a thread of its own, kept up until the block ends."""
    ready, stop, failed = threading.Event(), threading.Event(), []

    async def keep() -> None:
        async with seeded(meta_url, db_url):
            ready.set()
            while not stop.is_set():
                await asyncio.sleep(0.1)

    def run() -> None:
        try:
            asyncio.run(keep())
        except BaseException as exc:  # reported by the test
            failed.append(exc)
            ready.set()

    thread = threading.Thread(target=run, name="console-seed", daemon=True)
    thread.start()
    assert ready.wait(120), "seeding did not finish"
    assert not failed, failed
    try:
        yield
    finally:
        stop.set()
        thread.join(30)


def test_pages_stay_right_with_1000_subjects_and_100_brokers(tmp_path):
    db_url = f"sqlite+aiosqlite:///{tmp_path / 'meta.db'}"
    meta = harness.start_server("metaserver", ["metaserver", "--db", db_url, "--port", "0"])
    try:
        with seeded_in_background(meta.url, db_url), watched_page() as (page, errors):
            base = meta.url
            page.goto(base + "/")
            assert page.locator("#realtime tbody tr").count() == 90
            assert page.locator("#delay tbody tr").count() == 10
            shot(page, "scale-overview")
            page.goto(base + "/subjects")
            assert page.locator("#subjects tbody tr").count() == 100
            assert page.locator("#groups tbody tr").count() == 100
            assert "page 1 of 10" in page.content() and "page 1 of 20" in page.content()
            shot(page, "scale-subjects")
            page.goto(base + "/subjects?page=10&gpage=20")
            assert page.locator("#subjects tbody tr").last.inner_text().startswith(
                "subject-0999")
            page.goto(base + "/subjects?q=subject-0999")
            assert page.locator("#subjects tbody tr").count() == 1
            assert page.locator("#groups tbody tr").count() == 2
            page.goto(base + "/delay")
            heights = [float(h) for h in page.locator("svg.chart rect.bar").evaluate_all(
                "bars => bars.map(b => b.getAttribute('height'))")]
            assert len(heights) == 48 and sum(h > 0 for h in heights) >= 47
            shot(page, "scale-delay")
            assert errors == []
    finally:
        meta.terminate()
