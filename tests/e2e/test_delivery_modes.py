"""Broadcast groups, tag filters and where a new group starts, through the SDK."""

from __future__ import annotations

import pytest

import qmq
from tests.e2e.support import Ledger, RunningConsumer, close_all, send_all
from tests.harness import admin, group_lag, wait_for


@pytest.fixture
async def meta_url(cluster) -> str:
    cluster.start_meta()
    cluster.start_broker("rt1", "--ack-timeout-ms", "3000", "--consumer-expiry-ms", "3000")
    await wait_for(lambda: admin(cluster.meta_url, "brokers"), 20, "the broker to register",
                   in_thread=True)
    return cluster.meta_url


@pytest.mark.timeout(60)
async def test_every_broadcast_consumer_gets_every_message_while_a_normal_group_shares_them(
    meta_url,
):
    subject = "prices.changed"
    ids = [f"price-{i:03d}" for i in range(120)]
    broadcast, shared = Ledger(), Ledger()
    consumers = [
        *[await RunningConsumer(meta_url, "caches", subject, broadcast, name=f"cache-{n}",
                                broadcast=True, start="earliest").start() for n in range(3)],
        *[await RunningConsumer(meta_url, "indexer", subject, shared, name=f"indexer-{n}",
                                start="earliest").start() for n in range(2)],
    ]
    try:
        async with qmq.Producer(meta_url) as producer:
            await send_all(producer, subject, ids[:60])
            await send_all(producer, subject, ids[60:])

        def each_cache_has_all() -> bool:
            return all({d.id for d in broadcast.deliveries if d.consumer == f"cache-{n}"}
                       >= set(ids) for n in range(3))

        await wait_for(each_cache_has_all, 30, "every broadcast consumer to get every message")
        await wait_for(lambda: shared.ids >= set(ids), 30, "the indexer group to get everything")
        await wait_for(lambda: group_lag(meta_url, subject, "indexer") == (0, 1), 20,
                       "the indexer group's lag to reach 0", interval_s=0.3, in_thread=True)
    finally:
        await close_all(consumers)

    assert len(broadcast.deliveries) == 3 * len(ids)
    assert broadcast.duplicates() == {i: 3 for i in ids}
    assert shared.ids == set(ids) and shared.duplicates() == {}


@pytest.mark.timeout(60)
async def test_a_tag_filter_delivers_only_messages_carrying_one_of_its_tags(meta_url):
    subject = "orders.created"
    tagged = {"vip": [f"vip-{i}" for i in range(20)], "gold": [f"gold-{i}" for i in range(20)],
              "plain": [f"plain-{i}" for i in range(20)]}
    vip, vip_or_gold, everything = Ledger(), Ledger(), Ledger()
    consumers = [
        await RunningConsumer(meta_url, "vip-desk", subject, vip, name="vip",
                              tags=["vip"], start="earliest").start(),
        await RunningConsumer(meta_url, "loyalty", subject, vip_or_gold, name="loyalty",
                              tags=["vip", "gold"], start="earliest").start(),
        await RunningConsumer(meta_url, "audit", subject, everything, name="audit",
                              start="earliest").start(),
    ]
    try:
        async with qmq.Producer(meta_url) as producer:
            for tag, ids in tagged.items():
                tags = [] if tag == "plain" else [tag, "order"]
                await send_all(producer, subject, ids, tags=tags)
        every_id = {i for ids in tagged.values() for i in ids}
        await wait_for(lambda: everything.ids >= every_id, 30, "the unfiltered group")
        await wait_for(lambda: vip_or_gold.ids >= set(tagged["vip"] + tagged["gold"]), 30,
                       "the vip-or-gold group")
        await wait_for(lambda: vip.ids >= set(tagged["vip"]), 30, "the vip group")
        # Filtered-out messages still move the cursor: each group ends with nothing pending.
        for group in ("vip-desk", "loyalty", "audit"):
            await wait_for(lambda: group_lag(meta_url, subject, group) == (0, 1), 20,
                           f"group {group} to report lag 0", interval_s=0.3, in_thread=True)
    finally:
        await close_all(consumers)

    assert vip.ids == set(tagged["vip"])
    assert vip_or_gold.ids == set(tagged["vip"] + tagged["gold"])
    assert everything.ids == every_id
    assert all("vip" in d.tags for d in vip.deliveries)


@pytest.mark.timeout(60)
async def test_a_new_group_starts_at_latest_by_default_and_at_earliest_on_request(meta_url):
    subject = "users.signed_up"
    old = [f"old-{i}" for i in range(10)]
    new = [f"new-{i}" for i in range(10)]
    latest, earliest = Ledger(), Ledger()
    async with qmq.Producer(meta_url) as producer:
        await send_all(producer, subject, old)
        consumers = [
            await RunningConsumer(meta_url, "mailer", subject, latest, name="mailer").start(),
            await RunningConsumer(meta_url, "backfill", subject, earliest, name="backfill",
                                  start="earliest").start(),
        ]
        try:
            # The group's cursor exists once the broker reports it (its first pull made it);
            # the MetaServer lists the group earlier, from the consumer's heartbeat alone.
            await wait_for(lambda: (group_lag(meta_url, subject, "mailer") or (0, 0))[1] == 1,
                           20, "the broker to report group mailer", interval_s=0.3,
                           in_thread=True)
            await send_all(producer, subject, new)
            await wait_for(lambda: latest.ids >= set(new), 30, "the latest group to get new ones")
            await wait_for(lambda: earliest.ids >= set(old + new), 30,
                           "the earliest group to get everything")
            await wait_for(lambda: group_lag(meta_url, subject, "mailer") == (0, 1), 20,
                           "group mailer to report lag 0", interval_s=0.3, in_thread=True)
        finally:
            await close_all(consumers)

    assert latest.ids == set(new), "a group starting at latest must not get older messages"
    assert earliest.ids == set(old + new)
