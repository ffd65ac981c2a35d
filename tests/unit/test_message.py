"""The message model: payload round-trips, malformed payloads, names, and every message limit."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wire.errors import BadRequest, DelayOutOfRange, QmqError, TooLarge
from wire.limits import (
    MAX_BODY_BYTES,
    MAX_DELAY_MS,
    MAX_MESSAGE_ID_CHARS,
    MAX_PROPERTIES,
    MAX_PROPERTY_KEY_BYTES,
    MAX_PROPERTY_VALUE_BYTES,
    MAX_SUBJECT_CHARS,
    MAX_TAG_BYTES,
    MAX_TAGS,
)
from wire.message import (
    InternalSubject,
    Message,
    dead_subject,
    decode_message,
    decode_message_fields,
    encode_message,
    encode_plain_message,
    message_from_fields,
    new_message_id,
    parse_internal_subject,
    retry_subject,
    tag_hash,
    validate_group,
    validate_message,
    validate_subject,
)

NOW_MS = 1_700_000_000_000

names = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9._-]{0,30}\Z")
# Text that UTF-8 can encode (no lone surrogates).
texts = st.text(st.characters(blacklist_categories=("Cs",)), max_size=20)
ints64 = st.integers(min_value=0, max_value=2**63 - 1)

messages = st.builds(
    Message,
    id=st.from_regex(r"\A[\x21-\x7e]{1,40}\Z"),
    subject=names,
    body=st.binary(max_size=200),
    tags=st.lists(texts, max_size=5).map(tuple),
    properties=st.dictionaries(texts, texts, max_size=5),
    created_at_ms=ints64,
    deliver_at_ms=st.none() | ints64,
    retries=st.integers(min_value=0, max_value=1000),
    expire_at_ms=st.none() | ints64,
)


def a_message(**changes) -> Message:
    fields = dict(id="m-1", subject="order.created", body=b"hello", created_at_ms=NOW_MS)
    fields.update(changes)
    return Message(**fields)


# --- payload round-trips ---


@given(messages)
def test_a_decoded_payload_equals_the_message_that_was_encoded(msg):
    assert decode_message(encode_message(msg)) == msg


@given(messages)
def test_encoding_is_deterministic_so_a_resend_carries_the_same_bytes(msg):
    assert encode_message(msg) == encode_message(decode_message(encode_message(msg)))


def test_the_payload_uses_the_documented_one_letter_keys():
    msg = a_message(
        tags=("vip",), properties={"k": "v"}, deliver_at_ms=5, retries=2, expire_at_ms=9
    )
    payload = msgpack.unpackb(encode_message(msg), raw=False)
    assert payload == {
        "i": "m-1", "s": "order.created", "b": b"hello", "c": NOW_MS,
        "t": ["vip"], "p": {"k": "v"}, "d": 5, "r": 2, "x": 9,
    }


def test_empty_and_default_fields_are_left_out_of_the_payload():
    payload = msgpack.unpackb(encode_message(a_message()), raw=False)
    assert set(payload) == {"i", "s", "b", "c"}


def test_unknown_payload_keys_from_a_newer_producer_are_ignored():
    raw = msgpack.packb({"i": "a", "s": "x", "b": b"", "c": 1, "zz": [1, 2]}, use_bin_type=True)
    assert decode_message(raw) == Message("a", "x", b"", created_at_ms=1)


def test_tags_given_as_a_list_are_stored_as_a_tuple_and_properties_are_copied():
    props = {"a": "1"}
    msg = Message("a", "x", b"", tags=["t1"], properties=props)
    props["b"] = "2"
    assert msg.tags == ("t1",)
    assert msg.properties == {"a": "1"}


def test_messages_can_be_kept_in_sets_despite_their_properties_dict():
    assert len({a_message(properties={"k": "v"}), a_message(properties={"k": "v"})}) == 1


def test_message_create_stamps_the_given_time_and_a_fresh_id():
    one = Message.create("s", b"x", now_ms=NOW_MS)
    two = Message.create("s", b"x", now_ms=NOW_MS)
    assert one.created_at_ms == NOW_MS
    assert one.id != two.id


# --- malformed payloads ---


MALFORMED_PAYLOADS = [
        ([1, 2], "map"),
        ({"s": "x", "b": b"", "c": 1}, "id"),
        ({"i": "a", "b": b"", "c": 1}, "subject"),
        ({"i": "a", "s": "x", "c": 1}, "body"),
        ({"i": "a", "s": "x", "b": b""}, "created_at_ms"),
        ({"i": 7, "s": "x", "b": b"", "c": 1}, "id must be str, got int"),
        ({"i": "a", "s": "x", "b": "text", "c": 1}, "body must be bytes, got str"),
        ({"i": "a", "s": "x", "b": b"", "c": True}, "created_at_ms must be int, got bool"),
        ({"i": "a", "s": "x", "b": b"", "c": 1, "t": "vip"}, "tags must be list"),
        ({"i": "a", "s": "x", "b": b"", "c": 1, "t": [1]}, "tags must hold str"),
        ({"i": "a", "s": "x", "b": b"", "c": 1, "p": {"k": 1}}, "properties"),
        ({"i": "a", "s": "x", "b": b"", "c": 1, "d": "soon"}, "deliver_at_ms must be int"),
        ({"i": "a", "s": "x", "b": b"", "c": 1, "r": None}, "retries must be int"),
]


@pytest.mark.parametrize("payload, words", MALFORMED_PAYLOADS)
def test_a_malformed_payload_is_a_bad_request_naming_what_is_wrong(payload, words):
    with pytest.raises(BadRequest, match=words):
        decode_message(msgpack.packb(payload, use_bin_type=True))


@given(messages)
def test_the_consumers_field_map_holds_the_message_that_was_encoded(msg):
    assert message_from_fields(decode_message_fields(encode_message(msg))) == msg


@pytest.mark.parametrize("payload, words", MALFORMED_PAYLOADS)
def test_the_consumers_field_map_refuses_what_decode_message_refuses_in_its_words(payload, words):
    data = msgpack.packb(payload, use_bin_type=True)
    with pytest.raises(BadRequest, match=words) as fast:
        decode_message_fields(data)
    with pytest.raises(BadRequest) as full:
        decode_message(data)
    assert fast.value.message == full.value.message


field_values = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1), texts,
    st.binary(max_size=8), st.floats(allow_nan=False), st.lists(texts | ints64, max_size=3),
    st.dictionaries(texts, texts | ints64, max_size=2))
payload_maps = st.dictionaries(st.sampled_from("isbctpdrxz"), field_values, max_size=9)


@settings(max_examples=500)
@given(payload_maps | st.binary(max_size=32).map(lambda data: {"raw": data}))
def test_the_consumers_field_map_agrees_with_decode_message_on_any_payload(shape):
    data = shape["raw"] if set(shape) == {"raw"} else msgpack.packb(shape, use_bin_type=True)
    try:
        expected = decode_message(data)
    except BadRequest as exc:
        with pytest.raises(BadRequest) as fast:
            decode_message_fields(data)
        assert fast.value.message == exc.message
    else:
        assert message_from_fields(decode_message_fields(data)) == expected


def test_bytes_that_are_not_msgpack_are_a_bad_request():
    with pytest.raises(BadRequest, match="not valid msgpack"):
        decode_message(b"\xc1")
    with pytest.raises(BadRequest, match="not valid msgpack"):
        decode_message(b"")


@settings(max_examples=300)
@given(st.binary(max_size=64))
def test_random_bytes_never_raise_anything_but_a_qmq_error(data):
    try:
        decode_message(data)
    except QmqError:
        pass


def test_encoding_a_message_with_a_wrong_field_type_is_a_bad_request():
    with pytest.raises(BadRequest, match="body must be bytes, got str"):
        encode_message(a_message(body="text"))
    with pytest.raises(BadRequest, match="retries must be int, got bool"):
        encode_message(a_message(retries=True))


# --- ids and hashes ---


def test_new_message_ids_are_unique_valid_ids():
    ids = {new_message_id() for _ in range(1000)}
    assert len(ids) == 1000
    for message_id in ids:
        validate_message(a_message(id=message_id))


def test_the_tag_hash_is_a_stable_unsigned_32_bit_crc():
    # Golden values: ConsumerLog files store these hashes, so they must never change.
    assert tag_hash("vip") == 0x4B076C22
    assert tag_hash("order") == 0xF5299398
    assert tag_hash("") == 0
    assert 0 <= tag_hash("\u00e9" * 64) < 2**32


# --- names ---


@pytest.mark.parametrize("name", ["a", "order.created", "A-1_b.c", "9", "x" * MAX_SUBJECT_CHARS])
def test_valid_subject_and_group_names_are_accepted(name):
    validate_subject(name)
    validate_group(name)


@pytest.mark.parametrize("name", ["", ".a", "-a", "a b", "a/b", "a%b", "caf\u00e9", "a\n"])
def test_invalid_names_are_bad_requests(name):
    with pytest.raises(BadRequest, match="not a valid name"):
        validate_subject(name)
    with pytest.raises(BadRequest, match="not a valid name"):
        validate_group(name)


def test_a_name_that_is_not_a_str_is_a_bad_request_naming_its_type():
    with pytest.raises(BadRequest, match="subject must be str, got int"):
        validate_subject(5)
    with pytest.raises(BadRequest, match="group must be str, got NoneType"):
        validate_group(None)


def test_subject_length_is_accepted_up_to_the_limit_and_rejected_past_it():
    validate_subject("s" * (MAX_SUBJECT_CHARS - 1))
    validate_subject("s" * MAX_SUBJECT_CHARS)
    with pytest.raises(BadRequest, match=f"subject of 201 characters exceeds MAX_SUBJECT_CHARS 200"):
        validate_subject("s" * (MAX_SUBJECT_CHARS + 1))
    with pytest.raises(BadRequest, match="group of 201 characters exceeds MAX_SUBJECT_CHARS 200"):
        validate_group("g" * (MAX_SUBJECT_CHARS + 1))


def test_retry_and_dead_subjects_are_built_and_parsed_back():
    assert retry_subject("order.created", "billing") == "%retry%order.created%billing"
    assert dead_subject("order.created", "billing") == "%dead%order.created%billing"
    assert parse_internal_subject("%retry%order.created%billing") == InternalSubject(
        "retry", "order.created", "billing"
    )
    assert parse_internal_subject("%dead%a%b") == ("dead", "a", "b")
    assert parse_internal_subject("order.created") is None


@given(names, names)
def test_internal_subjects_round_trip_through_the_parser(subject, group):
    assert parse_internal_subject(retry_subject(subject, group)) == ("retry", subject, group)
    assert parse_internal_subject(dead_subject(subject, group)) == ("dead", subject, group)


def test_internal_subjects_need_permission_and_a_valid_form():
    with pytest.raises(BadRequest, match="internal"):
        validate_subject("%retry%a%b")
    validate_subject("%retry%a%b", allow_internal=True)
    for bad in ["%other%a%b", "%retry%a", "%retry%a%b%c", "%dead%%b", "%retry%a% b"]:
        with pytest.raises(BadRequest):
            validate_subject(bad, allow_internal=True)


def test_internal_names_cannot_be_built_from_invalid_parts():
    with pytest.raises(BadRequest, match="not a valid name"):
        retry_subject("a%b", "g")
    with pytest.raises(BadRequest, match="group"):
        dead_subject("a", "")
    with pytest.raises(BadRequest):
        validate_group("%retry%a%b")


# --- limits: max-1, max, max+1 ---


def test_body_size_is_accepted_up_to_the_limit_and_too_large_past_it():
    validate_message(a_message(body=b"x" * (MAX_BODY_BYTES - 1)))
    validate_message(a_message(body=b"x" * MAX_BODY_BYTES))
    with pytest.raises(TooLarge, match="message body of 4194305 bytes exceeds MAX_BODY_BYTES 4194304"):
        validate_message(a_message(body=b"x" * (MAX_BODY_BYTES + 1)))


def test_tag_count_is_accepted_up_to_the_limit_and_rejected_past_it():
    validate_message(a_message(tags=tuple(f"t{i}" for i in range(MAX_TAGS - 1))))
    validate_message(a_message(tags=tuple(f"t{i}" for i in range(MAX_TAGS))))
    with pytest.raises(BadRequest, match="message has 11 tags, exceeds MAX_TAGS 10"):
        validate_message(a_message(tags=tuple(f"t{i}" for i in range(MAX_TAGS + 1))))


def test_tag_size_is_counted_in_utf8_bytes_up_to_the_limit():
    validate_message(a_message(tags=("t" * (MAX_TAG_BYTES - 1),)))
    validate_message(a_message(tags=("t" * MAX_TAG_BYTES,)))
    validate_message(a_message(tags=("\u00e9" * (MAX_TAG_BYTES // 2),)))
    with pytest.raises(BadRequest, match="tag of 65 bytes exceeds MAX_TAG_BYTES 64"):
        validate_message(a_message(tags=("t" * (MAX_TAG_BYTES + 1),)))
    with pytest.raises(BadRequest, match="tag of 66 bytes exceeds MAX_TAG_BYTES 64"):
        validate_message(a_message(tags=("\u00e9" * 33,)))


def test_an_empty_tag_is_a_bad_request():
    with pytest.raises(BadRequest, match="tag must not be empty"):
        validate_message(a_message(tags=("",)))


def test_property_count_is_accepted_up_to_the_limit_and_too_large_past_it():
    def props(n):
        return {f"k{i}": "v" for i in range(n)}

    validate_message(a_message(properties=props(MAX_PROPERTIES - 1)))
    validate_message(a_message(properties=props(MAX_PROPERTIES)))
    with pytest.raises(TooLarge, match="message has 65 properties, exceeds MAX_PROPERTIES 64"):
        validate_message(a_message(properties=props(MAX_PROPERTIES + 1)))


def test_property_key_size_is_accepted_up_to_the_limit_and_too_large_past_it():
    validate_message(a_message(properties={"k" * (MAX_PROPERTY_KEY_BYTES - 1): "v"}))
    validate_message(a_message(properties={"k" * MAX_PROPERTY_KEY_BYTES: "v"}))
    with pytest.raises(
        TooLarge, match="property key of 129 bytes exceeds MAX_PROPERTY_KEY_BYTES 128"
    ):
        validate_message(a_message(properties={"k" * (MAX_PROPERTY_KEY_BYTES + 1): "v"}))


def test_property_value_size_is_accepted_up_to_the_limit_and_too_large_past_it():
    validate_message(a_message(properties={"k": "v" * (MAX_PROPERTY_VALUE_BYTES - 1)}))
    validate_message(a_message(properties={"k": "v" * MAX_PROPERTY_VALUE_BYTES}))
    with pytest.raises(
        TooLarge, match="property 'k' value of 4097 bytes exceeds MAX_PROPERTY_VALUE_BYTES 4096"
    ):
        validate_message(a_message(properties={"k": "v" * (MAX_PROPERTY_VALUE_BYTES + 1)}))


def test_an_empty_property_key_is_a_bad_request():
    with pytest.raises(BadRequest, match="property key must not be empty"):
        validate_message(a_message(properties={"": "v"}))


def test_message_id_length_is_accepted_up_to_the_limit_and_rejected_past_it():
    validate_message(a_message(id="i" * (MAX_MESSAGE_ID_CHARS - 1)))
    validate_message(a_message(id="i" * MAX_MESSAGE_ID_CHARS))
    with pytest.raises(
        BadRequest, match="message id of 129 characters exceeds MAX_MESSAGE_ID_CHARS 128"
    ):
        validate_message(a_message(id="i" * (MAX_MESSAGE_ID_CHARS + 1)))


@pytest.mark.parametrize("bad_id", ["", "a b", "tab\there", "caf\u00e9"])
def test_message_ids_must_be_printable_ascii_without_spaces(bad_id):
    with pytest.raises(BadRequest, match="message id"):
        validate_message(a_message(id=bad_id))


def test_the_delay_horizon_is_accepted_up_to_the_limit_and_out_of_range_past_it():
    validate_message(a_message(deliver_at_ms=NOW_MS + MAX_DELAY_MS - 1), now_ms=NOW_MS)
    validate_message(a_message(deliver_at_ms=NOW_MS + MAX_DELAY_MS), now_ms=NOW_MS)
    with pytest.raises(
        DelayOutOfRange,
        match=f"deliver_at_ms is {MAX_DELAY_MS + 1} ms ahead of now, exceeds MAX_DELAY_MS {MAX_DELAY_MS}",
    ):
        validate_message(a_message(deliver_at_ms=NOW_MS + MAX_DELAY_MS + 1), now_ms=NOW_MS)


def test_the_delay_horizon_is_only_checked_when_the_time_is_given():
    validate_message(a_message(deliver_at_ms=NOW_MS + MAX_DELAY_MS + 1))


def test_a_delivery_time_in_the_past_is_valid():
    validate_message(a_message(deliver_at_ms=NOW_MS - 1000), now_ms=NOW_MS)


@pytest.mark.parametrize("field", ["created_at_ms", "deliver_at_ms", "expire_at_ms", "retries"])
def test_negative_times_and_retries_are_bad_requests(field):
    with pytest.raises(BadRequest, match=f"{field} must be >= 0, got -1"):
        validate_message(a_message(**{field: -1}))


def test_a_message_to_an_internal_subject_needs_allow_internal():
    msg = a_message(subject=retry_subject("order.created", "billing"), retries=1)
    with pytest.raises(BadRequest, match="internal"):
        validate_message(msg)
    validate_message(msg, allow_internal=True)


def test_an_invalid_subject_makes_the_message_invalid():
    with pytest.raises(BadRequest, match="not a valid name"):
        validate_message(a_message(subject="no spaces"))


def test_the_payload_keys_are_the_ones_protocol_md_documents():
    from wire.message import PAYLOAD_KEYS

    text = (Path(__file__).resolve().parents[2] / "docs" / "PROTOCOL.md").read_text()
    documented = set(re.findall(r"^\| `(\w)` +\|", text, re.MULTILINE))
    assert PAYLOAD_KEYS == documented == set("isbctpdrx")


def _payload_key_literals(path: Path) -> list[str]:
    """Lines of ``path`` where a one-letter payload key is spelled as a str literal used as a
    map key: a subscript, a dict display key, a ``get``/``setdefault``/``pop`` argument or the
    left side of ``in``."""
    letters = set("isbctpdrx")

    def is_key(node: ast.AST) -> bool:
        return isinstance(node, ast.Constant) and node.value in letters

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        keys: list[ast.AST] = []
        if isinstance(node, ast.Subscript):
            keys = [node.slice]
        elif isinstance(node, ast.Dict):
            keys = [key for key in node.keys if key is not None]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("get", "setdefault", "pop") and node.args):
            keys = [node.args[0]]
        elif isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.In, ast.NotIn)):
            keys = [node.left]
        found += [f"{path}:{key.lineno}" for key in keys if is_key(key)]
    return found


def test_only_wire_message_spells_the_payload_keys():
    root = Path(__file__).resolve().parents[2]
    packages = ("wire", "sdk", "serverkit", "tracelog", "realtime", "delayserver", "metaserver",
                "qmq", "spark_audit", "bench")
    spelled = [line for package in packages for path in sorted((root / package).rglob("*.py"))
               if path != root / "wire" / "message.py" for line in _payload_key_literals(path)]
    assert spelled == []


def test_a_plain_message_encoded_from_its_fields_is_the_same_bytes_as_encode_message():
    for deliver_at_ms in (None, 0, 1_795_622_400_123):
        assert encode_plain_message("id-1", "orders.eu", b"\x00body", 1_234, deliver_at_ms) == \
            encode_message(Message("id-1", "orders.eu", b"\x00body", created_at_ms=1_234,
                                   deliver_at_ms=deliver_at_ms))
