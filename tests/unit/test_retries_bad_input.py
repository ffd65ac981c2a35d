"""A nacked message whose producer set odd values still gets a retry copy that can be encoded and
stored, so it can always be nacked (found by probing the live broker: a stored message with
retries 2^64-1 could never be nacked)."""

from __future__ import annotations

import pytest

from realtime.retries import ORIGIN_ID_PROPERTY, RETRIES_COUNT_MAX, RetryPolicies, plan_retry
from wire.message import Message, decode_message, encode_message, validate_message

NOW_MS = 1_700_000_000_000


def nacked(**fields) -> bytes:
    return encode_message(Message(subject="orders", body=b"x", created_at_ms=NOW_MS,
                                  **{"id": "m1", **fields}))


@pytest.mark.parametrize("retries", [RETRIES_COUNT_MAX - 1, RETRIES_COUNT_MAX])
def test_a_retries_count_at_the_64_bit_maximum_saturates_in_a_dead_copy(retries: int) -> None:
    copy = plan_retry(nacked(retries=retries), "billing", RetryPolicies(), NOW_MS)
    assert copy.dead
    assert decode_message(copy.payload).retries == RETRIES_COUNT_MAX
    validate_message(copy.message, allow_internal=True, now_ms=NOW_MS)


@pytest.mark.parametrize("origin", ["has space", "é", "o" * 126])
def test_an_origin_id_property_that_makes_no_valid_copy_id_gets_a_fresh_id(origin: str) -> None:
    copy = plan_retry(nacked(properties={ORIGIN_ID_PROPERTY: origin}), "billing",
                      RetryPolicies(), NOW_MS)
    validate_message(copy.message, allow_internal=True, now_ms=NOW_MS)
    assert copy.message.id != f"{origin}.r1"
    assert copy.message.properties[ORIGIN_ID_PROPERTY] == origin
