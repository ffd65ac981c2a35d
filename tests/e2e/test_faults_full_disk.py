"""A full disk under a real server: sends are refused with a retriable error saying so, the
server stays up and serves what it stored, and takes sends again once space returns. Nothing
acknowledged is lost, duplicated or changed, also across a restart.

The disk is a small tmpfs (``tests/e2e/disk.py``) filled by a filler file from the test.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

import qmq
from tests.e2e.disk import fill, tmpfs
from tests.e2e.support import Ledger, RunningConsumer, close_all
from tests.harness import Cluster, start_delay, start_realtime, wait_for, wait_registered

# The tmpfs: room for the logs' first pages, the space their active segments allocate ahead
# (8 MiB each: StoreConfig/DelayStoreConfig.preallocate_step_bytes) and a filler.
DISK_BYTES = 48 << 20
BODY_BYTES = 2_048
# Bound on sending into a full disk before it refuses: the message log's allocated space
# (8 MiB, ~4,000 sends) takes sends first, as on a real disk.
SENDS_UNTIL_FULL_MAX = 8_000
BROKER_FLAGS = ("--ack-timeout-ms", "5000", "--consumer-expiry-ms", "5000")
PRODUCER_OPTIONS = {"retries_max": 0, "retry_budget_ms": 0, "send_timeout_ms": 15_000}


@contextmanager
def stopping(cluster: Cluster) -> Iterator[None]:
    """Stop the cluster's processes at the end of the block, before the tmpfs goes."""
    try:
        yield
    finally:
        cluster.stop_all()


def body_of(message_id: str) -> bytes:
    """The body sent under ``message_id``: seeded random bytes, so a changed byte shows."""
    return random.Random(message_id).randbytes(BODY_BYTES)


async def send_one(producer: qmq.Producer, subject: str, message_id: str, **kwargs) -> qmq.Receipt:
    return await producer.send(subject, body_of(message_id), message_id=message_id, **kwargs)


async def send_until_refused(producer: qmq.Producer, subject: str, prefix: str,
                             acknowledged: list[str], **kwargs) -> qmq.QmqError:
    """Send one at a time into a full disk (the last pages of open files still take a few)
    until a send is refused; returns that error. Acknowledged ids go into ``acknowledged``."""
    for n in range(SENDS_UNTIL_FULL_MAX):
        message_id = f"{prefix}-{n:05d}"
        try:
            await send_one(producer, subject, message_id, **kwargs)
        except qmq.QmqError as exc:
            return exc
        acknowledged.append(message_id)
    raise AssertionError(f"{SENDS_UNTIL_FULL_MAX} sends into a full disk were all stored")


def assert_exactly_once_and_intact(ledger: Ledger, acknowledged: list[str]) -> None:
    assert set(acknowledged) - ledger.ids == set(), "an acknowledged message was lost"
    assert ledger.duplicates() == {}
    changed = [d.id for d in ledger.deliveries if d.body != body_of(d.id)]
    assert changed == [], f"bodies changed: {changed[:5]}"


@pytest.mark.timeout(180)
async def test_a_full_disk_refuses_realtime_sends_retriably_and_they_resume_when_space_returns(
        cluster, tmp_path):
    with tmpfs(tmp_path / "disk", DISK_BYTES) as disk, stopping(cluster):
        cluster.start_meta()
        data_dir = str(disk / "rt1")
        broker = cluster.keep(await asyncio.to_thread(
            start_realtime, cluster.meta_url, data_dir, "rt1", *BROKER_FLAGS))
        await asyncio.to_thread(wait_registered, cluster.meta_url, {("realtime", "rt1"): "rw"})
        subject = "invoices.issued"
        acknowledged: list[str] = []
        ledger = Ledger()
        consumers = []
        try:
            async with qmq.Producer(cluster.meta_url, **PRODUCER_OPTIONS) as producer:
                for n in range(300):
                    await send_one(producer, subject, f"before-{n:03d}")
                    acknowledged.append(f"before-{n:03d}")
                filler = await asyncio.to_thread(fill, disk)
                refused = await send_until_refused(producer, subject, "full", acknowledged)
                assert isinstance(refused, qmq.Overloaded), repr(refused)
                assert refused.retriable
                assert "disk full" in refused.message
                assert broker.running

                # Still up and serving pulls (and acks) of everything it stored; one message
                # per pull, so the pull log's own appends meet the full disk too.
                consumers.append(await RunningConsumer(
                    cluster.meta_url, "billing", subject, ledger, name="biller",
                    start="earliest", pull_batch=1).start())
                await wait_for(lambda: ledger.ids >= set(acknowledged), 60,
                               "the stored messages to be delivered with the disk full")
                again = await send_until_refused(producer, subject, "still-full", acknowledged)
                assert isinstance(again, qmq.Overloaded), repr(again)

                filler.unlink()
                for n in range(100):
                    await send_one(producer, subject, f"after-{n:03d}")
                    acknowledged.append(f"after-{n:03d}")
                await wait_for(lambda: ledger.ids >= set(acknowledged), 60,
                               "the messages sent after space returned")
        finally:
            await close_all(consumers)
        assert_exactly_once_and_intact(ledger, acknowledged)
        assert broker.running

        # Across a restart the log holds exactly what was acknowledged, byte for byte.
        assert await asyncio.to_thread(broker.terminate) == 0
        cluster.keep(await asyncio.to_thread(
            start_realtime, cluster.meta_url, data_dir, "rt1", *BROKER_FLAGS))
        replay = Ledger()
        auditor = await RunningConsumer(cluster.meta_url, "audit", subject, replay,
                                        name="auditor", start="earliest").start()
        try:
            await wait_for(lambda: replay.ids >= set(acknowledged), 60,
                           "a new group to read every acknowledged message after a restart")
        finally:
            await close_all([auditor])
        assert_exactly_once_and_intact(replay, acknowledged)
        assert replay.ids == set(acknowledged)
    print(f"{len(acknowledged)} acknowledged; refused with the disk full: {refused.message}")


DELAY_MS = 1_500  # delayed sends come due soon after they are stored


@pytest.mark.timeout(180)
async def test_a_full_disk_refuses_delayed_sends_retriably_and_due_messages_still_arrive_once(
        cluster, tmp_path):
    with tmpfs(tmp_path / "disk", DISK_BYTES) as disk, stopping(cluster):
        cluster.start_meta()
        cluster.start_broker("rt1", *BROKER_FLAGS)
        data_dir = str(disk / "d1")
        delay = cluster.keep(await asyncio.to_thread(
            start_delay, cluster.meta_url, data_dir, "d1", "--bucket-ms", "1000"))
        await asyncio.to_thread(wait_registered, cluster.meta_url,
                                {("realtime", "rt1"): "rw", ("delay", "d1"): "rw"})
        subject = "orders.timeout"
        acknowledged: list[str] = []
        ledger = Ledger()
        consumers = [await RunningConsumer(cluster.meta_url, "cancel", subject, ledger,
                                           name="canceller", start="earliest").start()]
        try:
            async with qmq.Producer(cluster.meta_url, **PRODUCER_OPTIONS) as producer:
                for n in range(100):
                    receipt = await send_one(producer, subject, f"before-{n:03d}",
                                             delay=DELAY_MS)
                    assert receipt.delayed
                    acknowledged.append(f"before-{n:03d}")
                filler = await asyncio.to_thread(fill, disk)
                refused = await send_until_refused(producer, subject, "full", acknowledged,
                                                   delay=DELAY_MS)
                assert isinstance(refused, qmq.Overloaded), repr(refused)
                assert refused.retriable
                assert "disk full" in refused.message
                # Still up: what it stored comes due and is dispatched (its dispatch records
                # meet the full disk too; the realtime broker de-duplicates a re-dispatch).
                await wait_for(lambda: ledger.ids >= set(acknowledged), 60,
                               "the stored delayed messages to arrive with the disk full")
                assert delay.running

                filler.unlink()
                for n in range(100):
                    await send_one(producer, subject, f"after-{n:03d}", delay=DELAY_MS)
                    acknowledged.append(f"after-{n:03d}")
                await wait_for(lambda: ledger.ids >= set(acknowledged), 60,
                               "the delayed messages sent after space returned")
        finally:
            await close_all(consumers)
        assert_exactly_once_and_intact(ledger, acknowledged)
        assert delay.running
        assert await asyncio.to_thread(delay.terminate) == 0
    print(f"{len(acknowledged)} delayed sends acknowledged; refused with the disk full: "
          f"{refused.message}")
