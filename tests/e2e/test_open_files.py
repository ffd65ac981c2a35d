"""A broker under a low open-files limit serves more subjects than the limit (issue 19): it
raises its soft limit to the hard one at start, says so, and keeps its consumer-log files in a
bounded cache of descriptors, so no commit fails with EMFILE."""

from __future__ import annotations

import asyncio

import pytest

from tests.harness import start_server, wait_registered
from tests.rawclient import FakeClock, RawClient, message

SOFT_LIMIT, HARD_LIMIT = 128, 256
SUBJECTS = 600  # more than twice the hard limit: one open file per subject could not work
SEND_CHUNK = 100


@pytest.mark.timeout(180)
async def test_a_broker_limited_to_256_open_files_stores_and_hands_out_a_message_on_each_of_600_subjects(
    cluster,
):
    cluster.start_meta()
    broker = cluster.keep(start_server(
        "realtime rt1", ["realtime", "--meta", cluster.meta_url, "--data-dir",
                         str(cluster.root / "rt1"), "--group", "rt1", "--port", "0",
                         "--no-metrics"],
        wrapper=("prlimit", f"--nofile={SOFT_LIMIT}:{HARD_LIMIT}"), log_level="info"))
    wait_registered(cluster.meta_url, {("realtime", "rt1"): "rw"})
    assert any(f"open-files limit: soft {HARD_LIMIT} (was {SOFT_LIMIT}), hard {HARD_LIMIT}"
               in line for line in broker.output), broker.text()[-2000:]
    subjects = [f"files.s{i:03d}" for i in range(SUBJECTS)]
    clock = FakeClock()
    client = await RawClient.connect(broker.port)
    try:
        for first in range(0, SUBJECTS, SEND_CHUNK):
            answer = await client.send(*(message(s, s.encode(), clock)
                                         for s in subjects[first:first + SEND_CHUNK]))
            assert [r["status"] for r in answer["results"]] == ["stored"] * SEND_CHUNK, answer

        async def consume(subject: str) -> None:
            pulled = await client.pull(subject, "g", "c1", start="earliest")
            assert len(pulled["payloads"]) == 1, (subject, pulled)
            acked = await client.ack(subject, "g", "c1", [[0, 0]])
            assert acked["acked"] == 1, (subject, acked)

        for first in range(0, SUBJECTS, SEND_CHUNK):
            await asyncio.gather(*map(consume, subjects[first:first + SEND_CHUNK]))
    finally:
        await client.close()
    assert broker.running
    assert not any("Too many open files" in line for line in broker.output), broker.text()[-2000:]
