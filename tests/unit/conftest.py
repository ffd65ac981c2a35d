"""Shared fixtures for the unit tests (fixtures only, no tests)."""

from __future__ import annotations

import pytest

from logstore import LogConfig

# TigerBeetle-style test_min config: 4 KiB segments so every logstore test rolls segments,
# and a small record limit so the limit is cheap to test at max-1, max and max+1.
TINY_SEGMENT_SIZE_BYTES_MAX = 4096
TINY_RECORD_SIZE_BYTES_MAX = 2048


@pytest.fixture(scope="session")
def tiny_config() -> LogConfig:
    """4 KiB segments, a 2 KiB record limit, a 1 KiB write buffer (frozen, so session-wide;
    Hypothesis tests may use it)."""
    return LogConfig(
        segment_size_bytes_max=TINY_SEGMENT_SIZE_BYTES_MAX,
        record_size_bytes_max=TINY_RECORD_SIZE_BYTES_MAX,
        write_buffer_bytes_max=1024,
    )


@pytest.fixture
def log_dir(tmp_path) -> str:
    """A fresh directory for one log."""
    path = tmp_path / "log"
    return str(path)
