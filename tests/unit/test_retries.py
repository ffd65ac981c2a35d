"""What a nacked message becomes: retry copies on the group's backoff schedule, then a dead letter."""

from __future__ import annotations

import pytest

from realtime.retries import (
    DEFAULT_BACKOFF_MS,
    ORIGIN_ID_PROPERTY,
    RetryPolicies,
    RetryPolicy,
    origin_subject,
    plan_retry,
)
from wire.message import Message, decode_message, encode_message

NOW_MS = 1_700_000_000_000


def nack_chain(policies: RetryPolicies, times: int, group: str = "billing"):
    payload = encode_message(Message.create("orders", b"pay", now_ms=NOW_MS, id="order-42"))
    copies = []
    for _ in range(times):
        copy = plan_retry(payload, group, policies, NOW_MS)
        copies.append(copy)
        payload = copy.payload
    return copies


def test_the_default_schedule_is_5s_10s_30s_1m_2m_5m_10m_30m_1h_2h_then_2h():
    copies = nack_chain(RetryPolicies(), 16)
    delays_s = [(c.message.deliver_at_ms - NOW_MS) // 1000 for c in copies]
    assert delays_s == [5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200] + [7200] * 6


def test_after_the_last_retry_the_message_is_dead_at_once():
    copies = nack_chain(RetryPolicies(), 17)
    assert [c.dead for c in copies] == [False] * 16 + [True]
    dead = copies[-1]
    assert dead.subject == "%dead%orders%billing"
    assert dead.message.deliver_at_ms is None
    assert dead.message.retries == 17


def test_retries_max_is_honoured_at_its_boundary():
    policies = RetryPolicies(RetryPolicy(backoff_ms=(1000,), retries_max=3))
    assert [c.dead for c in nack_chain(policies, 4)] == [False, False, False, True]
    zero = RetryPolicies(RetryPolicy(retries_max=0))
    assert nack_chain(zero, 1)[0].dead


def test_retry_copies_go_to_the_groups_retry_subject_with_retries_counted():
    copies = nack_chain(RetryPolicies(), 3)
    assert {c.subject for c in copies} == {"%retry%orders%billing"}
    assert [c.message.retries for c in copies] == [1, 2, 3]
    assert decode_message(copies[2].payload).body == b"pay"


def test_each_retry_has_its_own_id_and_remembers_the_first():
    copies = nack_chain(RetryPolicies(), 3)
    assert [c.message.id for c in copies] == ["order-42.r1", "order-42.r2", "order-42.r3"]
    assert {c.message.properties[ORIGIN_ID_PROPERTY] for c in copies} == {"order-42"}


def test_an_explicit_retry_delay_overrides_the_schedule():
    payload = encode_message(Message.create("orders", b"x", now_ms=NOW_MS))
    copy = plan_retry(payload, "billing", RetryPolicies(), NOW_MS, retry_after_ms=42)
    assert copy.message.deliver_at_ms == NOW_MS + 42


def test_a_group_override_applies_only_to_that_subject_and_group():
    special = RetryPolicy(backoff_ms=(100,), retries_max=1)
    policies = RetryPolicies(overrides={("orders", "billing"): special})
    assert nack_chain(policies, 2)[1].dead
    assert not nack_chain(policies, 2, group="shipping")[1].dead
    assert nack_chain(policies, 1)[0].message.deliver_at_ms == NOW_MS + 100


def test_retry_and_dead_subjects_map_back_to_the_user_subject():
    assert origin_subject("%retry%orders%billing") == "orders"
    assert origin_subject("%dead%orders%billing") == "orders"
    assert origin_subject("orders") == "orders"


@pytest.mark.parametrize("backoff, retries_max", [((), 1), ((-1,), 1), ((5,), -1)])
def test_a_bad_policy_is_refused_naming_the_value(backoff, retries_max):
    with pytest.raises(ValueError):
        RetryPolicy(backoff_ms=backoff, retries_max=retries_max)


def test_the_default_schedule_has_ten_steps():
    assert len(DEFAULT_BACKOFF_MS) == 10


def test_a_groups_own_policy_applies_to_it_alone_and_takes_what_it_leaves_out_from_the_default():
    policies = RetryPolicies.from_settings(
        (1000, 2000), 5, backoff_ms_by_group={"shipping": (300,)},
        retries_max_by_group={"billing": 1, "shipping": 2})
    billing = nack_chain(policies, 2, group="billing")
    assert [c.dead for c in billing] == [False, True]
    assert billing[0].message.deliver_at_ms - NOW_MS == 1000  # the default schedule
    shipping = nack_chain(policies, 3, group="shipping")
    assert [c.dead for c in shipping] == [False, False, True]
    assert [c.message.deliver_at_ms - NOW_MS for c in shipping[:2]] == [300, 300]
    others = nack_chain(policies, 6, group="audit")
    assert [c.dead for c in others] == [False] * 5 + [True]


def test_a_subject_and_group_override_wins_over_the_groups_own_policy():
    policies = RetryPolicies(by_group={"billing": RetryPolicy(retries_max=0)},
                             overrides={("orders", "billing"): RetryPolicy(retries_max=1)})
    assert [c.dead for c in nack_chain(policies, 2)] == [False, True]
