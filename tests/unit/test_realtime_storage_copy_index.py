"""A slave's message store indexes a copy column by column, as its master indexed the commits:
the same consumer-log entries and dedup ids, holes before a subject's first record past its log's
end, and a record whose sequence the log already holds refused at its offset
(``realtime.storage.copying.index_copied``, docs/REPLICATION.md 8.2)."""

from __future__ import annotations

import pytest

from logstore import CorruptRecord
from logstore.record import HEADER_SIZE_BYTES, frame_records
from realtime.storage import MessageStore, StoreConfig
from realtime.storage.control_record import encode_held
from realtime.storage.message_record import (
    _decode_message_headers_py,
    decode_message_header,
    encode_message_record,
)
from tests.twins import built_twin

TINY = StoreConfig(segment_size_bytes_max=4096, record_size_bytes_max=2048,
                   consumer_log_entries_per_file=4, write_buffer_bytes_max=1024,
                   checkpoint_interval_bytes=2048, dedup_window_ms=60_000)
T0 = 1_700_000_000_000


def entries(store: MessageStore) -> dict[str, list]:
    return {subject: clog.entries(clog.begin, clog.end - clog.begin)
            for subject, clog in store._consumer_logs.items()}


def copy(master: MessageStore, slave: MessageStore, max_bytes: int) -> None:
    offset = slave.copy_bounds()[1]
    while data := master.read_copy(offset, max_bytes):
        offset = slave.append_copy(offset, data)


@pytest.mark.parametrize("max_bytes", [300, 700, 1 << 20])
def test_a_copy_of_commits_of_several_subjects_has_the_master_entries_and_ids(tmp_path,
                                                                               max_bytes):
    master = MessageStore(str(tmp_path / "master"), TINY, now_ms=T0)
    slave = MessageStore(str(tmp_path / "slave"), TINY, now_ms=T0)
    try:
        for batch in range(12):
            subjects = ["a", "a", "b", "é", "b", "a"][: 1 + batch % 6]
            master.append_many(subjects, [f"id-{batch}-{i}" for i in range(len(subjects))],
                               [(i,) if batch % 2 else () for i in range(len(subjects))],
                               T0 + batch, [b"p" * (batch * 7 % 50)] * len(subjects))
            master.commit()
        copy(master, slave, max_bytes)
        assert entries(slave) == entries(master)
        assert slave.end_sequences() == master.end_sequences()
        # The ids are in the slave's dedup index: a resend is a duplicate there too.
        for store in (master, slave):
            store.append("é", "id-11-3", [], T0 + 12, b"again")
        assert slave.commit() == master.commit()
        assert master.end_sequences() == slave.end_sequences()
    finally:
        master.close()
        slave.close()


def bodies_of(subject: str, sequences: list[int]) -> list[bytes]:
    return [encode_message_record(T0, sequence, 0, subject, f"{subject}-{sequence}", b"x")
            for sequence in sequences]


def test_a_subject_record_past_its_log_end_is_preceded_by_holes_even_mid_copy(tmp_path):
    slave = MessageStore(str(tmp_path / "slave"), TINY, now_ms=T0)
    try:
        bodies = bodies_of("a", [0, 1]) + bodies_of("b", [3]) + bodies_of("a", [5, 6])
        slave.append_copy(0, frame_records(bodies))
        logs = entries(slave)
        assert [e.is_hole for e in logs["a"]] == [False, False, True, True, True, False, False]
        assert [e.is_hole for e in logs["b"]] == [True, True, True, False]
        assert [slave.read("a", s).message_id for s in (0, 1, 5, 6)] == ["a-0", "a-1", "a-5",
                                                                         "a-6"]
        assert slave.read("b", 3).message_id == "b-3"
    finally:
        slave.close()


def test_a_copied_record_whose_sequence_its_log_holds_is_refused_at_its_offset(tmp_path):
    slave = MessageStore(str(tmp_path / "slave"), TINY, now_ms=T0)
    try:
        bodies = bodies_of("a", [0, 1, 2, 1])
        with pytest.raises(CorruptRecord, match="sequence 1, but its consumer log already "
                                                "ends at 3") as caught:
            slave.append_copy(0, frame_records(bodies))
        assert caught.value.offset == sum(HEADER_SIZE_BYTES + len(b) for b in bodies[:3])
    finally:
        slave.close()


@pytest.fixture(params=["python", "c"])
def decode_message_headers(request):
    """Each twin of ``decode_message_headers``: the Python one, and the C one as built."""
    if request.param == "python":
        return _decode_message_headers_py
    built = built_twin("realtime.storage._codecs", "decode_message_headers")
    if built is None:
        pytest.skip("realtime.storage._codecs is not built")
    return built


def test_decoding_headers_by_column_gives_what_decoding_each_gives(decode_message_headers):
    bodies = bodies_of("a", [4, 5]) + [encode_message_record(T0 + 1, 9, 1 << 63, "é", "ид",
                                                              b"")] + bodies_of("a", [6]) + [
        encode_message_record((1 << 64) - 1, (1 << 64) - 1, (1 << 64) - 1, "s" * 300,
                              "i" * 0xFFFF, b"p" * 5)]
    columns = decode_message_headers(bodies)
    assert columns is not None
    assert list(zip(*columns)) == [decode_message_header(b)[:5] for b in bodies]


@pytest.mark.parametrize("not_bodies", [[], (b"",), [bytearray(bodies_of("a", [0])[0])],
                                        "abc", None])
def test_decoding_headers_by_column_takes_a_nonempty_list_of_bytes_only(decode_message_headers,
                                                                        not_bodies):
    assert decode_message_headers(not_bodies) is None


@pytest.mark.parametrize("odd", [
    encode_held(T0, T0 + 5, 0, "a", "held", b"x"),  # a control record: decoded one by one
    b"\0" * 27,  # shorter than any message record
    bodies_of("a", [0])[0][:-3],  # its id runs past the body
    encode_message_record(T0, 0, 0, "a", "i", b"")[:28],  # its id length runs past the body
    encode_message_record(T0, 0, 0, "a", "i", b"")[:27],  # its id length cut
    encode_message_record(T0, 0, 0, "a", "\xe9", b"")[:-1],  # a UTF-8 id cut mid-character
])
def test_decoding_headers_by_column_leaves_an_odd_body_to_the_one_by_one_decode(
        decode_message_headers, odd):
    assert decode_message_headers(bodies_of("a", [0]) + [odd]) is None


def test_decoding_headers_by_column_leaves_a_subject_not_utf8_to_the_one_by_one_decode(
        decode_message_headers):
    body = bytearray(bodies_of("a", [0])[0])
    body[26] = 0xFF  # the subject's one byte
    with pytest.raises(ValueError, match="not UTF-8"):
        decode_message_header(bytes(body))
    assert decode_message_headers([bytes(body)]) is None
    assert decode_message_headers(bodies_of("a", [0]) + [bytes(body)]) is None


def test_decoding_headers_by_column_leaves_an_id_not_utf8_to_the_one_by_one_decode(
        decode_message_headers):
    body = bytearray(bodies_of("a", [0])[0])
    body[29] = 0xFF  # the id's first byte
    assert decode_message_headers(bodies_of("a", [0, 1]) + [bytes(body)]) is None
