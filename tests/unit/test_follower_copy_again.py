"""A delay store's two replicated logs are thrown away together (serverkit.follower,
``ReplicatedLog.empties``/``reset_with``; docs/REPLICATION.md 16): an old master whose done
journal alone diverges (it dispatched or cancelled what its slave never copied) keeps none of
those marks in its bucket files, and neither log keeps an epoch history entry that outlives
its records."""

from __future__ import annotations

from typing import Any

import pytest

from delayserver.storage import DelayStore, DelayStoreConfig
from logstore import CopyReset
from logstore.epoch_history import EpochHistory
from serverkit.follower import Follower, Scrub
from serverkit.replica_log import ReplicatedLog, cut_io

NOW_MS = 1_700_000_000_000
TINY = DelayStoreConfig(bucket_ms=1_000, segment_size_bytes_max=4096)


async def run(fn: Any, *args: Any) -> Any:
    return fn(*args)


def logs(store: DelayStore, directory: Any) -> list[ReplicatedLog]:
    return [
        ReplicatedLog("delay", store.delay_copy, EpochHistory(str(directory / "delay.epochs")),
                      run, empties=("done",)),
        ReplicatedLog("done", store.done_copy, EpochHistory(str(directory / "done.epochs")),
                      run, requires=("delay",), reset_with="delay"),
    ]


def copy(master: DelayStore, slave: DelayStore) -> None:
    for source, target in ((master.delay_copy, slave.delay_copy),
                           (master.done_copy, slave.done_copy)):
        offset = target.copy_bounds()[1]
        while data := source.read_copy(offset, 600):
            offset = target.append_copy(offset, data)


def pending_ids(store: DelayStore, buckets: list[int]) -> list[str]:
    return sorted(store.read(e).message_id for b in buckets for e in store.load_bucket(b))


async def test_a_diverging_done_journal_throws_the_whole_delay_copy_away_with_both_histories(
        tmp_path):
    master = DelayStore(str(tmp_path / "master"), TINY, now_ms=NOW_MS)
    old = DelayStore(str(tmp_path / "old"), TINY, now_ms=NOW_MS)
    try:
        for i in range(12):
            master.append(f"m-{i}", "orders", NOW_MS + 10_000 + i * 150, b"x")
        entries = master.commit()
        buckets = sorted({e.bucket_ms for e in entries})
        copy(master, old)
        replicated = logs(old, tmp_path / "old-epochs")
        for item in replicated:
            item.history.append(1, 0)
        # The old master dispatched four that its slave never copied: only its journal diverges.
        mine = [e for b in buckets for e in old.load_bucket(b)][:4]
        old.record_dispatched(mine)
        assert len(pending_ids(old, buckets)) == 8
        done = replicated[1]
        with pytest.raises(CopyReset):
            await run(cut_io, done, (1, master.done_copy.copy_bounds()[1]))
        follower = Follower("d1", "old", replicated, connect=None,  # type: ignore[arg-type]
                            clock_ms=lambda: 0, on_trouble=lambda: None, scrub=Scrub(0, 0))
        await follower._copy_again(done)
        assert [item.store.copy_bounds() for item in replicated] == [(0, 0), (0, 0)]
        assert [item.history.entries for item in replicated] == [(), ()]
        copy(master, old)
        # What the new master holds, and nothing of its own: the four are pending again.
        assert pending_ids(old, buckets) == pending_ids(master, buckets)
        assert len(pending_ids(old, buckets)) == 12
    finally:
        master.close()
        old.close()
