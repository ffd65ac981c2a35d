"""When a producer's failed send or cancel is tried again: ``RetryPolicy``, a pure class told
how long ago the first failure was (no clock of its own), so its rule is tested without
waiting (tests/unit/test_sdk_retry_policy.py).

A retriable failure (a lost connection, no answer, ``not_master`` while a group fails over) is
resent after a pause doubled per resend: ``retries_max`` resends whatever the time, then, when
the producer's ``retries_max`` was left at None, more while ``budget_ms`` from the first failure
lasts (the send timeout of RocketMQ or Pulsar, spent on retries). An explicit ``retries_max`` is
a maximum: no budget then, as before the budget existed.
"""

from __future__ import annotations

from dataclasses import dataclass

# First pause before a resend, doubled per attempt up to RETRY_BACKOFF_MS_MAX, in milliseconds.
RETRY_BACKOFF_MS_DEFAULT = 50
RETRY_BACKOFF_MS_MAX = 2_000
# Resends made whatever the time before the retry budget decides, when retries_max is left
# at its default (None).
RETRIES_MIN_DEFAULT = 3
# How long a send or cancel is tried again once its RETRIES_MIN_DEFAULT resends failed (with
# retries_max left at None), in milliseconds from its first failure: longer than a failover (a
# promotion commits ~3.75 s after a master's kill -9, docs/REPLICATION.md) or a master's stall,
# so that a send whose commit straddled one lands instead of failing after ~0.35 s of quick
# resends. 0: RETRIES_MIN_DEFAULT resends only.
RETRY_BUDGET_MS_DEFAULT = 10_000


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """The resends of one producer: ``retries_max`` made whatever the time, then more while
    ``budget_ms`` from the first failure lasts (0: none); the pause ``backoff_ms`` doubled per
    resend, at most RETRY_BACKOFF_MS_MAX."""

    retries_max: int
    backoff_ms: int
    budget_ms: int

    @classmethod
    def of_options(cls, retries_max: int | None, backoff_ms: int,
                   budget_ms: int) -> RetryPolicy:
        """The policy of a Producer's options: ``retries_max`` None is RETRIES_MIN_DEFAULT and
        then the budget; a given ``retries_max`` is exactly that many resends, no budget."""
        if retries_max is None:
            return cls(RETRIES_MIN_DEFAULT, backoff_ms, budget_ms)
        return cls(retries_max, backoff_ms, 0)

    def pause_ms(self, resend: int, failed_for_ms: float) -> int | None:
        """The pause in ms before resend number ``resend`` (from 1) of a send or cancel whose
        first failure was ``failed_for_ms`` ago, or None: give up.

        The first ``retries_max`` resends are made whatever the time; a later one only if it
        would start within ``budget_ms`` of the first failure. Past the ``retries_max`` the
        pause doubles from at least 1 ms, so that a backoff of 0 never spins through a
        budget."""
        pause_ms = min(self.backoff_ms << min(resend - 1, 16), RETRY_BACKOFF_MS_MAX)
        if resend <= self.retries_max:
            return pause_ms
        pause_ms = max(pause_ms, min(1 << min(resend - 1, 16), RETRY_BACKOFF_MS_MAX))
        if failed_for_ms + pause_ms > self.budget_ms:
            return None
        return pause_ms

    def attempts_said(self) -> str:
        """How many attempts a warning says a send or cancel gets: at least retries_max + 1,
        more while the retry budget lasts."""
        if not self.budget_ms:
            return f" of {self.retries_max + 1}"
        return (f" (at least {self.retries_max + 1}, more for up to {self.budget_ms} ms "
                "from the first failure)")
