"""Shared pytest fixtures: a session-wide throwaway PostgreSQL cluster (``pg_cluster``, ``pg_url``)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest
from hypothesis import settings

from qmq.logs import CLI_HANDLER_NAME
from tests.pg import PgCluster, PgUnavailable

# No Hypothesis deadline: its default (200 ms per example) is an upper bound on wall-clock time,
# which a test on a shared 2-core machine fails by being slow, not wrong.
settings.register_profile("qmq", deadline=None)
settings.load_profile("qmq")

# The audits the tests run as processes of their own (qmq audit) use no JVM class archive: the
# first would start a detached dump (about a minute and a half of CPU) after its verdict, and
# write to the user's cache. tests/unit/test_class_archive.py covers the archive.
os.environ["QMQ_AUDIT_CLASS_ARCHIVE_DIR"] = "off"
# Nor a cached driver JVM command line (spark_audit.launch; the user's cache again):
# tests/spark/test_launch_cache.py gives its audits a directory of their own.
os.environ["QMQ_AUDIT_LAUNCH_CACHE_DIR"] = "off"


@pytest.fixture(autouse=True)
def _logging_left_as_found() -> Iterator[None]:
    """Put the root logger back after each test: a test that runs the CLI in-process gets its
    setup_logging (root at INFO, a handler on that test's stderr), which would otherwise leak
    into every later test on the same worker (what a test's caplog sees, writes to a closed
    stream). pytest's own capture handlers change between phases and are left alone."""
    root = logging.getLogger()
    alembic = logging.getLogger("alembic")
    levels = root.level, alembic.level
    yield
    root.setLevel(levels[0])
    alembic.setLevel(levels[1])
    for handler in list(root.handlers):
        if handler.get_name() == CLI_HANDLER_NAME:
            root.removeHandler(handler)


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
