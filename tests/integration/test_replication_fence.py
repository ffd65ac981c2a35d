"""A realtime master that lost the last records its slave copied (a power loss before their
fsync: simulated by cutting its message log while it is down) and comes back as master of the
same epoch: the slave cuts that tail and copies the master's new records, so both logs end
equal byte for byte (docs/REPLICATION.md 8.3, the fence of a master's run)."""

from __future__ import annotations

import os
from typing import Any

from metaserver import MetaConfig, sqlite_url, start_metaserver
from tests.harness import wait_for
from tests.integration.test_replication_data import (
    FIRST, LEASE_MS, SECOND, message_log_bytes, pull_ids, realtime, send,
)
from tests.segment_files import segment_data_bytes


def last_segment(server: Any) -> str:
    directory = os.path.join(server.config.data_dir, "messagelog")
    return os.path.join(directory, sorted(n for n in os.listdir(directory)
                                          if n.endswith(".log"))[-1])


async def test_a_slave_cuts_the_tail_its_restarted_master_lost_and_copies_what_it_wrote_since(
        tmp_path, caplog):
    config = MetaConfig(db_url=sqlite_url(tmp_path / "m.db"), port=0, lease_ms=LEASE_MS)
    async with start_metaserver(config) as meta:
        first = realtime(tmp_path, meta.url, FIRST)
        second = realtime(tmp_path, meta.url, SECOND)
        await first.start()
        await second.start()
        try:
            await wait_for(lambda: SECOND in first.role.insync, 20, "the slave in sync")
            kept = await send(first.port, [f"kept-{n}" for n in range(10)])
            assert [r["status"] for r in kept] == ["stored"] * 10
            kept_bytes = segment_data_bytes(last_segment(first))
            await send(first.port, [f"lost-{n}" for n in range(5)])
            await wait_for(lambda: message_log_bytes(second) == message_log_bytes(first), 20,
                           "the slave holding every record")
            epoch = first.role.epoch
        finally:
            await second.stop()
            await first.stop()
        # The power loss: the master's last five records never reached its disk.
        with open(last_segment(first), "r+b") as segment:
            segment.truncate(kept_bytes)
        first = realtime(tmp_path, meta.url, FIRST)
        await first.start()
        second = None
        try:
            assert (first.role.role, first.role.epoch) == ("master", epoch)
            # More than the slave holds past the cut, before the slave fetches again: its
            # next fetch's offset lies inside what the master wrote since.
            new = await send(first.port, [f"new-{n}" for n in range(20)])
            assert [r["status"] for r in new] == ["stored"] * 20
            second = realtime(tmp_path, meta.url, SECOND)
            await second.start()
            await wait_for(lambda: message_log_bytes(second) == message_log_bytes(first), 30,
                           "the slave's copy equal to the master's log")
            assert any("lost before their fsync" in r.getMessage() for r in caplog.records)
            assert await pull_ids(first.port, "g") == (
                [f"kept-{n}" for n in range(10)] + [f"new-{n}" for n in range(20)])
        finally:
            if second is not None:
                await second.stop()
            await first.stop()
