"""Shared pytest fixtures: a session-wide throwaway PostgreSQL cluster (``pg_cluster``, ``pg_url``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import settings

from tests.pg import PgCluster, PgUnavailable

# No Hypothesis deadline: its default (200 ms per example) is an upper bound on wall-clock time,
# which a test on a shared 2-core machine fails by being slow, not wrong.
settings.register_profile("qmq", deadline=None)
settings.load_profile("qmq")


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PgCluster]:
    """A PostgreSQL 15 cluster on a free 127.0.0.1 port for the whole session; skips if absent."""
    try:
        cluster = PgCluster()
    except PgUnavailable as exc:
        pytest.skip(f"PostgreSQL tests skipped: {exc}")
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def pg_url(pg_cluster: PgCluster) -> str:
    """asyncpg URL (``postgresql+asyncpg://...``) of a database in the session's cluster."""
    return pg_cluster.url


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--twin-users", action="store_true",
        help="run only the unit-test files that import, through any chain of our modules, a "
             "module that chooses a C twin (tests/twins.py); CI's pass with QMQ_NO_EXTENSIONS=1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--twin-users"):
        return
    from tests.twins import in_second_pass

    kept = [item for item in items if in_second_pass(item.path)]
    deselected = [item for item in items if not in_second_pass(item.path)]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept
