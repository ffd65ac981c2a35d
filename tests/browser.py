"""Headless Chromium for tests: Debian's ``chromium`` package driven by Playwright.

Playwright's own browser download cannot run here (and must not in CI), so it launches the
system browser by path. ``.ci/run`` installs the package; where it is missing the tests that
need it are skipped, saying why. Screenshots go to ``artifact_path`` (``$QMQ_TEST_ARTIFACTS``,
else ``test-artifacts/`` at the repository root), where CI and people can look at them.

    with open_page() as (page, errors):
        page.goto(url)
        assert errors == []
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
# Headless, no sandbox (root in a container), and nothing that reaches the network by itself.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
VIEWPORT = {"width": 1280, "height": 900}
ARTIFACTS_DIR = Path(os.environ.get("QMQ_TEST_ARTIFACTS",
                                    Path(__file__).resolve().parent.parent / "test-artifacts"))


def artifact_path(name: str) -> Path:
    """Where a test saves an artifact (a screenshot) named ``name``; the directory is made."""
    ARTIFACTS_DIR.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS_DIR / name


@contextmanager
def open_page() -> Iterator[tuple[Any, list[str]]]:
    """A new page of a headless Chromium, and the list of every console error and uncaught
    page error it reports (filled as they happen). Skips the test without chromium."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"{CHROMIUM} is missing: apt-get install chromium (.ci/run does)")
    from playwright.sync_api import sync_playwright

    errors: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.on("console", lambda message: errors.append(f"console: {message.text}")
                    if message.type == "error" else None)
            page.on("pageerror", lambda error: errors.append(f"page error: {error}"))
            yield page, errors
        finally:
            browser.close()
