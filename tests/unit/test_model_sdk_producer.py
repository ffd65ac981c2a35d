"""A randomized model of the SDK producer's batching against the fake broker: 32 senders that
send again as they resume (W1's loop), two subjects, delayed and plain sends, dropped
connections, answers lost after the store, retriable errors, and senders cancelled at random.
Every send not cancelled returns a receipt whose id the broker stored; none hangs; afterwards no
batch counts as on the wire and none is open. Each sender draws from a random generator of its
own, seeded from the test's seed, so a seed makes the same sends whatever the interleaving."""

from __future__ import annotations

import asyncio
import random
from datetime import timedelta

import pytest

from sdk.producer import Producer
from tests.unit.test_sdk_fakes import broker_a, meta  # noqa: F401  (fixtures)

SUBJECTS = ("orders", "refunds")


@pytest.mark.parametrize("seed", range(8))
async def test_random_senders_with_faults_and_cancels_all_settle_and_nothing_stays_on_the_wire(
        meta, broker_a, seed: int) -> None:  # noqa: F811
    rng = random.Random(seed)
    for subject in SUBJECTS:
        meta.set_route(subject, [broker_a])
    p = Producer(meta.url, app="shop", retry_backoff_ms=0, route_start=0,
                 linger_ms=rng.choice((0, 2, 50)))
    for _ in range(rng.randint(0, 6)):
        broker_a.fail_next("send", rng.choice(("drop", "store_then_drop", "error")),
                           ("overloaded", "busy"))
    receipts: list[tuple[str, str]] = []
    cancelled = 0

    async def sender(number: int) -> None:
        own = random.Random(seed * 100 + number)
        for i in range(own.randint(5, 30)):
            subject = own.choice(SUBJECTS)
            if own.random() < 0.5:
                receipt = await p.send(subject, b"%d-%d" % (number, i),
                                       delay=timedelta(seconds=own.randint(1, 20)))
            else:
                receipt = await p.send(subject, b"%d-%d" % (number, i))
            receipts.append((receipt.message_id, receipt.status))

    tasks = [asyncio.create_task(sender(n)) for n in range(32)]
    for _ in range(rng.randint(0, 8)):
        await asyncio.sleep(rng.random() * 0.01)
        victim = rng.choice(tasks)
        if not victim.done():
            victim.cancel()
            cancelled += 1
    async with asyncio.timeout(60):
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    for outcome in outcomes:
        assert outcome is None or isinstance(outcome, asyncio.CancelledError), outcome
    await p.flush()
    assert p._on_wire == {}, p._on_wire
    assert p._open == {}, p._open
    for message_id, status in receipts:
        assert status in ("stored", "duplicate"), status
        assert message_id in broker_a.stored
    assert len({message_id for message_id, _ in receipts}) == len(receipts)
    await p.close()
