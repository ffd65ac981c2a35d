"""serverkit.access: subject patterns, what a grant covers, and the pattern limits at their bounds."""

from __future__ import annotations

import pytest

from serverkit.access import (
    OPEN,
    AccessCache,
    Gate,
    PATTERN_CHARS_MAX,
    PATTERNS_PER_TOKEN_MAX,
    Grant,
    check_pattern,
    check_patterns,
    covers,
    subject_of,
)
from serverkit.send_check import QuickCheck
from wire.errors import BadRequest, Forbidden
from wire.message import Message, encode_message

ORDERS = Grant(app="shop", produce=("order.*",), consume=("order.created", "audit.?"))


def test_retry_and_dead_subjects_are_checked_as_the_subject_they_belong_to() -> None:
    assert subject_of("%retry%order.created%billing") == "order.created"
    assert subject_of("%dead%order.created%billing") == "order.created"
    assert subject_of("order.created") == "order.created"
    # Not an internal form we know: checked as it is, so no pattern but '*'-like ones covers it.
    assert subject_of("%other%order.created%billing") == "%other%order.created%billing"


def test_an_order_star_pattern_covers_order_subjects_at_any_depth_and_nothing_else() -> None:
    assert covers(["order.*"], "order.created")
    assert covers(["order.*"], "order.a.b")
    assert covers(["order.*"], "%retry%order.created%billing")
    assert not covers(["order.*"], "payment.x")
    assert not covers(["order.*"], "order")
    assert not covers([], "order.created")


def test_a_grant_refuses_subjects_outside_its_patterns_naming_app_subject_and_patterns() -> None:
    ORDERS.check_produce("order.paid")
    ORDERS.check_consume("audit.1")
    with pytest.raises(Forbidden, match=r"app 'shop' may not produce to subject 'payment\.x' "
                                        r"\(its produce patterns: \['order\.\*'\]\)"):
        ORDERS.check_produce("payment.x")
    with pytest.raises(Forbidden, match="may not consume subject 'order.paid'"):
        ORDERS.check_consume("order.paid")
    with pytest.raises(Forbidden, match="admin op browse"):
        ORDERS.check_admin("browse")


def test_a_refused_retry_subject_is_named_as_the_subject_the_user_typed() -> None:
    with pytest.raises(Forbidden, match=r"may not consume subject 'order\.paid' ") as refused:
        ORDERS.check_consume("%retry%order.paid%billing")
    assert "%" not in str(refused.value)


def test_an_admin_grant_covers_every_subject_including_internal_ones() -> None:
    admin = Grant(app="ops", produce=(), consume=(), admin=True)
    admin.check_produce("%retry%payment.x%g")
    admin.check_consume("%dead%anything%g")
    admin.check_admin("purge")
    assert OPEN.may_produce("x") and OPEN.may_consume("y")


@pytest.mark.parametrize("length", [PATTERN_CHARS_MAX - 1, PATTERN_CHARS_MAX])
def test_a_pattern_up_to_the_length_limit_is_accepted(length: int) -> None:
    assert check_pattern("a" * length) == "a" * length


def test_a_pattern_one_past_the_length_limit_is_refused_with_both_numbers() -> None:
    with pytest.raises(BadRequest, match=f"{PATTERN_CHARS_MAX + 1} characters exceeds "
                                         f"PATTERN_CHARS_MAX {PATTERN_CHARS_MAX}"):
        check_pattern("a" * (PATTERN_CHARS_MAX + 1))


@pytest.mark.parametrize("count", [PATTERNS_PER_TOKEN_MAX - 1, PATTERNS_PER_TOKEN_MAX])
def test_up_to_the_pattern_count_limit_is_accepted(count: int) -> None:
    assert len(check_patterns("produce", ["a.*"] * count)) == count


def test_one_pattern_past_the_count_limit_is_refused() -> None:
    with pytest.raises(BadRequest, match=f"{PATTERNS_PER_TOKEN_MAX + 1} produce patterns exceed "
                                         f"PATTERNS_PER_TOKEN_MAX {PATTERNS_PER_TOKEN_MAX}"):
        check_patterns("produce", ["a.*"] * (PATTERNS_PER_TOKEN_MAX + 1))


@pytest.mark.parametrize("pattern", ["", "order/*", "order *", "%retry%x%y", 7])
def test_a_pattern_with_characters_a_subject_cannot_have_is_refused(pattern: object) -> None:
    with pytest.raises(BadRequest):
        check_pattern(pattern)


class _Clock:
    """A monotonic clock in ms that moves only when told."""

    def __init__(self) -> None:
        self.now_ms = 1_000

    def __call__(self) -> int:
        return self.now_ms


def _cache_with(answer: dict[str, object], token: str, clock: _Clock) -> AccessCache:
    """A cache (of an unreachable MetaServer) holding the MetaServer's ``answer`` for ``token``."""
    cache = AccessCache("http://127.0.0.1:9", token=None, ttl_ms=10_000, clock_ms=clock)
    cache._answers[token] = cache._answer_of(answer, token)
    return cache


def test_a_cached_grant_is_given_without_asking_until_its_ttl_ends_then_it_must_be_asked() -> None:
    clock = _Clock()
    cache = _cache_with({"enabled": True, "valid": True, "app": "shop", "produce": ["order.*"]},
                        "t1", clock)
    grant = cache.grant_now("t1")
    assert grant is not None and grant.app == "shop" and grant.may_produce("order.x")
    clock.now_ms += 9_999
    assert cache.grant_now("t1") is grant
    clock.now_ms += 1  # the TTL is over: a revoked token must not pass on the old answer
    assert cache.grant_now("t1") is None
    assert cache.grant_now("never-seen") is None


def test_a_refused_token_is_never_granted_from_the_cache_so_grant_words_the_refusal() -> None:
    clock = _Clock()
    cache = _cache_with({"enabled": True, "valid": False}, "", clock)
    assert cache.grant_now(None) is None  # no token is cached under ""


def test_a_gate_without_a_metaserver_grants_everyone_open_at_once() -> None:
    assert Gate(None).grant_now("anything") is OPEN
    assert Gate(None).grant_now(None) is OPEN


def _payload(subject: str) -> bytes:
    return encode_message(Message(id=f"id-{subject}", subject=subject, body=b"x"))


def test_a_send_is_refused_naming_the_first_payloads_subject_its_grant_does_not_cover() -> None:
    payloads = [_payload(s) for s in ("order.a", "payment.x", "order.b", "refund.y")]
    for checks in (None, QuickCheck().check_many(payloads, 1 << 62)):
        with pytest.raises(Forbidden) as refused:
            Gate(None).check_send(ORDERS, payloads, checks)
        assert "subject 'payment.x'" in refused.value.message
    Gate(None).check_send(ORDERS, [_payload("order.a"), b"\xc1 not msgpack"])  # left open
    Gate(None).check_send(OPEN, payloads)


def test_a_send_check_takes_the_quick_checks_subjects_and_reads_only_the_payloads_it_left_open(
        ) -> None:
    allowed, refused = _payload("order.a"), _payload("payment.x")
    [checked] = QuickCheck().check_many([allowed], 1 << 62)
    assert checked is not None
    # The quick check's subject is taken as read: the payload beside it is not read again.
    Gate(None).check_send(ORDERS, [b"\xc1 not read"], [checked])
    # A payload the quick check left open (None) is read here and refused by its subject.
    with pytest.raises(Forbidden, match="subject 'payment.x'"):
        Gate(None).check_send(ORDERS, [allowed, refused], [checked, None])
