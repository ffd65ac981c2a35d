"""MetaServer over HTTP on a real port-0 server, on SQLite and on a throwaway PostgreSQL.

Time is a fake clock the tests advance; expiry runs when a test calls ``expire_now()``.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest

from metaserver import MetaConfig, RunningMetaServer, sqlite_url, start_metaserver
from metaserver.db import current_revision, head_revision, make_engine
from metaserver.handlers import REGISTRY_KEY
from metaserver.validation import CLIENTS_PER_HEARTBEAT_MAX
from tests.pg import PgCluster, create_database

EXPIRY_MS = 15_000
CLIENT_EXPIRY_MS = 30_000
START_MS = 1_700_000_000_000


class FakeClock:
    """A clock in ms that moves only when told."""

    def __init__(self, now_ms: int = START_MS) -> None:
        self.now_ms = now_ms

    def __call__(self) -> int:
        return self.now_ms

    def advance(self, ms: int) -> None:
        """Move the clock forward by ``ms``."""
        self.now_ms += ms


class Api:
    """A tiny JSON client of one running MetaServer."""

    def __init__(self, server: RunningMetaServer, session: aiohttp.ClientSession) -> None:
        self.server = server
        self.session = session

    async def post(self, path: str, body: Any = None, *, raw: bytes | None = None) -> tuple[int, Any]:
        """POST ``body`` as JSON (or ``raw`` bytes as they are); return status and JSON answer."""
        kwargs: dict[str, Any] = {"data": raw} if raw is not None else {"json": body}
        async with self.session.post(self.server.url + path, **kwargs) as resp:
            return resp.status, await resp.json()

    async def get(self, path: str, **params: str) -> tuple[int, Any]:
        """GET ``path`` with query ``params``; return status and JSON answer."""
        async with self.session.get(self.server.url + path, params=params) as resp:
            return resp.status, await resp.json()

    async def ok(self, method: str, path: str, body: Any = None, **params: str) -> Any:
        """Call and assert a 200; return the body."""
        if method == "GET":
            status, out = await self.get(path, **params)
        else:
            status, out = await self.post(path, body)
        assert status == 200, (status, out)
        return out

    async def register(self, group: str, address: str, kind: str = "realtime", **extra: Any) -> Any:
        """Register a broker; assert it worked."""
        return await self.ok("POST", "/api/brokers/register",
                             {"group": group, "kind": kind, "address": address, **extra})

    async def heartbeat(self, group: str, address: str, kind: str = "realtime",
                        state: str = "rw", **extra: Any) -> tuple[int, Any]:
        """Send one broker heartbeat."""
        return await self.post("/api/brokers/heartbeat",
                               {"group": group, "kind": kind, "address": address, "state": state,
                                **extra})

    async def route(self, subject: str, role: str = "producer", kind: str = "realtime") -> tuple[int, Any]:
        """Ask for a subject's route."""
        return await self.get("/api/route", subject=subject, role=role, kind=kind)

    async def expire(self) -> dict[str, int]:
        """Run the server's expiry check now."""
        return await self.server.expire_now()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
async def db_url(request: pytest.FixtureRequest, tmp_path: Any) -> str:
    """A fresh, empty database of each kind."""
    if request.param == "sqlite":
        return sqlite_url(tmp_path / "meta.db")
    cluster: PgCluster = request.getfixturevalue("pg_cluster")
    name = f"t_{uuid.uuid4().hex[:16]}"
    await create_database(cluster.url_of("postgres"), name)
    return cluster.url_of(name)


@pytest.fixture
def clock() -> FakeClock:
    """A fake clock shared by the test and its MetaServer(s)."""
    return FakeClock()


@asynccontextmanager
async def serve(db_url: str, clock: FakeClock, **config: Any) -> AsyncIterator[Api]:
    """Run a MetaServer on port 0 over ``db_url`` and yield a client of it. The background
    expiry loop is all but off: the tests run expiry themselves (``Api.expire``), and a loop
    round between a test's clock advance and its own call would take its answer away."""
    config.setdefault("expiry_check_interval_ms", 3_600_000)
    cfg = MetaConfig(db_url=db_url, port=0, broker_expiry_ms=EXPIRY_MS,
                     client_expiry_ms=CLIENT_EXPIRY_MS, **config)
    async with start_metaserver(cfg, clock) as server, aiohttp.ClientSession() as session:
        yield Api(server, session)


@pytest.fixture
async def api(db_url: str, clock: FakeClock) -> AsyncIterator[Api]:
    """A client of a MetaServer on a fresh database."""
    async with serve(db_url, clock) as client:
        yield client


def names(route: dict[str, Any]) -> list[str]:
    """The group names of a route answer, in answer order."""
    return [g["group"] for g in route["groups"]]


# -- register, heartbeat, route ---------------------------------------------------------------


async def test_a_registered_broker_heartbeats_and_is_routed_to_producers_and_consumers(api: Api) -> None:
    reg = await api.register("rt1", "127.0.0.1:20881")
    assert reg["broker_id"] >= 1
    # A third of the expiry or a quarter of the lease, whichever is shorter.
    assert reg["heartbeat_interval_ms"] == min(EXPIRY_MS // 3, MetaConfig.lease_ms // 4)
    assert (reg["role"], reg["epoch"], reg["lease_required"]) == ("master", 1, False)
    status, hb = await api.heartbeat("rt1", "127.0.0.1:20881", backlog=[])
    assert status == 200
    assert (hb["ok"], hb["state"], hb["role"], hb["epoch"]) == (True, "rw", "master", 1)
    assert hb["backlog_version"] == 1
    status, route = await api.route("order.created")
    assert status == 200
    assert route == {
        "subject": "order.created",
        "version": 1,
        "groups": [{"group": "rt1", "kind": "realtime", "state": "rw",
                    "addresses": ["127.0.0.1:20881"], "epoch": 1}],
    }
    status, consumer = await api.route("order.created", role="consumer")
    assert (status, consumer) == (200, route)
    assert await api.ok("GET", "/health") == {"ok": True}


async def test_a_heartbeat_from_an_unknown_broker_is_404_so_it_registers_again(api: Api) -> None:
    status, body = await api.heartbeat("rt1", "127.0.0.1:1")
    assert status == 404
    assert body["error"]["code"] == "not_found"


async def test_a_second_server_of_a_group_is_a_slave_and_routes_name_the_master_only(
        api: Api) -> None:
    first = await api.register("rt1", "10.0.0.2:20881", server_id="aaaa")
    second = await api.register("rt1", "10.0.0.1:20881", server_id="bbbb")
    assert (first["role"], second["role"]) == ("master", "slave")
    assert second["master"] == {"server_id": "aaaa", "address": "10.0.0.2:20881"}
    for role in ("producer", "consumer"):
        _, route = await api.route("s", role=role)
        assert route["groups"][0]["addresses"] == ["10.0.0.2:20881"]
        assert route["groups"][0]["epoch"] == 1


async def test_a_subject_is_routed_to_two_of_three_groups_with_a_stable_version(api: Api) -> None:
    for i in (1, 2, 3):
        await api.register(f"rt{i}", f"127.0.0.1:{20880 + i}")
    _, first = await api.route("pay.done")
    assert first["version"] == 1
    assert len(first["groups"]) == 2
    for role in ("producer", "consumer", "producer"):
        _, again = await api.route("pay.done", role=role)
        assert again == first
    # Heartbeats that change nothing do not move the route.
    for i in (1, 2, 3):
        assert (await api.heartbeat(f"rt{i}", f"127.0.0.1:{20880 + i}"))[0] == 200
    _, again = await api.route("pay.done")
    assert again == first
    # A second subject goes to the least loaded groups first: the one left out gets it.
    _, other = await api.route("pay.other")
    left_out = ({"rt1", "rt2", "rt3"} - set(names(first))).pop()
    assert left_out in names(other)


async def test_a_subject_routed_to_one_group_takes_a_second_when_it_registers(api: Api) -> None:
    await api.register("rt1", "127.0.0.1:1001")
    _, route = await api.route("s")
    assert (names(route), route["version"]) == (["rt1"], 1)
    await api.register("rt2", "127.0.0.1:1002")
    _, route = await api.route("s")
    assert (names(route), route["version"]) == (["rt1", "rt2"], 2)


async def test_a_broker_silent_past_the_expiry_leaves_the_route_and_a_replacement_is_added(
    api: Api, clock: FakeClock
) -> None:
    clock.advance(CLIENT_EXPIRY_MS)  # past the grace period after the MetaServer's start
    for i in (1, 2, 3):
        await api.register(f"rt{i}", f"127.0.0.1:{20880 + i}")
    _, before = await api.route("order.timeout")
    victim, survivor = names(before)
    spare = ({"rt1", "rt2", "rt3"} - {victim, survivor}).pop()
    addr = {f"rt{i}": f"127.0.0.1:{20880 + i}" for i in (1, 2, 3)}

    clock.advance(EXPIRY_MS)
    for g in (survivor, spare):
        await api.heartbeat(g, addr[g])
    # Silent for exactly the expiry: still online.
    assert (await api.expire())["brokers_offline"] == 0
    clock.advance(1)
    assert (await api.expire())["brokers_offline"] == 1

    _, after = await api.route("order.timeout")
    assert sorted(names(after)) == sorted([survivor, spare])
    assert after["version"] == before["version"] + 1
    _, consumer = await api.route("order.timeout", role="consumer")
    assert sorted(names(consumer)) == sorted([survivor, spare])  # the offline group is left out
    brokers = (await api.ok("GET", "/api/admin/brokers"))["brokers"]
    states = {b["group"]: (b["state"], b["heartbeat_age_ms"]) for b in brokers}
    assert states[victim] == ("offline", EXPIRY_MS + 1)
    assert states[survivor] == ("rw", 1)

    # The expired broker is told to register again; once back, consumers drain it again too.
    status, body = await api.heartbeat(victim, addr[victim])
    assert (status, body["error"]["code"]) == (404, "not_found")
    await api.register(victim, addr[victim])
    _, consumer = await api.route("order.timeout", role="consumer")
    assert sorted(names(consumer)) == ["rt1", "rt2", "rt3"]
    _, producer = await api.route("order.timeout")
    assert producer == after  # the route does not flap back


async def test_an_offline_group_with_no_spare_is_left_out_without_a_new_version(
    api: Api, clock: FakeClock
) -> None:
    await api.register("rt1", "127.0.0.1:1001")
    await api.register("rt2", "127.0.0.1:1002")
    _, before = await api.route("s")
    clock.advance(EXPIRY_MS + 1)
    await api.heartbeat("rt2", "127.0.0.1:1002")
    await api.expire()
    _, after = await api.route("s")
    assert (names(after), after["version"]) == (["rt2"], before["version"])


async def test_a_deregistered_broker_leaves_the_route_at_once(api: Api) -> None:
    await api.register("rt1", "127.0.0.1:1001")
    await api.route("s")
    assert await api.ok("POST", "/api/brokers/deregister",
                        {"group": "rt1", "address": "127.0.0.1:1001"}) == {"ok": True}
    status, body = await api.route("s")
    assert (status, body["error"]["code"]) == (503, "no_route")
    status, body = await api.post("/api/brokers/deregister", {"group": "rt1", "address": "h:1"})
    assert status == 404


async def test_no_live_group_is_a_503_no_route(api: Api) -> None:
    status, body = await api.route("s")
    assert status == 503
    assert body["error"]["code"] == "no_route"
    assert "'s'" in body["error"]["message"]


async def test_kind_delay_returns_the_live_delay_groups(api: Api, clock: FakeClock) -> None:
    await api.register("rt1", "127.0.0.1:20881")
    await api.register("d1", "127.0.0.1:20801", kind="delay")
    await api.register("d2", "127.0.0.1:20802", kind="delay")
    _, route = await api.route("order.timeout", kind="delay")
    assert names(route) == ["d1", "d2"]
    assert all(g["kind"] == "delay" for g in route["groups"])
    _, realtime = await api.route("order.timeout")
    assert names(realtime) == ["rt1"]  # delay groups never carry realtime routes
    clock.advance(EXPIRY_MS + 1)
    await api.heartbeat("d2", "127.0.0.1:20802", kind="delay", stats={"pending": 3})
    await api.heartbeat("rt1", "127.0.0.1:20881")
    await api.expire()
    _, route = await api.route("order.timeout", kind="delay")
    assert names(route) == ["d2"]


async def test_a_broker_cannot_join_a_group_of_the_other_kind(api: Api) -> None:
    await api.register("g", "127.0.0.1:1001")
    status, body = await api.post("/api/brokers/register",
                                  {"group": "g", "kind": "delay", "address": "127.0.0.1:1002"})
    assert (status, body["error"]["code"]) == (400, "bad_request")


# -- readonly -----------------------------------------------------------------------------------


async def test_a_readonly_group_is_hidden_from_producers_and_still_given_to_consumers(api: Api) -> None:
    await api.register("rt1", "127.0.0.1:1001")
    await api.register("rt2", "127.0.0.1:1002")
    await api.register("rt3", "127.0.0.1:1003")
    _, before = await api.route("s")
    drained = names(before)[0]
    out = await api.ok("POST", "/api/admin/brokers/readonly", {"group": drained, "readonly": True})
    assert out == {"ok": True, "group": drained, "readonly": True}

    _, producer = await api.route("s")
    assert drained not in names(producer)
    assert len(producer["groups"]) == 2  # the spare group replaced it
    assert producer["version"] == before["version"] + 1
    _, consumer = await api.route("s", role="consumer")
    assert names(consumer) == ["rt1", "rt2", "rt3"]
    states = {g["group"]: g["state"] for g in consumer["groups"]}
    assert states[drained] == "readonly"

    # The broker learns it from its heartbeat answer.
    _, hb = await api.heartbeat(drained, f"127.0.0.1:100{drained[-1]}")
    assert (hb["ok"], hb["state"]) == (True, "readonly")
    brokers = {b["group"]: b for b in (await api.ok("GET", "/api/admin/brokers"))["brokers"]}
    assert brokers[drained]["state"] == "readonly"
    assert brokers[drained]["group_readonly"] is True

    await api.ok("POST", "/api/admin/brokers/readonly", {"group": drained, "readonly": False})
    _, hb = await api.heartbeat(drained, f"127.0.0.1:100{drained[-1]}")
    assert (hb["ok"], hb["state"]) == (True, "rw")
    status, body = await api.post("/api/admin/brokers/readonly", {"group": "nope", "readonly": True})
    assert (status, body["error"]["code"]) == (404, "not_found")


async def test_the_admin_switch_wins_over_a_broker_echoing_the_readonly_state_it_was_told(
    api: Api,
) -> None:
    await api.register("rt1", "127.0.0.1:1001")
    await api.route("s")
    await api.ok("POST", "/api/admin/brokers/readonly", {"group": "rt1", "readonly": True})
    _, hb = await api.heartbeat("rt1", "127.0.0.1:1001", state="readonly")
    assert (hb["ok"], hb["state"]) == (True, "readonly")
    assert (await api.route("s"))[0] == 503
    await api.ok("POST", "/api/admin/brokers/readonly", {"group": "rt1", "readonly": False})
    # The broker still reports what it was told last; the answer tells it to go back to rw.
    _, hb = await api.heartbeat("rt1", "127.0.0.1:1001", state="readonly")
    assert (hb["ok"], hb["state"]) == (True, "rw")
    _, route = await api.route("s")
    assert names(route) == ["rt1"]
    brokers = (await api.ok("GET", "/api/admin/brokers"))["brokers"]
    assert (brokers[0]["state"], brokers[0]["reported_state"]) == ("rw", "readonly")


# -- restarts and migrations ----------------------------------------------------------------------


async def test_a_restarted_broker_re_registers_under_the_same_id(api: Api, clock: FakeClock) -> None:
    first = await api.register("rt1", "127.0.0.1:1001")
    await api.route("s")
    clock.advance(EXPIRY_MS + 1)
    await api.expire()
    assert (await api.route("s"))[0] == 503
    again = await api.register("rt1", "127.0.0.1:1001", state="readonly")
    assert again["broker_id"] == first["broker_id"]
    brokers = (await api.ok("GET", "/api/admin/brokers"))["brokers"]
    assert len(brokers) == 1
    assert (brokers[0]["state"], brokers[0]["reported_state"]) == ("rw", "readonly")
    assert brokers[0]["heartbeat_age_ms"] == 0
    assert brokers[0]["registered_at_ms"] == clock.now_ms


async def test_migrations_run_on_a_fresh_database_are_idempotent_and_data_survives_a_restart(
    db_url: str, clock: FakeClock
) -> None:
    engine = make_engine(db_url)
    try:
        assert await current_revision(engine) is None
        async with serve(db_url, clock) as api:
            assert await current_revision(engine) == head_revision()
            await api.register("rt1", "127.0.0.1:1001")
            await api.register("rt2", "127.0.0.1:1002")
            _, before = await api.route("s")
            await api.ok("POST", "/api/clients/heartbeat",
                         {"client_id": "c1", "app": "billing", "group": "g1",
                          "subjects": ["s"], "role": "consumer"})
        clock.advance(1000)
        async with serve(db_url, clock) as api:
            assert await current_revision(engine) == head_revision()
            # The restarted MetaServer knows the brokers without a new registration.
            assert (await api.heartbeat("rt1", "127.0.0.1:1001"))[0] == 200
            _, after = await api.route("s")
            assert after == before
            subjects = (await api.ok("GET", "/api/admin/subjects"))["subjects"]
            assert subjects[0]["subject"] == "s"
            assert subjects[0]["version"] == before["version"]
            groups = (await api.ok("GET", "/api/admin/groups"))["groups"]
            assert [(g["group"], g["subject"], g["online_clients"]) for g in groups] == [
                ("g1", "s", 1)
            ]
    finally:
        await engine.dispose()


async def test_a_restarted_metaserver_gives_brokers_one_expiry_period_before_dropping_them(
    db_url: str, clock: FakeClock
) -> None:
    async with serve(db_url, clock) as api:
        await api.register("rt1", "127.0.0.1:1001")
    clock.advance(10 * EXPIRY_MS)  # the MetaServer was down for a long time
    async with serve(db_url, clock) as api:
        assert (await api.expire())["brokers_offline"] == 0
        assert (await api.route("s"))[0] == 200
        clock.advance(EXPIRY_MS + 1)
        assert (await api.expire())["brokers_offline"] == 1


# -- clients and admin ----------------------------------------------------------------------------


async def test_admin_groups_report_lag_summed_over_brokers_from_the_latest_backlog(
    api: Api, clock: FakeClock
) -> None:
    await api.register("rt1", "127.0.0.1:1001")
    await api.register("rt2", "127.0.0.1:1002")
    await api.ok("POST", "/api/clients/heartbeat",
                 {"client_id": "c1", "app": "billing", "group": "billing",
                  "subjects": ["order.created"], "role": "consumer"})
    await api.ok("POST", "/api/clients/heartbeat",
                 {"client_id": "c2", "app": "billing", "group": "billing",
                  "subjects": ["order.created"], "role": "consumer"})
    await api.ok("POST", "/api/clients/heartbeat",
                 {"client_id": "p1", "app": "shop", "subjects": ["order.created"],
                  "role": "producer"})
    entry = {"subject": "order.created", "group": "billing", "consumers": 2}
    await api.heartbeat("rt1", "127.0.0.1:1001", backlog=[{**entry, "lag": 100}])
    await api.heartbeat("rt1", "127.0.0.1:1001", backlog=[{**entry, "lag": 7}])  # latest wins
    await api.heartbeat("rt2", "127.0.0.1:1002", backlog=[
        {**entry, "lag": 5}, {"subject": "order.created", "group": "audit", "lag": 1}])

    groups = (await api.ok("GET", "/api/admin/groups"))["groups"]
    by_key = {(g["group"], g["subject"]): g for g in groups}
    assert set(by_key) == {("billing", "order.created"), ("audit", "order.created")}
    # The console's and the scrape's listing reads each broker's totals, not its rows.
    registry = api.server.app[REGISTRY_KEY]
    totals = {b["group"]: b["stats"]["backlog_total"]
              for b in await registry.list_brokers(backlog_rows=False)}
    assert totals == {"rt1": {"lag": 7, "pairs": 1}, "rt2": {"lag": 6, "pairs": 2}}
    assert all(b["stats"]["backlog"] == [] for b in await registry.list_brokers(backlog_rows=False))
    billing = by_key[("billing", "order.created")]
    assert (billing["online_clients"], billing["lag"], billing["brokers"]) == (2, 12, 2)
    assert by_key[("audit", "order.created")]["lag"] == 1

    # An offline client and an offline broker drop out of the figures.
    clock.advance(EXPIRY_MS)
    await api.heartbeat("rt1", "127.0.0.1:1001", backlog=[{**entry, "lag": 7}])
    clock.advance(CLIENT_EXPIRY_MS - EXPIRY_MS + 1)
    await api.heartbeat("rt1", "127.0.0.1:1001", backlog=[{**entry, "lag": 7}])
    await api.ok("POST", "/api/clients/heartbeat",
                 {"client_id": "c1", "app": "billing", "group": "billing",
                  "subjects": ["order.created"], "role": "consumer"})
    assert await api.expire() == {"brokers_offline": 1, "clients_offline": 2}
    groups = (await api.ok("GET", "/api/admin/groups"))["groups"]
    billing = {(g["group"], g["subject"]): g for g in groups}[("billing", "order.created")]
    assert (billing["online_clients"], billing["lag"], billing["brokers"]) == (1, 7, 1)


async def test_backlog_reports_apply_changes_and_removals_over_the_version_held(
    api: Api
) -> None:
    await api.register("rt1", "127.0.0.1:1001")
    await api.register("dl1", "127.0.0.1:1002", kind="delay")
    key = {"group": "rt1", "kind": "realtime", "address": "127.0.0.1:1001"}
    row = {"subject": "orders", "group": "billing", "lag": 5, "consumers": 1}
    other = {"subject": "orders", "group": "audit", "lag": 2}
    whole = await api.ok("POST", "/api/brokers/backlog", {**key, "backlog": [row, other]})
    assert whole["backlog_version"] == 1
    delta = await api.ok("POST", "/api/brokers/backlog", {
        **key, "backlog_base": 1, "backlog_changes": [{**row, "lag": 9}],
        "backlog_removed": [["orders", "audit"]], "stats": {"sends": 3}})
    assert delta["backlog_version"] == 2
    same = await api.ok("POST", "/api/brokers/backlog", {**key, "backlog_base": 2,
                                                         "stats": {"sends": 3}})
    assert same["backlog_version"] == 2
    stale = await api.ok("POST", "/api/brokers/backlog", {
        **key, "backlog_base": 1, "backlog_changes": [{**row, "lag": 100}]})
    assert stale["backlog_version"] is None  # the server sends it whole again
    for scheduled in (4, 4, 6):  # a delay server's stats object replaces the last one
        await api.ok("POST", "/api/brokers/backlog", {
            "group": "dl1", "kind": "delay", "address": "127.0.0.1:1002",
            "backlog": {"scheduled": scheduled}})

    brokers = {b["group"]: b for b in (await api.ok("GET", "/api/admin/brokers"))["brokers"]}
    realtime = brokers["rt1"]["stats"]
    assert realtime["backlog_version"] == 2 and realtime["stats"] == {"sends": 3}
    assert [(r["group"], r["lag"], r["consumers"]) for r in realtime["backlog"]] == [
        ("billing", 9, 1)]
    assert brokers["dl1"]["stats"]["backlog"] == {"scheduled": 6}


async def test_admin_groups_sum_the_redelivery_retry_and_dead_counts_of_online_brokers(
    api: Api, clock: FakeClock
) -> None:
    await api.register("rt1", "127.0.0.1:1001")
    await api.register("rt2", "127.0.0.1:1002")
    entry = {"subject": "orders", "group": "billing", "lag": 1}
    await api.heartbeat("rt1", "127.0.0.1:1001", backlog=[
        {**entry, "redelivered": 4, "retried": 2, "dead": 1}])
    await api.heartbeat("rt2", "127.0.0.1:1002", backlog=[{**entry, "redelivered": 1}])
    groups = (await api.ok("GET", "/api/admin/groups"))["groups"]
    (billing,) = groups
    assert (billing["redelivered"], billing["retried"], billing["dead"]) == (5, 2, 1)


async def test_a_client_that_leaves_is_offline_at_once_and_comes_back_with_its_next_heartbeat(
    api: Api, clock: FakeClock
) -> None:
    body = {"client_id": "c1", "app": "a", "group": "g", "subjects": ["s"], "role": "consumer"}
    await api.ok("POST", "/api/clients/heartbeat", body)
    await api.ok("POST", "/api/clients/heartbeat", {**body, "client_id": "c2"})
    assert await api.ok("POST", "/api/clients/leave", {"client_id": "c1"}) == {
        "ok": True, "known": True}
    [group] = (await api.ok("GET", "/api/admin/groups"))["groups"]
    assert group["online_clients"] == 1, "no waiting for the client expiry"
    assert await api.ok("POST", "/api/clients/leave", {"client_id": "never-seen"}) == {
        "ok": True, "known": False}
    await api.ok("POST", "/api/clients/heartbeat", body)
    [group] = (await api.ok("GET", "/api/admin/groups"))["groups"]
    assert group["online_clients"] == 2


async def test_clients_unseen_for_exactly_the_expiry_stay_online_and_one_ms_later_go_offline(
    api: Api, clock: FakeClock
) -> None:
    clock.advance(CLIENT_EXPIRY_MS)  # past the grace period after the MetaServer's start
    body = {"client_id": "c1", "app": "a", "group": "g", "subjects": ["s"], "role": "consumer"}
    await api.ok("POST", "/api/clients/heartbeat", body)
    clock.advance(CLIENT_EXPIRY_MS)
    assert (await api.expire())["clients_offline"] == 0
    clock.advance(1)
    assert (await api.expire())["clients_offline"] == 1
    groups = (await api.ok("GET", "/api/admin/groups"))["groups"]
    assert groups == [{"group": "g", "subject": "s", "online_clients": 0, "lag": 0, "brokers": 0,
                       "broker_consumers": 0, "redelivered": 0, "retried": 0, "dead": 0}]


async def test_repeated_client_heartbeats_are_written_in_one_batch_by_the_expiry_check(
    api: Api, clock: FakeClock
) -> None:
    registry = api.server.registry
    clock.advance(CLIENT_EXPIRY_MS)  # past the grace period after the MetaServer's start
    bodies = [{"client_id": f"c{i}", "app": "a", "group": "g", "subjects": ["s"],
               "role": "consumer"} for i in range(50)]
    for body in bodies:  # first heartbeats: written one by one, seen at once
        await api.ok("POST", "/api/clients/heartbeat", body)
    [group] = (await api.ok("GET", "/api/admin/groups"))["groups"]
    assert group["online_clients"] == 50
    for _ in range(3):
        clock.advance(CLIENT_EXPIRY_MS // 2)
        for body in bodies:
            await api.ok("POST", "/api/clients/heartbeat", body)
        assert registry.liveness.pending == 50  # each noted, none written
        assert (await api.expire())["clients_offline"] == 0  # flushed, then checked
        assert registry.liveness.pending == 0
    clock.advance(CLIENT_EXPIRY_MS + 1)
    assert (await api.expire())["clients_offline"] == 50
    await api.ok("POST", "/api/clients/heartbeat", bodies[0])  # written in full: online again
    [group] = (await api.ok("GET", "/api/admin/groups"))["groups"]
    assert group["online_clients"] == 1


async def test_a_client_that_changes_its_subjects_is_written_at_once(api: Api) -> None:
    body = {"client_id": "c1", "app": "a", "group": "g", "subjects": ["s"], "role": "consumer"}
    await api.ok("POST", "/api/clients/heartbeat", body)
    await api.ok("POST", "/api/clients/heartbeat", {**body, "subjects": ["s", "t"]})
    groups = (await api.ok("GET", "/api/admin/groups"))["groups"]
    assert [(g["subject"], g["online_clients"]) for g in groups] == [("s", 1), ("t", 1)]


async def test_a_route_read_again_at_once_is_answered_from_memory_until_a_write_of_ours(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = api.server.registry
    await api.register("rt1", "127.0.0.1:1001")
    await api.register("rt2", "127.0.0.1:1002")
    status, first = await api.route("orders", "consumer")
    assert status == 200
    reads = []
    real = registry._route_unchanged

    async def counted(*args: Any) -> Any:
        reads.append(args[1:])
        return await real(*args)

    monkeypatch.setattr(registry, "_route_unchanged", counted)
    for _ in range(5):
        assert await api.route("orders", "consumer") == (200, first)
    assert len(reads) <= 1  # the cache lasts 250 ms: a slow machine may read once more
    await api.ok("POST", "/api/admin/brokers/readonly", {"group": "rt1", "readonly": True})
    reads.clear()
    status, after = await api.route("orders", "consumer")
    assert status == 200 and len(reads) == 1
    assert {g["group"]: g["state"] for g in after["groups"]}["rt1"] == "readonly"


async def test_a_batched_heartbeat_writes_a_process_s_new_clients_in_one_transaction(
    api: Api, clock: FakeClock
) -> None:
    registry = api.server.registry
    bodies = [{"client_id": f"c{i}", "app": "a", "group": "g", "subjects": [f"s{i % 2}"],
               "role": "consumer"} for i in range(100)]
    writes = registry.write_transactions
    assert await api.ok("POST", "/api/clients/heartbeats", {"clients": bodies}) == {
        "ok": True, "written": 100, "noted": 0}
    assert registry.write_transactions == writes + 1
    groups = (await api.ok("GET", "/api/admin/groups"))["groups"]
    assert [(g["subject"], g["online_clients"]) for g in groups] == [("s0", 50), ("s1", 50)]
    # Again: only noted in memory, no write; then 40 leave and a changed one is written.
    assert await api.ok("POST", "/api/clients/heartbeats", {"clients": bodies}) == {
        "ok": True, "written": 0, "noted": 100}
    assert registry.write_transactions == writes + 1
    changed = {**bodies[99], "subjects": ["s0", "s1"]}
    answer = await api.ok("POST", "/api/clients/heartbeats", {
        "clients": [*bodies[40:99], changed], "left": [b["client_id"] for b in bodies[:40]]})
    assert answer == {"ok": True, "written": 1, "noted": 59}
    assert registry.write_transactions == writes + 2
    groups = (await api.ok("GET", "/api/admin/groups"))["groups"]
    assert [(g["subject"], g["online_clients"]) for g in groups] == [("s0", 31), ("s1", 30)]


async def test_clients_of_a_batched_heartbeat_expire_one_by_one_when_they_stop(
    api: Api, clock: FakeClock
) -> None:
    clock.advance(CLIENT_EXPIRY_MS)  # past the grace period after the MetaServer's start
    bodies = [{"client_id": f"c{i}", "app": "a", "group": "g", "subjects": ["s"],
               "role": "consumer"} for i in range(3)]
    await api.ok("POST", "/api/clients/heartbeats", {"clients": bodies})
    clock.advance(CLIENT_EXPIRY_MS // 2)
    await api.ok("POST", "/api/clients/heartbeats", {"clients": bodies[:2]})  # c2 died
    clock.advance(CLIENT_EXPIRY_MS // 2 + 1)
    assert (await api.expire())["clients_offline"] == 1
    [group] = (await api.ok("GET", "/api/admin/groups"))["groups"]
    assert group["online_clients"] == 2


@pytest.mark.parametrize("count", [CLIENTS_PER_HEARTBEAT_MAX - 1, CLIENTS_PER_HEARTBEAT_MAX])
async def test_a_batched_heartbeat_takes_up_to_its_client_limit(api: Api, count: int) -> None:
    bodies = [{"client_id": f"c{i}", "app": "a", "role": "producer"} for i in range(count)]
    answer = await api.ok("POST", "/api/clients/heartbeats", {"clients": bodies})
    assert answer["written"] == count


async def test_a_batched_heartbeat_over_its_client_limit_is_refused_naming_it(api: Api) -> None:
    over = CLIENTS_PER_HEARTBEAT_MAX + 1
    bodies = [{"client_id": f"c{i}", "app": "a", "role": "producer"} for i in range(over)]
    status, data = await api.post("/api/clients/heartbeats", {"clients": bodies})
    assert status == 400 and data["error"]["code"] == "bad_request"
    assert f"{over} clients, over the limit CLIENTS_PER_HEARTBEAT_MAX" in data["error"]["message"]
    status, data = await api.post("/api/clients/heartbeats",
                                  {"left": [f"c{i}" for i in range(over)]})
    assert status == 400 and "CLIENTS_PER_HEARTBEAT_MAX" in data["error"]["message"]
    status, data = await api.post("/api/clients/heartbeats", {"clients": [
        {"client_id": "c1", "app": "a", "role": "consumer", "group": "-bad"}]})
    assert status == 400 and "body.clients[0].group" in data["error"]["message"]


# -- bad requests -------------------------------------------------------------------------------

REGISTER_OK = {"group": "rt1", "kind": "realtime", "address": "127.0.0.1:1001"}
BAD_BODIES = [
    pytest.param("/api/brokers/register", b"{not json", id="bad-json"),
    pytest.param("/api/brokers/register", b"[1, 2]", id="not-an-object"),
    pytest.param("/api/brokers/register", b"", id="empty-body"),
    pytest.param("/api/brokers/register", {**REGISTER_OK, "colour": "red"}, id="unknown-field"),
    pytest.param("/api/brokers/register", {"group": "rt1", "kind": "realtime"}, id="missing-field"),
    pytest.param("/api/brokers/register", {**REGISTER_OK, "group": 7}, id="int-for-string"),
    pytest.param("/api/brokers/register", {**REGISTER_OK, "kind": "batch"}, id="unknown-kind"),
    pytest.param("/api/brokers/register", {**REGISTER_OK, "state": "offline"}, id="bad-state"),
    pytest.param("/api/brokers/register", {**REGISTER_OK, "address": "nohost"}, id="no-port"),
    pytest.param("/api/brokers/register", {**REGISTER_OK, "address": "h:70000"}, id="port-range"),
    pytest.param("/api/brokers/register", {**REGISTER_OK, "group": "-x"}, id="bad-group-name"),
    pytest.param("/api/brokers/heartbeat", {**REGISTER_OK, "backlog": "lots"}, id="backlog-str"),
    pytest.param("/api/brokers/heartbeat",
                 {**REGISTER_OK, "backlog": [{"subject": "s", "group": "g", "lag": True}]},
                 id="bool-for-int"),
    pytest.param("/api/brokers/heartbeat",
                 {**REGISTER_OK, "backlog": [{"subject": "s", "group": "g", "lag": -1}]},
                 id="negative-lag"),
    pytest.param("/api/brokers/heartbeat",
                 {**REGISTER_OK, "backlog": [{"subject": "s", "group": "g", "lag": 1, "x": 1}]},
                 id="unknown-backlog-field"),
    pytest.param("/api/admin/brokers/readonly", {"group": "rt1", "readonly": "yes"},
                 id="string-for-bool"),
    pytest.param("/api/clients/heartbeat",
                 {"client_id": "c", "app": "a", "subjects": ["s"], "role": "consumer"},
                 id="consumer-without-group"),
    pytest.param("/api/clients/heartbeat",
                 {"client_id": "c", "app": "a", "group": "g", "subjects": [1], "role": "consumer"},
                 id="int-subject"),
]


@pytest.mark.parametrize(("path", "body"), BAD_BODIES)
async def test_bad_json_unknown_fields_and_wrong_types_are_400_with_a_json_error(
    api: Api, path: str, body: Any
) -> None:
    if isinstance(body, bytes):
        status, out = await api.post(path, raw=body)
    else:
        status, out = await api.post(path, body)
    assert status == 400, out
    assert out["error"]["code"] == "bad_request"
    assert out["error"]["message"]


@pytest.mark.parametrize(
    "params",
    [
        {"role": "producer"},
        {"subject": "s", "role": "admin"},
        {"subject": "s", "role": "producer", "kind": "batch"},
        {"subject": "s", "role": "producer", "extra": "1"},
        {"subject": "bad subject", "role": "producer"},
    ],
    ids=["no-subject", "bad-role", "bad-kind", "unknown-param", "bad-subject"],
)
async def test_bad_route_queries_are_400(api: Api, params: dict[str, str]) -> None:
    status, out = await api.get("/api/route", **params)
    assert (status, out["error"]["code"]) == (400, "bad_request")


async def test_internal_subjects_are_routed_like_any_other(api: Api) -> None:
    await api.register("rt1", "127.0.0.1:1001")
    status, route = await api.route("%retry%order.created%billing")
    assert status == 200
    assert names(route) == ["rt1"]


async def test_unknown_paths_and_methods_answer_json_errors(api: Api) -> None:
    status, out = await api.get("/api/nothing")
    assert (status, out["error"]["code"]) == (404, "not_found")
    status, out = await api.get("/api/brokers/register")
    assert status == 405
    assert out["error"]["code"] == "bad_request"


# -- several MetaServers, body limit, schema ------------------------------------------------------


# Several MetaServers share PostgreSQL only; SQLite is for one MetaServer.
@pytest.mark.parametrize("db_url", [pytest.param("postgresql", marks=pytest.mark.postgres)],
                         indirect=True)
async def test_two_metaservers_over_one_postgresql_agree_on_a_new_subjects_route(
    db_url: str, clock: FakeClock
) -> None:
    async with serve(db_url, clock) as a, serve(db_url, clock) as b:
        for i in (1, 2, 3):
            await a.register(f"rt{i}", f"127.0.0.1:{1000 + i}")
        answers = await asyncio.gather(
            *[(a if i % 2 else b).route(f"s{i % 5}") for i in range(60)]
        )
        by_subject: dict[str, list[Any]] = {}
        for status, route in answers:
            assert status == 200, route
            by_subject.setdefault(route["subject"], []).append(route)
        for routes in by_subject.values():
            assert all(r == routes[0] for r in routes), routes
            assert routes[0]["version"] == 1


async def test_a_body_over_the_size_limit_is_413_too_large(api: Api) -> None:
    from metaserver.app import BODY_SIZE_BYTES_MAX

    status, out = await api.post("/api/brokers/register", raw=b" " * (BODY_SIZE_BYTES_MAX + 1))
    assert (status, out["error"]["code"]) == (413, "too_large")
    # At the limit the body is read (and found to be no JSON object).
    status, out = await api.post("/api/brokers/register", raw=b" " * BODY_SIZE_BYTES_MAX)
    assert (status, out["error"]["code"]) == (400, "bad_request")


async def test_the_migrated_schema_matches_the_models(db_url: str, clock: FakeClock) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from metaserver.models import Base

    async with serve(db_url, clock):
        pass
    engine = make_engine(db_url)
    try:
        async with engine.connect() as connection:
            diff = await connection.run_sync(
                lambda sync: compare_metadata(
                    MigrationContext.configure(sync, opts={"compare_type": True}), Base.metadata
                )
            )
    finally:
        await engine.dispose()
    assert diff == []
