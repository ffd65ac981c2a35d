"""Fire times and misfire decisions of recurring schedules, told the time (a fake clock).

Includes the 2026 daylight-saving changes of Europe/Berlin: the gap on 29 March (02:00 -> 03:00)
and the overlap on 25 October (03:00 -> 02:00), and a time zone without DST (Asia/Kolkata)."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from metaserver.schedule_plan import (
    EVERY_MS_MIN,
    FireTimes,
    SchedulePlanner,
    ScheduleSpecError,
    TriggerSpec,
    check_cron,
    check_every_ms,
    datetime_to_ms,
    ms_to_datetime,
    parse_time,
    zone,
)

BERLIN = "Europe/Berlin"
MINUTE_MS = 60_000
HOUR_MS = 60 * MINUTE_MS


def utc_ms(text: str) -> int:
    """``2026-03-29T01:30`` read as UTC, in epoch ms."""
    return datetime_to_ms(datetime.fromisoformat(text).replace(tzinfo=timezone.utc))


def local(ms: int, tz: str = BERLIN) -> str:
    """Epoch ms as local wall-clock time with its offset, e.g. ``2026-03-29T03:30+02:00``."""
    return ms_to_datetime(ms, zone(tz)).isoformat(timespec="minutes")


def cron(expr: str, tz: str = BERLIN, start: str = "2026-01-01T00:00", end: str | None = None
         ) -> FireTimes:
    return FireTimes(TriggerSpec(kind="cron", cron=expr, tz=tz, start_ms=utc_ms(start),
                                 end_ms=None if end is None else utc_ms(end)))


def every(every_ms: int, start_ms: int, end_ms: int | None = None) -> FireTimes:
    return FireTimes(TriggerSpec(kind="every", every_ms=every_ms, tz="UTC", start_ms=start_ms,
                                 end_ms=end_ms))


# -- fire times ---------------------------------------------------------------------------------

def test_weekdays_at_nine_in_berlin_stay_at_nine_local_across_the_march_change() -> None:
    fires = cron("0 9 * * MON-FRI").upcoming(utc_ms("2026-03-26T00:00"), 4)
    assert [local(f) for f in fires] == ["2026-03-26T09:00+01:00", "2026-03-27T09:00+01:00",
                                         "2026-03-30T09:00+02:00", "2026-03-31T09:00+02:00"]


def test_a_daily_time_in_the_march_gap_fires_once_that_day_shifted_past_the_gap() -> None:
    # 02:30 does not exist on 29 March 2026 in Berlin; APScheduler fires at 01:30 UTC (03:30).
    fires = cron("30 2 * * *").upcoming(utc_ms("2026-03-27T12:00"), 4)
    assert [local(f) for f in fires] == ["2026-03-28T02:30+01:00", "2026-03-29T03:30+02:00",
                                         "2026-03-30T02:30+02:00", "2026-03-31T02:30+02:00"]


def test_an_every_half_hour_cron_skips_the_wall_clock_times_the_gap_removes() -> None:
    fires = cron("*/30 * * * *").upcoming(utc_ms("2026-03-28T23:59"), 5)
    assert [local(f) for f in fires] == ["2026-03-29T01:00+01:00", "2026-03-29T01:30+01:00",
                                         "2026-03-29T03:00+02:00", "2026-03-29T03:30+02:00",
                                         "2026-03-29T04:00+02:00"]
    assert [b - a for a, b in zip(fires, fires[1:])] == [30 * MINUTE_MS] * 4


def test_a_daily_time_in_the_october_overlap_fires_once_not_in_both_passes() -> None:
    fires = cron("30 2 * * *").upcoming(utc_ms("2026-10-24T12:00"), 3)
    assert [local(f) for f in fires] == ["2026-10-25T02:30+02:00", "2026-10-26T02:30+01:00",
                                         "2026-10-27T02:30+01:00"]


def test_an_hourly_cron_fires_in_both_passes_of_the_repeated_hour() -> None:
    # A schedule of every hour is about real time: the repeated hour is an hour like any other.
    fires = cron("30 * * * *").upcoming(utc_ms("2026-10-24T23:00"), 4)
    assert [local(f) for f in fires] == ["2026-10-25T01:30+02:00", "2026-10-25T02:30+02:00",
                                         "2026-10-25T02:30+01:00", "2026-10-25T03:30+01:00"]
    assert [b - a for a, b in zip(fires, fires[1:])] == [HOUR_MS] * 3


def test_an_interval_is_real_time_and_ignores_the_clock_changes() -> None:
    start = utc_ms("2026-10-24T22:00")
    fires = every(HOUR_MS, start).upcoming(start - 1, 6)
    assert [b - a for a, b in zip(fires, fires[1:])] == [HOUR_MS] * 5
    assert fires[0] == start


def test_a_zone_without_dst_keeps_the_same_utc_time_all_year() -> None:
    fires = cron("0 9 * * *", tz="Asia/Kolkata").upcoming(utc_ms("2026-03-28T00:00"), 3)
    fires += cron("0 9 * * *", tz="Asia/Kolkata").upcoming(utc_ms("2026-10-24T00:00"), 3)
    assert {ms_to_datetime(f, timezone.utc).strftime("%H:%M") for f in fires} == {"03:30"}


def test_start_and_end_bound_the_fire_times_inclusively() -> None:
    fires = cron("0 12 * * *", tz="UTC", start="2026-05-01T12:00",
                 end="2026-05-03T12:00").upcoming(0, 10)
    assert [local(f, "UTC") for f in fires] == ["2026-05-01T12:00+00:00",
                                                "2026-05-02T12:00+00:00",
                                                "2026-05-03T12:00+00:00"]


def test_an_at_schedule_fires_once_and_then_has_nothing_left() -> None:
    at = FireTimes(TriggerSpec(kind="at", at_ms=5_000, tz="UTC", start_ms=0))
    assert at.upcoming(0, 3) == [5_000]
    assert at.first_after(5_000) is None


def test_interval_fire_times_are_the_same_whatever_after_ms_they_are_asked_from() -> None:
    # Two MetaServers may plan from different progress; the ids (fixed by fire time) must agree.
    start = 1_774_700_000_123
    times = every(EVERY_MS_MIN, start)
    chained = times.upcoming(start - 1, 500)
    assert chained == [start + i * EVERY_MS_MIN for i in range(500)]
    assert times.first_after(chained[250] - 7) == chained[250]


# -- checks -------------------------------------------------------------------------------------

def test_a_numeric_day_of_week_is_refused_because_crontab_and_apscheduler_disagree() -> None:
    with pytest.raises(ScheduleSpecError, match="names.*0 as Sunday"):
        check_cron("0 9 * * 1-5")
    assert check_cron("0 9 * * MON-FRI") == "0 9 * * MON-FRI"


@pytest.mark.parametrize("expr", ["0 25 * * *", "0 9 * *", "0 9 * * FOO", "", "x" * 201])
def test_a_bad_cron_expression_is_refused_quoting_it(expr: str) -> None:
    with pytest.raises(ScheduleSpecError, match="cron"):
        check_cron(expr)


def test_every_ms_is_checked_at_the_minimum_minus_one_the_minimum_and_the_maximum() -> None:
    assert check_every_ms(EVERY_MS_MIN) == EVERY_MS_MIN
    with pytest.raises(ScheduleSpecError, match=f"EVERY_MS_MIN {EVERY_MS_MIN}"):
        check_every_ms(EVERY_MS_MIN - 1)
    with pytest.raises(ScheduleSpecError, match="integer"):
        check_every_ms(True)


def test_an_unknown_time_zone_is_refused() -> None:
    with pytest.raises(ScheduleSpecError, match="Europe/Nowhere"):
        zone("Europe/Nowhere")
    with pytest.raises(ScheduleSpecError):
        zone("../etc/passwd")


def test_a_local_time_in_the_gap_or_the_overlap_needs_its_offset() -> None:
    with pytest.raises(ScheduleSpecError, match="does not exist.*forward"):
        parse_time("2026-03-29T02:30", BERLIN, "--at")
    with pytest.raises(ScheduleSpecError, match="happens twice.*back"):
        parse_time("2026-10-25T02:30", BERLIN, "--at")
    assert parse_time("2026-10-25T02:30+01:00", BERLIN, "--at") == utc_ms("2026-10-25T01:30")
    assert parse_time("2026-10-25T04:00", BERLIN, "--at") == utc_ms("2026-10-25T03:00")
    with pytest.raises(ScheduleSpecError, match="ISO 8601"):
        parse_time("tomorrow", BERLIN, "--at")


# -- plans: what to send, told the time ---------------------------------------------------------

class FakeClock:
    """Epoch ms that only move when told."""

    def __init__(self, now_ms: int) -> None:
        self.now_ms = now_ms

    def advance(self, ms: int) -> int:
        self.now_ms += ms
        return self.now_ms


def test_on_time_the_planner_hands_over_exactly_the_next_occurrence_and_wakes_at_it() -> None:
    start = utc_ms("2026-06-01T00:00")
    times, clock = every(MINUTE_MS, start), FakeClock(start - 5_000)
    planner = SchedulePlanner(grace_ms=10_000)
    plan = planner.plan(times, start - 1, clock.now_ms, "skip")
    assert (plan.fires_ms, plan.after_ms, plan.wake_ms) == ((start,), start, start)
    clock.advance(5_000)  # the occurrence fires: the runner plans again
    plan = planner.plan(times, plan.after_ms, clock.now_ms, "skip")
    assert plan.fires_ms == (start + MINUTE_MS,) and plan.skipped == 0


def test_after_downtime_skip_sends_only_the_next_occurrence_and_counts_the_missed() -> None:
    start = utc_ms("2026-06-01T00:00")
    plan = SchedulePlanner(grace_ms=10_000).plan(every(MINUTE_MS, start), start,
                                                 start + 10 * MINUTE_MS + 30_000, "skip")
    assert plan.fires_ms == (start + 11 * MINUTE_MS,)
    assert (plan.skipped, plan.skipped_more) == (10, False)


def test_after_downtime_once_sends_the_latest_missed_occurrence_and_the_next() -> None:
    start = utc_ms("2026-06-01T00:00")
    plan = SchedulePlanner(grace_ms=10_000).plan(every(MINUTE_MS, start), start,
                                                 start + 10 * MINUTE_MS + 30_000, "once")
    assert plan.fires_ms == (start + 10 * MINUTE_MS, start + 11 * MINUTE_MS)
    assert plan.skipped == 9


def test_after_downtime_all_sends_every_missed_occurrence_in_order() -> None:
    start = utc_ms("2026-06-01T00:00")
    plan = SchedulePlanner(grace_ms=10_000).plan(every(MINUTE_MS, start), start,
                                                 start + 10 * MINUTE_MS + 30_000, "all")
    assert plan.fires_ms == tuple(start + i * MINUTE_MS for i in range(1, 12))
    assert plan.skipped == 0 and plan.wake_ms == start + 11 * MINUTE_MS


def test_an_occurrence_late_by_less_than_the_grace_is_sent_under_every_policy() -> None:
    start = utc_ms("2026-06-01T00:00")
    for policy in ("skip", "once", "all"):
        plan = SchedulePlanner(grace_ms=10_000).plan(every(MINUTE_MS, start), start,
                                                     start + MINUTE_MS + 9_999, policy)
        assert plan.fires_ms == (start + MINUTE_MS, start + 2 * MINUTE_MS), policy


def test_catching_up_with_all_goes_in_slices_and_asks_to_be_planned_again_at_once() -> None:
    start = utc_ms("2026-06-01T00:00")
    planner = SchedulePlanner(grace_ms=1_000, catchup_max=4)
    now = start + 10 * MINUTE_MS + 30_000
    plan = planner.plan(every(MINUTE_MS, start), start, now, "all")
    assert plan.fires_ms == tuple(start + i * MINUTE_MS for i in range(1, 5))
    assert plan.wake_ms == now and plan.after_ms == start + 4 * MINUTE_MS


def test_a_very_long_downtime_is_skipped_in_bounded_steps() -> None:
    start = utc_ms("2026-06-01T00:00")
    planner = SchedulePlanner(grace_ms=1_000, steps_max=50)
    now = start + 1_000 * MINUTE_MS + 30_000
    plan = planner.plan(every(MINUTE_MS, start), start, now, "skip")
    assert plan.fires_ms == (start + 1_001 * MINUTE_MS,)
    assert (plan.skipped, plan.skipped_more) == (50, True)


def test_a_far_occurrence_waits_until_it_is_within_the_ahead_window() -> None:
    times = FireTimes(TriggerSpec(kind="at", at_ms=10 * 86_400_000, tz="UTC", start_ms=0))
    planner = SchedulePlanner(ahead_ms=86_400_000)
    plan = planner.plan(times, -1, 0, "skip")
    assert plan.fires_ms == () and plan.wake_ms == 9 * 86_400_000
    plan = planner.plan(times, plan.after_ms, 9 * 86_400_000, "skip")
    assert plan.fires_ms == (10 * 86_400_000,) and plan.wake_ms == 10 * 86_400_000


def test_the_last_occurrence_finishes_the_schedule() -> None:
    start = utc_ms("2026-06-01T00:00")
    times = every(MINUTE_MS, start, end_ms=start + MINUTE_MS)
    plan = SchedulePlanner().plan(times, start, start + 1, "skip")
    assert plan.fires_ms == (start + MINUTE_MS,) and not plan.finished
    plan = SchedulePlanner().plan(times, plan.after_ms, start + MINUTE_MS, "skip")
    assert plan.fires_ms == () and plan.finished


def test_the_planner_over_the_berlin_overlap_sends_each_daily_occurrence_once() -> None:
    times = cron("30 2 * * *")
    planner = SchedulePlanner(grace_ms=10_000)
    clock = FakeClock(utc_ms("2026-10-24T12:00"))
    after, sent = clock.now_ms, []
    for _ in range(10):  # a plan a day ahead at most: some plans only set the next wake
        if len(sent) == 3:
            break
        plan = planner.plan(times, after, clock.now_ms, "skip")
        sent += plan.fires_ms
        after = plan.after_ms
        assert plan.wake_ms is not None
        clock.now_ms = plan.wake_ms  # the runner wakes when the occurrence fires
    assert [local(f) for f in sent] == ["2026-10-25T02:30+02:00", "2026-10-26T02:30+01:00",
                                        "2026-10-27T02:30+01:00"]


def test_a_bad_policy_is_refused() -> None:
    with pytest.raises(ScheduleSpecError, match="misfire 'never'"):
        SchedulePlanner().plan(every(MINUTE_MS, 0), 0, 1, "never")
