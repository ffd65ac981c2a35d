"""The HTTP gateway's JSON checks, receipts and error statuses."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metaserver import gateway_codec as codec
from metaserver import validation as v
from metaserver.errors import BadRequest
from wire.errors import DelayOutOfRange
from wire.limits import MAX_DELAY_MS, MAX_SEND_BATCH_MESSAGES


def item(**fields: object) -> codec.SendItem:
    raw = {"subject": "orders", "body": "hi", **fields}
    return codec.send_item(v.parse_object(raw, codec.SEND_MESSAGE, where="m"), "m")


def test_a_receipt_reads_back_as_what_made_it():
    text = codec.make_receipt("[::1]:20881", "%retry%orders%billing", "billing", "c 1", 2**64 - 1)
    assert codec.read_receipt("r", text) == codec.Receipt(
        "[::1]:20881", "%retry%orders%billing", "billing", "c 1", 2**64 - 1)


@given(st.text(max_size=300))
def test_anything_that_is_not_a_receipt_is_a_bad_request(text):
    try:
        codec.read_receipt("r", text)
    except BadRequest:
        return
    raise AssertionError(f"{text!r} read as a receipt")


@pytest.mark.parametrize("fields", [
    ["1.2.3.4:1", "orders", "g", "c", 1],  # no version
    [2, "1.2.3.4:1", "orders", "g", "c", 1],  # another version
    [1, "not an address", "orders", "g", "c", 1],
    [1, "1.2.3.4:1", "bad subject", "g", "c", 1],
    [1, "1.2.3.4:1", "orders", "g", "c", -1],
    [1, "1.2.3.4:1", "orders", "g", "", 1],
])
def test_a_receipt_with_a_wrong_field_is_refused(fields):
    import base64
    import json
    text = base64.urlsafe_b64encode(json.dumps(fields).encode()).decode().rstrip("=")
    with pytest.raises(BadRequest):
        codec.read_receipt("r", text)


def test_a_send_item_takes_one_due_time_in_any_of_three_spellings():
    assert item(delay_ms=5).delay_ms == 5
    assert item(deliver_at_ms=7).deliver_at_ms == 7
    assert item(deliver_at="2027-01-01T00:00:00Z").deliver_at_ms == 1_798_761_600_000
    assert item(deliver_at="2027-01-01T01:00:00+01:00").deliver_at_ms == 1_798_761_600_000
    with pytest.raises(BadRequest, match="at most one"):
        item(delay_ms=5, deliver_at_ms=7)
    with pytest.raises(BadRequest, match="no time-zone offset"):
        item(deliver_at="2027-01-01T00:00:00")
    with pytest.raises(BadRequest, match="not an RFC 3339"):
        item(deliver_at="tomorrow")
    assert item(delay_ms=MAX_DELAY_MS).delay_ms == MAX_DELAY_MS
    with pytest.raises(DelayOutOfRange, match="MAX_DELAY_MS"):
        item(delay_ms=MAX_DELAY_MS + 1)


def test_bodies_are_text_or_base64():
    assert item(body="héllo").body == "héllo".encode()
    assert item(body="AAEC", encoding="base64").body == b"\x00\x01\x02"
    with pytest.raises(BadRequest, match="not valid base64"):
        item(body="@@@", encoding="base64")


def test_the_shape_of_a_message_is_checked_before_its_values():
    for raw in ({"subject": "o"}, {"subject": "o", "body": 1}, {"subject": "o", "body": "",
                                                                "extra": 1},
                {"subject": "o", "body": "", "delay_ms": -1},
                {"subject": "o", "body": "", "tags": [1]},
                {"subject": "o", "body": "", "properties": {"k": 1}},
                {"subject": "o", "body": "", "encoding": "latin-1"}):
        with pytest.raises(BadRequest):
            v.parse_object(raw, codec.SEND_MESSAGE, where="m")


@pytest.mark.parametrize("count", [MAX_SEND_BATCH_MESSAGES - 1, MAX_SEND_BATCH_MESSAGES])
def test_a_send_of_up_to_the_batch_limit_passes_the_batch_check(count):
    assert len(codec.check_batch("messages", [{}] * count)) == count


def test_a_send_over_the_batch_limit_is_too_large_and_an_empty_one_bad():
    with pytest.raises(codec.TooLargeBatch, match="exceeds MAX_SEND_BATCH_MESSAGES 256"):
        codec.check_batch("messages", [{}] * (MAX_SEND_BATCH_MESSAGES + 1))
    with pytest.raises(BadRequest):
        codec.check_batch("messages", [])


def test_each_error_code_has_its_status_and_unknown_ones_follow_retriability():
    assert [codec.error_status(c, False) for c in (
        "bad_request", "unauthorized", "forbidden", "not_found", "too_large")] == [
        400, 401, 403, 404, 413]
    assert codec.error_status("overloaded", True) == 503
    assert codec.error_status("something_new", False) == 500
