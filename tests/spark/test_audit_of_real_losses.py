"""A real run that loses specific messages on purpose, and the audit that must name exactly them.

A MetaServer, a realtime broker and a delay server run in-process with tracing on; clients
speak the wire protocol. Faults are injected, not hoped for:

- ``refused-1``, a delayed message, is refused for good by the realtime side when the delay
  server dispatches it (``refuse_dispatch`` wraps the server's dispatch function and answers
  ``bad_request`` for it, as a broker would for a message it will never take): the scheduler
  drops it from the schedule.
- ``corrupt-1`` is pulled and held by a consumer; the broker is restarted (so nothing is cached
  in memory), one bit of the record is flipped on disk (``logstore.faults.flip_bit``), the
  consumer expires, and its redelivery cannot be read: the broker acks it in the group's name.
- ``rotten-1`` is stored but never pulled before the restart; its record rots the same way, and
  the ``stockers`` group's first pull of it (a scan of the store) passes over it for good
  instead of failing every pull of the group: ``record_unreadable``, named by the id its
  damaged record still holds.
- ``headless-1``, stored after ``rotten-1``, has the subject in its record's header damaged, so
  not even its id can be read: the broker names it ``stock@<seq>`` with its location, and the
  audit ties it to its ``stored`` line: ``record_unreadable`` under its own id.
- ``retried-1`` is nacked by the ``fixers`` group; its retry copy ``retried-1.r1``, stored under
  the retry subject after the delay server's dispatch, rots and is passed over by the group's
  pull of the retry subject: the broker names it by the copy's id, the audit by its origin.
- ``capped-1``, ``capped-2`` and ``capped-3``, on a second broker with small segments, are held
  by a consumer when retention's hard cap (lowered on the store thread: the fault) deletes
  their segments: ``retention_hard_cap``. ``capped-1``'s record is damaged first; the naming
  walk passes over it (named by location) and names ``capped-2``, after it in the same
  segment. ``capped-4``, in the active segment, is acked.
- ``held-1`` is pulled by a consumer of another group that never acks it: past the deadline the
  broker still holds it, so it is overdue, not lost.

Everything else is delivered and acked in time. The audit (the session's SparkSession) must exit
1 and name exactly refused-1, corrupt-1, rotten-1, headless-1, retried-1 and capped-1..3 as
lost, with their reasons, and held-1 as overdue.
"""

from __future__ import annotations

import asyncio
import dataclasses
import glob
import json
import os
import time

import pytest

from delayserver.config import DelayConfig
from delayserver.server import DelayServer
from logstore.faults import flip_bit
from metaserver.app import start_metaserver
from metaserver.config import MetaConfig, sqlite_url
from qmq.cli import main
from realtime.config import RealtimeConfig
from realtime.server import RealtimeServer
from wire.message import Message, decode_message
from wire.protocol import pull_columns
from tests.rawclient import RawClient

DEADLINE_MS = 3_000  # generous for a loaded machine: an ack in time must not look late
CORRUPT_MARKER = b"please-damage-this-body"
ROTTEN_MARKER = b"please-rot-this-unread-body"
RETRY_MARKER = b"please-rot-this-retry-copy"
CAPPED_MARKER = b"please-rot-this-capped-body"
# With 1 KiB segments: capped-1 and capped-2 share the first segment, capped-3 fills the second,
# capped-4 starts the active one.
CAPPED_BODY_BYTES = {"capped-1": 300, "capped-2": 300, "capped-3": 700, "capped-4": 700}
WAIT_S = 30
RETRY_SUBJECT = "%retry%redo%fixers"


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def refuse_dispatch(server: DelayServer, doomed: set[str]) -> None:
    """Fault injection (before ``start``): the realtime side refuses the ids in ``doomed`` for
    good (bad_request) when ``server`` dispatches them; the rest go through to the real
    brokers."""
    real = server._dispatch

    async def dispatch(subject: str, payloads: list[bytes]):
        ids = [decode_message(p).id for p in payloads]
        kept = [p for p, i in zip(payloads, ids) if i not in doomed]
        group, results = await real(subject, kept) if kept else ("rt-1", [])
        answers = iter(results)
        return group, [{"id": i, "error": {"code": "bad_request", "message": "injected"}}
                       if i in doomed else next(answers) for i in ids]

    server._dispatch = dispatch


async def until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def pull_ack(client: RawClient, subject: str, group: str, consumer: str, want: set[str],
                   hold: set[str] = frozenset()) -> None:
    """Pull until every id of ``want`` arrived; ack all but those in ``hold``."""
    got: set[str] = set()
    deadline = time.monotonic() + WAIT_S
    while not want <= got:
        assert time.monotonic() < deadline, f"{want - got} never arrived on {subject}"
        response = await client.pull(subject, group, consumer, start="earliest", wait_ms=300)
        pull_seqs, payloads, _redelivered = pull_columns(response)
        ids = [decode_message(p).id for p in payloads]
        acks = [[seq, seq] for seq, i in zip(pull_seqs, ids) if i not in hold]
        got.update(ids)
        if acks:
            await client.ack(subject, group, consumer, acks)


def rt_config(tmp_path, meta_url: str) -> RealtimeConfig:
    return RealtimeConfig(data_dir=str(tmp_path / "rt"), meta_url=meta_url, group="rt-1", port=0,
                          consumer_expiry_ms=1_000, expiry_check_interval_ms=100,
                          heartbeat_interval_ms=200)


async def lose_to_the_hard_cap(tmp_path, meta_url: str) -> None:
    """A second broker, small segments: capped-1..4 pulled by ``slow``/s1, capped-4 acked;
    capped-1's record damaged; then the hard cap, lowered to 0 bytes, deletes every segment but
    the active one."""
    rt2 = RealtimeServer(dataclasses.replace(
        rt_config(tmp_path, meta_url), data_dir=str(tmp_path / "rt2"), group="rt-2",
        segment_size_bytes_max=1024))
    await rt2.start()
    try:
        client = await RawClient.connect(rt2.port)
        for msg_id, size in CAPPED_BODY_BYTES.items():
            body = (CAPPED_MARKER if msg_id == "capped-1" else b"").ljust(size, b"c")
            await client.send(Message.create("capped.s", body, now_ms=now_ms(), id=msg_id))
        await pull_ack(client, "capped.s", "slow", "s1", set(CAPPED_BODY_BYTES),
                       hold={"capped-1", "capped-2", "capped-3"})
        segments = await rt2.broker.on_store_thread(rt2.broker.store._message_log.segments)
        assert len(segments) == 3, segments  # the layout the docstring says
        damage(str(tmp_path / "rt2"), CAPPED_MARKER)
        store = rt2.broker.store

        def lower_the_hard_cap() -> None:  # the fault, on the store's own thread
            store.config = dataclasses.replace(store.config, retention_hard_cap_bytes=0)

        await rt2.broker.on_store_thread(lower_the_hard_cap)
        await rt2.broker._retention_round()
        assert rt2.broker.tracer.gave_up_counts == {"retention_hard_cap": 3}
        await client.close()
    finally:
        await rt2.stop()


def message_log_files(data_dir: str) -> list[str]:
    """The message-log segments under ``data_dir``, oldest first."""
    return sorted(glob.glob(os.path.join(data_dir, "messagelog", "*.log")))


def damage(data_dir: str, marker: bytes, *, last: bool = False, at: int = 0) -> None:
    """Flip one bit of the message log: inside ``marker`` (its middle), or ``at`` bytes from
    its start when ``at`` is given; the first occurrence, or the last one with ``last``."""
    files = message_log_files(data_dir)
    for path in reversed(files) if last else files:
        with open(path, "rb") as file:
            data = file.read()
        offset = data.rfind(marker) if last else data.find(marker)
        if offset >= 0:
            flip_bit(path, offset + (at or len(marker) // 2))
            return
    raise AssertionError(f"{marker!r} is in no message-log segment under {data_dir}")


def count_in_message_log(data_dir: str, marker: bytes) -> int:
    """How many times ``marker`` is in the message log (a copy stored once is there once)."""
    total = 0
    for path in message_log_files(data_dir):
        with open(path, "rb") as file:
            total += file.read().count(marker)
    return total


async def run_the_faulty_scenario(tmp_path) -> int:
    """Run it; returns when held-1 was sent (epoch ms)."""
    meta_config = MetaConfig(db_url=sqlite_url(tmp_path / "meta.db"), port=0)
    async with start_metaserver(meta_config) as meta:
        rt = RealtimeServer(rt_config(tmp_path, meta.url))
        await rt.start()
        delay = DelayServer(DelayConfig(data_dir=str(tmp_path / "delay"), meta_url=meta.url,
                                        group="delay-1", port=0, bucket_ms=1_000,
                                        heartbeat_interval_ms=200))
        refuse_dispatch(delay, {"refused-1"})
        await delay.start()
        try:
            client = await RawClient.connect(rt.port)
            delayed = await RawClient.connect(delay.port)
            for msg_id, body in (("ok-1", b"a"), ("ok-2", b"b"), ("corrupt-1", CORRUPT_MARKER)):
                await client.send(Message.create("orders", body, now_ms=now_ms(), id=msg_id))
            # stockers starts before rotten-1 is sent, so it is owed rotten-1.
            await client.send(Message.create("stock", b"s", now_ms=now_ms(), id="stock-ok"))
            await pull_ack(client, "stock", "stockers", "s1", {"stock-ok"})
            await client.send(Message.create("stock", ROTTEN_MARKER, now_ms=now_ms(),
                                             id="rotten-1"))
            await client.send(Message.create("stock", b"h", now_ms=now_ms(), id="headless-1"))
            # fixers nacks retried-1 at once; its copy comes back through the delay server.
            await client.send(Message.create("redo", RETRY_MARKER, now_ms=now_ms(),
                                             id="retried-1"))
            response = await client.pull("redo", "fixers", "f1", start="earliest", wait_ms=2_000)
            pull_seqs, payloads, _ = pull_columns(response)
            assert [decode_message(p).id for p in payloads] == ["retried-1"]
            nacked = await client.request({"op": "nack", "subject": "redo", "group": "fixers",
                                           "consumer_id": "f1", "pull_seqs": pull_seqs,
                                           "retry_after_ms": 100})
            assert "error" not in nacked, nacked
            await until(lambda: count_in_message_log(str(tmp_path / "rt"), RETRY_MARKER) == 2,
                        "retried-1's retry copy stored")
            held_at_ms = now_ms()
            await client.send(Message.create("held.s", b"h", now_ms=held_at_ms, id="held-1"))
            for msg_id in ("late-ok", "refused-1"):
                await delayed.send(Message.create("orders", b"d", now_ms=now_ms(), id=msg_id,
                                                  deliver_at_ms=now_ms() + 300))
            await pull_ack(client, "orders", "billing", "c1", {"ok-1", "ok-2", "corrupt-1"},
                           hold={"corrupt-1"})
            await pull_ack(client, "held.s", "keeper", "k1", {"held-1"}, hold={"held-1"})
            await pull_ack(client, "orders", "billing", "c1", {"late-ok"})
            await until(lambda: delay.scheduler.tracer.gave_up_counts, "the refused dispatch")
            await client.close()
            await rt.stop()
            # Restarted: what c1 and k1 hold is named from the store, then one record rots.
            rt = RealtimeServer(rt_config(tmp_path, meta.url))
            await rt.start()
            damage(str(tmp_path / "rt"), CORRUPT_MARKER)
            damage(str(tmp_path / "rt"), ROTTEN_MARKER)
            # The last byte of the subject in headless-1's header (before the id's length).
            damage(str(tmp_path / "rt"), b"headless-1", at=-3)
            damage(str(tmp_path / "rt"), RETRY_MARKER, last=True)  # the copy, not the original
            client = await RawClient.connect(rt.port)
            response = await client.pull("stock", "stockers", "s1", wait_ms=200)
            assert pull_columns(response)[1] == []  # passed over, not a pull that fails
            response = await client.pull(RETRY_SUBJECT, "fixers", "f1", start="earliest",
                                         wait_ms=200)
            assert pull_columns(response)[1] == []
            assert rt.broker.tracer.gave_up_counts == {"record_unreadable": 3}
            counts = rt.broker.tracer.gave_up_counts
            deadline = time.monotonic() + WAIT_S
            while not counts.get("redelivery_unreadable"):  # c1 expires, c2 finds it unreadable
                assert time.monotonic() < deadline, "the unreadable redelivery never came up"
                response = await client.pull("orders", "billing", "c2", wait_ms=200)
                assert pull_columns(response)[1] == []
            await client.close()
            await delayed.close()
            await lose_to_the_hard_cap(tmp_path, meta.url)
        finally:
            await delay.stop()
            await rt.stop()
    return held_at_ms


@pytest.mark.timeout(900)  # three servers, two restarts and an audit on a loaded 2-core machine
def test_the_audit_of_a_run_with_injected_losses_names_exactly_the_lost_ids(
        spark, tmp_path, capsys):
    # Not an async test: the CLI runs its own event loop, and the session's SparkSession is
    # the active one only on this thread.
    held_at_ms = asyncio.run(run_the_faulty_scenario(tmp_path))
    # The audit's horizon (--until) is past held-1's deadline, whatever the run's pace.
    until_ms = max(now_ms(), held_at_ms + DEADLINE_MS + 1_000)
    out = tmp_path / "audit"
    code = main(["audit", "--data-dir", str(tmp_path), "--out", str(out),
                 "--deadline-ms", str(DEADLINE_MS), "--until", str(until_ms), "--json"])
    printed = capsys.readouterr()
    assert code == 1, printed.out + printed.err[-3000:]
    rows = spark.read.parquet(str(out / "anomalies")).collect()
    judged = sorted((r.kind, r.group, r.msg_id, r.reason, r.holder) for r in rows
                    if r.kind in ("lost", "overdue"))
    assert judged == [
        ("lost", "billing", "corrupt-1", "redelivery_unreadable", "realtime:rt-1"),
        ("lost", "billing", "refused-1", "dispatch_refused", "delay:delay-1"),
        ("lost", "fixers", "retried-1", "record_unreadable", "realtime:rt-1"),
        ("lost", "slow", "capped-1", "retention_hard_cap", "realtime:rt-2"),
        ("lost", "slow", "capped-2", "retention_hard_cap", "realtime:rt-2"),
        ("lost", "slow", "capped-3", "retention_hard_cap", "realtime:rt-2"),
        ("lost", "stockers", "headless-1", "record_unreadable", "realtime:rt-1"),
        ("lost", "stockers", "rotten-1", "record_unreadable", "realtime:rt-1"),
        ("overdue", "keeper", "held-1", "held", "realtime:rt-1")]
    assert [r.kind for r in rows if r.kind not in ("lost", "overdue")] == []
    (held,) = [r for r in rows if r.kind == "overdue"]
    assert held.holder_consumer == "k1" and held.held_ms > DEADLINE_MS
    verdict = json.loads(printed.out)  # --json: one document on stdout, the same exit code
    assert (verdict["passed"], verdict["exit_code"], verdict["lost"], verdict["overdue"],
            verdict["early"]) == (False, 1, 8, 1, 0)
    assert verdict["verdict"].startswith("FAIL: 8 lost, 1 overdue, 0 early")
    assert verdict["gave_up"] == {"dispatch_refused": 1, "redelivery_unreadable": 1,
                                  "record_unreadable": 3, "retention_hard_cap": 3}
    assert verdict["anomalies"]["lost"] == 8
