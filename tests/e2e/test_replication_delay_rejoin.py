"""A delay group's old master rejoining (docs/REPLICATION.md 8.6, 16), with real processes and
``sync`` replication: the master holds delays and has dispatched some; its slave is frozen
(SIGSTOP) so that a last batch of sends reaches only the master's disk, unanswered; the master
is killed (kill -9), the slave promoted, and the old master restarted on its old data dir.

It joins as a slave and throws its copy away (a delay store cannot cut back in place), so it
ends holding exactly the new master's delay log and done journal. Switched back to master, it
never dispatches the tail it alone had. Every acknowledged delay is delivered once, none early,
and no cancelled one."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

import qmq
from tests.e2e import replication_support as replication
from tests.e2e.replication_support import start_leased_meta
from tests.e2e.support import same_bytes
from tests.harness import (
    Arrivals, Cluster, ServerProcess, admin, consume_into, epoch_ms, run_qmq, start_realtime,
    wait_for, wait_registered,
)
from tests.rawclient import RawClient
from tests.segment_files import segment_data_bytes
from wire.message import Message

FLAGS = ("--bucket-ms", "1000", "--flush", "sync", "--replication", "sync")
OLD_ID, NEW_ID = "00000000000d1a01", "00000000000d1b02"
CONSUMER_OPTIONS = {"wait_ms": 500, "heartbeat_interval_ms": 500, "reconnect_backoff_max_ms": 500,
                    "start": "earliest"}
SUBJECT = "orders.timeout"
COUNT = 400  # acknowledged delays, due over DUE_OVER_MS from LEAD_MS after sending began
LEAD_MS = 2_000
DUE_OVER_MS = 8_000
CANCELS = 20  # cancelled ones, due CANCEL_LEAD_MS after they were sent
CANCEL_LEAD_MS = 5_000
TAIL = 30  # sends only the old master wrote (the slave frozen): never acknowledged
TAIL_LEAD_MS = 12_000  # the tail falls due after the old master is master again
SEEN_MS = 1_500  # a wrongly dispatched one has arrived this long after its due time


def group_row(url: str) -> dict:
    return replication.group_row(url, "d1")


def log_bytes(data_dir: Path, log_dir: str) -> int:
    """The data in a log's files (not the space allocated after it), a file deleted while
    they are read (the rejoining server resetting its copy) counting 0."""
    directory = data_dir / log_dir
    total = 0
    for name in os.listdir(directory):
        try:
            total += (segment_data_bytes(directory / name) if name.endswith(".log")
                      else os.path.getsize(directory / name))
        except FileNotFoundError:
            pass
    return total


def member(cluster: Cluster, name: str, me: str) -> ServerProcess:
    return replication.start_member(cluster, "delay", "d1", name, *FLAGS, me=me)


@pytest.mark.timeout(180)
async def test_a_killed_delay_master_rejoins_holding_only_the_new_masters_copy_and_never_dispatches_its_own_tail(
        cluster: Cluster):
    url = start_leased_meta(cluster).url
    cluster.keep(start_realtime(url, str(cluster.root / "rt1"), "rt1"))
    old = member(cluster, "old", OLD_ID)
    await asyncio.to_thread(wait_registered, url, {("realtime", "rt1"): "rw",
                                                   ("delay", "d1"): "rw"})
    slave = member(cluster, "new", NEW_ID)
    await wait_for(lambda: group_row(url)["insync"] == [NEW_ID], 60, "the slave in sync",
                   in_thread=True)
    arrivals = Arrivals()
    try:
        async with qmq.Consumer(url, group="orders", **CONSUMER_OPTIONS) as consumer:
            consuming = asyncio.create_task(consume_into(consumer.subscribe(SUBJECT), arrivals))
            async with qmq.Producer(url, retries_max=12) as producer:
                first_ms = epoch_ms() + LEAD_MS
                receipts = await asyncio.gather(*(
                    producer.send(SUBJECT, b"due", deliver_at=first_ms + n * DUE_OVER_MS // COUNT)
                    for n in range(COUNT)))
                late = await asyncio.gather(*(
                    producer.send(SUBJECT, b"cancelled", deliver_at=epoch_ms() + CANCEL_LEAD_MS)
                    for _ in range(CANCELS)))
                assert all(r.status == "stored" and r.delayed for r in receipts + late)
                outcomes = await asyncio.gather(*(producer.cancel(r) for r in late))
                assert set(outcomes) == {"cancelled"}, outcomes
            expected = {r.message_id for r in receipts}
            cancelled = {r.message_id for r in late}
            # Some dispatched, so the done journal has records of its own to copy.
            await wait_for(lambda: len(arrivals.ids) >= COUNT // 10, 60,
                           "a tenth of the delays dispatched", interval_s=0.01)

            # Freeze the slave; its pending long poll is answered empty within 500 ms and sits
            # unread, so nothing written after this pause reaches it.
            os.kill(slave.process.pid, signal.SIGSTOP)
            await asyncio.sleep(1.0)
            before = log_bytes(cluster.root / "old", "delaylog")
            raw = await RawClient.connect(old.port)
            tail_due_ms = epoch_ms() + TAIL_LEAD_MS
            tail = [Message.create(SUBJECT, b"tail", now_ms=epoch_ms(), id=f"tail-{n}",
                                   deliver_at_ms=tail_due_ms) for n in range(TAIL)]
            sending = asyncio.create_task(raw.send(*tail))
            await wait_for(lambda: log_bytes(cluster.root / "old", "delaylog") > before, 30,
                           "the tail on the old master's disk", in_thread=True)
            epoch = group_row(url)["epoch"]
            await asyncio.to_thread(old.kill9)
            os.kill(slave.process.pid, signal.SIGCONT)
            [answer] = await asyncio.gather(sending, return_exceptions=True)
            tail_acked = isinstance(answer, dict) and any(
                "status" in r for r in answer.get("results", []))
            assert not tail_acked, answer  # the kill came before the master answered
            await wait_for(lambda: group_row(url)["epoch"] > epoch
                           and group_row(url)["master_id"] == NEW_ID, 60, "the promotion",
                           in_thread=True)

            # The old master comes back on its old data dir and joins as a slave.
            rejoined = member(cluster, "old", OLD_ID)
            await wait_for(lambda: any(
                r.get("server_id") == OLD_ID and r["role"] == "slave" and r["state"] != "offline"
                for r in admin(url, "brokers")), 60, "the old master to rejoin as a slave",
                in_thread=True)
            for log_dir in ("delaylog", "donelog"):
                await wait_for(lambda: same_bytes(cluster.root / "new", cluster.root / "old",
                                                  log_dir), 60,
                               f"the old master's {log_dir} to be the new master's",
                               in_thread=True)
            assert "copy thrown away" in rejoined.text(), rejoined.text()[-3000:]
            await wait_for(lambda: group_row(url)["insync"] == [OLD_ID], 60,
                           "the old master in sync", in_thread=True)

            # Master again, it holds nothing the new master lacked: its tail never falls due.
            switched = await asyncio.to_thread(run_qmq, "admin", "switchover", "d1", "--to",
                                               OLD_ID, "--meta", url)
            assert switched.returncode == 0, switched.stdout + switched.stderr
            await wait_for(lambda: group_row(url)["master_id"] == OLD_ID, 60,
                           "the switchover back", in_thread=True)
            await wait_for(lambda: arrivals.ids >= expected, 60, "every delay delivered",
                           interval_s=0.1)
            await wait_for(lambda: epoch_ms() >= tail_due_ms + SEEN_MS, 60,
                           "the tail's due time to pass")
            consuming.cancel()
            await raw.close()
    finally:
        if slave.running:
            os.kill(slave.process.pid, signal.SIGCONT)
    assert expected - arrivals.ids == set()
    assert arrivals.early() == []
    assert arrivals.duplicates() == {}
    assert arrivals.ids & cancelled == set()
    assert {f"tail-{n}" for n in range(TAIL)} & arrivals.ids == set()
    print(f"{len(expected)} delays delivered; {arrivals.lateness_summary()}")
