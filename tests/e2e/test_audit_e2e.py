"""The trace and the Spark audit against a real run: ``qmq up`` (tracing on by default) serves a
scenario whose every outcome the test knows, then ``qmq audit`` must report exactly that.

The scenario, on two subjects:

- ``orders.paid`` (realtime), group ``billing``: a consumer process holds the first HELD
  messages unacked and is killed with kill -9, so they are redelivered to the survivor after
  the consumer expiry; LATER more messages; one message nacked once (retried through the delay
  server, then acked); one nacked every time until it is dead-lettered (``--retries-max 1``).
- ``orders.timeout`` (delayed), group ``reaper``: DELAYED messages due a second or two ahead,
  and one more cancelled right after its send (never delivered).
- ``orders.tagged``: TAGGED messages, half tagged ``vip``, to a group ``vip`` that subscribes
  with the tag filter ``vip`` (it must be expected to receive only those), a group ``all``
  without a filter, and a broadcast group ``cache`` of two consumers; one of them leaves before
  LATE_TAGGED more are sent, which only the others are owed.

The audit finds both servers' trace directories under the data dir (``--data-dir``) after a
graceful stop (so every event is flushed) and must exit 0 (nothing lost, overdue or early:
redeliveries and dead letters do not fail the gate, and no group is owed what its
subscriptions exclude), with Parquet tables and report.md giving the counts below.
"""

from __future__ import annotations

import asyncio
import json
import time
from datetime import timedelta
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import qmq
from tests.harness import Cluster, run_qmq, start_consumer_worker, wait_for

PAID, TIMEOUT, TAGGED = "orders.paid", "orders.timeout", "orders.tagged"
BILLING, REAPER, VIP, ALL, CACHE = "billing", "reaper", "vip", "all", "cache"
TAGGED_COUNT = 6  # half of them tagged vip
LATE_TAGGED = 2  # sent after cache-2 left: one vip, one not
HELD = 12  # held by the consumer that is killed
LATER = 8  # realtime messages sent after the kill
DELAYED = 4  # delayed messages that are delivered
RETRY_ONCE, ALWAYS_FAILS = "paid-retry-once", "paid-always-fails"
UP_FLAGS = ("--consumer-expiry-ms", "2000", "--retry-backoff-ms", "300", "--retries-max", "1")
CONSUMER_OPTIONS = {"wait_ms": 500, "heartbeat_interval_ms": 300,
                    "reconnect_backoff_max_ms": 500, "start": "earliest"}
AUDIT_TIMEOUT_S = 600  # a fresh JVM and a few dozen Spark jobs on a heavily loaded 2-core machine


def parquet_rows(directory: Path) -> list[dict]:
    """A Spark output directory's rows (pyarrow skips _SUCCESS and the .crc files)."""
    return pq.read_table(str(directory)).to_pylist()


def rows_by(rows: list[dict], *keys: str) -> dict[tuple, dict]:
    return {tuple(row[k] for k in keys): row for row in rows}


async def run_scenario(cluster: Cluster, meta_url: str) -> dict:
    """Drive the scenario; return what happened as the test saw it."""
    held_ids = [f"paid-held-{i:02d}" for i in range(HELD)]
    later_ids = [f"paid-later-{i:02d}" for i in range(LATER)]
    delayed_ids = [f"timeout-{i:02d}" for i in range(DELAYED)]
    cancelled_id = "timeout-cancelled"
    got: dict[str, list[tuple[str, int, int]]] = {}  # user id -> (group, retries, redelivered)
    handled: dict[str, list[int]] = {RETRY_ONCE: [], ALWAYS_FAILS: []}  # retries per call

    worker = cluster.keep(await asyncio.to_thread(start_consumer_worker, meta_url, BILLING, PAID,
                                                  "doomed", "--hold", "--start", "earliest"))
    async with qmq.Producer(meta_url) as producer:
        for message_id in held_ids:
            await producer.send(PAID, message_id.encode(), message_id=message_id)
        await wait_for(lambda: {r["id"] for r in worker.records()} >= set(held_ids), 60,
                       "the doomed consumer to hold its messages")
        worker.kill9()

        async def billing_loop(subscription) -> None:
            async for msg in subscription:
                origin = msg.properties.get("qmq-origin-id", msg.id)
                got.setdefault(origin, []).append((BILLING, msg.retries, msg.redelivered))
                if origin == ALWAYS_FAILS:
                    handled[origin].append(msg.retries)
                    await msg.nack()  # the schedule: 300 ms, then dead after retries_max 1
                elif origin == RETRY_ONCE and msg.retries == 0:
                    handled[origin].append(msg.retries)
                    await msg.nack(retry_after=timedelta(milliseconds=500))
                else:
                    if origin == RETRY_ONCE:
                        handled[origin].append(msg.retries)
                    await msg.ack()

        async def reaper_loop(subscription) -> None:
            async for msg in subscription:
                got.setdefault(msg.id, []).append((REAPER, msg.retries, msg.redelivered))
                await msg.ack()

        billing = qmq.Consumer(meta_url, group=BILLING, consumer_id="survivor",
                               **CONSUMER_OPTIONS)
        reaper = qmq.Consumer(meta_url, group=REAPER, consumer_id="reaper-1", **CONSUMER_OPTIONS)
        async with billing, reaper:
            tasks = [asyncio.create_task(billing_loop(billing.subscribe(PAID))),
                     asyncio.create_task(reaper_loop(reaper.subscribe(TIMEOUT)))]
            for message_id in later_ids + [RETRY_ONCE, ALWAYS_FAILS]:
                await producer.send(PAID, message_id.encode(), message_id=message_id)
            for i, message_id in enumerate(delayed_ids):
                await producer.send(TIMEOUT, message_id.encode(), message_id=message_id,
                                    delay=timedelta(milliseconds=1_000 + 300 * i))
            doomed = await producer.send(TIMEOUT, b"cancelled", message_id=cancelled_id,
                                         delay=timedelta(seconds=5))
            await producer.cancel(doomed)
            expected = set(held_ids + later_ids + delayed_ids + [RETRY_ONCE])

            def finished() -> bool:
                if any(t.done() for t in tasks):
                    return True  # a loop failed: stop waiting and report it
                return (expected <= set(got) and handled[RETRY_ONCE] == [0, 1]
                        and handled[ALWAYS_FAILS] == [0, 1])

            await wait_for(finished, 60, "every message to be settled")
            for task in tasks:
                if task.done():
                    task.result()
            # The dead copy is durable once the broker answered the second nack; the dead-letter
            # list says so from the outside, and the cancelled message's time passes meanwhile.
            await wait_for(lambda: dead_letters(meta_url), 30, "the dead letter to be listed",
                           interval_s=0.5, in_thread=True)
            cancel_due_ms = doomed.deliver_at_ms + 500
            await wait_for(lambda: time.time() * 1000 > cancel_due_ms, 10,
                           "the cancelled message's deliver time to pass")
            for task in tasks:
                task.cancel()
    return {"held": held_ids, "later": later_ids, "delayed": delayed_ids,
            "cancelled": cancelled_id, "got": got, "handled": handled,
            "doomed_records": worker.records()}


async def run_tagged_and_broadcast(meta_url: str) -> dict[str, set[str]]:
    """TAGGED messages to a vip-filtered group, an unfiltered one and two broadcast consumers,
    then LATE_TAGGED more after one broadcast consumer left. Returns the ids each got."""
    got: dict[str, set[str]] = {}

    async def take(name: str, subscription) -> None:
        async for msg in subscription:
            got.setdefault(name, set()).add(msg.id)
            await msg.ack()

    def tagged(i: int) -> tuple[str, list[str]]:
        return f"tagged-{i:02d}", ["vip"] if i % 2 == 0 else ["std"]

    consumers = {
        VIP: qmq.Consumer(meta_url, group=VIP, consumer_id="vip-1", **CONSUMER_OPTIONS),
        ALL: qmq.Consumer(meta_url, group=ALL, consumer_id="all-1", **CONSUMER_OPTIONS),
        "cache-1": qmq.Consumer(meta_url, group=CACHE, consumer_id="cache-1", broadcast=True,
                                **CONSUMER_OPTIONS),
        "cache-2": qmq.Consumer(meta_url, group=CACHE, consumer_id="cache-2", broadcast=True,
                                **CONSUMER_OPTIONS),
    }
    tasks = []
    for name, consumer in consumers.items():
        await consumer.__aenter__()
        tags = ["vip"] if name == VIP else None
        tasks.append(asyncio.create_task(take(name, consumer.subscribe(TAGGED, tags=tags))))
    try:
        async with qmq.Producer(meta_url) as producer:
            for i in range(TAGGED_COUNT):
                message_id, tags = tagged(i)
                await producer.send(TAGGED, b"t", message_id=message_id, tags=tags)
            first = {tagged(i)[0] for i in range(TAGGED_COUNT)}
            await wait_for(lambda: all(got.get(n, set()) >= first
                                       for n in (ALL, "cache-1", "cache-2")), 60,
                           "the tagged messages to reach every unfiltered consumer")
            await consumers.pop("cache-2").__aexit__(None, None, None)  # leaves
            for i in range(TAGGED_COUNT, TAGGED_COUNT + LATE_TAGGED):
                message_id, tags = tagged(i)
                await producer.send(TAGGED, b"t", message_id=message_id, tags=tags)
            everything = {tagged(i)[0] for i in range(TAGGED_COUNT + LATE_TAGGED)}
            vip = {m for m in everything if int(m[-2:]) % 2 == 0}
            await wait_for(lambda: got.get(ALL, set()) >= everything
                           and got.get("cache-1", set()) >= everything
                           and got.get(VIP, set()) >= vip, 60,
                           "the late tagged messages to arrive")
    finally:
        for task in tasks:
            task.cancel()
        for consumer in consumers.values():
            await consumer.__aexit__(None, None, None)
    return got


def dead_letters(meta_url: str) -> list[dict]:
    result = run_qmq("admin", "dead", "list", "--subject", PAID, "--group", BILLING,
                     "--meta", meta_url, "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout)["dead"]


@pytest.mark.slow
@pytest.mark.timeout(1200)
async def test_the_audit_of_a_real_run_reports_exactly_the_redeliveries_retries_dead_letter_and_cancel(  # noqa: E501
        cluster, tmp_path):
    up = await asyncio.to_thread(cluster.start_up, *UP_FLAGS)
    seen = await run_scenario(cluster, up.meta_url)
    tagged = await run_tagged_and_broadcast(up.meta_url)
    assert tagged[VIP] == {f"tagged-{i:02d}" for i in range(0, TAGGED_COUNT + LATE_TAGGED, 2)}
    assert seen["cancelled"] not in seen["got"], "a cancelled message was delivered"
    redelivered = [i for i in seen["held"] if any(r >= 1 for _g, _r, r in seen["got"][i])]
    assert redelivered == seen["held"], "the killed consumer's messages must come back"

    assert await asyncio.to_thread(up.terminate, 60) == 0, up.text()[-3000:]
    data_dir = tmp_path / "up"
    out = tmp_path / "audit"
    started = time.monotonic()
    result = await asyncio.to_thread(
        run_qmq, "audit", "--data-dir", str(data_dir),
        "--out", str(out), "--master", "local[2]", "--driver-memory", "1g",
        timeout_s=AUDIT_TIMEOUT_S)
    print(f"qmq audit took {time.monotonic() - started:.1f} s")
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr[-4000:]}"
    assert result.stdout.startswith("PASS: 0 lost, 0 overdue, 0 early")
    assert (f"trace directories: {data_dir / 'delay' / 'trace'}, "
            f"{data_dir / 'realtime' / 'trace'}") in result.stderr

    paid_total = HELD + LATER + 2  # + the retried message + the dead one
    delivery = rows_by(parquet_rows(out / "delivery"), "subject", "group")
    assert set(delivery) == {(PAID, BILLING), (TIMEOUT, REAPER), (TAGGED, VIP), (TAGGED, ALL),
                             (TAGGED, f"{CACHE}#cache-1"), (TAGGED, f"{CACHE}#cache-2")}
    counts = ("produced", "delivered", "acked", "lost", "overdue", "in_flight", "duplicated")
    assert {k: delivery[(PAID, BILLING)][k] for k in counts} == {
        "produced": paid_total, "delivered": paid_total, "acked": paid_total - 1,  # dead: no ack
        "lost": 0, "overdue": 0, "in_flight": 0, "duplicated": HELD}  # held: pulled twice
    assert {k: delivery[(TIMEOUT, REAPER)][k] for k in counts} == {
        "produced": DELAYED, "delivered": DELAYED, "acked": DELAYED,  # the cancelled: not due
        "lost": 0, "overdue": 0, "in_flight": 0, "duplicated": 0}
    every, before_leave = TAGGED_COUNT + LATE_TAGGED, TAGGED_COUNT
    for group, owed in ((VIP, every // 2), (ALL, every), (f"{CACHE}#cache-1", every),
                        (f"{CACHE}#cache-2", before_leave)):
        assert {k: delivery[(TAGGED, group)][k] for k in counts} == {
            "produced": owed, "delivered": owed, "acked": owed, "lost": 0, "overdue": 0,
            "in_flight": 0, "duplicated": 0}, group

    delay = rows_by(parquet_rows(out / "delay"), "subject")
    assert {k: delay[(TIMEOUT,)][k] for k in ("scheduled", "dispatched", "cancelled", "early")} \
        == {"scheduled": DELAYED + 1, "dispatched": DELAYED, "cancelled": 1, "early": 0}
    # The two retry copies (.r1 of each nacked message) went through the delay server.
    assert {k: delay[(PAID,)][k] for k in ("scheduled", "dispatched", "cancelled", "early")} \
        == {"scheduled": 2, "dispatched": 2, "cancelled": 0, "early": 0}

    summary = rows_by(parquet_rows(out / "retry_summary"), "subject", "group")
    assert {k: summary[(PAID, BILLING)][k] for k in (
        "messages", "retried", "dead", "succeeded_after_retries", "max_retries")} == {
        "messages": paid_total, "retried": 2, "dead": 1, "succeeded_after_retries": 1,
        "max_retries": 2}
    retries = rows_by(parquet_rows(out / "retries"), "subject", "group", "retries")
    assert {key[2]: (row["messages"], row["acked"], row["dead"])
            for key, row in retries.items() if key[:2] == (PAID, BILLING)} == {
        0: (paid_total - 2, paid_total - 2, 0), 1: (1, 1, 0), 2: (1, 0, 1)}

    anomalies = parquet_rows(out / "anomalies")
    duplicates = {a["msg_id"]: a for a in anomalies if a["kind"] == "duplicate"}
    assert set(duplicates) == set(seen["held"])
    for anomaly in duplicates.values():  # pulled by the killed consumer, then by the survivor
        pulls = [(e["event"], e["consumer"]) for e in anomaly["history"]
                 if e["event"] in ("pulled", "redelivered")]
        assert pulls == [("pulled", "doomed"), ("redelivered", "survivor"),
                         ("pulled", "survivor")], pulls
    assert [(a["kind"], a["msg_id"]) for a in anomalies if a["kind"] != "duplicate"] == [
        ("dead", f"{ALWAYS_FAILS}.r2")]
    assert not any(a["origin_id"] == seen["cancelled"] for a in anomalies)

    report = (out / "report.md").read_text()
    assert "- Verdict: **PASS** (0 lost, 0 overdue, 0 early)" in report
    assert (f"| {PAID} | {BILLING} | {paid_total} | {paid_total} | {paid_total - 1} | 0 | 0 | "
            f"0 | {HELD} |") in report
    assert (f"| {TIMEOUT} | {REAPER} | {DELAYED} | {DELAYED} | {DELAYED} | 0 | 0 | 0 | "
            "0 |") in report
    assert "PASS: 0 lost, 0 overdue, 0 early" in (out / "report.html").read_text()
    assert f"| {PAID} | {BILLING} | {paid_total} | 2 | 1 | 1 | 2 |" in report  # retry summary
    delay_rows = [line for line in report.splitlines()
                  if line.startswith(f"| {TIMEOUT} | {DELAYED + 1} | {DELAYED} | 1 | ")]
    assert len(delay_rows) == 1 and delay_rows[0].endswith(" | 0 |"), delay_rows  # 0 early
