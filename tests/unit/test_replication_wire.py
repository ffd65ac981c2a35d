"""The replication ops of the frame protocol (wire.replication): fetch and snapshot requests
through parse_request, their answers, and their limits at max-1, max and max+1."""

from __future__ import annotations

import pytest

from wire.errors import BadRequest
from wire.limits import MAX_FETCH_BYTES, MAX_FETCH_WAIT_MS, MAX_SERVER_ID_CHARS
from wire.protocol import FrameDecoder, encode_frame, parse_request
from wire.replication import (
    Fetch,
    FetchAnswer,
    Snapshot,
    SnapshotAnswer,
    fetch_request,
    parse_fetch_answer,
    parse_snapshot_answer,
    snapshot_request,
)


def fetch(**changes) -> dict:
    frame = fetch_request("0123456789abcdef", 3, "message", 4096, 2, 1 << 20, 500)
    frame["rid"] = 9
    frame.update(changes)
    return frame


def test_a_fetch_survives_encoding_framing_and_parsing():
    (frame,) = FrameDecoder().feed(encode_frame(fetch()))
    assert parse_request(frame) == Fetch(9, "0123456789abcdef", 3, "message", 4096, 2, 1 << 20,
                                         500)


def test_a_snapshot_survives_encoding_framing_and_parsing():
    frame = snapshot_request("s-1", 4, "actions", 17, 100, 4096)
    frame["rid"] = 2
    (decoded,) = FrameDecoder().feed(encode_frame(frame))
    assert parse_request(decoded) == Snapshot(2, "s-1", 4, "actions", 17, 100, 4096)


@pytest.mark.parametrize("name", ["message", "actions", "delay", "done"])
def test_every_replicated_log_can_be_fetched(name):
    assert parse_request(fetch(log=name)).log == name


def test_an_unknown_log_is_a_bad_request_naming_the_known_ones():
    with pytest.raises(BadRequest, match="fetch.log 'schedule' is not one of message, actions"):
        parse_request(fetch(log="schedule"))
    with pytest.raises(BadRequest, match="snapshot.log 'delay' is not one of message, actions"):
        parse_request(snapshot_request("s", 1, "delay", 0, 0, 10) | {"rid": 1})


def test_fetch_max_bytes_is_accepted_up_to_the_limit_and_refused_past_it():
    assert parse_request(fetch(max_bytes=MAX_FETCH_BYTES - 1)).max_bytes == MAX_FETCH_BYTES - 1
    assert parse_request(fetch(max_bytes=MAX_FETCH_BYTES)).max_bytes == MAX_FETCH_BYTES
    with pytest.raises(BadRequest, match=f"fetch.max_bytes {MAX_FETCH_BYTES + 1} is outside"):
        parse_request(fetch(max_bytes=MAX_FETCH_BYTES + 1))
    with pytest.raises(BadRequest, match="outside 1"):
        parse_request(fetch(max_bytes=0))


def test_fetch_wait_is_accepted_up_to_the_limit_and_refused_past_it():
    assert parse_request(fetch(wait_ms=MAX_FETCH_WAIT_MS - 1)).wait_ms == MAX_FETCH_WAIT_MS - 1
    assert parse_request(fetch(wait_ms=MAX_FETCH_WAIT_MS)).wait_ms == MAX_FETCH_WAIT_MS
    with pytest.raises(BadRequest, match="fetch.wait_ms 60001 is outside 0..60000"):
        parse_request(fetch(wait_ms=MAX_FETCH_WAIT_MS + 1))


def test_server_id_length_is_accepted_up_to_the_limit_and_refused_past_it():
    for length in (MAX_SERVER_ID_CHARS - 1, MAX_SERVER_ID_CHARS):
        assert parse_request(fetch(server_id="a" * length)).server_id == "a" * length
    with pytest.raises(BadRequest, match="server_id"):
        parse_request(fetch(server_id="a" * (MAX_SERVER_ID_CHARS + 1)))
    with pytest.raises(BadRequest, match="server_id"):
        parse_request(fetch(server_id="a b"))


def test_the_metaserver_takes_the_server_ids_a_fetch_takes_up_to_the_same_limit():
    from metaserver.errors import BadRequest as HttpBadRequest
    from metaserver.validation import check_server_id

    for length in (MAX_SERVER_ID_CHARS - 1, MAX_SERVER_ID_CHARS):
        assert check_server_id("server_id", "a" * length) == "a" * length
    with pytest.raises(HttpBadRequest, match="server_id"):
        check_server_id("server_id", "a" * (MAX_SERVER_ID_CHARS + 1))


@pytest.mark.parametrize("field,value,words", [
    ("offset", -1, "fetch.offset -1 is outside"),
    ("offset", "7", "fetch.offset must be int, got str"),
    ("epoch", True, "fetch.epoch must be int, got bool"),
    ("last_epoch", None, "fetch.last_epoch must be int, got NoneType"),
])
def test_a_wrong_fetch_field_is_a_bad_request_naming_it(field, value, words):
    with pytest.raises(BadRequest, match=words):
        parse_request(fetch(**{field: value}))


@pytest.mark.parametrize("field,value,words", [
    ("offset", 2**64, "fetch.offset 18446744073709551616 is outside"),
    ("max_bytes", 0, "fetch.max_bytes 0 is outside"),
    ("wait_ms", MAX_FETCH_WAIT_MS + 1, "fetch.wait_ms"),
    ("log", "pulls", "fetch.log 'pulls' is not one of"),
    ("log", ["message"], "fetch.log must be a non-empty str, got list"),
    ("server_id", 7, "fetch.server_id must be a non-empty str, got int"),
    ("epoch", 1.0, "fetch.epoch must be int, got float"),
])
def test_a_fetch_from_a_server_seen_before_is_checked_field_by_field_as_the_first(
        field, value, words):
    # The first fetch of a server id takes the field-by-field checks; later ones a quick path
    # of builtins, which must refuse the same maps in the same words.
    assert parse_request(fetch()) == parse_request(fetch())
    with pytest.raises(BadRequest, match=words):
        parse_request(fetch(**{field: value}))


def test_a_missing_fetch_field_is_a_bad_request_naming_it():
    frame = fetch()
    del frame["last_epoch"]
    with pytest.raises(BadRequest, match="fetch request lacks field 'last_epoch'"):
        parse_request(frame)


def test_a_fetch_answer_reads_back_what_the_master_wrote():
    answer = FetchAnswer(5, "delay", 100, b"x" * 24, 124, 0, 124, ((4, 0), (5, 110)), None)
    assert parse_fetch_answer(answer.to_wire()) == answer
    diverging = FetchAnswer(5, "delay", 100, b"", 100, 0, 90, (), (4, 90))
    assert parse_fetch_answer(diverging.to_wire()) == diverging
    actions = FetchAnswer(5, "actions", 100, b"x" * 24, 124, 0, 124, ((5, 0),), None,
                          {"message": 2**64 - 1})
    assert parse_fetch_answer(actions.to_wire()) == actions


@pytest.mark.parametrize("change,words", [
    ({"epoch": -1}, "epoch -1 is outside"),
    ({"log_end": 2**64}, "log_end 18446744073709551616 is outside"),
    ({"offset": True}, "offset must be int, got bool"),
    ({"log": ""}, "log must be a non-empty str"),
    ({"epochs": None}, "epochs must be a list"),
    ({"epochs": [[1, True]]}, "epochs must be a list"),
    ({"epochs": [[1, 2], [3, -4]]}, "epochs must be a list"),
    ({"epochs": [(1, 2)]}, "epochs must be a list"),
    ({"requires": {"pulls": 1}}, "requires must map log names to offsets"),
    ({"requires": {"message": -1}}, "requires must map log names to offsets"),
    ({"requires": {"message": 1.0}}, "requires must map log names to offsets"),
    ({"requires": [["message", 1]]}, "requires must map log names to offsets"),
])
def test_a_fetch_answer_with_a_field_out_of_range_is_a_bad_request_naming_it(change, words):
    wire = FetchAnswer(5, "delay", 100, b"", 100, 0, 102, (), None).to_wire() | change
    with pytest.raises(BadRequest, match=words):
        parse_fetch_answer(wire)


@pytest.mark.parametrize("change,words", [
    ({"next_offset": 7}, "next_offset 7 is not offset 100"),
    ({"data": "text"}, "data must be bin"),
    ({"epochs": [[1]]}, "epochs must be a list"),
    ({"diverging": {"epoch": 1}}, "diverging must be"),
])
def test_a_malformed_fetch_answer_is_a_bad_request_naming_the_defect(change, words):
    wire = FetchAnswer(5, "delay", 100, b"ab", 102, 0, 102, (), None).to_wire() | change
    with pytest.raises(BadRequest, match=words):
        parse_fetch_answer(wire)


def test_a_snapshot_answer_reads_back_and_may_not_run_past_its_size():
    answer = SnapshotAnswer(3, "actions", 12, 4096, 10, 4, b"abcdef")
    assert parse_snapshot_answer(answer.to_wire()) == answer
    with pytest.raises(BadRequest, match="runs past its size"):
        parse_snapshot_answer(SnapshotAnswer(3, "actions", 12, 4096, 10, 5, b"abcdef").to_wire())
