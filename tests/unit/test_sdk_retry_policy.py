"""A producer's resends (sdk.retry_policy.RetryPolicy), told how long ago the first failure
was: a few quick ones, then more while the budget lasts, or exactly retries_max when given."""

from __future__ import annotations

from sdk.retry_policy import RETRY_BACKOFF_MS_MAX, RetryPolicy


def test_the_defaults_resend_three_times_at_once_then_while_the_budget_lasts():
    policy = RetryPolicy.of_options(None, 50, 10_000)
    assert [policy.pause_ms(n, 0) for n in (1, 2, 3)] == [50, 100, 200]
    assert policy.pause_ms(4, 9_000) == 400  # starts at 9.4 s: within the 10 s
    assert policy.pause_ms(4, 9_700) is None  # would start at 10.1 s
    assert policy.pause_ms(9, 0) == RETRY_BACKOFF_MS_MAX


def test_a_given_retries_max_is_exactly_that_many_resends_with_no_budget():
    assert RetryPolicy.of_options(0, 50, 10_000).pause_ms(1, 0) is None
    two = RetryPolicy.of_options(2, 50, 10_000)
    assert [two.pause_ms(n, 60_000) for n in (1, 2, 3)] == [50, 100, None]
    assert two.attempts_said() == " of 3"


def test_a_backoff_of_0_still_pauses_past_the_quick_resends_so_it_never_spins():
    policy = RetryPolicy.of_options(None, 0, 1_000)
    assert [policy.pause_ms(n, 0) for n in (1, 2, 3)] == [0, 0, 0]
    assert [policy.pause_ms(n, 0) for n in (4, 5, 6)] == [8, 16, 32]
    assert "more for up to 1000 ms" in policy.attempts_said()
