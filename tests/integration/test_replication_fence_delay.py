"""The fence of a master's run on the delay log (docs/REPLICATION.md 8.3): a delay master that
lost the last records its tailing slave copied (a power loss before their fsync, simulated by
cutting its delay log while it is down) comes back as master of the same epoch and writes other
records at those offsets; the slave cuts the lost tail (its delay copy is copied again) and
ends equal to the master byte for byte. Since the overlap ships a delay commit's records before
the master's fsync, a power loss can leave a slave past its master's durable end under
``--flush sync`` too, no longer only under ``--flush async``; test_replication_fence.py is the
realtime message log's case."""

from __future__ import annotations

import os
from typing import Any

from metaserver import MetaConfig, sqlite_url, start_metaserver
from tests.harness import wait_for
from tests.integration.test_replication_overlap import (
    FIRST,
    LEASE_MS,
    SECOND,
    delay,
    log_bytes,
    now_ms,
    send,
    tailing,
)
from tests.segment_files import segment_data_bytes


def last_delay_segment(server: Any) -> str:
    directory = os.path.join(server.config.data_dir, "delaylog")
    return os.path.join(directory, sorted(n for n in os.listdir(directory)
                                          if n.endswith(".log"))[-1])


async def test_a_delay_slave_cuts_the_tail_its_restarted_master_lost_and_copies_what_it_wrote_since(
        tmp_path, caplog) -> None:
    due_ms = now_ms() + 3_600_000  # nothing comes due during the test
    config = MetaConfig(db_url=sqlite_url(tmp_path / "m.db"), port=0, lease_ms=LEASE_MS)
    async with start_metaserver(config) as meta:
        first = delay(tmp_path, meta.url, FIRST)
        second = delay(tmp_path, meta.url, SECOND)
        await first.start()
        await second.start()
        try:
            await tailing(first, SECOND, "delay", first.port, deliver_at_ms=due_ms)
            kept = [f"kept-{n}" for n in range(10)]
            assert await send(first.port, kept, deliver_at_ms=due_ms) == kept
            kept_bytes = segment_data_bytes(last_delay_segment(first))
            lost = [f"lost-{n}" for n in range(5)]
            assert await send(first.port, lost, deliver_at_ms=due_ms) == lost
            await wait_for(lambda: log_bytes(second, "delaylog") == log_bytes(first, "delaylog"),
                           20, "the slave holding every record")
            epoch = first.role.epoch
        finally:
            await second.stop()
            await first.stop()
        # The power loss: the master's last five records never reached its disk.
        with open(last_delay_segment(first), "r+b") as segment:
            segment.truncate(kept_bytes)
        first = delay(tmp_path, meta.url, FIRST)
        await first.start()
        second = None
        try:
            assert (first.role.role, first.role.epoch) == ("master", epoch)
            # More than the slave holds past the cut, before it fetches again: its next
            # fetch's offset lies inside what the master wrote since.
            new = [f"new-{n}" for n in range(20)]
            assert await send(first.port, new, deliver_at_ms=due_ms) == new
            second = delay(tmp_path, meta.url, SECOND)
            await second.start()
            await wait_for(lambda: log_bytes(second, "delaylog") == log_bytes(first, "delaylog"),
                           30, "the slave's copy equal to the master's log")
            assert any("past the end" in r.getMessage() for r in caplog.records)
            copy = log_bytes(second, "delaylog")
            assert b"lost-" not in copy
            assert all(i.encode() in copy for i in kept + new)
        finally:
            if second is not None:
                await second.stop()
            await first.stop()
