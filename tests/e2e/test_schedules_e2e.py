"""Recurring schedules with real processes: two MetaServers over one PostgreSQL, a realtime
broker and a delay server; one MetaServer killed with kill -9 half-way, then every MetaServer
down for a while (downtime), and the misfire policies checked after it.

Three schedules fire every 100 ms on one grid (``--start``), one per misfire policy, so well
over 100 occurrences come in a few seconds without any test clock."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import qmq
from tests.harness import Cluster, ServerProcess, free_port, start_server, wait_for, wait_registered
from tests.pg import PgCluster, create_database

pytestmark = [pytest.mark.postgres]

INTERVAL_MS = 100
GRACE_MS = 500
LEASE_MS = 2_000
POLICIES = ("skip", "once", "all")


def metaserver(db_url: str, port: int = 0) -> ServerProcess:
    return start_server("metaserver", [
        "metaserver", "--db", db_url, "--port", str(port),
        "--schedule-misfire-grace-ms", str(GRACE_MS), "--schedule-lease-ms", str(LEASE_MS)])


async def settled_view(meta_url: str) -> dict[str, dict]:
    """The schedules at a moment when none has a hand-over in flight (bounded retries)."""
    async with qmq.Schedules(meta_url) as schedules:
        for _ in range(500):
            shown = {s["name"]: s for s in await schedules.list()}
            if all(s["in_doubt"] == 0 and s["pending_fire_ms"] for s in shown.values()):
                return shown
            await asyncio.sleep(0.01)
    raise AssertionError(f"no moment without a hand-over in flight: {shown}")


def now_ms() -> int:
    return time.time_ns() // 1_000_000


async def test_two_metaservers_send_each_occurrence_once_through_a_kill_and_a_downtime(
        tmp_path: Path, pg_cluster: PgCluster) -> None:
    name = f"e_{uuid.uuid4().hex[:16]}"
    await create_database(pg_cluster.url_of("postgres"), name)
    db_url = pg_cluster.url_of(name)
    cluster = Cluster(tmp_path)
    kept_port = free_port()
    try:
        # Started two at a time: a process start takes seconds on a busy machine.
        with ThreadPoolExecutor(2) as pool:
            first, kept = map(cluster.keep, pool.map(lambda port: metaserver(db_url, port),
                                                     (0, kept_port)))
            cluster.meta = kept  # brokers talk to the MetaServer that stays up
            list(pool.map(lambda start: start(), (lambda: cluster.start_broker("rt1"),
                                                  lambda: cluster.start_delay("d1"))))
        wait_registered(kept.url, {("realtime", "rt1"): "rw", ("delay", "d1"): "rw"})
        fires: dict[str, list[tuple[int, int, str]]] = defaultdict(list)  # name -> (fire, at, id)

        async def consume() -> None:
            async with qmq.Consumer(kept.url, group="g", start="earliest") as consumer:
                async for msg in consumer.subscribe("ticks"):
                    fires[msg.properties["qmq-schedule"]].append(
                        (int(msg.properties["qmq-fire-at-ms"]), now_ms(), msg.id))
                    await msg.ack()

        consumer = asyncio.create_task(consume())
        start = now_ms() + 1_000
        for i, policy in enumerate(POLICIES):
            url = first.url if i % 2 else kept.url  # made through both
            async with qmq.Schedules(url) as schedules:
                await schedules.create(policy, "ticks", policy, every=INTERVAL_MS, start=start,
                                       misfire=policy)

        def total() -> int:
            return sum(len(v) for v in fires.values())

        await wait_for(lambda: total() >= 60, 30, "60 occurrences with both MetaServers up")
        first.kill9()  # possibly holding claims: the other resolves them after the lease
        await wait_for(lambda: total() >= 120, 30, "60 more with one MetaServer")
        await asyncio.sleep(LEASE_MS / 1000 + 0.5)  # anything the dead one held is resolved
        kept.kill9()
        killed_at = now_ms()
        await asyncio.sleep(3)  # all MetaServers down: the pending occurrences still fire
        restarted_at = now_ms()
        cluster.keep(metaserver(db_url, kept_port))
        await asyncio.sleep(LEASE_MS / 1000 + 2)  # claims of the killed one resolved, then more

        # A view with no hand-over in flight: every count then covers exactly the occurrences
        # up to each schedule's pending one, which the consumer is then waited for.
        shown = await settled_view(kept.url)

        def caught_up() -> bool:
            return all(fires[p] and max(f for f, _a, _i in fires[p]) >= shown[p]["pending_fire_ms"]
                       for p in POLICIES)

        await wait_for(caught_up, 30, "every occurrence up to the pending ones")
        consumer.cancel()
        await asyncio.gather(consumer, return_exceptions=True)

        assert total() >= 100
        for policy in POLICIES:
            got = sorted(x for x in fires[policy] if x[0] <= shown[policy]["pending_fire_ms"])
            ids = [i for _f, _a, i in got]
            assert len(ids) == len(set(ids)), f"{policy}: duplicates"
            times = [f for f, _a, _i in got]
            assert all((f - start) % INTERVAL_MS == 0 for f in times)
            # Every occurrence from the first on that was not sent: the skipped ones (under
            # `skip` and `once` that may include the first few, on a machine slow enough to
            # miss them by more than the grace).
            missing = (times[-1] - start) // INTERVAL_MS + 1 - len(times)
            # Exactly one message per occurrence sent, and the gaps are the skipped ones.
            row = shown[policy]
            assert row["sent_count"] == len(times) and missing == row["skipped_count"], (
                policy, row, missing)
            in_downtime = [f for f in times if killed_at + 300 < f < restarted_at - GRACE_MS]
            if policy == "all":
                assert missing == 0 and len(in_downtime) >= 20
            elif policy == "skip":
                assert in_downtime == [] and row["skipped_count"] >= 20
            else:  # once: one occurrence stands for the whole downtime, sent late
                after_kill = [(f, at) for f, at, _i in got if f > killed_at + 300]
                (first, arrived), (second, _at) = after_kill[0], after_kill[1]
                assert len(in_downtime) <= 1 and row["skipped_count"] >= 20
                # It was missed (older than the grace when planned), and the next one follows.
                assert arrived - first > GRACE_MS and second == first + INTERVAL_MS
    except BaseException:
        print(cluster.dump())
        raise
    finally:
        cluster.stop_all()
