"""A burst that wakes many idle consumers of a group is shared among them (issue 19), in-process
on port 0, driven by raw protocol clients."""

from __future__ import annotations

import asyncio

import pytest

from realtime.config import RealtimeConfig
from realtime.server import RealtimeServer
from tests.harness import wait_for
from wire.message import decode_message
from tests.rawclient import FakeClock, RawClient, message

CONSUMERS = 10
BURST = 100


async def start(tmp_path, **overrides) -> RealtimeServer:
    config = RealtimeConfig(data_dir=str(tmp_path / "rt"), port=0,
                            expiry_check_interval_ms=3_600_000, **overrides)
    server = RealtimeServer(config, FakeClock())
    await server.start()
    return server


def answered(poll: asyncio.Task) -> bool:
    """The poll has answered (the others are still parked)."""
    return poll.done() and poll.exception() is None


def taken_by(polls: list[asyncio.Task]) -> list[int]:
    """Messages each poll took (0 while it is parked)."""
    return [len(poll.result()["payloads"]) if answered(poll) else 0 for poll in polls]


async def burst_to_idle_consumers(tmp_path, consumers: int, **overrides) -> list[int]:
    """On a broker with the config ``overrides``, ``consumers`` of group g park a long poll each
    (max_count 256), then one send of BURST messages arrives: how many each consumer's poll
    took, and every message taken once."""
    server = await start(tmp_path, **overrides)
    try:
        return await _burst(server, consumers)
    finally:
        await server.stop()


async def _burst(server: RealtimeServer, consumers: int) -> list[int]:
    """``burst_to_idle_consumers`` on a started broker."""
    clock = FakeClock()
    producer = await RawClient.connect(server.port)
    clients = [await RawClient.connect(server.port) for _ in range(consumers)]
    polls: list[asyncio.Task] = []
    try:
        await clients[0].pull("burst", "g", "c0")  # creates the group at "latest"
        polls += [asyncio.create_task(client.pull("burst", "g", f"c{i}", max_count=256,
                                                 wait_ms=30_000))
                 for i, client in enumerate(clients)]
        await wait_for(lambda: server.broker.pulls.waiting_pulls == consumers, 10,
                       "every consumer's long poll to park")
        sent = await producer.send(*[message("burst", b"m%d" % i, clock) for i in range(BURST)])
        assert [r["status"] for r in sent["results"]] == ["stored"] * BURST

        # The polls that got nothing park again until their wait ends: wait for the burst only.
        await wait_for(lambda: sum(taken_by(polls)) == BURST, 30, "the whole burst to be taken")
        taken = [decode_message(payload).body for poll in polls if answered(poll)
                 for payload in poll.result()["payloads"]]
        assert sorted(taken) == sorted(b"m%d" % i for i in range(BURST))
        return taken_by(polls)
    finally:
        for client in [producer, *clients]:
            await client.close()
        await asyncio.gather(*polls, return_exceptions=True)


async def test_a_burst_reaches_every_idle_consumer_of_the_group_in_even_shares(tmp_path):
    counts = await burst_to_idle_consumers(tmp_path, CONSUMERS, burst_share_min_messages=1)
    assert counts == [BURST // CONSUMERS] * CONSUMERS


async def test_the_share_is_never_below_the_configured_minimum(tmp_path):
    counts = await burst_to_idle_consumers(tmp_path, CONSUMERS, burst_share_min_messages=40)
    assert sorted(counts, reverse=True)[:3] == [40, 40, 20]
    assert sum(1 for count in counts if count) == 3


async def test_with_sharing_off_the_first_woken_poll_takes_the_whole_burst(tmp_path):
    counts = await burst_to_idle_consumers(tmp_path, CONSUMERS, burst_share_min_messages=0)
    assert sorted(counts, reverse=True)[:2] == [BURST, 0]


async def test_a_lone_consumer_takes_the_whole_burst_in_one_pull(tmp_path):
    counts = await burst_to_idle_consumers(tmp_path, 1)
    assert counts == [BURST]


def test_a_negative_share_minimum_fails_at_start_naming_the_key_and_value(tmp_path):
    with pytest.raises(ValueError, match="burst_share_min_messages.*-1"):
        RealtimeConfig(data_dir=str(tmp_path), burst_share_min_messages=-1)
