"""Hypothesis throws random, mutated, damaged and lying frames at a LIVE realtime broker; after
each run the broker still serves an SDK send and pull, logged no traceback, the messages it
stored before the fuzzing read back byte-identical, and everything the fuzzing stored can be
pulled and nacked."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import strategies as st

from tests.fuzzing import (
    ClusterThread,
    browse_payloads,
    drain_and_nack,
    frame_strategies,
    store_messages,
    throw_frames,
    tracebacks,
)

KEPT_SUBJECT = "fuzz.kept"
KEPT_COUNT = 5


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ClusterThread, list[bytes]]]:
    """One cluster for the module, with messages stored before any fuzzing."""
    cluster = ClusterThread(tmp_path_factory.mktemp("fuzz-realtime")).start()
    try:
        assert cluster.realtime is not None
        kept = store_messages(cluster.realtime.port, KEPT_SUBJECT, KEPT_COUNT)
        yield cluster, kept
    finally:
        cluster.stop()


@pytest.mark.parametrize("frames", frame_strategies())
def test_bad_frames_never_crash_the_realtime_broker_nor_change_what_it_stored(
    cluster: tuple[ClusterThread, list[bytes]], caplog: pytest.LogCaptureFixture,
    frames: st.SearchStrategy[bytes], request: pytest.FixtureRequest,
) -> None:
    running, kept = cluster
    assert running.realtime is not None
    port = running.realtime.port
    throw_frames(port, frames, caplog)
    assert browse_payloads(port, KEPT_SUBJECT, KEPT_COUNT) == kept
    # Whatever the fuzzing managed to store can be consumed and nacked (retried or dead-lettered).
    assert drain_and_nack(port, f"drain-{request.node.callspec.id}") >= KEPT_COUNT
    running.sdk_round_trip(f"fuzz.after.{request.node.callspec.id}")
    assert tracebacks(caplog.records) == []
