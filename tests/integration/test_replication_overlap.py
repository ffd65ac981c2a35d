"""A sync commit's records reach a tailing slave while the master fsyncs them (the overlap,
docs/REPLICATION.md 8.3): a batch the master cuts within its run is never shipped. With a real
MetaServer, a master and a ``sync`` slave in one process, a full disk on the master (at the
message log's write, at the consumer log's write after it, at the delay log's write), while the
slave tails: the refused batch never reaches the slave, the master writes other records at its
offsets, and both logs end equal byte for byte, every answered send on the slave."""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import pytest

from delayserver.config import DelayConfig
from delayserver.server import DelayServer
from logstore.faults import FaultPlan
from logstore.fileio import FileHandle, OsFile
from metaserver import MetaConfig, sqlite_url, start_metaserver
from realtime.config import RealtimeConfig
from realtime.server import RealtimeServer
from serverkit import server_id
from serverkit.replica import Replica
from tests.harness import wait_for
from tests.rawclient import RawClient
from tests.segment_files import read_segment_data
from wire.message import Message, encode_message

FIRST, SECOND = "00000000000000a1", "00000000000000b2"
LEASE_MS = 2_000
BIG = b"x" * 20_000  # larger than any block a file may hold past its data: it meets the full disk


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def faulty_under(plan: FaultPlan, directory: str) -> Callable[[str], FileHandle]:
    """An opener giving the files under ``<data dir>/<directory>/`` to ``plan``, real files
    elsewhere: the fault meets that log alone."""
    part = f"{os.sep}{directory}{os.sep}"
    return lambda path: plan.opener(path) if part in path else OsFile(path)


def data_dir(tmp_path: Any, me: str) -> str:
    data = tmp_path / me
    data.mkdir(exist_ok=True)
    server_id.write(str(data), bytes.fromhex(me))
    return str(data)


def realtime(tmp_path: Any, meta_url: str, me: str, opener: Any = OsFile) -> RealtimeServer:
    return RealtimeServer(RealtimeConfig(data_dir=data_dir(tmp_path, me), meta_url=meta_url,
                                         group="rt1", port=0, trace=False,
                                         heartbeat_interval_ms=200), opener=opener)


async def never_dispatched(*_args: Any) -> None:
    raise AssertionError("nothing is due in these tests")


def delay(tmp_path: Any, meta_url: str, me: str, opener: Any = OsFile) -> DelayServer:
    return DelayServer(DelayConfig(data_dir=data_dir(tmp_path, me), meta_url=meta_url,
                                   group="d1", port=0, heartbeat_interval_ms=200),
                       dispatch=never_dispatched, opener=opener)


def replica(server: Any) -> Replica:
    assert isinstance(server.replication, Replica)
    return server.replication


def log_bytes(server: Any, directory: str) -> bytes:
    path = os.path.join(server.config.data_dir, directory)
    return b"".join(read_segment_data(os.path.join(path, name))
                    for name in sorted(os.listdir(path)) if name.endswith(".log"))


async def send(port: int, ids: list[str], payload: bytes = b"x", deliver_at_ms: int = 0,
               subjects: tuple[str, ...] = ("orders",)) -> list[str]:
    """Send one message per id in one request (subjects taken in turn); the ids answered
    ``stored``."""
    client = await RawClient.connect(port)
    try:
        payloads = [encode_message(Message.create(subjects[n % len(subjects)], payload,
                                                  now_ms=now_ms(), id=i,
                                                  deliver_at_ms=deliver_at_ms))
                    for n, i in enumerate(ids)]
        answer = await client.request({"op": "send", "messages": payloads})
    finally:
        await client.close()
    results = answer.get("results") or []
    return [i for i, result in zip(ids, results) if result.get("status") == "stored"]


async def tailing(master: Any, slave_id: str, name: str, port: int, **send_args: Any) -> None:
    """Wait until the slave is in sync and the master ships ``name``'s commits to it before
    their fsync (a send's records kept by ``written_io``)."""
    source = replica(master).source
    assert source is not None
    await wait_for(lambda: slave_id in master.role.insync, 20, "the slave in sync")

    async def overlapped() -> bool:
        before = source.fresh_before_fsync[name]
        assert await send(port, [f"warm-{time.monotonic_ns()}"], **send_args)
        return source.fresh_before_fsync[name] > before

    await wait_for(overlapped, 20, "a commit shipped before its fsync")


async def refused_then_equal(master: Any, slave: Any, plan: FaultPlan, directory: str,
                             name: str, fault: Callable[[], None], **send_args: Any) -> bytes:
    """Send, fail one batch with ``fault``, send again once the disk has room; wait for the
    slave's copy to equal the master's log; returns it."""
    await tailing(master, SECOND, name, master.port, **send_args)
    assert await send(master.port, [f"kept-{n}" for n in range(10)], **send_args)
    fault()
    assert await send(master.port, [f"cut-{n}" for n in range(3)], BIG, **send_args) == []
    plan.disk_capacity_bytes = None  # space returns
    # More bytes than the refused batch: the master's next records cover its offsets.
    new = [f"new-{n}" for n in range(10)]
    assert await send(master.port, new, BIG, **send_args) == new
    await wait_for(lambda: log_bytes(slave, directory) == log_bytes(master, directory), 30,
                   "the slave's copy equal to the master's log")
    copied = log_bytes(slave, directory)
    for n in range(10):
        assert f"kept-{n}".encode() in copied and f"new-{n}".encode() in copied
    assert b"cut-" not in copied
    return copied


@pytest.mark.timeout(120)
async def test_a_batch_cut_by_a_full_disk_at_the_masters_message_log_write_never_reaches_the_slave(
        tmp_path):
    plan = FaultPlan(allocate_unsupported=True)  # no space ahead: the write meets the full disk
    config = MetaConfig(db_url=sqlite_url(tmp_path / "m.db"), port=0, lease_ms=LEASE_MS)
    async with start_metaserver(config) as meta:
        first = realtime(tmp_path, meta.url, FIRST, faulty_under(plan, "messagelog"))
        second = realtime(tmp_path, meta.url, SECOND)
        await first.start()
        await second.start()
        try:
            def full_disk() -> None:
                plan.disk_capacity_bytes = plan.bytes_written + 10

            await refused_then_equal(first, second, plan, "messagelog", "message", full_disk)
        finally:
            await second.stop()
            await first.stop()


@pytest.mark.timeout(120)
async def test_a_batch_cut_after_its_consumer_log_write_failed_never_reaches_the_slave(tmp_path):
    # The message log's write succeeds; the consumer log's entries then meet a full disk, and
    # the store cuts the batch's records back (MessageStore._indexed) and stays writable.
    plan = FaultPlan(allocate_unsupported=True)
    config = MetaConfig(db_url=sqlite_url(tmp_path / "m.db"), port=0, lease_ms=LEASE_MS)
    async with start_metaserver(config) as meta:
        first = realtime(tmp_path, meta.url, FIRST, faulty_under(plan, "consumerlog"))
        second = realtime(tmp_path, meta.url, SECOND)
        await first.start()
        await second.start()
        try:
            def full_disk() -> None:
                plan.disk_capacity_bytes = plan.bytes_written - (1 << 30)  # not one byte fits

            writes = plan.writes
            await refused_then_equal(first, second, plan, "messagelog", "message", full_disk)
            assert plan.writes > writes  # the consumer log's write was attempted
        finally:
            await second.stop()
            await first.stop()


@pytest.mark.timeout(120)
async def test_a_batch_of_two_subjects_cut_after_a_consumer_log_write_never_reaches_the_slave(
        tmp_path):
    # A batch of two subjects: its entries are written after the message log's fsync
    # (MessageStore._index), so it is shipped after it, as before the overlap.
    plan = FaultPlan(allocate_unsupported=True)
    config = MetaConfig(db_url=sqlite_url(tmp_path / "m.db"), port=0, lease_ms=LEASE_MS)
    async with start_metaserver(config) as meta:
        first = realtime(tmp_path, meta.url, FIRST, faulty_under(plan, "consumerlog"))
        second = realtime(tmp_path, meta.url, SECOND)
        await first.start()
        await second.start()
        try:
            def full_disk() -> None:
                plan.disk_capacity_bytes = plan.bytes_written - (1 << 30)  # not one byte fits

            await refused_then_equal(first, second, plan, "messagelog", "message", full_disk,
                                     subjects=("orders", "refunds"))
        finally:
            await second.stop()
            await first.stop()


@pytest.mark.timeout(120)
async def test_a_batch_cut_by_a_full_disk_at_the_masters_delay_log_write_never_reaches_the_slave(
        tmp_path):
    plan = FaultPlan(allocate_unsupported=True)
    due_ms = now_ms() + 3_600_000  # nothing comes due during the test
    config = MetaConfig(db_url=sqlite_url(tmp_path / "m.db"), port=0, lease_ms=LEASE_MS)
    async with start_metaserver(config) as meta:
        first = delay(tmp_path, meta.url, FIRST, faulty_under(plan, "delaylog"))
        second = delay(tmp_path, meta.url, SECOND)
        await first.start()
        await second.start()
        try:
            def full_disk() -> None:
                plan.disk_capacity_bytes = plan.bytes_written + 10

            await refused_then_equal(first, second, plan, "delaylog", "delay", full_disk,
                                     deliver_at_ms=due_ms)
        finally:
            await second.stop()
            await first.stop()


@pytest.mark.timeout(120)
async def test_a_batch_whose_fsync_failed_after_it_was_shipped_is_unanswered_and_never_cut(
        tmp_path):
    # A failed fsync is sticky: the broker turns read-only and writes nothing at those offsets
    # in this run, so the copy the slave took equals the master's log; the send is refused.
    plan = FaultPlan()
    config = MetaConfig(db_url=sqlite_url(tmp_path / "m.db"), port=0, lease_ms=LEASE_MS)
    async with start_metaserver(config) as meta:
        first = realtime(tmp_path, meta.url, FIRST, faulty_under(plan, "messagelog"))
        second = realtime(tmp_path, meta.url, SECOND)
        await first.start()
        await second.start()
        try:
            await tailing(first, SECOND, "message", first.port)
            kept = [f"kept-{n}" for n in range(10)]
            assert await send(first.port, kept) == kept
            plan.fail_sync_at = plan.syncs + 1
            assert await send(first.port, ["unanswered"]) == []
            assert await send(first.port, ["refused"]) == []  # read-only now
            await wait_for(lambda: b"unanswered" in log_bytes(second, "messagelog"), 30,
                           "the slave holding the shipped batch")
            assert log_bytes(second, "messagelog") == log_bytes(first, "messagelog")
            assert all(i.encode() in log_bytes(second, "messagelog") for i in kept)
        finally:
            await second.stop()
            await first.stop()
