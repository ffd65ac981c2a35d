"""A randomized model of the overlap (docs/REPLICATION.md 8.3: a sync commit's records shipped
to a tailing slave before the master's fsync) under full disks: while a ``sync`` slave tails,
random rounds of pipelined sends (one subject or two, small and large payloads) meet a full
disk on the master, at the message log's write, at the consumer log's write after it, or at
the delay log's write, and the space returns after the round. Every send answered ``stored``
is in the slave's copy, no refused send is anywhere in it, and the two logs end equal byte for
byte: a batch the master cut was never shipped, though the master wrote other records at its
offsets. Each seed plans its own faults and sends; only the interleaving varies."""

from __future__ import annotations

import asyncio
import os
import random
from typing import Any, Callable

import pytest

from logstore.faults import FaultPlan
from logstore.fileio import FileHandle, OsFile
from metaserver import MetaConfig, sqlite_url, start_metaserver
from tests.harness import wait_for
from tests.integration.test_replication_overlap import (
    FIRST,
    SECOND,
    delay,
    log_bytes,
    now_ms,
    realtime,
    replica,
    tailing,
)
from tests.rawclient import RawClient
from wire.message import Message, encode_message

ROUNDS = 60
# The MetaServer and both servers share this process: a lease no loaded host's stalls outlast,
# and a slave that never leaves the in-sync set by lagging (test_model_realtime_traffic).
MODEL_LEASE_MS = 8_000
MODEL_INSYNC_LAG_MAX_MS = 3_600_000
BODIES = (b"x", b"y" * 300, b"z" * 20_000)  # the largest meets a full disk


def opener_of(plans: dict[str, FaultPlan]) -> Callable[[str], FileHandle]:
    """Files under ``<data dir>/<directory>/`` obey ``plans[directory]``; others are real."""
    def opener(path: str) -> FileHandle:
        for directory, plan in plans.items():
            if f"{os.sep}{directory}{os.sep}" in path:
                return plan.opener(path)
        return OsFile(path)
    return opener


async def run_rounds(master: Any, rng: random.Random, arm: Callable[[float], None],
                     disarm: Callable[[], None], prefix: str, subjects: Callable[[], tuple],
                     deliver_at_ms: int = 0) -> tuple[set[str], set[str]]:
    """ROUNDS rounds of 1-3 pipelined send requests of 1-8 messages each, ``arm(roll)``
    before a round (a full disk, or nothing), ``disarm()`` after it; the ids answered stored
    and the ids refused."""
    client = await RawClient.connect(master.port)
    stored: set[str] = set()
    refused: set[str] = set()
    number = 0
    try:
        for round_number in range(ROUNDS):
            arm(rng.random())
            requests = []
            for _ in range(rng.choice((1, 1, 2, 3))):
                ids = [f"{prefix}-{round_number}-{number + k}" for k in range(rng.randint(1, 8))]
                number += len(ids)
                names, body = subjects(), rng.choice(BODIES)
                payloads = [encode_message(Message.create(
                    names[k % len(names)], body, now_ms=now_ms(), id=message_id,
                    deliver_at_ms=deliver_at_ms and deliver_at_ms + k))
                    for k, message_id in enumerate(ids)]
                requests.append((ids, asyncio.create_task(client.request(
                    {"op": "send", "messages": payloads}, timeout_s=30))))
            for ids, task in requests:
                answer = await task
                assert "error" not in answer, answer
                for message_id, result in zip(ids, answer["results"]):
                    if result.get("status") == "stored":
                        stored.add(message_id)
                    else:
                        assert result["error"]["code"] == "overloaded", result  # a full disk: retriable
                        refused.add(message_id)
            disarm()
    finally:
        await client.close()
    return stored, refused


async def equal_and_complete(master: Any, slave: Any, directory: str, stored: set[str],
                             refused: set[str]) -> None:
    await wait_for(lambda: log_bytes(slave, directory) == log_bytes(master, directory), 60,
                   "the slave's copy equal to the master's log")
    copy = log_bytes(slave, directory)
    assert [i for i in stored if i.encode() not in copy] == []
    assert [i for i in refused if i.encode() in copy] == []
    assert stored and refused  # both happened: the model tested something


@pytest.mark.timeout(180)
@pytest.mark.parametrize("seed", range(2))
async def test_random_full_disks_at_the_message_and_consumer_logs_never_reach_the_slave(
        tmp_path, seed: int) -> None:
    rng = random.Random(seed)
    plans = {"messagelog": FaultPlan(allocate_unsupported=True),
             "consumerlog": FaultPlan(allocate_unsupported=True)}

    def arm(roll: float) -> None:
        if roll < 0.15:  # the message log's write meets the full disk part-way
            plan = plans["messagelog"]
            plan.disk_capacity_bytes = plan.bytes_written + rng.randint(0, 3000)
        elif roll < 0.3:  # the message log's write succeeds, the entries' does not
            plan = plans["consumerlog"]
            plan.disk_capacity_bytes = plan.bytes_written - (1 << 30)

    def disarm() -> None:
        for plan in plans.values():
            plan.disk_capacity_bytes = None

    config = MetaConfig(db_url=sqlite_url(tmp_path / "m.db"), port=0, lease_ms=MODEL_LEASE_MS)
    async with start_metaserver(config) as meta:
        first = realtime(tmp_path, meta.url, FIRST, opener_of(plans))
        second = realtime(tmp_path, meta.url, SECOND)
        replica(first)._insync_lag_max_ms = MODEL_INSYNC_LAG_MAX_MS
        await first.start()
        await second.start()
        try:
            await tailing(first, SECOND, "message", first.port)
            source = replica(first).source
            shipped = source.fresh_before_fsync["message"]
            stored, refused = await run_rounds(
                first, rng, arm, disarm, f"m{seed}",
                lambda: ("orders",) if rng.random() < 0.8 else ("orders", "refunds"))
            assert source.fresh_before_fsync["message"] > shipped  # the overlap ran
            await equal_and_complete(first, second, "messagelog", stored, refused)
        finally:
            await second.stop()
            await first.stop()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("seed", range(1))
async def test_random_full_disks_at_the_delay_log_never_reach_the_slave(
        tmp_path, seed: int) -> None:
    rng = random.Random(seed)
    plan = FaultPlan(allocate_unsupported=True)

    def arm(roll: float) -> None:
        if roll < 0.25:
            plan.disk_capacity_bytes = plan.bytes_written + rng.randint(0, 3000)

    def disarm() -> None:
        plan.disk_capacity_bytes = None

    due_ms = now_ms() + 3_600_000  # nothing comes due during the test
    config = MetaConfig(db_url=sqlite_url(tmp_path / "m.db"), port=0, lease_ms=MODEL_LEASE_MS)
    async with start_metaserver(config) as meta:
        first = delay(tmp_path, meta.url, FIRST, opener_of({"delaylog": plan}))
        second = delay(tmp_path, meta.url, SECOND)
        replica(first)._insync_lag_max_ms = MODEL_INSYNC_LAG_MAX_MS
        await first.start()
        await second.start()
        try:
            await tailing(first, SECOND, "delay", first.port, deliver_at_ms=due_ms)
            source = replica(first).source
            shipped = source.fresh_before_fsync["delay"]
            stored, refused = await run_rounds(
                first, rng, arm, disarm, f"d{seed}",
                lambda: (rng.choice(("orders", "refunds")),), deliver_at_ms=due_ms)
            assert source.fresh_before_fsync["delay"] > shipped  # the overlap ran
            await equal_and_complete(first, second, "delaylog", stored, refused)
        finally:
            await second.stop()
            await first.stop()
