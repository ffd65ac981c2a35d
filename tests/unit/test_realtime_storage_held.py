"""MessageStore's held messages (the hand-off ahead of the due time): held records are durable
but invisible, made visible in one call after whatever was stored meanwhile, cancelled by id,
de-duplicated, rebuilt the same by recovery (checkpoint or not, closed or not) and by a slave's
copy, and cut back with a copy (docs/FORMATS.md "Held messages")."""

from __future__ import annotations

import pytest

from realtime.storage import MessageStore, SequenceOutOfRange, StoreConfig
from realtime.storage.control_record import (
    decode_cancelled, decode_held, decode_visible, encode_cancelled, encode_held, encode_visible,
    is_control,
)
from realtime.storage.message_record import encode_message_record
from realtime.storage.store_checkpoint import (
    StoreCheckpoint, decode_store_checkpoint, encode_store_checkpoint,
)

TINY = StoreConfig(segment_size_bytes_max=4096, record_size_bytes_max=2048,
                   consumer_log_entries_per_file=4, write_buffer_bytes_max=1024,
                   checkpoint_interval_bytes=2048, dedup_window_ms=60_000)
T0 = 1_700_000_000_000


def hold(store: MessageStore, subject: str, ids: list[str], visible_at_ms: int = T0 + 5_000,
         now_ms: int = T0) -> list[int | None]:
    return store.hold_many([subject] * len(ids), ids, [()] * len(ids), now_ms,
                           [b"payload-" + i.encode() for i in ids], [visible_at_ms] * len(ids))


def send(store: MessageStore, subject: str, ids: list[str], now_ms: int = T0) -> None:
    for message_id in ids:
        store.append(subject, message_id, [], now_ms, b"payload-" + message_id.encode())
    store.commit()


def messages(store: MessageStore, subject: str) -> list[tuple[int, str, bytes]]:
    first, end = store.first_sequence(subject), store.end_sequence(subject)
    return [(m.sequence, m.message_id, m.payload)
            for m in (store.read(subject, s) for s in range(first, end))]


def copy(master: MessageStore, slave: MessageStore, max_bytes: int = 700) -> None:
    offset = slave.copy_bounds()[1]
    while True:
        data = master.read_copy(offset, max_bytes)
        if not data:
            return
        offset = slave.append_copy(offset, data)


@pytest.fixture
def store(tmp_path):
    opened = MessageStore(str(tmp_path / "s"), TINY, now_ms=T0)
    yield opened
    opened.close()


def test_control_records_round_trip_and_are_told_apart_from_message_records():
    held = encode_held(T0, T0 + 9, 5, "orders", "m-1", b"body")
    record, at = decode_held(held)
    assert (record.timestamp_ms, record.visible_at_ms, record.tag_bloom, record.subject,
            record.message_id, held[at:]) == (T0, T0 + 9, 5, "orders", "m-1", b"body")
    runs = [("orders", 7, [(100, 40, 0), (150, 41, 3)]), ("pay", 0, [(200, 9, 1)])]
    assert decode_visible(encode_visible(T0, runs)) == (T0, runs)
    assert decode_cancelled(encode_cancelled(T0, [3, 99])) == (T0, [3, 99])
    assert is_control(held) and is_control(encode_visible(T0, []))
    assert not is_control(encode_message_record(T0, 0, 0, "o", "m", b""))


def test_a_checkpoint_keeps_its_held_watermark_and_a_version_1_payload_still_decodes():
    checkpoint = StoreCheckpoint(500, {"orders": 3}, 120)
    assert decode_store_checkpoint(encode_store_checkpoint(checkpoint)) == checkpoint
    assert checkpoint.replay_from_offset == 120
    version_1 = bytes([1]) + (500).to_bytes(8, "big") + (0).to_bytes(4, "big")
    assert decode_store_checkpoint(version_1) == StoreCheckpoint(500, {}, None)


def test_a_held_message_is_invisible_until_made_visible_after_what_was_stored_meanwhile(store):
    offsets = hold(store, "orders", ["h-1", "h-2"])
    assert None not in offsets
    assert store.end_sequence("orders") == 0
    send(store, "orders", ["r-1"])
    assert [h.message_id for h in store.held()] == ["h-1", "h-2"]
    made = store.make_visible(offsets, T0 + 5_000)
    assert [(subject, first, [h.message_id for h in items]) for subject, first, items in made] \
        == [("orders", 1, ["h-1", "h-2"])]
    assert messages(store, "orders") == [(0, "r-1", b"payload-r-1"), (1, "h-1", b"payload-h-1"),
                                         (2, "h-2", b"payload-h-2")]
    assert store.held() == []
    assert store.make_visible(offsets, T0 + 5_001) == []  # already visible: nothing again


def test_a_held_id_is_a_duplicate_for_a_hand_off_and_for_a_send(store):
    assert hold(store, "orders", ["h-1"])[0] is not None
    assert hold(store, "orders", ["h-1", "h-2", "h-2"])[0] is None
    assert [h.message_id for h in store.held()] == ["h-1", "h-2"]
    assert store.append("orders", "h-1", [], T0, b"again").duplicate
    store.discard()
    send(store, "orders", ["r-1"])
    assert hold(store, "orders", ["r-1"]) == [None]  # stored already


def test_a_cancelled_held_message_never_becomes_visible(store):
    offsets = hold(store, "orders", ["h-1", "h-2"])
    assert store.cancel_held("orders", ["h-1", "nope"], T0 + 1) == [True, False]
    assert store.cancel_held("orders", ["h-1"], T0 + 2) == [False]
    store.make_visible(offsets, T0 + 5_000)
    assert [m[1] for m in messages(store, "orders")] == ["h-2"]
    assert store.cancel_held("orders", ["h-2"], T0 + 5_001) == [False]  # visible already


@pytest.mark.parametrize("closed", [True, False], ids=["closed", "killed"])
def test_a_reopened_store_holds_again_what_was_not_visible_and_keeps_what_was(tmp_path, closed):
    path = str(tmp_path / "s")
    store = MessageStore(path, TINY, now_ms=T0)
    first = hold(store, "orders", ["a-1", "a-2"])
    hold(store, "pay", ["b-1"])
    # Enough realtime records that checkpoints are written past the held records.
    for batch in range(12):
        send(store, "orders", [f"r-{batch}-{i}" for i in range(3)])
    store.make_visible(first[:1], T0 + 5_000)
    store.cancel_held("pay", ["b-1"], T0 + 5_000)
    hold(store, "pay", ["b-2"])
    before = messages(store, "orders")
    if closed:
        store.close()
    # Not closed: what a kill -9 leaves (every write above was fsynced in sync mode).
    reopened = MessageStore(path, TINY, now_ms=T0 + 6_000)
    try:
        assert [(h.subject, h.message_id) for h in reopened.held()] == [("orders", "a-2"),
                                                                        ("pay", "b-2")]
        assert messages(reopened, "orders") == before
        assert reopened.append("orders", "a-2", [], T0, b"x").duplicate
        reopened.discard()
        reopened.make_visible([h.offset for h in reopened.held()], T0 + 7_000)
        assert messages(reopened, "orders")[-1][1:] == ("a-2", b"payload-a-2")
        assert [m[1] for m in messages(reopened, "pay")] == ["b-2"]
    finally:
        reopened.close()
        if not closed:
            store.close()


def test_a_copy_holds_what_its_master_holds_and_makes_it_visible_under_the_same_sequences(
        tmp_path):
    master = MessageStore(str(tmp_path / "m"), TINY, now_ms=T0)
    slave = MessageStore(str(tmp_path / "c"), TINY, now_ms=T0)
    try:
        offsets = hold(master, "orders", ["h-1", "h-2", "h-3"])
        send(master, "orders", ["r-1"])
        master.make_visible(offsets[:1], T0 + 5_000)
        master.cancel_held("orders", ["h-2"], T0 + 5_000)
        copy(master, slave)
        assert slave.held() == master.held()
        assert messages(slave, "orders") == messages(master, "orders")
        # Promoted: the copy makes visible what is left, as its master would have.
        slave.make_visible([h.offset for h in slave.held()], T0 + 6_000)
        assert [m[1] for m in messages(slave, "orders")] == ["r-1", "h-1", "h-3"]
    finally:
        master.close()
        slave.close()


def test_a_copy_cut_back_before_a_visible_record_holds_those_messages_again(tmp_path):
    master = MessageStore(str(tmp_path / "m"), TINY, now_ms=T0)
    slave = MessageStore(str(tmp_path / "c"), TINY, now_ms=T0)
    try:
        offsets = hold(master, "orders", ["h-1", "h-2"])
        cut_at = master.copy_bounds()[1]
        master.make_visible(offsets, T0 + 5_000)
        copy(master, slave)
        assert slave.held() == [] and slave.end_sequence("orders") == 2
        slave.truncate_copy(cut_at)
        assert [h.message_id for h in slave.held()] == ["h-1", "h-2"]
        assert slave.end_sequence("orders") == 0
        with pytest.raises(SequenceOutOfRange):
            slave.read("orders", 0)
        copy(master, slave)
        assert messages(slave, "orders") == messages(master, "orders")
        assert slave.held() == []
    finally:
        master.close()
        slave.close()


def test_retention_keeps_the_segments_of_held_messages(tmp_path):
    config = StoreConfig(segment_size_bytes_max=4096, record_size_bytes_max=2048,
                         retention_ms=1_000, checkpoint_interval_bytes=2048)
    store = MessageStore(str(tmp_path / "s"), config, now_ms=T0)
    try:
        hold(store, "orders", ["h-1"])
        for batch in range(40):
            send(store, "pay", [f"r-{batch}-{i}" for i in range(3)], now_ms=T0 + batch)
        report = store.apply_retention(T0 + 10_000_000, {})
        assert report.deleted_segments == [] and report.kept_for == "<held messages>"
        store.make_visible([h.offset for h in store.held()], T0 + 10_000_000)
        store.apply_retention(T0 + 10_000_000, {"orders": 0})
        assert messages(store, "orders")[0][1] == "h-1"
    finally:
        store.close()
