"""The message store over a message log allocated ahead (``StoreConfig.preallocate_step_bytes``,
on by default): the usual commit's one call (``commit_run.write_run``, the C twin or its Python
twin) writes into the allocated space, and a store killed with its files as they are (never
closed) reopens with every committed message, then goes on at the data's end."""

from __future__ import annotations

import glob
import os

import pytest

from realtime.storage import MessageStore, StoreConfig

T0 = 1_700_000_000_000
CONFIG = StoreConfig(segment_size_bytes_max=4096, record_size_bytes_max=2048,
                     consumer_log_entries_per_file=64, preallocate_step_bytes=1024,
                     checkpoint_interval_bytes=2048, dedup_window_ms=60_000)


def stored(store: MessageStore, subject: str) -> list[tuple[str, bytes]]:
    first, end = store.first_sequence(subject), store.end_sequence(subject)
    return [(m.message_id, m.payload) for m in (store.read(subject, s) for s in range(first, end))]


@pytest.mark.parametrize("style", ["one call", "general path"])
def test_a_killed_store_over_an_allocated_log_reopens_with_every_commit_and_goes_on(tmp_path,
                                                                                  style):
    data_dir = str(tmp_path / "s")
    expected: list[tuple[str, bytes]] = []
    killed = []
    for round_ in range(3):
        store = MessageStore(data_dir, CONFIG, now_ms=T0 + round_)
        assert stored(store, "orders") == expected
        for batch in range(12):  # rolls a 4 KiB segment several times
            ids = [f"r{round_}b{batch}m{i}" for i in range(3)]
            payloads = [i.encode() * 9 for i in ids]
            if style == "one call":
                store.append_commit(["orders"] * 3, ids, [()] * 3, T0, payloads)
            else:
                store.append_many(["orders"] * 3, ids, [()] * 3, T0, payloads)
                store.commit_sequences()
            expected += list(zip(ids, payloads))
        segments = sorted(glob.glob(os.path.join(data_dir, "messagelog", "*.log")))
        active = segments[-1]
        data_end = store.copy_bounds()[1] - int(os.path.basename(active)[:20])
        assert os.path.getsize(active) > data_end  # allocated ahead of the data
        killed.append(store)  # kill -9: never closed
    store = MessageStore(data_dir, CONFIG, now_ms=T0 + 10)
    assert stored(store, "orders") == expected
    assert store.recovery.message_log.truncation is None
    store.close()
    for old in killed:
        old.close()
