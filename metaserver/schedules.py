"""Recurring schedules in the MetaServer database: create, list, show, pause, resume, delete and
the next fire times (the admin API's operations; ``metaserver.schedule_api`` serves them).

Handing occurrences to the delay servers is ``metaserver.schedule_runner``'s job; what this module
changes, it leaves for the runner through the row's ``action_ms`` and ``doubt`` (see
``metaserver.models.Schedule``): pausing or deleting a schedule puts its pending occurrence on the
row's list to cancel, and the runner cancels it at its delay group.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from metaserver.errors import BadRequest, Conflict, NotFound
from metaserver.models import Schedule
from metaserver.registry import Registry
from metaserver.schedule_plan import (
    NEXT_COUNT_MAX,
    FireTimes,
    ScheduleSpecError,
    TriggerSpec,
    check_cron,
    check_every_ms,
    ms_to_datetime,
    parse_time,
    zone,
)
from wire.errors import QmqError
from wire.message import Message, validate_message

# Largest message body a schedule stores, in bytes: every occurrence carries it, and the row
# holds it for the schedule's lifetime.
SCHEDULE_BODY_BYTES_MAX = 64 * 1024
# Property names every occurrence's message carries (docs/SCHEDULES.md).
SCHEDULE_PROPERTY = "qmq-schedule"
FIRE_AT_MS_PROPERTY = "qmq-fire-at-ms"
FIRE_AT_PROPERTY = "qmq-fire-at"
# Schedules a list answers at most.
SCHEDULES_LISTED_MAX = 10_000
# Prefix of the message ids of occurrences: ``sched-<schedule id>-<fire ms>``.
MESSAGE_ID_PREFIX = "sched-"

ACTIVE, PAUSED, FINISHED, DELETED = "active", "paused", "finished", "deleted"


def occurrence_id(schedule_id: int, fire_ms: int) -> str:
    """The message id of one occurrence: fixed by (schedule, fire time), so every MetaServer
    that hands it over, and every resend, carries the same id."""
    return f"{MESSAGE_ID_PREFIX}{schedule_id}-{fire_ms}"


def trigger_spec(row: Schedule) -> TriggerSpec:
    """The TriggerSpec of a stored schedule."""
    return TriggerSpec(kind=row.kind, tz=row.tz, start_ms=row.start_ms, end_ms=row.end_ms,
                       cron=row.cron, every_ms=row.every_ms, at_ms=row.at_ms)


def occurrence_properties(name: str | None, tz: str, properties: dict[str, str],
                          fire_ms: int) -> dict[str, str]:
    """The properties of an occurrence's message: the schedule's own plus its name and fire
    time (epoch ms, and ISO 8601 in the schedule's time zone)."""
    fire_at = ms_to_datetime(fire_ms, zone(tz)).isoformat(timespec="milliseconds")
    return {**properties, SCHEDULE_PROPERTY: name or "", FIRE_AT_MS_PROPERTY: str(fire_ms),
            FIRE_AT_PROPERTY: fire_at}


@dataclass(frozen=True)
class NewSchedule:
    """A checked create request."""

    name: str
    subject: str
    body: bytes
    tags: list[str]
    properties: dict[str, str]
    spec: TriggerSpec
    misfire: str
    start_given: bool = True  # False: start_ms is the default the MetaServer chose at create

    def same_as(self, row: Schedule, app: str) -> bool:
        """Whether ``row`` is this schedule as far as the request said: a create tried again
        after its answer was lost (another MetaServer, a client retry) finds it so. A start
        the request left out was chosen from the clock and is not compared."""
        spec = self.spec
        return (row.app == app and row.subject == self.subject and row.body == self.body
                and list(row.tags) == list(self.tags)
                and dict(row.properties) == dict(self.properties)
                and row.kind == spec.kind and row.cron == spec.cron
                and row.every_ms == spec.every_ms and row.at_ms == spec.at_ms
                and row.tz == spec.tz and row.end_ms == spec.end_ms
                and row.misfire == self.misfire
                and (not self.start_given or row.start_ms == spec.start_ms))


def decode_body(text: str, encoding: str) -> bytes:
    """The body of a create request: UTF-8 text, or base64 with ``encoding: base64``."""
    if encoding == "base64":
        try:
            return base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise BadRequest("body.body is not valid base64") from None
    return text.encode("utf-8")


def check_new(body: dict[str, Any], now_ms: int) -> NewSchedule:
    """Check a create request (already type-checked by ``schedule_api.CREATE``)."""
    given = [key for key in ("cron", "every_ms", "at") if body[key] is not None]
    if len(given) != 1:
        raise BadRequest(f"a schedule needs exactly one of cron, every_ms, at; got "
                         f"{given or 'none'}")
    message_body = decode_body(body["body"], body["encoding"])
    if len(message_body) > SCHEDULE_BODY_BYTES_MAX:
        raise BadRequest(f"schedule body of {len(message_body)} bytes exceeds "
                         f"SCHEDULE_BODY_BYTES_MAX {SCHEDULE_BODY_BYTES_MAX}")
    try:
        tz = body["tz"]
        zone(tz)
        start_ms = _time(body["start"], tz, "start")
        end_ms = _time(body["end"], tz, "end")
        kind, cron, every_ms, at_ms = given[0], None, None, None
        if kind == "cron":
            cron = check_cron(body["cron"])
        elif kind == "every_ms":
            kind, every_ms = "every", check_every_ms(body["every_ms"])
        else:
            at_ms = _time(body["at"], tz, "at")
            assert at_ms is not None
            if at_ms <= now_ms:
                raise ScheduleSpecError(f"at {body['at']!r} ({at_ms} ms) is not in the future "
                                        f"(now is {now_ms} ms)")
    except ScheduleSpecError as exc:
        raise BadRequest(str(exc)) from None
    start_given = start_ms is not None
    if start_ms is None:
        # An interval starts one interval after its creation, as APScheduler's does; the others
        # may fire from now on.
        start_ms = now_ms + every_ms if every_ms is not None else now_ms
    if end_ms is not None and end_ms < start_ms:
        raise BadRequest(f"end {body['end']!r} is before the start ({start_ms} ms)")
    spec = TriggerSpec(kind=kind, tz=tz, start_ms=start_ms, end_ms=end_ms, cron=cron,
                       every_ms=every_ms, at_ms=at_ms)
    new = NewSchedule(body["name"], body["subject"], message_body, body["tags"],
                      body["properties"], spec, body["misfire"], start_given)
    _check_message(new, now_ms)
    return new


def _time(value: str | int | None, tz: str, what: str) -> int | None:
    """An ISO 8601 string (local to ``tz`` without an offset) or epoch ms, as epoch ms."""
    if value is None or isinstance(value, int):
        if isinstance(value, int) and value < 0:
            raise ScheduleSpecError(f"{what} {value} must be epoch ms >= 0")
        return value
    return parse_time(value, tz, what)


def _check_message(new: NewSchedule, now_ms: int) -> None:
    """Refuse at once what every occurrence's message would be refused for (with room for the
    properties the runner adds)."""
    for key in new.properties:
        if key.startswith("qmq-"):
            raise BadRequest(f"property {key!r}: names starting with 'qmq-' are the system's")
    properties = {**new.properties, SCHEDULE_PROPERTY: new.name, FIRE_AT_MS_PROPERTY: "0" * 20,
                  FIRE_AT_PROPERTY: "0" * 40}
    sample = Message.create(new.subject, new.body, now_ms=now_ms, tags=new.tags,
                            properties=properties, id=occurrence_id(2**62, 2**62))
    try:
        validate_message(sample)
    except QmqError as exc:
        raise BadRequest(exc.message) from None


class Schedules:
    """The schedule operations over the registry's database; time comes from its clock."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    async def create(self, new: NewSchedule, app: str) -> tuple[dict[str, Any], bool]:
        """Store a new schedule; returns it and whether it is new. A schedule of that name
        that is the same as far as the request said is returned as it is (a create tried again
        after a lost answer); a different one is a Conflict."""
        now_ms = self.registry.clock()

        async def body(s: AsyncSession) -> tuple[dict[str, Any], bool]:
            taken = (await s.execute(select(Schedule).where(Schedule.name == new.name))).scalar()
            if taken is not None:
                if new.same_as(taken, app):
                    return view(taken, now_ms), False
                raise Conflict(f"schedule {new.name!r} exists with another definition; delete "
                               "it first or pick another name")
            spec = new.spec
            row = Schedule(
                name=new.name, app=app, subject=new.subject, body=new.body, tags=new.tags,
                properties=new.properties, kind=spec.kind, cron=spec.cron,
                every_ms=spec.every_ms, at_ms=spec.at_ms, tz=spec.tz, start_ms=spec.start_ms,
                end_ms=spec.end_ms, misfire=new.misfire, state=ACTIVE, created_at_ms=now_ms,
                updated_at_ms=now_ms, after_ms=now_ms - 1, sent_count=0, skipped_count=0,
                action_ms=now_ms)
            s.add(row)
            await s.flush()
            return view(row, now_ms), True

        return await self.registry._write(body)

    async def list(self) -> list[dict[str, Any]]:
        """Every schedule that is not deleted, by name."""
        now_ms = self.registry.clock()
        async with self.registry._read() as s:
            rows = (await s.execute(select(Schedule).where(Schedule.name.is_not(None))
                                    .order_by(Schedule.name).limit(SCHEDULES_LISTED_MAX)))
            return [view(row, now_ms) for row in rows.scalars()]

    async def get(self, name: str) -> Schedule:
        """The stored row of schedule ``name``; NotFound when there is none."""
        async with self.registry._read() as s:
            row = (await s.execute(select(Schedule).where(Schedule.name == name))).scalar()
        if row is None:
            raise NotFound(f"no schedule named {name!r}")
        return row

    async def show(self, name: str) -> dict[str, Any]:
        """One schedule's view."""
        return view(await self.get(name), self.registry.clock())

    async def next_fires(self, name: str, count: int) -> dict[str, Any]:
        """The next ``count`` fire times from now (whether or not it is paused)."""
        if not 1 <= count <= NEXT_COUNT_MAX:
            raise BadRequest(f"n {count} must be between 1 and NEXT_COUNT_MAX {NEXT_COUNT_MAX}")
        row = await self.get(name)
        now_ms = self.registry.clock()
        times = FireTimes(trigger_spec(row))
        fires = times.upcoming(now_ms - 1, count) if row.state != FINISHED else []
        return {"name": name, "tz": row.tz, "state": row.state,
                "fires": [{"fire_ms": f, "local": _iso(f, row.tz), "utc": _iso(f, "UTC")}
                          for f in fires]}

    async def pause(self, name: str) -> dict[str, Any]:
        """Stop handing over occurrences; the one already handed over is cancelled."""
        return await self._change(name, PAUSED)

    async def resume(self, name: str) -> dict[str, Any]:
        """Hand over occurrences again, from now on: those that fell in the pause are not sent."""
        return await self._change(name, ACTIVE)

    async def delete(self, name: str) -> dict[str, Any]:
        """Delete a schedule; what it handed over and is still to come is cancelled."""
        return await self._change(name, DELETED)

    async def _change(self, name: str, to: str) -> dict[str, Any]:
        async def body(s: AsyncSession) -> dict[str, Any]:
            now_ms = self.registry.clock()
            row = (await s.execute(select(Schedule).where(Schedule.name == name)
                                   .with_for_update())).scalar()
            if row is None:
                raise NotFound(f"no schedule named {name!r}")
            if to == ACTIVE:
                _resume(row, now_ms)
            elif to == PAUSED:
                if row.state == FINISHED:
                    raise Conflict(f"schedule {name!r} is finished: nothing is left to pause")
                _stop(row, now_ms)
            else:
                answer = view(row, now_ms)
                _stop(row, now_ms)
                row.state, row.name = DELETED, None
                if row.doubt is None:
                    await s.delete(row)  # nothing handed over is left to cancel
                return {**answer, "state": DELETED}
            return view(row, now_ms)

        return await self.registry._write(body)


def _stop(row: Schedule, now_ms: int) -> None:
    """Pause a row (or begin deleting it): no more planning, and what it handed over that may
    still be to come joins the list to cancel. A runner handing occurrences over right now
    (it owns the list until ``action_ms``) sees the new state when it confirms and puts what it
    sent on that list itself."""
    if row.state == PAUSED:
        return
    row.state = PAUSED
    row.updated_at_ms = now_ms
    owned = row.doubt_owner is not None and (row.action_ms or 0) > now_ms
    if row.doubt is not None and not owned:
        row.doubt = [[fire_ms, group, 0] for fire_ms, group, _resend in row.doubt]
        row.doubt_owner = None
        row.action_ms = now_ms
    if row.pending_fire_ms is not None and row.pending_group and not owned:
        row.doubt = (row.doubt or []) + [[row.pending_fire_ms, row.pending_group, 0]]
        row.action_ms = now_ms
    elif row.doubt is None:
        row.action_ms = None
    if not owned:
        row.pending_fire_ms = row.pending_group = None


def _resume(row: Schedule, now_ms: int) -> None:
    """Resume a paused row from now on: what fell in the pause is not sent."""
    if row.state != PAUSED:
        return
    row.state = ACTIVE
    row.updated_at_ms = now_ms
    row.after_ms = now_ms - 1
    if row.doubt_owner is None or (row.action_ms or 0) <= now_ms:
        row.action_ms = now_ms


def _iso(ms: int, tz: str) -> str:
    return ms_to_datetime(ms, zone(tz)).isoformat(timespec="milliseconds")


def view(row: Schedule, now_ms: int) -> dict[str, Any]:
    """A schedule as the API shows it."""
    try:
        text, encoding = row.body.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        text, encoding = base64.b64encode(row.body).decode("ascii"), "base64"
    next_fire_ms = None
    if row.state == ACTIVE:
        if row.pending_fire_ms is not None and row.pending_fire_ms > now_ms:
            next_fire_ms = row.pending_fire_ms
        else:
            next_fire_ms = FireTimes(trigger_spec(row)).first_after(max(row.after_ms,
                                                                        now_ms - 1))
    return {
        "id": row.id, "name": row.name, "app": row.app, "subject": row.subject,
        "body": text, "encoding": encoding, "tags": list(row.tags),
        "properties": dict(row.properties), "kind": row.kind, "cron": row.cron,
        "every_ms": row.every_ms, "at_ms": row.at_ms, "tz": row.tz, "start_ms": row.start_ms,
        "end_ms": row.end_ms, "misfire": row.misfire, "state": row.state,
        "created_at_ms": row.created_at_ms, "updated_at_ms": row.updated_at_ms,
        "next_fire_ms": next_fire_ms, "next_fire": None if next_fire_ms is None
        else _iso(next_fire_ms, row.tz),
        "pending_fire_ms": row.pending_fire_ms, "pending_group": row.pending_group,
        "sent_count": row.sent_count, "skipped_count": row.skipped_count,
        "in_doubt": len(row.doubt or ()), "last_error": row.last_error,
    }
