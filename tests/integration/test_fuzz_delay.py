"""Hypothesis throws random, mutated, damaged and lying frames at a LIVE delay server; after each
run the server still takes an SDK delayed send that a consumer then receives, logged no
traceback, and the delayed messages it held before the fuzzing read back byte-identical."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import strategies as st

from tests.fuzzing import (
    BASE_MS,
    ClusterThread,
    frame_strategies,
    store_messages,
    throw_frames,
    tracebacks,
)

KEPT_SUBJECT = "fuzz.kept"
KEPT_COUNT = 5
# Far enough ahead that the kept messages are still pending when the module ends.
KEPT_DUE_MS = BASE_MS + 6 * 3_600_000


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ClusterThread, list[bytes]]]:
    """One cluster for the module, with delayed messages stored before any fuzzing."""
    cluster = ClusterThread(tmp_path_factory.mktemp("fuzz-delay")).start()
    try:
        assert cluster.delay is not None
        kept = store_messages(cluster.delay.port, KEPT_SUBJECT, KEPT_COUNT, KEPT_DUE_MS)
        yield cluster, kept
    finally:
        cluster.stop()


@pytest.mark.parametrize("frames", frame_strategies())
def test_bad_frames_never_crash_the_delay_server_nor_change_what_it_holds(
    cluster: tuple[ClusterThread, list[bytes]], caplog: pytest.LogCaptureFixture,
    frames: st.SearchStrategy[bytes], request: pytest.FixtureRequest,
) -> None:
    running, kept = cluster
    assert running.delay is not None
    port = running.delay.port
    throw_frames(port, frames, caplog)
    assert running.delay_pending_payloads(KEPT_DUE_MS) == kept
    running.sdk_round_trip(f"fuzz.after.{request.node.callspec.id}", delay_ms=200)
    assert tracebacks(caplog.records) == []
