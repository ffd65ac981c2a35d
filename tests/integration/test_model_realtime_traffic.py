"""A randomized model of the realtime broker's send and pull paths, run against a live server:
four connections pipeline random send batches (three subjects, fresh ids, ids resent by the
same or another connection, invalid payloads, compact or not) while consumers long-poll and ack.
Every valid id is stored exactly once whatever its resends (one "stored", the rest
"duplicate"), every invalid payload gets an error, each stored message is delivered exactly once
to a group of one consumer a subject and to a group of two, byte for byte, and a connection's
messages of one subject arrive in the order it sent them.

What is sent is planned from the seed alone (``plan_traffic``): a seed sends the same requests
in the same order on every run; only the interleaving of the connections and the polls varies.
Every wait is bounded (a request 30 s, the deliveries 30 s, the lossy group's acks 60 s)."""

from __future__ import annotations

import asyncio
import os
import random
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import pytest

from metaserver import MetaConfig, sqlite_url, start_metaserver
from realtime.config import RealtimeConfig
from realtime.server import RealtimeServer
from tests.harness import wait_for
from tests.integration.test_replication_data import (
    FIRST,
    SECOND,
    message_log_bytes,
    now_ms,
    realtime,
    replica,
)
from tests.rawclient import FakeClock, RawClient, message
from wire.message import decode_message, encode_message

SUBJECTS = ("model.a", "model.b", "model.c")
PRODUCERS = 4
GROUP = "model"
LOSSY_GROUP = "lossy"
LOSSY_ACK_TIMEOUT_MS = 1_000
# Every other group's ack timeout: past all the fake time the lossy phase runs (at most
# 1,200 s), so an ack still on its way when the clock jumps never hands a message out again.
ACK_TIMEOUT_MS = 24 * 3_600_000
INVALID_PAYLOAD = b"\x93not a message"
SEED_BASE = int(os.environ.get("QMQ_MODEL_SEED_BASE", "0"))  # another set of seeds


@dataclass
class PlannedRequest:
    """One send request of the plan: its entries ((id, payload), payload None for an invalid
    one), compact or not, and how many requests its connection keeps unanswered before it
    yields to the others (``pipeline``)."""

    entries: list[tuple[str, bytes | None]]
    compact: bool
    pipeline: int


@dataclass
class Plan:
    """Everything ``plan_traffic`` decided for one seed: each connection's requests; each
    planned id's payload; per (connection, subject) the ids it sends first, in its order."""

    requests: list[list[PlannedRequest]]
    payload: dict[str, bytes]
    order: dict[tuple[int, str], list[str]]


def plan_traffic(seed: int, clock: FakeClock) -> Plan:
    """The requests of the four connections, from ``seed`` alone: 20-40 requests each of 1-12
    entries, built a round at a time (one request of every connection) so that a resend (12%)
    may name an id another connection planned in an earlier round or this one, whether or not
    that connection has sent it yet. 8% of the entries are invalid payloads."""
    rng = random.Random(seed)
    counts = [rng.randint(20, 40) for _ in range(PRODUCERS)]
    plan = Plan([[] for _ in range(PRODUCERS)], {}, defaultdict(list))
    planned: list[str] = []
    for number in range(max(counts)):
        for producer in range(PRODUCERS):
            if number >= counts[producer]:
                continue
            entries: list[tuple[str, bytes | None]] = []
            subject_of_request = rng.choice(SUBJECTS)
            for index in range(rng.randint(1, 12)):
                roll = rng.random()
                if roll < 0.08:
                    entries.append(("", None))
                    continue
                if roll < 0.2 and planned:
                    message_id = rng.choice(planned)
                    entries.append((message_id, plan.payload[message_id]))
                    continue
                subject = subject_of_request if rng.random() < 0.8 else rng.choice(SUBJECTS)
                message_id = f"model-{seed}-p{producer}-{number}-{index}"
                payload = encode_message(message(subject, message_id.encode(), clock,
                                                 id=message_id))
                planned.append(message_id)
                plan.payload[message_id] = payload
                plan.order[(producer, subject)].append(message_id)
                entries.append((message_id, payload))
            plan.requests[producer].append(
                PlannedRequest(entries, rng.random() < 0.5, rng.randint(1, 8)))
    return plan


@dataclass
class Outcome:
    """What the answers said: per id how often "stored" and "duplicate", and who stored it."""

    stored: dict[str, int]
    duplicate: dict[str, int]
    stored_by: dict[str, int]


async def _request(client: RawClient, frame: dict[str, Any],
                   check: Callable[[list[bytes], dict[str, Any]], None] | None
                   ) -> dict[str, Any]:
    answer = await client.request(frame, timeout_s=30)
    if check is not None:
        check(frame["messages"], answer)
    return answer


async def _producer(port: int, producer: int, requests: list[PlannedRequest],
                    outcome: Outcome,
                    check: Callable[[list[bytes], dict[str, Any]], None] | None) -> None:
    """Send one connection's planned requests, pipelined, and record what each answer says."""
    client = await RawClient.connect(port)
    try:
        inflight: list[asyncio.Task[dict[str, Any]]] = []
        for request in requests:
            frame: dict[str, Any] = {"op": "send", "messages": [
                payload if payload is not None else INVALID_PAYLOAD
                for _id, payload in request.entries]}
            if request.compact:
                frame["compact"] = True
            inflight.append(asyncio.create_task(_request(client, frame, check)))
            if sum(not task.done() for task in inflight) >= request.pipeline:
                await asyncio.sleep(0)
        answers = await asyncio.gather(*inflight)
    finally:
        await client.close()
    for request, answer in zip(requests, answers):
        entries = request.entries
        assert "error" not in answer, answer
        if "stored" in answer:
            assert answer["stored"] == len(entries), (answer, entries)
            assert all(payload is not None for _id, payload in entries), (answer, entries)
            for message_id, _payload in entries:
                outcome.stored[message_id] += 1
                outcome.stored_by[message_id] = producer
            continue
        results = answer["results"]
        assert len(results) == len(entries), (answer, entries)
        for (message_id, payload), result in zip(entries, results):
            if payload is None:
                assert "error" in result, result
                continue
            assert result["id"] == message_id, (result, message_id)
            assert result.get("status") in ("stored", "duplicate"), result
            if result["status"] == "stored":
                outcome.stored[message_id] += 1
                outcome.stored_by[message_id] = producer
            else:
                outcome.duplicate[message_id] += 1


async def _consumer(port: int, group: str, name: str, subject: str, got: dict[str, list[str]],
                    payloads: dict[str, bytes], stop: asyncio.Event, rng: random.Random,
                    ack_share: float = 1.0, acked_ids: set[str] | None = None) -> None:
    client = await RawClient.connect(port)
    try:
        while not stop.is_set():
            answer = await client.pull(subject, group, name, wait_ms=rng.choice((0, 50, 300)),
                                       start="earliest", max_count=rng.randint(1, 50))
            assert "error" not in answer, answer
            seqs = answer["pull_seqs"]
            ids = []
            for payload in answer["payloads"]:
                msg = decode_message(payload)
                got[subject].append(msg.id)
                payloads[msg.id] = payload
                ids.append(msg.id)
            if seqs and rng.random() < ack_share:
                acked = await client.ack(subject, group, name, [[seqs[0], seqs[-1]]])
                assert "error" not in acked, acked
                if acked_ids is not None and acked["acked"] == len(seqs):
                    acked_ids.update(ids)
    finally:
        await client.close()


async def run_model(port: int, seed: int, clock: FakeClock,
                    check: Callable[[list[bytes], dict[str, Any]], None] | None = None,
                    lossy: bool = False) -> int:
    """The planned traffic of ``seed`` against the broker at ``port``, and every check of the
    module's docstring; ``check(payloads, answer)`` is called as each send's answer arrives.
    ``lossy``: a third group (LOSSY_GROUP, whose ack timeout the server sets short) acks about
    half of what it pulls; once the sends are answered the fake clock runs ack timeouts out
    until it acked every stored message. Returns how many messages were stored."""
    seed += SEED_BASE
    plan = plan_traffic(seed, clock)
    outcome = Outcome(defaultdict(int), defaultdict(int), {})
    got: dict[str, list[str]] = defaultdict(list)  # one consumer a subject: its order
    shared: dict[str, list[str]] = defaultdict(list)  # a group of two consumers a subject
    received: dict[str, bytes] = {}
    stop = asyncio.Event()
    consumers = [asyncio.create_task(_consumer(port, GROUP, f"c{i}", subject, got, received,
                                               stop, random.Random(seed * 100 + i)))
                 for i, subject in enumerate(SUBJECTS)]
    consumers += [asyncio.create_task(_consumer(port, GROUP + "2", f"d{i}", subject, shared,
                                                received, stop, random.Random(seed * 1000 + i)))
                  for i, subject in enumerate(SUBJECTS * 2)]
    lossy_got: dict[str, list[str]] = defaultdict(list)
    lossy_acked: set[str] = set()
    if lossy:
        consumers += [asyncio.create_task(_consumer(
            port, LOSSY_GROUP, f"e{i}", subject, lossy_got, received, stop,
            random.Random(seed * 7 + i), ack_share=0.5, acked_ids=lossy_acked))
            for i, subject in enumerate(SUBJECTS * 2)]
    try:
        await asyncio.gather(*(_producer(port, producer, requests, outcome, check)
                               for producer, requests in enumerate(plan.requests)))
        stored_ids = set(outcome.stored)
        assert all(count == 1 for count in outcome.stored.values()), [
            (i, c) for i, c in outcome.stored.items() if c != 1]
        assert stored_ids == set(plan.payload), set(plan.payload) - stored_ids
        for _ in range(600):
            if (sum(map(len, got.values())) >= len(stored_ids)
                    and sum(map(len, shared.values())) >= len(stored_ids)):
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # anything extra (a duplicate delivery) shows up meanwhile
        if lossy:
            for _ in range(1200):  # the dedup window no longer matters: every send was answered
                if lossy_acked >= stored_ids:
                    break
                clock.advance(LOSSY_ACK_TIMEOUT_MS)
                await asyncio.sleep(0.05)
            assert lossy_acked >= stored_ids, len(stored_ids - lossy_acked)
            redelivered = sum(map(len, lossy_got.values())) - len(stored_ids)
            assert redelivered > 0, "no ack ran out: the lossy group tested nothing"
    finally:
        stop.set()
        await asyncio.gather(*consumers)
    for deliveries in (got, shared):
        delivered = [i for ids in deliveries.values() for i in ids]
        assert len(delivered) == len(set(delivered)), "a message was delivered twice"
        assert set(delivered) == stored_ids, (len(stored_ids - set(delivered)),
                                              len(set(delivered) - stored_ids))
    for message_id, payload in received.items():
        assert payload == plan.payload[message_id]
    for (producer, subject), ids in plan.order.items():
        # Delivered within the subject in the order one connection sent them (those it
        # stored: another connection's resend of an id may reach the broker first).
        position = {i: n for n, i in enumerate(got[subject])}
        order = [position[i] for i in ids if outcome.stored_by[i] == producer]
        assert order == sorted(order), (producer, subject)
    return len(stored_ids)


def test_the_plan_is_the_seeds_alone_and_has_every_kind_of_entry() -> None:
    first, again = plan_traffic(3, FakeClock()), plan_traffic(3, FakeClock())
    assert first == again
    assert first != plan_traffic(4, FakeClock())
    entries = [entry for requests in first.requests for request in requests
               for entry in request.entries]
    invalid = [1 for _id, payload in entries if payload is None]
    resent = len(entries) - len(invalid) - len(first.payload)
    owner = {i: producer for (producer, _subject), ids in first.order.items() for i in ids}
    resent_by_another = {i for producer, requests in enumerate(first.requests)
                         for request in requests for i, payload in request.entries
                         if payload is not None and owner[i] != producer}
    assert invalid and resent > 0 and resent_by_another
    assert {request.compact for requests in first.requests for request in requests} == {
        True, False}


@pytest.mark.parametrize("seed", range(4))
async def test_random_pipelined_sends_are_stored_once_and_delivered_once_in_order(
        tmp_path, seed: int) -> None:
    clock = FakeClock()
    config = RealtimeConfig(data_dir=str(tmp_path / "rt"), port=0,
                            expiry_check_interval_ms=20, ack_timeout_ms=ACK_TIMEOUT_MS,
                            ack_timeout_ms_by_group={LOSSY_GROUP: LOSSY_ACK_TIMEOUT_MS})
    server = RealtimeServer(config, clock)
    await server.start()
    try:
        await run_model(server.port, seed, clock, lossy=True)
    finally:
        await server.stop()


# The MetaServer, the master and the slave share this one process. On a host at load 6 the
# heartbeats of test_replication_data's 2 s lease ran late and the master rightly stopped
# writing ("its lease ran out"); a slave 5 s behind (the default lag bound) leaves the in-sync
# set and the master rightly answers without it. Either fails this test for the host's sake,
# not the server's: an 8 s lease rides out 6 s of stalls (each test takes ~1.5 s longer to
# see the slave join, the heartbeats being a quarter of the lease apart), and the slave never
# leaves the set by lagging, so every answer below waited for it.
MODEL_LEASE_MS = 8_000
MODEL_INSYNC_LAG_MAX_MS = 3_600_000


@pytest.mark.parametrize("seed", range(2))
async def test_under_sync_replication_every_answered_send_is_in_the_slaves_copy_already(
        tmp_path, seed: int) -> None:
    config = MetaConfig(db_url=sqlite_url(tmp_path / "m.db"), port=0,
                        lease_ms=MODEL_LEASE_MS)
    async with start_metaserver(config) as meta:
        first = realtime(tmp_path, meta.url, FIRST, ack_timeout_ms=ACK_TIMEOUT_MS)
        second = realtime(tmp_path, meta.url, SECOND, ack_timeout_ms=ACK_TIMEOUT_MS)
        for server in (first, second):
            replica(server)._insync_lag_max_ms = MODEL_INSYNC_LAG_MAX_MS
        await first.start()
        await second.start()
        checked = [0]

        def in_the_copy(payloads: list[bytes], answer: dict[str, Any]) -> None:
            """Every message an answer says is stored (or was already) is in the slave's
            message log when the answer arrives, and the master still waits for that slave."""
            assert "error" not in answer, answer
            source = replica(first).source
            assert source is not None
            assert SECOND in source.tracker.waiting_set(source._clock_ms())
            copy = message_log_bytes(second)
            results = answer.get("results") or [{"status": "stored"}] * len(payloads)
            for payload, result in zip(payloads, results):
                if result.get("status") in ("stored", "duplicate"):
                    assert payload in copy, result
                    checked[0] += 1

        try:
            await wait_for(lambda: SECOND in first.role.insync, 20, "the slave in sync")
            assert (first.role.role, second.role.role) == ("master", "slave")
            stored = await run_model(first.port, seed, FakeClock(now_ms()), in_the_copy)
            assert checked[0] >= stored
        finally:
            await second.stop()
            await first.stop()
