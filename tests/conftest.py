"""Shared pytest fixtures: a session-wide throwaway PostgreSQL cluster (``pg_cluster``, ``pg_url``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.pg import PgCluster, PgUnavailable


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
