"""A broker under a low open-files limit serves more subjects than the limit (issue 19): it
raises its soft limit to the hard one at start, says so, and keeps its consumer-log files in a
bounded cache of descriptors, so no commit fails with EMFILE. The full-size case is the issue's:
the usual default limit of 1024, and 10,000 subjects each with a message and a consumer."""

from __future__ import annotations

import asyncio

import pytest

from tests.harness import start_server, wait_registered
from tests.rawclient import FakeClock, RawClient, message

SEND_CHUNK = 100


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("soft_limit", "hard_limit", "subjects_count"), [
    # more than twice the hard limit: one open file per subject could not work
    pytest.param(128, 256, 600, id="600-subjects-under-128:256"),
    # the full size: about 60 s on a quiet 2-core machine
    pytest.param(1024, 1024, 10_000, id="10000-subjects-under-1024"),
])
async def test_a_broker_under_a_low_open_files_limit_stores_and_hands_out_a_message_on_each_of_many_subjects(
    cluster, soft_limit: int, hard_limit: int, subjects_count: int,
):
    cluster.start_meta()
    broker = cluster.keep(start_server(
        "realtime rt1", ["realtime", "--meta", cluster.meta_url, "--data-dir",
                         str(cluster.root / "rt1"), "--group", "rt1", "--port", "0",
                         "--no-metrics"],
        wrapper=("prlimit", f"--nofile={soft_limit}:{hard_limit}"), log_level="info"))
    wait_registered(cluster.meta_url, {("realtime", "rt1"): "rw"})
    assert any(f"open-files limit: soft {hard_limit} (was {soft_limit}), hard {hard_limit}"
               in line for line in broker.output), broker.text()[-2000:]
    subjects = [f"files.s{i:05d}" for i in range(subjects_count)]
    clock = FakeClock()
    client = await RawClient.connect(broker.port)
    try:
        for first in range(0, subjects_count, SEND_CHUNK):
            answer = await client.send(*(message(s, s.encode(), clock)
                                         for s in subjects[first:first + SEND_CHUNK]))
            assert [r["status"] for r in answer["results"]] == ["stored"] * SEND_CHUNK, answer

        async def consume(subject: str) -> None:
            pulled = await client.pull(subject, "g", "c1", start="earliest")
            assert len(pulled["payloads"]) == 1, (subject, pulled)
            acked = await client.ack(subject, "g", "c1", [[0, 0]])
            assert acked["acked"] == 1, (subject, acked)

        for first in range(0, subjects_count, SEND_CHUNK):
            await asyncio.gather(*map(consume, subjects[first:first + SEND_CHUNK]))
    finally:
        await client.close()
    assert broker.running
    assert not any("Too many open files" in line for line in broker.output), broker.text()[-2000:]
