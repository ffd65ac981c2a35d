"""A broker's heartbeats against a live MetaServer (issue 19): a backlog of more groups than the
MetaServer takes in one heartbeat reaches it over a few heartbeats, the steady heartbeat of an
idle broker stays small whatever its groups, and a refused heartbeat is logged with the
MetaServer's reason and never expires the broker."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from metaserver import MetaConfig, sqlite_url, start_metaserver
from metaserver.validation import BACKLOG_ENTRIES_MAX
from serverkit.backlog import BACKLOG_ROWS_PER_HEARTBEAT_MAX
from serverkit.registration import Registration

EXPIRY_MS = 15_000
GROUPS = BACKLOG_ENTRIES_MAX + 2_000


class Clock:
    def __init__(self) -> None:
        self.now_ms = 1_700_000_000_000

    def __call__(self) -> int:
        return self.now_ms


class Broker:
    """What a broker hands its registration: a backlog report it can change, and the bodies
    of the heartbeats it sent."""

    def __init__(self, groups: int) -> None:
        self.rows = [{"subject": f"orders.s{i:05d}", "group": f"g{i % 7}", "lag": 0,
                      "consumers": 1} for i in range(groups)]
        self.sent: list[dict[str, Any]] = []

    async def report(self) -> list[dict[str, Any]]:
        return [dict(row) for row in self.rows]


def registration(url: str, broker: Broker, clock: Clock) -> Registration:
    # The registration reads the test's clock too: a backlog rides on a heartbeat at most every
    # STATS_INTERVAL_MS, and each heartbeat here comes a third of the expiry after the last.
    reg = Registration(url, group="rt1", kind="realtime", address="127.0.0.1:20881",
                       heartbeat_interval_ms=3_600_000, report=broker.report,
                       on_state=lambda state: None, clock_ms=clock)
    post = reg._post

    async def recording_post(path: str, body: dict[str, Any], **options: Any) -> tuple[int, Any]:
        if path.endswith("/heartbeat"):
            broker.sent.append(body)
        return await post(path, body, **options)

    reg._post = recording_post  # type: ignore[method-assign]
    return reg


@pytest.fixture
async def meta(tmp_path):
    clock = Clock()
    config = MetaConfig(db_url=sqlite_url(tmp_path / "meta.db"), port=0,
                        broker_expiry_ms=EXPIRY_MS, expiry_check_interval_ms=3_600_000,
                        # Heartbeats every EXPIRY_MS // 3, each given twice that to be answered
                        # (a 3 s lease would leave 1.5 s to a MetaServer on a loaded machine).
                        lease_ms=4 * EXPIRY_MS // 3)
    async with start_metaserver(config, clock) as server:
        server.clock = clock
        yield server


async def held_backlog(meta) -> dict[tuple[str, str], int]:
    (broker,) = await meta.registry.list_brokers()
    return {(r["subject"], r["group"]): r["lag"] for r in broker["stats"]["backlog"]}


@pytest.mark.timeout(120)
async def test_a_broker_with_more_groups_than_a_heartbeat_takes_stays_registered_and_idles_small(
    meta, caplog,
):
    broker = Broker(GROUPS)
    reg = registration(meta.url, broker, meta.clock)
    await reg.start()
    try:
        for _ in range(3 * GROUPS // BACKLOG_ROWS_PER_HEARTBEAT_MAX):  # bounded: converges
            meta.clock.now_ms += EXPIRY_MS // 3
            await reg.heartbeat_now()
            assert (await meta.expire_now())["brokers_offline"] == 0
            if len(await held_backlog(meta)) == GROUPS and not broker.sent[-1].get(
                    "backlog_changes", True):
                break
        assert reg.registered
        assert len(await held_backlog(meta)) == GROUPS
        idle = json.dumps(broker.sent[-1]).encode()
        assert len(idle) < 1_000, idle  # an idle heartbeat: no row, whatever the groups
        broker.rows[5]["lag"] = 42
        del broker.rows[7]
        meta.clock.now_ms += EXPIRY_MS // 3
        await reg.heartbeat_now()
        changed = broker.sent[-1]
        assert len(changed["backlog_changes"]) == 1 and len(changed["backlog_removed"]) == 1
        held = await held_backlog(meta)
        assert len(held) == GROUPS - 1 and held[("orders.s00005", "g5")] == 42
    finally:
        await reg.stop()


@pytest.mark.timeout(60)
async def test_a_refused_heartbeat_is_logged_with_the_reason_and_the_broker_is_not_expired(
    meta, caplog,
):
    broker = Broker(3)
    broker.rows[0]["subject"] = "not a subject!"
    reg = registration(meta.url, broker, meta.clock)
    await reg.start()
    try:
        with caplog.at_level(logging.INFO, logger="serverkit.registration"):
            for _ in range(4):
                meta.clock.now_ms += EXPIRY_MS // 3
                await reg.heartbeat_now()
                assert (await meta.expire_now())["brokers_offline"] == 0
        refusals = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(refusals) == 4
        assert "HTTP 400: bad_request:" in refusals[0] and "not a subject!" in refusals[0]
        registered = [r for r in caplog.records if "registered realtime group" in r.getMessage()]
        assert registered == []  # never cycled through registering again
        (state,) = await meta.registry.list_brokers()
        assert state["state"] == "rw" and state["heartbeat_age_ms"] == 0
    finally:
        await reg.stop()
