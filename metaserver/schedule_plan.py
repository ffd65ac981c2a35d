"""Recurring schedules, the pure part: fire times from APScheduler's triggers, and what to send.

Nothing here reads the clock or the database: the runner (``metaserver.schedule_runner``) tells
``SchedulePlanner`` the time and the schedule's progress, and it answers which occurrences to hand
to the delay server now. Tests drive it with a fake clock (docs/SCHEDULES.md).

Fire times come only from APScheduler 3's triggers (``CronTrigger``, ``IntervalTrigger``,
``DateTrigger``): no cron or time-zone arithmetic of ours. Each next fire time is asked as
"the first fire time at or after T" (``get_next_fire_time(None, T)``), never chained from the
previous one, so every MetaServer computes the same fire times from the same stored ``after_ms``
and message ids (fixed by fire time) agree. We add one rule on top, as Vixie cron does: a cron
schedule that names its hours (``0 2 * * *``, not ``*/30 * * * *``) does not fire a second time
when the clock is set back and the same wall-clock time comes round again (APScheduler would).
That rule drops a fire time APScheduler gave; it computes none.

Times are integer milliseconds since the epoch (``*_ms``); ``datetime`` is used only to talk to
APScheduler and zoneinfo.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone, tzinfo
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from apscheduler.triggers.base import BaseTrigger
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger

EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_MS = timedelta(milliseconds=1)
_HALF_MS = timedelta(microseconds=500)

KINDS = ("cron", "every", "at")
MISFIRE_POLICIES = ("skip", "once", "all")

# Shortest --every, in ms: below it a schedule is a message stream, not a schedule.
EVERY_MS_MIN = 100
# Longest --every, in ms (10 years; longer ones never fire within the delay horizon anyway).
EVERY_MS_MAX = 10 * 366 * 86_400_000
# Longest cron expression and time-zone name we store, in characters.
CRON_CHARS_MAX = 200
TZ_CHARS_MAX = 64
# Most fire times one `next` request lists.
NEXT_COUNT_MAX = 1000
# Occurrences handed over in one plan when catching up (misfire "all"); the rest follow in the
# next plan, which the runner makes at once.
CATCHUP_SENDS_MAX = 1000
# Missed occurrences one plan steps through one by one; past that it jumps to the first one
# still on time (counting the skipped ones only as "at least this many").
PLAN_STEPS_MAX = 100_000
# Answers of FireTimes.first_after remembered per definition (a dict of ints).
FIRST_AFTER_MEMO_MAX = 4_096
# How far ahead of its fire time an occurrence is handed to the delay server at most, in ms.
# Closer ones go at once; a further one waits (the runner plans it again this long before).
AHEAD_MS_MAX_DEFAULT = 86_400_000
# How late an occurrence may be handed over and still count as on time, in ms: older ones are
# misfires and the schedule's misfire policy decides.
MISFIRE_GRACE_MS_DEFAULT = 60_000

_CRON_FIELDS = 5
# A day-of-week field written with digits: crontab counts 0 as Sunday, APScheduler 3 as Monday.
_DIGIT_RE = re.compile(r"\d")


class ScheduleSpecError(ValueError):
    """A schedule definition that cannot be used: the message quotes the value and the rule."""


@dataclass(frozen=True)
class TriggerSpec:
    """When a schedule fires. Exactly one of ``cron``, ``every_ms``, ``at_ms`` is set (``kind``).

    ``start_ms`` is the first moment a fire time may fall on (for ``every``, the first fire time);
    ``end_ms`` the last (inclusive), None for no end. ``tz`` is an IANA time-zone name: cron
    fields are matched against the wall clock there.
    """

    kind: str
    tz: str
    start_ms: int
    end_ms: int | None = None
    cron: str | None = None
    every_ms: int | None = None
    at_ms: int | None = None


def ms_to_datetime(ms: int, tz: tzinfo) -> datetime:
    """Epoch ms as an aware datetime in ``tz`` (exact: no float on the way)."""
    return (EPOCH + ms * _MS).astimezone(tz)


def datetime_to_ms(moment: datetime) -> int:
    """An aware datetime as epoch ms, rounded to the nearest ms (interval triggers add floats)."""
    return (moment - EPOCH + _HALF_MS) // _MS


def zone(name: str) -> ZoneInfo:
    """The IANA time zone ``name``; ScheduleSpecError for an unknown or malformed one."""
    if not isinstance(name, str) or not 1 <= len(name) <= TZ_CHARS_MAX:
        raise ScheduleSpecError(f"time zone {name!r} must be an IANA name of 1 to "
                                f"{TZ_CHARS_MAX} characters, e.g. Europe/Berlin")
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise ScheduleSpecError(f"time zone {name!r} is not a known IANA time zone "
                                "(e.g. Europe/Berlin, UTC, Asia/Kolkata)") from None


def parse_time(text: str, tz_name: str, what: str) -> int:
    """An ISO 8601 time as epoch ms; one without an offset is wall-clock time in ``tz_name``.

    A wall-clock time that does not exist there (skipped when the clocks go forward) or exists
    twice (when they go back) is refused: the caller gives the offset to say which is meant.
    """
    try:
        moment = datetime.fromisoformat(text)
    except (TypeError, ValueError):
        raise ScheduleSpecError(f"{what} {text!r} is not an ISO 8601 time "
                                "(e.g. 2026-12-24T18:00 or 2026-12-24T18:00+01:00)") from None
    if moment.tzinfo is not None:
        return datetime_to_ms(moment)
    tz = zone(tz_name)
    first, second = moment.replace(tzinfo=tz, fold=0), moment.replace(tzinfo=tz, fold=1)
    if first.utcoffset() != second.utcoffset():
        # zoneinfo gives the two offsets around a change; which case it is shows on a round trip.
        exists = ms_to_datetime(datetime_to_ms(first), tz).replace(tzinfo=None) == moment
        why = ("happens twice there (the clocks go back)" if exists
               else "does not exist there (the clocks go forward)")
        raise ScheduleSpecError(f"{what} {text!r} {why} in {tz_name}; add the UTC offset, e.g. "
                                f"{text}{_offset_text(first)}")
    return datetime_to_ms(first)


def _offset_text(moment: datetime) -> str:
    """``+01:00`` for a datetime's UTC offset (for an error message)."""
    return moment.isoformat()[-6:]


def check_cron(expr: str) -> str:
    """Check a 5-field crontab expression; returns it. Day-of-week must be names (MON-FRI)."""
    if not isinstance(expr, str) or not 1 <= len(expr) <= CRON_CHARS_MAX:
        raise ScheduleSpecError(f"cron {expr!r} must be 1 to {CRON_CHARS_MAX} characters")
    fields = expr.split()
    if len(fields) != _CRON_FIELDS:
        raise ScheduleSpecError(f"cron {expr!r} has {len(fields)} fields; it needs 5: minute "
                                "hour day-of-month month day-of-week")
    if _DIGIT_RE.search(fields[4]):
        # Translating would be cron arithmetic of our own; names mean the same everywhere.
        raise ScheduleSpecError(
            f"cron {expr!r}: write the day-of-week field {fields[4]!r} with names (MON-FRI, "
            "SUN): crontab counts 0 as Sunday and APScheduler 3 as Monday")
    try:
        CronTrigger.from_crontab(expr, timezone=timezone.utc)
    except ValueError as exc:
        raise ScheduleSpecError(f"cron {expr!r} is not valid: {exc}") from None
    return expr


def check_every_ms(every_ms: int) -> int:
    """Check an interval in ms against EVERY_MS_MIN and EVERY_MS_MAX."""
    if isinstance(every_ms, bool) or not isinstance(every_ms, int):
        raise ScheduleSpecError(f"every_ms {every_ms!r} must be an integer")
    if not EVERY_MS_MIN <= every_ms <= EVERY_MS_MAX:
        raise ScheduleSpecError(f"every_ms {every_ms} must be between EVERY_MS_MIN "
                                f"{EVERY_MS_MIN} and EVERY_MS_MAX {EVERY_MS_MAX}")
    return every_ms


class FireTimes:
    """The fire times of one TriggerSpec, from an APScheduler trigger built once."""

    def __init__(self, spec: TriggerSpec) -> None:
        self.spec = spec
        self.tz = zone(spec.tz)
        self._trigger: BaseTrigger | None = None
        # after_ms -> first_after(after_ms): many schedules share a definition and their
        # progress (every "0 9 * * MON-FRI" fired at the same time), so the answer is asked
        # again and again; APScheduler takes ~60 us per question.
        self._memo: dict[int, int | None] = {}
        # Vixie cron's rule: a schedule that names its hours fires once per wall-clock time.
        self._once_per_wall_time = False
        start = ms_to_datetime(spec.start_ms, self.tz)
        end = None if spec.end_ms is None else ms_to_datetime(spec.end_ms, self.tz)
        if spec.kind == "cron":
            assert spec.cron is not None, "a cron spec without its expression"
            minute, hour, day, month, day_of_week = check_cron(spec.cron).split()
            self._trigger = CronTrigger(minute=minute, hour=hour, day=day, month=month,
                                        day_of_week=day_of_week, start_date=start,
                                        end_date=end, timezone=self.tz)
            self._once_per_wall_time = not hour.startswith("*")
        elif spec.kind == "every":
            assert spec.every_ms is not None, "an every spec without its interval"
            seconds = check_every_ms(spec.every_ms) / 1000
            self._trigger = IntervalTrigger(seconds=seconds, start_date=start, end_date=end,
                                            timezone=self.tz)
        elif spec.kind == "at":
            assert spec.at_ms is not None, "an at spec without its time"
        else:
            raise ScheduleSpecError(f"kind {spec.kind!r} must be one of {', '.join(KINDS)}")

    def first_after(self, after_ms: int) -> int | None:
        """The first fire time later than ``after_ms``, or None when there is none."""
        memo = self._memo
        if after_ms in memo:
            return memo[after_ms]
        if len(memo) >= FIRST_AFTER_MEMO_MAX:
            memo.clear()
        fire_ms = memo[after_ms] = self._first_after(after_ms)
        return fire_ms

    def _first_after(self, after_ms: int) -> int | None:
        if self._trigger is None:  # "at": one fire time, later than after_ms or gone
            at_ms = self.spec.at_ms
            assert at_ms is not None
            return at_ms if at_ms > after_ms else None
        cursor = after_ms
        while True:
            moment = self._trigger.get_next_fire_time(None, ms_to_datetime(cursor + 1, self.tz))
            if moment is None:
                return None
            fire_ms = datetime_to_ms(moment)
            if fire_ms <= cursor:
                # APScheduler must move forward; if it ever does not, stop rather than loop.
                raise ScheduleSpecError(f"the trigger of {self.spec} answered {fire_ms} for a "
                                        f"fire time after {cursor}")
            if not (self._once_per_wall_time and self._repeats_wall_time(fire_ms)):
                return fire_ms
            cursor = fire_ms

    def _repeats_wall_time(self, fire_ms: int) -> bool:
        """True when ``fire_ms`` is the second pass of a wall-clock time (clocks set back)."""
        local = ms_to_datetime(fire_ms, self.tz)
        return local.fold == 1 and local.replace(fold=0).utcoffset() != local.utcoffset()

    def upcoming(self, after_ms: int, count: int) -> list[int]:
        """Up to ``count`` fire times later than ``after_ms``, oldest first."""
        out: list[int] = []
        cursor = after_ms
        while len(out) < count:
            fire_ms = self.first_after(cursor)
            if fire_ms is None:
                break
            out.append(fire_ms)
            cursor = fire_ms
        return out


@dataclass(frozen=True)
class Plan:
    """What to do with one schedule now.

    ``fires_ms``: the occurrences to hand to the delay server now, oldest first (missed ones the
    policy keeps, those within the grace, and the next one ahead). ``skipped``: missed
    occurrences the policy dropped (``skipped_more``: at least that many; the plan jumped past
    the rest). ``after_ms``: the schedule's new progress, the latest occurrence sent or skipped.
    ``wake_ms``: when to plan again (None: the schedule has no occurrence left).
    """

    fires_ms: tuple[int, ...]
    skipped: int
    skipped_more: bool
    after_ms: int
    wake_ms: int | None

    @property
    def finished(self) -> bool:
        """True when no occurrence is left after ``fires_ms``."""
        return self.wake_ms is None


class SchedulePlanner:
    """Decides which occurrences of a schedule to send, told the time; see the module doc.

    ``grace_ms``: an occurrence handed over at most this late is on time, an older one is a
    misfire. ``ahead_ms``: the next occurrence is handed over once it is at most this far ahead.
    """

    def __init__(self, grace_ms: int = MISFIRE_GRACE_MS_DEFAULT,
                 ahead_ms: int = AHEAD_MS_MAX_DEFAULT, catchup_max: int = CATCHUP_SENDS_MAX,
                 steps_max: int = PLAN_STEPS_MAX) -> None:
        for name, value in (("grace_ms", grace_ms), ("ahead_ms", ahead_ms),
                            ("catchup_max", catchup_max), ("steps_max", steps_max)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SchedulePlanner {name} {value!r} must be an integer >= 1")
        self.grace_ms = grace_ms
        self.ahead_ms = ahead_ms
        self.catchup_max = catchup_max
        self.steps_max = steps_max

    def plan(self, fire_times: FireTimes, after_ms: int, now_ms: int, misfire: str) -> Plan:
        """The occurrences later than ``after_ms`` to send at ``now_ms`` under ``misfire``."""
        if misfire not in MISFIRE_POLICIES:
            raise ScheduleSpecError(f"misfire {misfire!r} must be one of "
                                    f"{', '.join(MISFIRE_POLICIES)}")
        late_before_ms = now_ms - self.grace_ms  # fire times before this are misfires
        fires: list[int] = []
        skipped = 0
        skipped_more = False
        last_missed: int | None = None
        cursor = after_ms
        steps = 0
        while True:
            fire_ms = fire_times.first_after(cursor)
            if fire_ms is None or fire_ms >= late_before_ms:
                break
            if misfire == "all":
                if len(fires) >= self.catchup_max:  # the rest in the next plan, at once
                    return Plan(tuple(fires), 0, False, cursor, now_ms)
                fires.append(fire_ms)
            else:
                skipped += 1
                last_missed = fire_ms
            cursor = fire_ms
            steps += 1
            if steps >= self.steps_max and misfire != "all":
                # Too many to step through: everything before the grace counts as missed.
                skipped_more = True
                cursor = max(cursor, late_before_ms - 1)
                break
        if misfire == "once" and last_missed is not None:
            fires.append(last_missed)
            skipped -= 1
        return self._on_time(fire_times, fires, skipped, skipped_more, cursor, now_ms)

    def _on_time(self, fire_times: FireTimes, fires: list[int], skipped: int,
                 skipped_more: bool, cursor: int, now_ms: int) -> Plan:
        """Add the occurrences within the grace and the next one ahead to ``fires``."""
        while True:
            fire_ms = fire_times.first_after(cursor)
            if fire_ms is None:
                return Plan(tuple(fires), skipped, skipped_more, cursor, None)
            if fire_ms - now_ms > self.ahead_ms:  # too far ahead: plan again nearer the time
                return Plan(tuple(fires), skipped, skipped_more, cursor,
                            fire_ms - self.ahead_ms)
            if len(fires) >= self.catchup_max:
                return Plan(tuple(fires), skipped, skipped_more, cursor, now_ms)
            fires.append(fire_ms)
            cursor = fire_ms
            if fire_ms > now_ms:  # the next occurrence is with the delay server: wake at its time
                return Plan(tuple(fires), skipped, skipped_more, cursor, fire_ms)
