"""The MetaServer's dead-letter helpers that need no broker: re-drive copies, listing rows,
request checks and the delay stats view."""

from __future__ import annotations

import pytest

from metaserver import dead_letters as dead
from metaserver.errors import BadRequest
from realtime import retries
from wire.limits import MAX_MESSAGE_ID_CHARS
from wire.message import Message, validate_message


def dead_letter(**fields) -> Message:
    base = dict(id="o1.r17", subject="%dead%orders%billing", body=b"b", created_at_ms=5,
                retries=17, properties={"qmq-origin-id": "o1", "qmq-origin-subject": "orders"})
    return Message(**{**base, **fields})


def test_the_mirrored_property_names_are_the_ones_realtime_retries_sets():
    assert dead.ORIGIN_ID_PROPERTY == retries.ORIGIN_ID_PROPERTY
    assert dead.ORIGIN_SUBJECT_PROPERTY == retries.ORIGIN_SUBJECT_PROPERTY


def test_a_redriven_message_starts_a_new_chain_on_the_original_subject():
    copy = dead.redrive_message(dead_letter(tags=("vip",), expire_at_ms=9,
                                            deliver_at_ms=7), "orders", now_ms=1000)
    assert (copy.id, copy.subject, copy.retries, copy.body, copy.tags) == (
        "o1.redrive1", "orders", 0, b"b", ("vip",))
    assert (copy.created_at_ms, copy.deliver_at_ms, copy.expire_at_ms) == (1000, None, None)
    assert copy.properties == {"qmq-redriven-from": "o1.r17", "qmq-redrives": "1"}
    validate_message(copy)


def test_a_second_redrive_of_the_same_chain_gets_the_next_number():
    again = dead_letter(id="o1.redrive1.r17",
                        properties={"qmq-origin-id": "o1.redrive1", "qmq-redrives": "1"})
    assert dead.redrive_message(again, "orders", 1).properties["qmq-redrives"] == "2"
    assert dead.redrive_message(again, "orders", 1).id == "o1.redrive1.redrive2"
    odd = dead_letter(properties={"qmq-redrives": "²"})
    assert dead.redrive_message(odd, "orders", 1).properties["qmq-redrives"] == "1"


@pytest.mark.parametrize("extra, fresh", [(-1, False), (0, False), (1, True)])
def test_a_redrive_id_over_the_id_limit_becomes_a_fresh_id(extra, fresh):
    origin = "x" * (MAX_MESSAGE_ID_CHARS - len(".redrive1") + extra)
    copy = dead.redrive_message(dead_letter(properties={"qmq-origin-id": origin}), "orders", 1)
    assert (copy.id != f"{origin}.redrive1") is fresh
    assert len(copy.id) <= MAX_MESSAGE_ID_CHARS


def test_a_dead_letter_without_origin_properties_uses_its_own_id():
    copy = dead.redrive_message(dead_letter(properties={}), "orders", 1)
    assert copy.id == "o1.r17.redrive1"


@pytest.mark.parametrize("chars, shown", [(199, 199), (200, 200), (201, 200)])
def test_the_listing_preview_is_at_most_200_characters(chars, shown):
    row = dead.dead_row(dead.BrokerRef("rt1", "h:1"), "%dead%orders%billing", 4,
                        dead_letter(body="€".encode() * chars))
    assert row["body_preview"] == "€" * shown
    assert row["size_bytes"] == 3 * chars
    assert (row["subject"], row["group"], row["origin_id"]) == ("orders", "billing", "o1")


def test_dead_prefixes_narrow_the_broker_listing():
    assert dead.dead_prefix("orders", "billing") == "%dead%orders%billing"
    assert dead.dead_prefix("orders", None) == "%dead%orders%"
    assert dead.dead_prefix(None, "billing") == "%dead%"


@pytest.mark.parametrize("text", ["-1", "1.5", "", "²", str(2**64)])
def test_a_query_sequence_must_be_a_u64_in_decimal(text):
    with pytest.raises(BadRequest, match="non-negative integer"):
        dead.check_sequence_text("query.sequence", text)
    assert dead.check_sequence_text("query.sequence", str(2**64 - 1)) == 2**64 - 1


@pytest.mark.parametrize("count, ok", [(0, False), (1, True), (dead.REDRIVE_IDS_MAX, True),
                                       (dead.REDRIVE_IDS_MAX + 1, False)])
def test_redrive_ids_are_accepted_up_to_the_limit(count, ok):
    ids = [f"id{i}" for i in range(count)]
    if ok:
        assert dead.check_ids("body.ids", ids) == ids
    else:
        with pytest.raises(BadRequest, match="ids"):
            dead.check_ids("body.ids", ids)


def test_only_online_brokers_of_the_right_kind_are_asked():
    brokers = [
        {"group": "rt1", "kind": "realtime", "address": "a:1", "state": "rw"},
        {"group": "rt2", "kind": "realtime", "address": "b:1", "state": "offline"},
        {"group": "rt3", "kind": "realtime", "address": "c:1", "state": "readonly"},
        {"group": "d1", "kind": "delay", "address": "d:1", "state": "rw", "broker_id": 4,
         "last_heartbeat_ms": 10, "heartbeat_age_ms": 2,
         "stats": {"backlog": {"pending_total": 3}, "stats": None}},
        {"group": "d2", "kind": "delay", "address": "e:1", "state": "offline", "stats": None},
    ]
    assert dead.realtime_brokers(brokers) == [dead.BrokerRef("rt1", "a:1"),
                                              dead.BrokerRef("rt3", "c:1")]
    assert dead.realtime_brokers(brokers, "rt3") == [dead.BrokerRef("rt3", "c:1")]
    (entry,) = dead.delay_stats(brokers)
    assert (entry["group"], entry["stats"]) == ("d1", {"pending_total": 3})
