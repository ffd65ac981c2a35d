"""The console's figures, chart geometry, filters and session helpers: pure functions."""

from __future__ import annotations

import pytest

from metaserver.console import model
from metaserver.console.chart import bar_chart, nice_step
from metaserver.console.render import format_age, format_count, format_ms
from metaserver.console.session import Viewer, csrf_for, safe_next
from serverkit.access import Grant
from tracelog.events import HOUR_MS

NOW = 1_700_000_000_000


def broker(group: str, kind: str, state: str = "rw", **extra: object) -> dict[str, object]:
    return {"broker_id": 1, "group": group, "kind": kind, "address": f"{group}:1", "state": state,
            "heartbeat_age_ms": 10, "group_readonly": False, **extra}


def test_the_overview_puts_online_servers_first_and_sums_backlog_and_pending_of_online_ones():
    brokers = [
        broker("rt2", "realtime", "offline", stats={"backlog": [{"lag": 100}]}),
        broker("rt1", "realtime", stats={"backlog": [{"lag": 3}, {"lag": 4}]},
               role="master", epoch=2, lag_ms=15),
        broker("d1", "delay", stats={"backlog": {"pending_total": 7, "dispatch_rate_per_s": 1.5}}),
    ]
    view = model.overview(brokers)
    assert [r["group"] for r in view.realtime] == ["rt1", "rt2"]
    assert (view.online, view.offline, view.backlog, view.pending) == (2, 1, 7, 7)
    first = view.realtime[0]
    assert (first["role"], first["epoch"], first["lag"], first["pairs"]) == ("master", 2,
                                                                             "15 ms", 2)
    assert view.delay[0]["dispatch_rate"] == 1.5


def test_a_slaves_copy_is_shown_with_its_role_and_lag_but_left_out_of_the_totals():
    brokers = [
        broker("rt1", "realtime", stats={"backlog": [{"lag": 3}]}, role="master", epoch=4),
        broker("rt1", "realtime", stats={"backlog": [{"lag": 3}]}, role="slave", epoch=4,
               in_sync=True, lag_ms=1200, lag_bytes=4096),
        broker("d1", "delay", stats={"backlog": {"pending_total": 7}}, role="master", epoch=1),
        broker("d1", "delay", stats={"backlog": {"pending_total": 7}}, role="slave", epoch=1,
               in_sync=False, lag_bytes=10),
    ]
    view = model.overview(brokers)
    assert (view.online, view.backlog, view.pending) == (4, 3, 7)
    slave = [r for r in view.realtime if r["role"] == "slave"][0]
    assert (slave["epoch"], slave["in_sync"], slave["lag"]) == (4, True, "1,200 ms / 4,096 B")
    assert [r["role"] for r in view.delay] == ["master", "slave"]


def test_a_slave_whose_copy_stopped_at_a_record_it_cannot_decode_says_where_beside_its_lag():
    at = {"log": "done", "offset": 64, "kind": 1, "version": 2, "reason": "unknown version 2"}
    view = model.overview([
        broker("d1", "delay", stats=None, role="master", epoch=1),
        broker("d1", "delay", stats=None, role="slave", epoch=1, lag_bytes=48,
               undecodable_at=at)])
    master, slave = view.delay
    assert (master["stopped_at"], slave["stopped_at"]) == (None, "done@64 v2")
    assert slave["stopped_why"] == "unknown version 2"


def test_a_broker_without_replication_fields_shows_dashes_for_role_and_lag():
    row = model.overview([broker("rt1", "realtime", stats=None)]).realtime[0]
    assert (row["role"], row["lag"], row["backlog"]) == ("-", "-", 0)


def test_group_rows_fold_the_retry_subject_into_its_group_as_retry_backlog():
    groups = [
        {"group": "billing", "subject": "orders", "lag": 5, "online_clients": 2,
         "broker_consumers": 1, "brokers": 1, "redelivered": 3, "retried": 2, "dead": 1},
        {"group": "billing", "subject": "%retry%orders%billing", "lag": 4, "online_clients": 0,
         "broker_consumers": 0, "brokers": 1},
    ]
    (row,) = model.group_rows(groups)
    assert (row["backlog"], row["retry_backlog"], row["redelivered"], row["dead"]) == (5, 4, 3, 1)


def test_subject_rows_total_their_groups_and_split_routed_from_drained_groups():
    subjects = [{"subject": "orders", "version": 3, "groups": [
        {"group": "rt1", "active": True, "state": "rw"},
        {"group": "rt2", "active": False, "state": "offline"}]}]
    groups = [{"subject": "orders", "backlog": 2, "online_clients": 1},
              {"subject": "orders", "backlog": 3, "online_clients": 0}]
    (row,) = model.subject_rows(subjects, groups)
    assert (row["routed"], row["drained"], row["groups"], row["backlog"]) == (
        ["rt1"], ["rt2"], 2, 5)


@pytest.mark.parametrize(("count", "number", "expected"), [
    (0, 1, (1, 1, 0)), (100, 1, (1, 1, 100)), (101, 2, (2, 2, 1)), (250, 9, (3, 3, 50))])
def test_paginate_clamps_the_page_number_and_counts_pages(count, number, expected):
    page = model.paginate(list(range(count)), number)
    assert (page.number, page.count, len(page.rows)) == expected


def test_matching_is_a_case_insensitive_substring_over_the_given_keys():
    rows = [{"subject": "Orders.A", "group": "x"}, {"subject": "b", "group": "ORD"}]
    assert model.matching(rows, "ord", "subject") == rows[:1]
    assert model.matching(rows, "ord", "subject", "group") == rows
    assert model.matching(rows, "  ", "subject") == rows


def test_delay_hours_sum_servers_fill_empty_hours_and_count_overdue_and_later():
    hour = NOW - NOW % HOUR_MS
    servers = [{"stats": {"pending_per_hour": {str(hour): 2, str(hour - HOUR_MS): 1,
                                               str(hour + 5 * HOUR_MS): 4}}},
               {"stats": {"pending_per_hour": {str(hour): 3}}}, {"stats": {}}]
    view = model.delay_hours(servers, NOW, hours=3)
    assert view.hours == [(hour, 5), (hour + HOUR_MS, 0), (hour + 2 * HOUR_MS, 0)]
    assert (view.overdue, view.later, view.total) == (1, 4, 10)


def test_dead_summary_counts_per_subject_and_group_with_oldest_and_newest():
    rows = [{"subject": "o", "group": "g", "created_at_ms": t} for t in (5, 3, 9)]
    assert model.dead_summary(rows) == [{"subject": "o", "group": "g", "count": 3,
                                         "first_ms": 3, "last_ms": 9}]


@pytest.mark.parametrize(("peak", "step"), [(0, 1), (1, 1), (7, 2), (10, 2), (99, 20),
                                            (1234, 500), (5_000_000, 1_000_000)])
def test_nice_step_is_one_two_or_five_times_a_power_of_ten(peak, step):
    assert nice_step(peak) == step


def test_bar_heights_are_proportional_and_labels_thin_out_but_marks_stay():
    points = [(f"{h:02d}:00", h) for h in range(48)]
    chart = bar_chart(points, labels_max=24, marks={0: "2026-11-25", 24: "2026-11-26"})
    heights = [b.height for b in chart.bars]
    assert heights[0] == 0 and heights == sorted(heights)
    assert sum(b.show_label for b in chart.bars) == 24
    assert [b.mark for b in chart.bars if b.mark] == ["2026-11-25", "2026-11-26"]
    assert all(chart.left <= b.x and b.x + b.width <= chart.right for b in chart.bars)
    assert chart.ticks[0].value == 0 and chart.ticks[-1].value >= 47
    assert bar_chart([]).bars == []


def test_the_filters_format_times_ages_and_counts():
    assert format_ms(0) == "1970-01-01 00:00:00.000"
    assert format_ms(None) == "-"
    assert [format_age(ms) for ms in (850, 4200, 180_000, 9_000_000, 259_200_000)] == [
        "850 ms", "4.2 s", "3 min", "2.5 h", "3.0 d"]
    assert (format_count(1234567), format_count(None), format_count(2.25)) == (
        "1,234,567", "-", "2.2")


def test_csrf_values_differ_per_secret_and_next_targets_stay_on_this_site():
    assert csrf_for("a") != csrf_for("b") and csrf_for("a") == csrf_for("a")
    for target in ("//evil.example/x", "https://evil.example", "/\\evil", "", None):
        assert safe_next(target) == "/"
    assert safe_next("/dead?subject=a") == "/dead?subject=a"


def test_an_app_viewer_sees_the_subjects_its_patterns_cover_and_an_open_console_sees_all():
    grant = Grant(app="shop", produce=("order.*",), consume=("pay",))
    viewer = Viewer(auth_enabled=True, app="shop", admin=False, grant=grant)
    assert viewer.read_only
    assert [s for s in ("order.a", "pay", "other") if viewer.may_see(s)] == ["order.a", "pay"]
    assert Viewer(auth_enabled=False, app=None, admin=True).may_see("anything")


async def test_a_stale_snapshot_is_served_while_one_refresh_replaces_it():
    import asyncio

    from metaserver.console.snapshot import Snapshots

    now = [0.0]
    taken: list[int] = []
    release = asyncio.Event()

    async def taker(registry: object) -> object:
        taken.append(len(taken))
        if len(taken) > 1:
            await release.wait()
        return len(taken)

    snaps = Snapshots(None, ttl_ms=1000,  # type: ignore[arg-type]
                      monotonic_ms=lambda: now[0], taker=taker)
    assert await snaps.get() == 1  # the first waits for it
    now[0] = 999
    assert await snaps.get() == 1 and len(taken) == 1  # fresh: no refresh
    now[0] = 1000
    assert [await snaps.get(), await snaps.get()] == [1, 1]  # stale: served, one refresh
    await asyncio.sleep(0)
    assert len(taken) == 2
    release.set()
    for _ in range(10):
        await asyncio.sleep(0)
    assert await snaps.get() == 2
    await snaps.close()


def test_visible_rows_are_those_an_app_may_see_and_all_rows_for_an_admin_or_an_open_console():
    rows = [{"subject": "order.a"}, {"subject": "pay"}, {"subject": "other"}]
    app = Viewer(auth_enabled=True, app="shop", admin=False,
                 grant=Grant(app="shop", produce=("order.*",), consume=("pay",)))
    assert [r["subject"] for r in app.visible(rows)] == ["order.a", "pay"]
    admin = Viewer(auth_enabled=True, app="ops", admin=True,
                   grant=Grant(app="ops", produce=(), consume=(), admin=True))
    assert admin.visible(rows) is rows
    assert Viewer(auth_enabled=False, app=None, admin=True).visible(rows) is rows
