"""Recurring schedules end to end in one process: a MetaServer (SQLite, and PostgreSQL where it
matters), a realtime broker and a delay server on port 0, the SDK's Schedules and a Consumer.

Also the delay server's answer to a resend of the same message id, which the exactly-once
argument of docs/SCHEDULES.md leans on."""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest

import qmq
from delayserver.config import DelayConfig
from delayserver.server import DelayServer
from metaserver import MetaConfig, sqlite_url, start_metaserver
from metaserver.app import RunningMetaServer
from metaserver.registry import Registry
from metaserver.schedule_api import RUNNER_KEY, SCHEDULES_KEY
from metaserver.schedule_plan import SchedulePlanner
from metaserver.schedule_runner import ScheduleRunner
from metaserver.schedules import check_new
from realtime.config import RealtimeConfig
from realtime.server import RealtimeServer
from tests.harness import free_port, wait_for
from tests.pg import PgCluster, create_database
from tests.rawclient import RawClient
from wire.message import Message

ADMIN_TOKEN = "admin-secret-0123456789"


@dataclass
class Cluster:
    meta: RunningMetaServer
    realtime: RealtimeServer
    delay: DelayServer


@asynccontextmanager
async def cluster(tmp_path: Any, db_url: str, **meta: Any) -> AsyncIterator[Cluster]:
    """A MetaServer over ``db_url``, one realtime broker and one delay server."""
    config = MetaConfig(db_url=db_url, port=0, schedule_misfire_grace_ms=5_000, **meta)
    token = meta.get("admin_token")
    async with start_metaserver(config) as server:
        realtime = RealtimeServer(RealtimeConfig(
            data_dir=str(tmp_path / "rt"), meta_url=server.url, group="rt-1", port=0,
            heartbeat_interval_ms=200, trace=False, token=token, metrics_port=None))
        await realtime.start()
        delay = DelayServer(DelayConfig(
            data_dir=str(tmp_path / "delay"), meta_url=server.url, group="delay-1", port=0,
            bucket_ms=1000, heartbeat_interval_ms=200, trace=False, token=token,
            metrics_port=None))
        await delay.start()
        try:
            yield Cluster(server, realtime, delay)
        finally:
            await delay.stop()
            await realtime.stop()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
async def db_url(request: pytest.FixtureRequest, tmp_path: Any) -> str:
    if request.param == "sqlite":
        return sqlite_url(tmp_path / "meta.db")
    pg: PgCluster = request.getfixturevalue("pg_cluster")
    name = f"s_{uuid.uuid4().hex[:16]}"
    await create_database(pg.url_of("postgres"), name)
    return pg.url_of(name)


class Inbox:
    """Every message of one subject a consumer got, with when (wall clock, ms)."""

    def __init__(self) -> None:
        self.items: list[tuple[int, qmq.ReceivedMessage]] = []

    async def run(self, meta_url: str, subject: str, token: str | None = None) -> None:
        async with qmq.Consumer(meta_url, group="g", start="earliest", token=token) as consumer:
            async for msg in consumer.subscribe(subject):
                self.items.append((time.time_ns() // 1_000_000, msg))
                await msg.ack()

    @property
    def ids(self) -> list[str]:
        return [msg.id for _, msg in self.items]


@asynccontextmanager
async def consuming(meta_url: str, subject: str, token: str | None = None
                    ) -> AsyncIterator[Inbox]:
    inbox = Inbox()
    task = asyncio.create_task(inbox.run(meta_url, subject, token))
    try:
        yield inbox
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_every_occurrence_arrives_once_on_time_carrying_name_and_fire_time(
        tmp_path: Any, db_url: str) -> None:
    async with cluster(tmp_path, db_url) as c, qmq.Schedules(c.meta.url) as schedules, \
            consuming(c.meta.url, "ticks") as inbox:
        made = await schedules.create("tick", "ticks", b"tock", every=200,
                                      properties={"team": "a"})
        assert made["state"] == "active" and made["next_fire_ms"] is not None
        await wait_for(lambda: len(inbox.items) >= 6, 30, "six occurrences")
        assert len(set(inbox.ids)) == len(inbox.ids)
        for at_ms, msg in inbox.items:
            fire_ms = int(msg.properties["qmq-fire-at-ms"])
            assert msg.id == f"sched-{made['id']}-{fire_ms}"
            assert msg.properties["qmq-schedule"] == "tick" and msg.properties["team"] == "a"
            assert msg.message.deliver_at_ms == fire_ms and at_ms >= fire_ms
            assert msg.body == b"tock"
        fires = sorted(int(m.properties["qmq-fire-at-ms"]) for _, m in inbox.items)
        # On the grid (a runner stalled past the grace on a starved machine skips, never shifts).
        assert all((b - a) % 200 == 0 for a, b in zip(fires, fires[1:]))
        shown = await schedules.get("tick")
        assert shown["sent_count"] >= 6


async def test_pause_cancels_the_pending_occurrence_and_resume_goes_on_from_now(
        tmp_path: Any) -> None:
    async with cluster(tmp_path, sqlite_url(tmp_path / "m.db")) as c, \
            qmq.Schedules(c.meta.url) as schedules, consuming(c.meta.url, "beats") as inbox:
        await schedules.create("beat", "beats", "x", every=1_000)
        await wait_for(lambda: len(inbox.items) >= 1, 30, "a first occurrence")
        paused = await schedules.pause("beat")
        assert paused["state"] == "paused" and paused["next_fire_ms"] is None
        await wait_for(_settled(c.meta, "beat"), 10, "the pending occurrence cancelled")
        count, paused_at = len(inbox.items), time.time_ns() // 1_000_000
        await asyncio.sleep(2.5)  # two occurrences would have fired: none may arrive
        assert len(inbox.items) == count
        await schedules.resume("beat")
        await wait_for(lambda: len(inbox.items) >= count + 1, 30, "occurrences again")
        late = [m for _, m in inbox.items[count:]]
        assert all(int(m.properties["qmq-fire-at-ms"]) > paused_at + 2_000 for m in late)


def _settled(meta: RunningMetaServer, name: str):
    async def check() -> bool:
        return (await meta.app[SCHEDULES_KEY].show(name))["in_doubt"] == 0
    return check


async def test_delete_cancels_what_was_handed_over_and_frees_the_name(tmp_path: Any) -> None:
    async with cluster(tmp_path, sqlite_url(tmp_path / "m.db")) as c, \
            qmq.Schedules(c.meta.url) as schedules, consuming(c.meta.url, "once") as inbox:
        at_ms = time.time_ns() // 1_000_000 + 1_500
        made = await schedules.create("later", "once", "boom", at=at_ms)
        await wait_for(functools.partial(_pending, c.meta, made["id"]), 10, "the occurrence handed over")
        await schedules.delete("later")
        await wait_for(functools.partial(_row_gone, c.meta, made["id"]), 10, "the row deleted after cancel")
        await asyncio.sleep(max(0, at_ms - time.time_ns() // 1_000_000) / 1000 + 1)
        assert inbox.items == []
        again = await schedules.create("later", "once", "boom", every=60_000)
        assert again["id"] != made["id"]


async def _pending(meta: RunningMetaServer, row_id: int) -> bool:
    async with meta.registry._read() as s:
        from metaserver.models import Schedule
        row = await s.get(Schedule, row_id)
        return row is not None and row.pending_fire_ms is not None


async def _row_gone(meta: RunningMetaServer, row_id: int) -> bool:
    async with meta.registry._read() as s:
        from metaserver.models import Schedule
        return await s.get(Schedule, row_id) is None


async def test_the_api_refuses_bad_definitions_with_the_reason(tmp_path: Any) -> None:
    async with start_metaserver(MetaConfig(db_url=sqlite_url(tmp_path / "m.db"), port=0)) as m, \
            qmq.Schedules(m.url) as schedules:
        cases = [dict(cron="0 9 * * 1-5"), dict(cron="0 25 * * *"), dict(every=50),
                 dict(cron="0 9 * * *", every=1000), {}, dict(cron="0 9 * * *", tz="Mars/Base"),
                 dict(at="2026-10-25T02:30", tz="Europe/Berlin"), dict(at=1000)]
        for spec in cases:
            with pytest.raises(qmq.BadRequest):
                await schedules.create("s", "subj", "b", **spec)
        with pytest.raises(qmq.BadRequest, match="qmq-"):
            await schedules.create("s", "subj", "b", every=1000, properties={"qmq-x": "1"})
        with pytest.raises(qmq.BadRequest, match="SCHEDULE_BODY_BYTES_MAX"):
            await schedules.create("s", "subj", b"x" * (64 * 1024 + 1), every=1000)
        made = await schedules.create("s", "subj", b"x" * (64 * 1024), every=1000)
        # The same create again (an answer lost on the way) is the same schedule, not a second.
        again = await schedules.create("s", "subj", b"x" * (64 * 1024), every=1000)
        assert again["id"] == made["id"] and again["start_ms"] == made["start_ms"]
        with pytest.raises(qmq.Conflict, match="another definition"):
            await schedules.create("s", "subj", "b", every=1000)
        with pytest.raises(qmq.NotFound):
            await schedules.pause("nope")
        fires = await schedules.next("s", 3)
        assert [f["fire_ms"] for f in fires][1] - fires[0]["fire_ms"] == 1000
        with pytest.raises(qmq.BadRequest):
            await schedules.next("s", 1001)


async def test_the_schedule_client_takes_several_metaservers_and_skips_one_that_is_down(
        tmp_path: Any) -> None:
    async with start_metaserver(MetaConfig(db_url=sqlite_url(tmp_path / "m.db"), port=0)) as m:
        down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        async with qmq.Schedules([down, m.url]) as schedules:
            await schedules.create("beat", "subj", "b", every=1000)
            assert schedules.meta.url == m.url, "the one that answered is asked first now"
            assert [s["name"] for s in await schedules.list()] == ["beat"]
        async with qmq.Schedules(down) as lost:
            with pytest.raises(qmq.ConnectionLost, match="unreachable"):
                await lost.list()


async def test_an_app_token_manages_only_schedules_of_subjects_it_may_produce_to(
        tmp_path: Any) -> None:
    config = MetaConfig(db_url=sqlite_url(tmp_path / "m.db"), port=0, admin_token=ADMIN_TOKEN)
    async with start_metaserver(config) as m, qmq.Schedules(m.url, token=ADMIN_TOKEN) as admin:
        tokens = m.app  # the token API is admin-only: make one app token through it
        from metaserver.tokens import TOKENS_KEY
        orders = (await tokens[TOKENS_KEY].create("shop", ["orders.*"], [], False))["token"]
        await admin.create("billing-run", "billing.run", "go", cron="0 3 * * *")
        async with qmq.Schedules(m.url, token=orders) as shop:
            made = await shop.create("reminder", "orders.remind", "x", every=60_000)
            assert made["app"] == "shop"
            with pytest.raises(qmq.Forbidden):
                await shop.create("sneaky", "billing.run", "x", every=60_000)
            with pytest.raises(qmq.Forbidden):
                await shop.pause("billing-run")
            assert [s["name"] for s in await shop.list()] == ["reminder"]
            await shop.pause("reminder")
        assert {s["name"] for s in await admin.list()} == {"billing-run", "reminder"}
        async with qmq.Schedules(m.url) as anonymous:
            with pytest.raises(qmq.Unauthorized):
                await anonymous.list()


async def test_a_resend_of_one_id_to_the_delay_server_is_stored_twice_but_delivered_once(
        tmp_path: Any) -> None:
    # What the runner's crash window would do without its cancel-before-resend: the delay
    # server does not de-duplicate ids (it keeps no index of pending ids); both copies are
    # dispatched, and the realtime broker's de-duplication window keeps one. A cancel of the
    # id cancels every pending copy.
    async with cluster(tmp_path, sqlite_url(tmp_path / "m.db")) as c, \
            consuming(c.meta.url, "dup") as inbox:
        client = await RawClient.connect(c.delay.port)
        try:
            due = time.time_ns() // 1_000_000 + 800
            twice = Message.create("dup", b"1", now_ms=due - 800, deliver_at_ms=due, id="same-1")
            answers = [await client.send(twice) for _ in range(2)]
            assert [a["results"][0]["status"] for a in answers] == ["stored", "stored"]
            await wait_for(lambda: "same-1" in inbox.ids, 20, "the occurrence")
            await wait_for(lambda: c.delay.scheduler.stats.dispatched >= 2, 10,
                           "both copies dispatched (counted once recorded)")
            gone = Message.create("dup", b"2", now_ms=due, deliver_at_ms=due + 1_500, id="same-2")
            await client.send(gone)
            await client.send(gone)
            cancel = await client.request({"op": "cancel", "ids": ["same-2"],
                                           "deliver_at_ms": [due + 1_500]})
            assert cancel["results"][0]["status"] == "cancelled"
            await asyncio.sleep(2.5)
            assert inbox.ids == ["same-1"]
        finally:
            await client.close()


@pytest.mark.postgres
async def test_a_runner_that_died_after_sending_is_resolved_by_another_without_a_duplicate(
        tmp_path: Any, pg_cluster: PgCluster) -> None:
    name = f"s_{uuid.uuid4().hex[:16]}"
    await create_database(pg_cluster.url_of("postgres"), name)
    async with cluster(tmp_path, pg_cluster.url_of(name), schedule_poll_interval_ms=60_000) as c, \
            consuming(c.meta.url, "doubt") as inbox:
        registry = c.meta.registry
        c.meta.app[RUNNER_KEY].poll_interval_ms = 60_000
        now_ms = registry.clock()
        new = check_new({"name": "d", "subject": "doubt", "body": "x", "encoding": "utf-8",
                         "tags": [], "properties": {}, "cron": None, "every_ms": None,
                         "at": now_ms + 1_500, "tz": "UTC", "start": None, "end": None,
                         "misfire": "skip"}, now_ms)
        row, _ = await c.meta.app[SCHEDULES_KEY].create(new, "-")  # no poke: the runner sleeps
        dying = ScheduleRunner(registry, SchedulePlanner(grace_ms=5_000), token=None,
                               lease_ms=300)
        targets = await registry.delay_route("producer")
        _claimed, jobs = await registry._write(
            lambda s: dying._claim(s, registry.clock(), targets))
        await dying._hand_over(jobs, targets)  # sent, then "killed" before confirming
        assert [j.sent for j in jobs] == [[now_ms + 1_500]]
        await dying.close()
        heir = ScheduleRunner(registry, SchedulePlanner(grace_ms=5_000), token=None)
        await wait_for(functools.partial(_lease_over, registry, row["id"]), 10, "the lease to run out")
        assert await heir.run_once() == 1  # resolves: cancels the copy, sends it again
        shown = await c.meta.app[SCHEDULES_KEY].show("d")
        assert shown["in_doubt"] == 0 and shown["pending_fire_ms"] == now_ms + 1_500
        await wait_for(lambda: len(inbox.items) >= 1, 20, "the occurrence")
        await asyncio.sleep(1.5)
        assert inbox.ids == [f"sched-{row['id']}-{now_ms + 1_500}"]
        await wait_for(lambda: c.delay.scheduler.stats.dispatched >= 1, 10, "the dispatch")
        assert c.delay.scheduler.stats.dispatched == 1  # one copy reached the broker
        await heir.close()


async def _lease_over(registry: Any, row_id: int) -> bool:
    from metaserver.models import Schedule
    async with registry._read() as s:
        row = await s.get(Schedule, row_id)
        return row.action_ms <= registry.clock()


async def test_a_schedule_runner_cancelled_just_as_it_is_poked_stops(tmp_path: Any) -> None:
    # The hang seen in CI: a pause poked the runner as the MetaServer stopped, Python 3.11's
    # asyncio.wait_for returned the poke and dropped the cancel, and the runner slept on.
    config = MetaConfig(db_url=sqlite_url(tmp_path / "m.db"), port=0)
    async with start_metaserver(config) as m:
        runner = ScheduleRunner(m.registry, SchedulePlanner(grace_ms=5_000), token=None,
                                poll_interval_ms=60_000)
        task = asyncio.create_task(runner.run())
        try:
            await wait_for(lambda: runner._wakeup._waiters, 10, "the runner to sleep")
            runner.poke()
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=30)
            assert task in done and task.cancelled()
        finally:
            task.cancel()
            await runner.close()


async def test_an_idle_runner_waits_until_the_earliest_action_at_most_its_poll_interval(
        db_url: str) -> None:
    from metaserver.models import Schedule
    now_ms = 1_800_000_000_000
    registry = Registry(MetaConfig(db_url=db_url, port=0), lambda: now_ms)
    await registry.open()
    runner = ScheduleRunner(registry, SchedulePlanner(grace_ms=5_000), token=None,
                            poll_interval_ms=60_000)
    try:
        assert await runner._idle_ms() == 60_000  # no schedule at all

        async def add(s: Any, name: str, action_ms: int | None) -> None:
            s.add(Schedule(name=name, app="a", subject="s", body=b"x", tags=[], properties={},
                           kind="at", at_ms=now_ms, tz="UTC", start_ms=now_ms, misfire="skip",
                           state="active", created_at_ms=now_ms, updated_at_ms=now_ms,
                           after_ms=now_ms, action_ms=action_ms))

        await registry._write(lambda s: add(s, "paused", None))  # no action: not counted
        assert await runner._idle_ms() == 60_000
        await registry._write(lambda s: add(s, "later", now_ms + 90_000))
        assert await runner._idle_ms() == 60_000  # capped at the poll interval
        await registry._write(lambda s: add(s, "sooner", now_ms + 2_500))
        assert await runner._idle_ms() == 2_500
        await registry._write(lambda s: add(s, "overdue", now_ms - 7_000))
        assert await runner._idle_ms() == 0
    finally:
        await runner.close()
        await registry.close()
