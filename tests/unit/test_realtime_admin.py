"""StorageAdmin over a real MessageStore and PullLogStore in a temp dir: subjects, browse, purge,
and the purge watermark as a pull-log group that retention honours."""

from __future__ import annotations

import os

import pytest

from pulllog import PullLogConfig, PullLogStore
from realtime import admin as admin_module
from realtime.admin import ADMIN_GROUP, StorageAdmin
from realtime.pulls import PULL_RESPONSE_PAYLOAD_BYTES_MAX
from realtime.storage import MessageStore, StoreConfig
from wire.errors import BadRequest, NotFound

T0 = 1_700_000_000_000
HOUR_MS = 3_600_000
DEAD = "%dead%orders%billing"

# 4 KiB segments and 4 entries per consumer-log file: rollover in every test.
TINY = StoreConfig(
    segment_size_bytes_max=4096,
    record_size_bytes_max=2048,
    consumer_log_entries_per_file=4,
    write_buffer_bytes_max=1024,
    checkpoint_interval_bytes=2048,
    retention_ms=HOUR_MS,
    retention_hard_cap_ms=100 * HOUR_MS,
)


class Stores:
    """A message store, a pull log and the admin over them, reopenable."""

    def __init__(self, root: str, payload_bytes_max: int = PULL_RESPONSE_PAYLOAD_BYTES_MAX):
        self.root = root
        self.payload_bytes_max = payload_bytes_max
        self.open()

    def open(self) -> None:
        self.store = MessageStore(os.path.join(self.root, "store"), TINY, now_ms=T0)
        self.pulllog = PullLogStore(os.path.join(self.root, "pulllog"),
                                    PullLogConfig(segment_size_bytes_max=4096))
        self.admin = StorageAdmin(self.store, self.pulllog, self.payload_bytes_max)

    def close(self) -> None:
        self.store.close()
        self.pulllog.close()

    def add(self, subject: str, *payloads: bytes, now_ms: int = T0) -> None:
        for payload in payloads:
            self.store.append(subject, f"{subject}-{os.urandom(6).hex()}", [], now_ms, payload)
        self.store.commit()


@pytest.fixture
def stores(tmp_path):
    s = Stores(str(tmp_path))
    yield s
    s.close()


def payloads(count: int, prefix: bytes = b"m") -> list[bytes]:
    return [prefix + b"%d" % i for i in range(count)]


def test_subjects_lists_the_stored_subjects_with_the_prefix_and_their_ranges(stores):
    stores.add(DEAD, *payloads(3))
    stores.add("%dead%pay%risk", *payloads(1))
    stores.add("orders", *payloads(5))
    answer = stores.admin.subjects("%dead%")
    assert answer == {"subjects": [
        {"subject": DEAD, "first_sequence": 0, "end_sequence": 3, "purged_before": 0},
        {"subject": "%dead%pay%risk", "first_sequence": 0, "end_sequence": 1, "purged_before": 0},
    ], "truncated": False}
    assert [s["subject"] for s in stores.admin.subjects("")["subjects"]] == [
        DEAD, "%dead%pay%risk", "orders"]
    assert stores.admin.subjects("nothing")["subjects"] == []


@pytest.mark.parametrize("count, truncated", [(2, False), (3, False), (4, True)])
def test_subjects_lists_at_most_the_limit_and_says_it_truncated(stores, monkeypatch, count,
                                                                  truncated):
    monkeypatch.setattr(admin_module, "SUBJECTS_LISTED_MAX", 3)
    for i in range(count):
        stores.add(f"s{i}", b"x")
    answer = stores.admin.subjects("")
    assert [s["subject"] for s in answer["subjects"]] == [f"s{i}" for i in range(min(count, 3))]
    assert answer["truncated"] is truncated


def test_browse_reads_without_consuming_or_touching_the_pull_log(stores):
    stores.add(DEAD, *payloads(4))
    stores.pulllog.ensure_group(DEAD, "billing", 0, T0)
    before = stores.pulllog.export_state()
    first = stores.admin.browse(DEAD, None, 10)
    again = stores.admin.browse(DEAD, None, 10)
    assert first == again
    assert [(m["sequence"], m["payload"]) for m in first["messages"]] == list(
        enumerate(payloads(4)))
    assert (first["next_sequence"], first["first_sequence"], first["end_sequence"]) == (4, 0, 4)
    assert stores.pulllog.export_state() == before
    assert not stores.pulllog.has_group(DEAD, ADMIN_GROUP)


def test_browse_returns_at_most_max_count_and_the_next_sequence_continues(stores):
    stores.add(DEAD, *payloads(7))
    seen = []
    next_sequence = None
    for _ in range(3):
        answer = stores.admin.browse(DEAD, next_sequence, 3)
        assert len(answer["messages"]) <= 3
        seen += [m["sequence"] for m in answer["messages"]]
        next_sequence = answer["next_sequence"]
    assert seen == list(range(7))
    assert next_sequence == 7
    assert stores.admin.browse(DEAD, 7, 3)["messages"] == []
    assert stores.admin.browse(DEAD, 99, 3)["messages"] == []


@pytest.mark.parametrize("budget_delta, returned", [(-1, 1), (0, 2), (1, 2)])
def test_browse_stops_adding_messages_when_the_payload_budget_would_be_exceeded(
    tmp_path, budget_delta, returned
):
    sizes = 100
    stores = Stores(str(tmp_path), payload_bytes_max=2 * sizes + budget_delta)
    try:
        stores.add(DEAD, *(bytes([i]) * sizes for i in range(3)))
        answer = stores.admin.browse(DEAD, None, 10)
        assert [m["sequence"] for m in answer["messages"]] == list(range(returned))
        assert answer["next_sequence"] == returned
    finally:
        stores.close()


def test_a_message_larger_than_the_whole_budget_is_still_browsed_alone(tmp_path):
    stores = Stores(str(tmp_path), payload_bytes_max=10)
    try:
        stores.add(DEAD, b"x" * 50, b"y" * 50)
        answer = stores.admin.browse(DEAD, None, 10)
        assert [m["payload"] for m in answer["messages"]] == [b"x" * 50]
        assert stores.admin.browse(DEAD, answer["next_sequence"], 10)["messages"][0][
            "payload"] == b"y" * 50
    finally:
        stores.close()


def test_purge_moves_the_watermark_past_the_sequence_and_browse_no_longer_shows_it(stores):
    stores.add(DEAD, *payloads(5))
    assert stores.admin.purge(DEAD, 1, T0) == {"purged_before": 2, "purged": 2}
    assert stores.pulllog.cursor(DEAD, ADMIN_GROUP) == 2
    assert [m["sequence"] for m in stores.admin.browse(DEAD, None, 10)["messages"]] == [2, 3, 4]
    # An explicit start below the watermark does not bring purged messages back.
    assert [m["sequence"] for m in stores.admin.browse(DEAD, 0, 10)["messages"]] == [2, 3, 4]
    assert stores.admin.subjects("%dead%")["subjects"][0]["purged_before"] == 2


def test_purge_never_moves_the_watermark_backwards(stores):
    stores.add(DEAD, *payloads(5))
    stores.admin.purge(DEAD, 3, T0)
    assert stores.admin.purge(DEAD, 0, T0) == {"purged_before": 4, "purged": 0}
    assert stores.pulllog.cursor(DEAD, ADMIN_GROUP) == 4


def test_purge_is_capped_at_the_end_sequence(stores):
    stores.add(DEAD, *payloads(3))
    assert stores.admin.purge(DEAD, 2**64 - 1, T0) == {"purged_before": 3, "purged": 3}
    assert stores.admin.browse(DEAD, None, 10)["messages"] == []
    stores.add(DEAD, b"later")
    # A dead letter arriving after the purge is not purged.
    assert [m["payload"] for m in stores.admin.browse(DEAD, None, 10)["messages"]] == [b"later"]


def test_only_dead_letter_subjects_can_be_purged(stores):
    stores.add("orders", b"x")
    stores.add("%retry%orders%billing", b"x")
    for subject in ("orders", "%retry%orders%billing"):
        with pytest.raises(BadRequest, match="not a dead-letter subject"):
            stores.admin.purge(subject, 0, T0)
        assert not stores.pulllog.has_group(subject, ADMIN_GROUP)


def test_a_subject_this_broker_never_stored_is_not_found(stores):
    with pytest.raises(NotFound, match="not stored on this broker"):
        stores.admin.browse(DEAD, None, 1)
    with pytest.raises(NotFound, match="not stored on this broker"):
        stores.admin.purge(DEAD, 0, T0)


def test_the_watermark_survives_reopening_the_stores(stores):
    stores.add(DEAD, *payloads(4))
    stores.admin.purge(DEAD, 1, T0)
    stores.close()
    stores.open()
    assert stores.admin.subjects("%dead%")["subjects"][0]["purged_before"] == 2
    assert [m["sequence"] for m in stores.admin.browse(DEAD, None, 10)["messages"]] == [2, 3]


def test_a_watermark_makes_retention_keep_unpurged_dead_letters_until_they_are_purged(stores):
    big = b"d" * 600  # about 5 records per 4 KiB segment
    stores.add(DEAD, *(big for _ in range(12)), now_ms=T0)
    stores.admin.ensure_watermark_pulllog(DEAD, 0, T0)
    assert stores.admin.retention_floor_pulllog(DEAD) == 0

    def retain(now_ms: int) -> None:
        keep = {}
        for subject, group in stores.pulllog.groups():
            needed = stores.pulllog.lowest_needed_sequence(subject, group)
            keep[subject] = min(keep.get(subject, needed), needed)
        stores.store.apply_retention(now_ms, keep)

    retain(T0 + 10 * HOUR_MS)
    assert stores.store.first_sequence(DEAD) == 0
    stores.admin.purge(DEAD, 7, T0)
    assert stores.admin.retention_floor_pulllog(DEAD) == 8
    retain(T0 + 10 * HOUR_MS)
    first = stores.store.first_sequence(DEAD)
    assert 0 < first <= 8
    assert [m["sequence"] for m in stores.admin.browse(DEAD, None, 10)["messages"]] == list(
        range(8, 12))


def test_without_a_watermark_time_retention_deletes_old_dead_letters(stores):
    # The contrast to the test above: this is why dead subjects need their %admin group.
    big = b"d" * 600
    stores.add(DEAD, *(big for _ in range(12)), now_ms=T0)
    stores.store.apply_retention(T0 + 10 * HOUR_MS, {})
    assert stores.store.first_sequence(DEAD) > 0
    assert stores.admin.retention_floor_pulllog(DEAD) is None


def test_a_corrupt_stored_message_is_reported_as_unreadable_and_skipped(stores):
    stores.add(DEAD, b"A" * 40, b"B" * 40, b"C" * 40)
    stores.close()
    log_dir = os.path.join(stores.root, "store", "messagelog")
    (segment,) = sorted(os.listdir(log_dir))
    path = os.path.join(log_dir, segment)
    data = bytearray(open(path, "rb").read())
    where = data.index(b"B" * 40)
    data[where + 5] ^= 0xFF
    open(path, "wb").write(bytes(data))
    stores.open()
    answer = stores.admin.browse(DEAD, None, 10)
    assert [m["payload"] for m in answer["messages"]] == [b"A" * 40, b"C" * 40]
    assert answer["unreadable"] == [1]
