"""A pytest plugin that runs the in-process async tests on uvloop, the loop the server commands
take (``qmq.event_loop``; review rv21-L3): ``pytest -p tests.uvloop_loop ...``. CI runs the
frame-server, TLS and server integration tests this way after the whole suite (.ci/run), so
the code every ``qmq up`` runs is tested in-process on both loops, not only end to end."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import uvloop


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item
                                  ) -> Mapping[str, Callable[[], Any]]:
    """pytest-asyncio's hook: every async test and fixture gets a uvloop loop."""
    return {"uvloop": uvloop.new_event_loop}


def pytest_report_header(config: pytest.Config) -> str:
    """Said at the top of the run, so a log shows which loop the tests ran on."""
    return "event loop: uvloop (tests.uvloop_loop)"


@pytest.fixture(autouse=True)
def _on_uvloop(request: pytest.FixtureRequest) -> None:
    """Fails an async test that was not given uvloop (a hook pytest-asyncio stopped calling
    would otherwise leave this leg running on asyncio's loop, green and proving nothing). The
    loop factory is the test's ``_asyncio_loop_factory`` parameter, set by the hook above."""
    test = getattr(request.node, "obj", None)
    if not inspect.iscoroutinefunction(test):
        return  # a plain test runs no loop of its own
    callspec = getattr(request.node, "callspec", None)
    factory = callspec.params.get("_asyncio_loop_factory") if callspec else None
    if factory is not uvloop.new_event_loop:
        raise AssertionError(f"tests.uvloop_loop: {request.node.nodeid} got the loop factory "
                             f"{factory!r}, not uvloop's")
