"""Retries and dead letters against real processes: ``msg.nack`` with an explicit delay and on
the group's schedule (``qmq realtime --retry-backoff-ms 300,600,900 --retries-max 3``), a
handler that always raises ending in ``%dead%<subject>%<group>``, and the ``qmq admin dead``
commands that list, re-drive and purge it."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import timedelta

import pytest

import qmq
from wire.message import retry_subject
from tests.harness import Arrivals, run_qmq, start_delay_cluster, wait_for

BACKOFF_MS = (300, 600, 900)
RETRIES_MAX = 3
REALTIME_FLAGS = ("--retry-backoff-ms", ",".join(map(str, BACKOFF_MS)),
                  "--retries-max", str(RETRIES_MAX))
GAP_SLACK_MS = 1_500  # a retry may come this much after its step, no more
CONSUMER_OPTIONS = {"wait_ms": 500, "heartbeat_interval_ms": 500, "reconnect_backoff_max_ms": 500,
                    "start": "earliest"}


def assert_gaps_follow(gaps_ms: list[float], steps_ms: tuple[int, ...] | list[int]) -> None:
    """Each observed gap is at least its configured step and less than step + GAP_SLACK_MS."""
    assert len(gaps_ms) == len(steps_ms), (gaps_ms, steps_ms)
    for gap_ms, step_ms in zip(gaps_ms, steps_ms):
        assert step_ms <= gap_ms < step_ms + GAP_SLACK_MS, (
            f"gap {gap_ms:.0f} ms for a {step_ms} ms step (all gaps {gaps_ms})")


@pytest.mark.timeout(90)
async def test_a_nack_comes_back_after_its_explicit_delay_or_after_each_step_of_the_schedule(
        cluster):
    await asyncio.to_thread(start_delay_cluster, cluster, realtime_flags=REALTIME_FLAGS)
    subject, group = "payments.capture", "psp"
    explicit_ms = 1_200  # far from the schedule's first step (300 ms), so it cannot pass by luck
    arrivals = Arrivals()
    nacked_at: dict[str, float] = {}  # origin id -> monotonic time of its latest nack
    gaps: dict[str, list[float]] = {"explicit": [], "schedule": []}
    done: set[str] = set()

    async with qmq.Consumer(cluster.meta_url, group=group, **CONSUMER_OPTIONS) as consumer:
        subscription = consumer.subscribe(subject)

        async def consume() -> None:
            async for msg in subscription:
                seen = time.monotonic()
                arrivals.record(msg)
                kind = msg.body.decode()
                origin = msg.properties.get("qmq-origin-id", msg.id)
                if msg.retries:
                    gaps[kind].append((seen - nacked_at[origin]) * 1000)
                    assert msg.wire_subject == retry_subject(subject, group)
                    assert msg.subject == subject
                if kind == "explicit" and msg.retries == 0:
                    nacked_at[origin] = time.monotonic()
                    await msg.nack(retry_after=timedelta(milliseconds=explicit_ms))
                elif kind == "schedule" and msg.retries < RETRIES_MAX:
                    nacked_at[origin] = time.monotonic()
                    await msg.nack()
                else:
                    await msg.ack()
                    done.add(kind)

        consuming = asyncio.create_task(consume())
        async with qmq.Producer(cluster.meta_url) as producer:
            explicit = await producer.send(subject, b"explicit")
            scheduled = await producer.send(subject, b"schedule")
        await wait_for(lambda: done == {"explicit", "schedule"} or consuming.done(), 30,
                       "both messages to finish their retries")
        await asyncio.sleep(0.5)  # room for an extra retry to show up
        consuming.cancel()
        if not consuming.cancelled() and consuming.done():
            consuming.result()  # an assertion inside the consumer loop

    print(f"explicit {explicit_ms} ms -> gaps {[round(g) for g in gaps['explicit']]} ms; "
          f"schedule {BACKOFF_MS} -> gaps {[round(g) for g in gaps['schedule']]} ms")
    assert_gaps_follow(gaps["explicit"], [explicit_ms])
    assert_gaps_follow(gaps["schedule"], BACKOFF_MS)
    retries = {a.body: [] for a in arrivals.items}
    for arrival in arrivals.items:
        retries[arrival.body].append(arrival.retries)
    assert retries == {b"explicit": [0, 1], b"schedule": [0, 1, 2, 3]}
    assert {a.properties.get("qmq-origin-id", a.id) for a in arrivals.items} == {
        explicit.message_id, scheduled.message_id}
    assert arrivals.early() == []


def _cli_json(*args: str) -> dict:
    result = run_qmq(*args, "--json")
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-2000:]}"
    return json.loads(result.stdout)


def _cli_text(*args: str) -> str:
    result = run_qmq(*args)
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-2000:]}"
    return result.stdout


@pytest.mark.timeout(120)
async def test_a_handler_that_always_raises_ends_in_the_dead_letters_and_can_be_redriven(cluster):
    await asyncio.to_thread(start_delay_cluster, cluster, realtime_flags=REALTIME_FLAGS)
    subject, group = "invoices.send", "mailer"
    meta = ("--meta", cluster.meta_url)
    calls: list[tuple[float, int, str]] = []  # (monotonic time, retries, id) per handler call

    failing = qmq.Consumer(cluster.meta_url, group=group, **CONSUMER_OPTIONS)

    @failing.handler(subject)
    async def always_fails(msg: qmq.ReceivedMessage) -> None:
        calls.append((time.monotonic(), msg.retries, msg.id))
        raise RuntimeError(f"mail server rejected invoice {msg.body.decode()}")

    async with failing:
        async with qmq.Producer(cluster.meta_url) as producer:
            sent = await producer.send(subject, b"INV-42")

        def listed() -> list[dict]:
            rows = _cli_json("admin", "dead", "list", "--subject", subject, "--group", group,
                             *meta)["dead"]
            return rows

        rows = await wait_for(listed, 30, "the dead letter to be listed", interval_s=0.5,
                              in_thread=True)
        await asyncio.sleep(0.5)  # room for a call after the last retry, which must not come

    assert [retries for _at, retries, _id in calls] == [0, 1, 2, 3]
    assert calls[0][2] == sent.message_id
    gaps_ms = [(later[0] - earlier[0]) * 1000 for earlier, later in zip(calls, calls[1:])]
    print(f"schedule {BACKOFF_MS} -> handler call gaps {[round(g) for g in gaps_ms]} ms")
    assert_gaps_follow(gaps_ms, BACKOFF_MS)
    [row] = rows
    assert row["subject"] == subject and row["group"] == group
    assert row["retries"] == RETRIES_MAX + 1
    assert row["id"] == f"{sent.message_id}.r{RETRIES_MAX + 1}"
    assert row["body_preview"] == "INV-42"
    table = await asyncio.to_thread(_cli_text, "admin", "dead", "list", *meta)
    [table_row] = [line.split() for line in table.splitlines() if row["id"] in line]
    assert [subject, group] == table_row[2:4]

    # Re-drive to a consumer of the group whose handler now succeeds.
    redriven: list[qmq.ReceivedMessage] = []
    fixed = qmq.Consumer(cluster.meta_url, group=group, **CONSUMER_OPTIONS)

    @fixed.handler(subject)
    async def succeeds(msg: qmq.ReceivedMessage) -> None:
        redriven.append(msg)

    async with fixed:
        out = await asyncio.to_thread(_cli_text, "admin", "dead", "redrive", subject, group, *meta)
        assert out.strip() == f"redriven 1 message(s) to {subject}"
        await wait_for(lambda: redriven, 20, "the re-driven message")
        await asyncio.sleep(0.5)
    [again] = redriven
    assert again.body == b"INV-42"
    assert again.retries == 0
    assert again.wire_subject == subject
    assert again.id.startswith(sent.message_id)

    out = await asyncio.to_thread(_cli_text, "admin", "dead", "purge", subject, group, *meta)
    assert out.strip() == f"purged 1 dead letter(s) of {subject} / {group}"
    after = await asyncio.to_thread(_cli_json, "admin", "dead", "list", "--subject", subject,
                                    "--group", group, *meta)
    assert after["dead"] == [] and after["errors"] == []
