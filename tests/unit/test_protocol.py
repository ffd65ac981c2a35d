"""The wire codec: framing, request parsing, responses and errors, fed as bytes."""

from __future__ import annotations

import dataclasses
import struct
import tracemalloc

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wire import errors, protocol
from wire.errors import (
    BadRequest,
    DelayOutOfRange,
    NotSupported,
    QmqError,
    TooLarge,
    error_from_wire,
)
from wire.limits import (
    MAX_ACK_RANGES,
    MAX_DELAY_MS,
    MAX_FRAME_BYTES,
    MAX_PULL_BATCH_MESSAGES,
    MAX_PULL_WAIT_MS,
    MAX_SEND_BATCH_MESSAGES,
    MAX_TAGS,
)
from wire.message import Message, encode_message
from wire.protocol import (
    MAX_SUBJECT_PREFIX_CHARS,
    Ack,
    Browse,
    Cancel,
    FrameDecoder,
    Heartbeat,
    Hello,
    Leave,
    Nack,
    Pull,
    Purge,
    Send,
    Subjects,
    browsed_message,
    decode_frame_payload,
    encode_frame,
    error_response,
    hello_response,
    parse_request,
    parse_response,
    pull_columns,
    pull_response,
    request_rid,
    cancel_result,
    delayed_send_result,
    send_result_error,
    send_result_ok,
    send_results_stored,
)

# --- framing ---

# Text that UTF-8 can encode (no lone surrogates).
texts = st.text(st.characters(blacklist_categories=("Cs",)), max_size=10)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | texts
    | st.binary(max_size=20)
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=10,
)
frames_maps = st.dictionaries(texts, values, max_size=6)


@given(st.lists(frames_maps, max_size=4))
def test_frames_fed_whole_come_back_equal_and_in_order(maps):
    stream = b"".join(encode_frame(m) for m in maps)
    assert FrameDecoder().feed(stream) == maps


@settings(max_examples=50)
@given(st.lists(frames_maps, min_size=1, max_size=3))
def test_frames_split_at_every_byte_boundary_come_back_equal(maps):
    stream = b"".join(encode_frame(m) for m in maps)
    for cut in range(len(stream) + 1):
        decoder = FrameDecoder()
        got = decoder.feed(stream[:cut]) + decoder.feed(stream[cut:])
        assert got == maps
        assert decoder.buffered_bytes == 0


@settings(max_examples=50)
@given(st.lists(frames_maps, min_size=1, max_size=3))
def test_frames_fed_one_byte_at_a_time_come_back_equal(maps):
    stream = b"".join(encode_frame(m) for m in maps)
    decoder = FrameDecoder()
    got = []
    for i in range(len(stream)):
        got += decoder.feed(stream[i : i + 1])
    assert got == maps


def test_a_frame_is_a_big_endian_length_then_a_msgpack_map():
    frame = encode_frame({"op": "hello"})
    payload = msgpack.packb({"op": "hello"})
    assert frame == struct.pack(">I", len(payload)) + payload


def test_a_truncated_frame_stays_buffered_until_the_rest_arrives():
    frame = encode_frame({"op": "x", "rid": 1})
    decoder = FrameDecoder()
    assert decoder.feed(frame[:2]) == []
    assert decoder.feed(frame[2:-1]) == []
    assert decoder.buffered_bytes == len(frame) - 1
    assert decoder.feed(frame[-1:]) == [{"op": "x", "rid": 1}]
    assert decoder.buffered_bytes == 0


def _frame_with_payload_bytes(size: int) -> bytes:
    """A frame whose msgpack payload is exactly ``size`` bytes (size >= 8)."""
    base = len(msgpack.packb({"b": b""}, use_bin_type=True))
    # The bin header grows as the body does (bin8 2 bytes, bin16 3, bin32 5).
    for header_extra in (0, 1, 3):
        body = b"x" * (size - base - header_extra)
        payload = msgpack.packb({"b": body}, use_bin_type=True)
        if len(payload) == size:
            return struct.pack(">I", size) + payload
    raise AssertionError(size)


@pytest.mark.parametrize("limit", [64, 1000])
def test_frame_size_is_accepted_up_to_the_decoder_limit_and_too_large_past_it(limit):
    for size in (limit - 1, limit):
        frame = _frame_with_payload_bytes(size)
        assert FrameDecoder(max_frame_bytes=limit).feed(frame) == [msgpack.unpackb(frame[4:])]
    with pytest.raises(TooLarge, match=f"frame of {limit + 1} bytes exceeds MAX_FRAME_BYTES {limit}"):
        FrameDecoder(max_frame_bytes=limit).feed(_frame_with_payload_bytes(limit + 1))


def test_frame_size_is_accepted_up_to_max_frame_bytes_and_too_large_past_it():
    for size in (MAX_FRAME_BYTES - 1, MAX_FRAME_BYTES):
        (got,) = FrameDecoder().feed(_frame_with_payload_bytes(size))
        assert len(got["b"]) > MAX_FRAME_BYTES - 16
    with pytest.raises(TooLarge, match="frame of 8388609 bytes exceeds MAX_FRAME_BYTES 8388608"):
        FrameDecoder().feed(struct.pack(">I", MAX_FRAME_BYTES + 1))


def test_encoding_a_frame_over_the_limit_is_too_large():
    encode_frame({"b": b"x" * 50}, max_frame_bytes=100)
    with pytest.raises(TooLarge, match="exceeds MAX_FRAME_BYTES 100"):
        encode_frame({"b": b"x" * 100}, max_frame_bytes=100)


def test_an_oversized_declared_length_is_refused_from_the_header_alone_without_allocating():
    decoder = FrameDecoder()
    tracemalloc.start()
    try:
        with pytest.raises(TooLarge, match="frame of 4294967295 bytes exceeds"):
            decoder.feed(b"\xff\xff\xff\xff" + b"x" * 100)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1024 * 1024
    assert decoder.buffered_bytes == 0


def test_a_failed_decoder_keeps_failing_because_the_stream_is_out_of_sync():
    decoder = FrameDecoder(max_frame_bytes=10)
    with pytest.raises(TooLarge):
        decoder.feed(struct.pack(">I", 11))
    assert decoder.failed
    with pytest.raises(TooLarge):
        decoder.feed(encode_frame({"a": 1}))


@pytest.mark.parametrize(
    "payload, words",
    [
        (msgpack.packb([1, 2]), "must be a msgpack map, got list"),
        (msgpack.packb("op"), "must be a msgpack map, got str"),
        (b"", "not valid msgpack"),
        (b"\xc1", "not valid msgpack"),
        (msgpack.packb({"a": 1}) + b"\x00", "not valid msgpack"),
        (msgpack.packb({1: "a"}), "not valid msgpack"),
        (msgpack.packb({b"op": "a"}, use_bin_type=True), "keys must be str, got bytes"),
        (b"\x81\xa1a\xa2\xff\xfe", "not valid msgpack"),  # invalid UTF-8 in a str
    ],
)
def test_a_frame_that_is_not_a_msgpack_map_with_str_keys_is_a_bad_request(payload, words):
    decoder = FrameDecoder()
    with pytest.raises(BadRequest, match=words):
        decoder.feed(struct.pack(">I", len(payload)) + payload)
    assert decoder.failed


@settings(max_examples=500)
@given(st.binary(max_size=200))
def test_random_bytes_never_raise_anything_but_a_qmq_error(data):
    decoder = FrameDecoder(max_frame_bytes=64)
    try:
        for frame in decoder.feed(data):
            try:
                parse_request(frame)
            except QmqError:
                pass
    except QmqError:
        pass


@settings(max_examples=300)
@given(st.binary(max_size=100))
def test_random_frame_payloads_never_raise_anything_but_a_qmq_error(payload):
    try:
        for frame in FrameDecoder().feed(struct.pack(">I", len(payload)) + payload):
            for check in (parse_request, parse_response):
                try:
                    check(frame)
                except QmqError:
                    pass
    except QmqError:
        pass


# --- requests ---

PAYLOAD = encode_message(Message("m-1", "order.created", b"x", created_at_ms=1))

VALID_REQUESTS = [
    Hello(rid=1, client_id="c-1", app="billing", token="secret", protocol=1),
    Hello(rid=2, client_id="c-1", app="billing", token=None, protocol=1),
    Send(rid=3, messages=[PAYLOAD, PAYLOAD]),
    Pull(
        rid=4, subject="order.created", group="billing", consumer_id="c-1", max_count=32,
        wait_ms=1000, tags=["vip"], start="earliest", broadcast=False,
    ),
    Pull(
        rid=5, subject="%retry%order.created%billing", group="billing", consumer_id="c-1",
        max_count=1, wait_ms=0, tags=[], start="latest", broadcast=True,
    ),
    Ack(rid=6, subject="s", group="g", consumer_id="c", ranges=[(0, 0), (3, 9)]),
    Nack(rid=7, subject="s", group="g", consumer_id="c", pull_seqs=[1, 5], retry_after_ms=10_000),
    Nack(rid=8, subject="s", group="g", consumer_id="c", pull_seqs=[1], retry_after_ms=None),
    Cancel(rid=9, ids=["m-1", "m-2"], deliver_at_ms=[1, 2]),
    Heartbeat(rid=10, consumer_id="c", subscriptions=[("s", "g"), ("%retry%s%g", "g")]),
    Subjects(rid=11, prefix="%dead%"),
    Browse(rid=12, subject="%dead%orders%billing", from_sequence=7, max_count=50),
    Browse(rid=13, subject="orders", from_sequence=None, max_count=1),
    Purge(rid=14, subject="%dead%orders%billing", through_sequence=41),
    Leave(rid=15, consumer_id="c", subscriptions=[("s", "g"), ("%retry%s%g", "g")]),
]


@pytest.mark.parametrize("req", VALID_REQUESTS, ids=lambda r: type(r).__name__)
def test_every_op_survives_encoding_framing_and_parsing(req):
    (frame,) = FrameDecoder().feed(encode_frame(_wire(req)))
    assert frame["op"] == req.op
    assert parse_request(frame) == req


def test_optional_pull_fields_take_their_documented_defaults():
    req = parse_request(
        {"op": "pull", "rid": 1, "subject": "s", "group": "g", "consumer_id": "c", "max_count": 5}
    )
    assert (req.wait_ms, req.tags, req.start, req.broadcast) == (0, [], "latest", False)


def test_unknown_request_fields_are_ignored():
    req = parse_request({"op": "cancel", "rid": 1, "ids": ["a"], "deliver_at_ms": [5], "future": {"x": 1}})
    assert req == Cancel(rid=1, ids=["a"], deliver_at_ms=[5])


def test_a_request_without_op_or_rid_is_a_bad_request():
    with pytest.raises(BadRequest, match="lacks field 'op'"):
        parse_request({"rid": 1})
    with pytest.raises(BadRequest, match="cancel request lacks field 'rid'"):
        parse_request({"op": "cancel", "ids": ["a"]})
    with pytest.raises(BadRequest, match="op must be str, got int"):
        parse_request({"op": 3, "rid": 1})
    with pytest.raises(BadRequest, match="rid must be int, got str"):
        parse_request({"op": "cancel", "rid": "1", "ids": ["a"]})
    with pytest.raises(BadRequest, match="rid must be int, got bool"):
        parse_request({"op": "cancel", "rid": True, "ids": ["a"]})
    with pytest.raises(BadRequest, match="outside"):
        parse_request({"op": "cancel", "rid": -1, "ids": ["a"]})


def test_an_unknown_op_is_a_bad_request_naming_the_op():
    with pytest.raises(BadRequest, match="unknown op 'publish'"):
        parse_request({"op": "publish", "rid": 1})


def test_the_rid_of_a_rejected_request_can_still_be_answered():
    assert request_rid({"op": "nope", "rid": 42}) == 42
    assert request_rid({"rid": "x"}) is None
    assert request_rid({}) is None
    assert request_rid({"rid": True}) is None


def _wire(req) -> dict:
    """The wire map of a typed request: the inverse of ``parse_request`` (clients write their
    maps directly; this only serves the round-trip tests)."""
    frame = {"op": req.op}
    for field in dataclasses.fields(req):
        value = getattr(req, field.name)
        if isinstance(value, list):
            value = [list(v) if isinstance(v, tuple) else v for v in value]
        frame[field.name] = value
    return frame


@pytest.mark.parametrize(
    "base, field, value, words",
    [
        (0, "client_id", 5, "hello.client_id must be str, got int"),
        (0, "app", None, "hello.app must be str, got NoneType"),
        (0, "token", 1, "hello.token must be str or nil, got int"),
        (0, "protocol", "1", "hello.protocol must be int, got str"),
        (0, "client_id", "", "hello.client_id must not be empty"),
        (2, "messages", PAYLOAD, "send.messages must be list, got bytes"),
        (2, "messages", ["text"], "send.messages must hold bin payloads, got str"),
        (2, "messages", [], "send.messages must not be empty"),
        (3, "subject", 1, "subject must be str, got int"),
        (3, "subject", "bad subject", "not a valid name"),
        (3, "group", "%retry%a%b", "not a valid name"),
        (3, "consumer_id", b"c", "pull.consumer_id must be str, got bytes"),
        (3, "max_count", 1.5, "pull.max_count must be int, got float"),
        (3, "max_count", 0, "pull.max_count must be >= 1, got 0"),
        (3, "wait_ms", None, "pull.wait_ms must be int, got NoneType"),
        (3, "wait_ms", -1, "pull.wait_ms must be >= 0, got -1"),
        (3, "tags", "vip", "tags must be list, got str"),
        (3, "tags", [1], "tag must be str, got int"),
        (3, "start", "middle", "pull.start must be 'latest' or 'earliest'"),
        (3, "broadcast", 1, "pull.broadcast must be bool, got int"),
        (5, "ranges", [[3, 2]], r"ack range \[3, 2\] has first > last"),
        (5, "ranges", [[1]], "ack.ranges must hold"),
        (5, "ranges", [[-1, 2]], "ack.ranges must hold"),
        (5, "ranges", [[1, "2"]], "ack.ranges must hold"),
        (5, "ranges", [], "ack.ranges must not be empty"),
        (5, "ranges", {"a": 1}, "ack.ranges must be list, got dict"),
        (6, "pull_seqs", ["1"], "nack.pull_seqs must hold non-negative int, got str"),
        (6, "pull_seqs", [], "nack.pull_seqs must not be empty"),
        (6, "retry_after_ms", "10s", "nack.retry_after_ms must be int or nil, got str"),
        (6, "retry_after_ms", -5, "nack.retry_after_ms must be >= 0, got -5"),
        (8, "ids", "m-1", "cancel.ids must be list, got str"),
        (8, "ids", [1], "message id must be str, got int"),
        (8, "ids", [], "cancel.ids must not be empty"),
        (9, "subscriptions", [["s"]], "heartbeat.subscriptions must hold"),
        (9, "subscriptions", [["s", 1]], "group must be str, got int"),
        (9, "consumer_id", None, "heartbeat.consumer_id must be str, got NoneType"),
        (10, "prefix", 5, "subjects.prefix must be str, got int"),
        (10, "prefix", None, "subjects.prefix must be str, got NoneType"),
        (11, "subject", "bad subject", "not a valid name"),
        (11, "subject", "%lost%a%b", "starts with '%' but is not"),
        (11, "from_sequence", "7", "browse.from_sequence must be int or nil, got str"),
        (11, "from_sequence", -1, r"browse.from_sequence -1 is outside 0\.\."),
        (11, "max_count", 0, "browse.max_count must be >= 1, got 0"),
        (11, "max_count", True, "browse.max_count must be int, got bool"),
        (13, "subject", "orders", "'orders' is not a dead-letter subject"),
        (13, "subject", "%retry%orders%billing", "is not a dead-letter subject"),
        (13, "through_sequence", None, "purge.through_sequence must be int, got NoneType"),
        (13, "through_sequence", -1, r"purge.through_sequence -1 is outside 0\.\."),
        (14, "subscriptions", [["s"]], "leave.subscriptions must hold"),
        (14, "subscriptions", [["bad subject", "g"]], "not a valid name"),
        (14, "consumer_id", 7, "leave.consumer_id must be str, got int"),
    ],
)
def test_a_wrong_field_is_a_bad_request_naming_the_field_and_its_type(base, field, value, words):
    frame = _wire(VALID_REQUESTS[base])
    frame[field] = value
    with pytest.raises(BadRequest, match=words):
        parse_request(frame)


@pytest.mark.parametrize("base", range(len(VALID_REQUESTS)))
def test_a_missing_required_field_is_a_bad_request_naming_it(base):
    optional = {"token", "wait_ms", "tags", "start", "broadcast", "retry_after_ms", "prefix",
                "from_sequence", "compact"}
    full = _wire(VALID_REQUESTS[base])
    for field in set(full) - {"op", "rid"} - optional:
        frame = dict(full)
        del frame[field]
        with pytest.raises(BadRequest, match=field):
            parse_request(frame)


def test_a_hello_with_another_protocol_version_is_not_supported():
    frame = _wire(VALID_REQUESTS[0])
    frame["protocol"] = 2
    with pytest.raises(NotSupported, match="protocol version 2 is not supported"):
        parse_request(frame)


# --- request limits: max-1, max, max+1 ---


def test_send_batch_size_is_accepted_up_to_the_limit_and_too_large_past_it():
    for n in (MAX_SEND_BATCH_MESSAGES - 1, MAX_SEND_BATCH_MESSAGES):
        assert len(parse_request({"op": "send", "rid": 1, "messages": [PAYLOAD] * n}).messages) == n
    with pytest.raises(
        TooLarge, match="send batch of 257 messages exceeds MAX_SEND_BATCH_MESSAGES 256"
    ):
        parse_request({"op": "send", "rid": 1, "messages": [PAYLOAD] * (MAX_SEND_BATCH_MESSAGES + 1)})


def test_a_send_asks_for_the_compact_answer_only_with_compact_true_and_a_non_bool_is_refused():
    frame = {"op": "send", "rid": 1, "messages": [PAYLOAD]}
    assert parse_request(frame).compact is False
    assert parse_request({**frame, "compact": True}).compact is True
    assert parse_request({**frame, "compact": False}).compact is False
    with pytest.raises(BadRequest, match="compact"):
        parse_request({**frame, "compact": 1})
    assert protocol.send_stored_answer(3) == {"stored": 3}


def _pull(**changes) -> dict:
    frame = _wire(VALID_REQUESTS[3])
    frame.update(changes)
    return frame


def test_pull_max_count_is_accepted_up_to_the_limit_and_rejected_past_it():
    for n in (MAX_PULL_BATCH_MESSAGES - 1, MAX_PULL_BATCH_MESSAGES):
        assert parse_request(_pull(max_count=n)).max_count == n
    with pytest.raises(
        BadRequest, match="pull.max_count 1025 exceeds MAX_PULL_BATCH_MESSAGES 1024"
    ):
        parse_request(_pull(max_count=MAX_PULL_BATCH_MESSAGES + 1))


def test_pull_wait_is_accepted_up_to_the_limit_and_rejected_past_it():
    for ms in (MAX_PULL_WAIT_MS - 1, MAX_PULL_WAIT_MS):
        assert parse_request(_pull(wait_ms=ms)).wait_ms == ms
    with pytest.raises(BadRequest, match="pull.wait_ms 60001 ms exceeds MAX_PULL_WAIT_MS 60000"):
        parse_request(_pull(wait_ms=MAX_PULL_WAIT_MS + 1))


def test_pull_tag_filter_size_is_accepted_up_to_the_limit_and_rejected_past_it():
    for n in (MAX_TAGS - 1, MAX_TAGS):
        assert len(parse_request(_pull(tags=[f"t{i}" for i in range(n)])).tags) == n
    with pytest.raises(BadRequest, match="pull tag filter has 11 tags, exceeds MAX_TAGS 10"):
        parse_request(_pull(tags=[f"t{i}" for i in range(MAX_TAGS + 1)]))


def test_ack_range_count_is_accepted_up_to_the_limit_and_too_large_past_it():
    def ack(n):
        frame = _wire(VALID_REQUESTS[5])
        frame["ranges"] = [[i * 2, i * 2 + 1] for i in range(n)]
        return frame

    for n in (MAX_ACK_RANGES - 1, MAX_ACK_RANGES):
        assert len(parse_request(ack(n)).ranges) == n
    with pytest.raises(TooLarge, match="ack of 1025 ranges exceeds MAX_ACK_RANGES 1024"):
        parse_request(ack(MAX_ACK_RANGES + 1))


def test_nack_seq_count_is_accepted_up_to_the_limit_and_too_large_past_it():
    def nack(n):
        frame = _wire(VALID_REQUESTS[6])
        frame["pull_seqs"] = list(range(n))
        return frame

    for n in (MAX_ACK_RANGES - 1, MAX_ACK_RANGES):
        assert len(parse_request(nack(n)).pull_seqs) == n
    with pytest.raises(TooLarge, match="nack of 1025 pull_seqs exceeds MAX_ACK_RANGES 1024"):
        parse_request(nack(MAX_ACK_RANGES + 1))


def test_nack_retry_delay_is_accepted_up_to_the_horizon_and_out_of_range_past_it():
    frame = _wire(VALID_REQUESTS[6])
    for ms in (MAX_DELAY_MS - 1, MAX_DELAY_MS):
        frame["retry_after_ms"] = ms
        assert parse_request(frame).retry_after_ms == ms
    frame["retry_after_ms"] = MAX_DELAY_MS + 1
    with pytest.raises(
        DelayOutOfRange,
        match=f"nack.retry_after_ms {MAX_DELAY_MS + 1} ms exceeds MAX_DELAY_MS {MAX_DELAY_MS}",
    ):
        parse_request(frame)


def test_browse_max_count_is_accepted_up_to_the_limit_and_rejected_past_it():
    frame = _wire(VALID_REQUESTS[11])
    for count in (MAX_PULL_BATCH_MESSAGES - 1, MAX_PULL_BATCH_MESSAGES):
        assert parse_request({**frame, "max_count": count}).max_count == count
    with pytest.raises(BadRequest, match=f"browse.max_count {MAX_PULL_BATCH_MESSAGES + 1} "
                                         f"exceeds MAX_PULL_BATCH_MESSAGES"):
        parse_request({**frame, "max_count": MAX_PULL_BATCH_MESSAGES + 1})


def test_subjects_prefix_length_is_accepted_up_to_the_limit_and_rejected_past_it():
    for size in (MAX_SUBJECT_PREFIX_CHARS - 1, MAX_SUBJECT_PREFIX_CHARS):
        req = parse_request({"op": "subjects", "rid": 1, "prefix": "a" * size})
        assert len(req.prefix) == size
    with pytest.raises(BadRequest, match=f"subjects.prefix of {MAX_SUBJECT_PREFIX_CHARS + 1} "
                                         "characters exceeds MAX_SUBJECT_PREFIX_CHARS"):
        parse_request({"op": "subjects", "rid": 1, "prefix": "a" * (MAX_SUBJECT_PREFIX_CHARS + 1)})


def test_the_longest_internal_subject_fits_the_subjects_prefix_limit():
    longest = "%retry%" + "s" * 200 + "%" + "g" * 200
    assert len(longest) == MAX_SUBJECT_PREFIX_CHARS
    assert parse_request({"op": "subjects", "rid": 1, "prefix": longest}).prefix == longest


def test_optional_admin_fields_take_their_documented_defaults():
    assert parse_request({"op": "subjects", "rid": 1}) == Subjects(rid=1, prefix="")
    browse = parse_request({"op": "browse", "rid": 2, "subject": "s", "max_count": 3})
    assert browse == Browse(rid=2, subject="s", from_sequence=None, max_count=3)


def test_purge_sequences_are_accepted_up_to_u64_max_and_rejected_past_it():
    frame = _wire(VALID_REQUESTS[13])
    assert parse_request({**frame, "through_sequence": 2**64 - 1}).through_sequence == 2**64 - 1
    with pytest.raises(BadRequest, match="outside"):
        parse_request({**frame, "through_sequence": 2**64})


def test_a_browse_entry_has_the_documented_shape():
    assert browsed_message(5, b"p") == {"sequence": 5, "payload": b"p"}


def test_cancel_batch_size_is_accepted_up_to_the_limit_and_too_large_past_it():
    for n in (MAX_SEND_BATCH_MESSAGES - 1, MAX_SEND_BATCH_MESSAGES):
        assert len(parse_request({"op": "cancel", "rid": 1, "ids": ["a"] * n,
                                  "deliver_at_ms": [1] * n}).ids) == n
    with pytest.raises(TooLarge, match="cancel of 257 ids exceeds MAX_SEND_BATCH_MESSAGES 256"):
        parse_request({"op": "cancel", "rid": 1, "ids": ["a"] * (MAX_SEND_BATCH_MESSAGES + 1)})


# --- responses and errors ---

WIRE_CLASSES = list(errors.WIRE_ERRORS.values())


@pytest.mark.parametrize("cls", WIRE_CLASSES, ids=lambda c: c.code)
def test_an_error_response_comes_back_as_the_same_error_class_with_its_rid(cls):
    frame = error_response(17, cls("it went wrong"))
    (decoded,) = FrameDecoder().feed(encode_frame(frame))
    with pytest.raises(cls, match="it went wrong") as info:
        parse_response(decoded)
    assert info.value.rid == 17
    assert info.value.code == cls.code
    assert info.value.to_wire() == {"code": cls.code, "message": "it went wrong"}


def test_the_wire_codes_and_retriable_flags_are_the_documented_ones():
    got = {cls.code: cls.retriable for cls in WIRE_CLASSES}
    assert got == {
        "bad_request": False, "unauthorized": False, "forbidden": False, "too_large": False,
        "delay_out_of_range": False, "readonly": True, "overloaded": True, "not_found": False,
        "not_supported": False, "internal": True, "not_master": True, "unavailable": True,
        "stale_epoch": False, "not_enough_replicas": True, "unreadable_record": False,
    }
    assert errors.ConnectionLost.retriable and errors.NoRoute.retriable
    assert errors.ConnectionLost.code not in errors.WIRE_ERRORS
    assert all(issubclass(cls, QmqError) for cls in WIRE_CLASSES)


def test_an_error_for_an_unreadable_rid_carries_a_nil_rid():
    with pytest.raises(TooLarge) as info:
        parse_response(error_response(None, TooLarge("frame too big")))
    assert info.value.rid is None


def test_an_unknown_error_code_from_a_newer_server_keeps_its_code():
    err = error_from_wire("quota_exceeded", "slow down")
    assert isinstance(err, QmqError)
    assert err.code == "quota_exceeded"
    assert not err.retriable
    assert err.to_wire() == {"code": "quota_exceeded", "message": "slow down"}


def test_a_success_response_returns_its_rid_and_the_rest_of_the_map():
    frame = {"rid": 3, **hello_response(kind="realtime", group="rt-1", node="n-1",
                                        role="slave", epoch=4)}
    assert parse_response(frame) == (
        3, {"ok": True, "server": {"kind": "realtime", "group": "rt-1", "node": "n-1",
                                   "role": "slave", "epoch": 4}}
    )


def test_send_cancel_and_pull_result_entries_have_the_documented_shape():
    assert send_result_ok("a") == {"id": "a", "status": "stored"}
    assert send_result_ok("a", duplicate=True) == {"id": "a", "status": "duplicate"}
    assert send_results_stored(iter(["a", "b"])) == [send_result_ok("a"), send_result_ok("b")]
    assert delayed_send_result("a", 5) == {"id": "a", "status": "stored", "deliver_at_ms": 5}
    assert cancel_result("a", "cancelled") == {"id": "a", "status": "cancelled"}
    assert send_result_error("a", TooLarge("big")) == {
        "id": "a", "error": {"code": "too_large", "message": "big"}
    }
    assert pull_response([7, 8], [b"p", b"q"], [2, 0]) == {
        "pull_seqs": [7, 8], "payloads": [b"p", b"q"], "redelivered": [2, 0]}


def test_a_pull_response_is_read_back_as_its_columns():
    _, answer = parse_response(decode_frame_payload(encode_frame(
        {"rid": 1, **pull_response((7, 8), [b"p", b"q"], [2, 0])})[4:]))
    assert pull_columns(answer) == ([7, 8], [b"p", b"q"], [2, 0])
    assert pull_columns({"pull_seqs": [], "payloads": [], "redelivered": []}) == ([], [], [])


@pytest.mark.parametrize("answer, words", [
    ({"payloads": [], "redelivered": []}, "pull_seqs must be an array, got NoneType"),
    ({"pull_seqs": [1], "payloads": {1: b"p"}, "redelivered": [0]}, "payloads must be an array"),
    ({"pull_seqs": [1], "payloads": [b"p"]}, "redelivered must be an array"),
    ({"pull_seqs": [1, 2], "payloads": [b"p"], "redelivered": [0]}, "differ in length"),
    ({"pull_seqs": [1, "2"], "payloads": [b"p", b"q"], "redelivered": [0, 0]},
     "pull_seqs must hold int, got str"),
    ({"pull_seqs": [1], "payloads": [b"p"], "redelivered": [True]},
     "redelivered must hold int, got bool"),
])
def test_a_malformed_pull_response_is_a_bad_request_naming_the_defect(answer, words):
    with pytest.raises(BadRequest, match=words):
        pull_columns(answer)


@pytest.mark.parametrize(
    "frame, words",
    [
        ({"ok": True}, "lacks field 'rid'"),
        ({"rid": "1"}, "rid must be int or nil, got str"),
        ({"rid": None, "ok": True}, "must have an int rid"),
        ({"rid": 1, "error": "boom"}, "response error must be"),
        ({"rid": 1, "error": {"code": 1, "message": "m"}}, "response error must be"),
    ],
)
def test_a_malformed_response_is_a_bad_request(frame, words):
    with pytest.raises(BadRequest, match=words):
        parse_response(frame)


def test_error_messages_quote_the_value_and_the_limit_with_units():
    with pytest.raises(TooLarge) as info:
        FrameDecoder(max_frame_bytes=100).feed(struct.pack(">I", 5_242_880))
    assert str(info.value) == "frame of 5242880 bytes exceeds MAX_FRAME_BYTES 100"


def test_a_cancel_needs_one_due_time_per_id():
    with pytest.raises(BadRequest, match="cancel.deliver_at_ms has 1 entries, cancel.ids has 2"):
        parse_request({"op": "cancel", "rid": 1, "ids": ["a", "b"], "deliver_at_ms": [5]})
    with pytest.raises(BadRequest, match="lacks field 'deliver_at_ms'"):
        parse_request({"op": "cancel", "rid": 1, "ids": ["a"]})


def test_a_cancel_due_time_must_be_a_non_negative_int():
    for bad in (-1, "5", 1.5, None):
        with pytest.raises(BadRequest, match="cancel.deliver_at_ms must hold non-negative int"):
            parse_request({"op": "cancel", "rid": 1, "ids": ["a"], "deliver_at_ms": [bad]})


def _pull_frame(**fields) -> dict:
    frame = {"op": "pull", "rid": 1, "subject": "orders", "group": "billing",
             "consumer_id": "c-1", "max_count": 32, "wait_ms": 5000}
    frame.update(fields)
    return frame


def test_a_consumer_seen_before_is_checked_as_strictly_as_a_new_one():
    assert parse_request(_pull_frame()).consumer_id == "c-1"  # now remembered as valid
    with pytest.raises(BadRequest, match="pull.consumer_id of 201 characters"):
        parse_request(_pull_frame(consumer_id="c" * 201))
    with pytest.raises(BadRequest, match="subject must be str, got bytes"):
        parse_request(_pull_frame(subject=b"orders"))
    with pytest.raises(BadRequest, match="not a valid name"):
        parse_request(_pull_frame(group="bill ing"))
    with pytest.raises(BadRequest, match="lacks field 'group'"):
        parse_request({k: v for k, v in _pull_frame().items() if k != "group"})
    with pytest.raises(BadRequest, match="pull.max_count 1025 exceeds"):
        parse_request(_pull_frame(max_count=1025))
    with pytest.raises(BadRequest, match="pull.start must be str, got NoneType"):
        parse_request(_pull_frame(start=None))


def test_the_memory_of_valid_consumers_stays_bounded():
    for n in range(protocol.VALID_CONSUMER_FIELDS_MAX + 10):
        parse_request(_pull_frame(consumer_id=f"c-{n}"))
    assert 0 < len(protocol._VALID_CONSUMER_FIELDS) <= protocol.VALID_CONSUMER_FIELDS_MAX


@pytest.mark.parametrize("ranges, words", [
    ([[1, 2], [True, 3]], "must hold \\[first, last\\] pairs"),
    ([[1, 2], [3]], "must hold \\[first, last\\] pairs"),
    ([[1, 2], [-1, 3]], "must hold \\[first, last\\] pairs"),
    ([[1, 2], [0, 2**64]], "must hold \\[first, last\\] pairs"),
    ([[1, 2], (3, 4)], "must hold \\[first, last\\] pairs"),
    ([[5, 9], [9, 5]], "ack range \\[9, 5\\] has first > last"),
])
def test_a_bad_ack_range_after_good_ones_is_refused_naming_it(ranges, words):
    frame = {"op": "ack", "rid": 1, "subject": "s", "group": "g", "consumer_id": "c",
             "ranges": ranges}
    with pytest.raises(BadRequest, match=words):
        parse_request(frame)
    frame["ranges"] = [[0, 0], [3, 2**64 - 1]]
    assert parse_request(frame).ranges == [(0, 0), (3, 2**64 - 1)]
