"""Fixtures of the end-to-end tests: a ``cluster`` of real processes, stopped after every test.

A failing test prints what each of its processes wrote, so a broker traceback is not lost.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.harness import Cluster, UpProcess, start_up


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    report = yield
    if report.when == "call":
        item.stash[_CALL_FAILED] = report.failed
    return report


_CALL_FAILED = pytest.StashKey[bool]()


@pytest.fixture
def cluster(tmp_path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """A place to start MetaServers and brokers (under ``tmp_path``); all stopped at the end."""
    cluster = Cluster(tmp_path)
    try:
        yield cluster
    finally:
        cluster.stop_all()
        if request.node.stash.get(_CALL_FAILED, False):
            print(cluster.dump())


@pytest.fixture(scope="module")
def module_up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    """One ``qmq up --no-trace`` for a test module (the examples, the docs' snippets), started as
    a user starts it and stopped after the module."""
    cluster = Cluster(tmp_path_factory.mktemp("module-up"))
    try:
        yield cluster.start_up("--no-trace")
    finally:
        cluster.stop_all()


@pytest.fixture(scope="session")
def gateway_up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    """One ``qmq up`` shared by the gateway's tests (its OpenAPI checks, docs/HTTP.md's
    examples): they send to subjects of their own and need nothing else of it."""
    up = start_up(str(tmp_path_factory.mktemp("gateway") / "up"))
    try:
        yield up
    finally:
        up.terminate()
