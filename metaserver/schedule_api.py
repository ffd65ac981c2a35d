"""HTTP API of recurring schedules (docs/SCHEDULES.md): ``/api/schedules...``.

With auth on, any valid token may call these paths, but only for subjects its produce patterns
cover (an admin token covers every subject): creating a schedule sends messages to its subject,
so it needs the right to produce there. A list shows only the schedules whose subject the token
may produce to; another app's schedule on a subject the token does not cover is a 403.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from metaserver import validation as v
from metaserver.errors import Forbidden
from metaserver.schedule_plan import MISFIRE_POLICIES, NEXT_COUNT_MAX
from metaserver.schedule_runner import ScheduleRunner
from metaserver.schedules import Schedules, check_new
from metaserver.tokens import GRANT_KEY
from serverkit.access import Grant

SCHEDULES_KEY = web.AppKey("metaserver_schedules", Schedules)
RUNNER_KEY = web.AppKey("metaserver_schedule_runner", ScheduleRunner)
# The app a schedule made while auth is off is recorded under.
NO_AUTH_APP = "-"


def _check_properties(key: str, value: dict[str, Any]) -> dict[str, Any]:
    for name, item in value.items():
        if not isinstance(item, str):
            raise v.BadRequest(f"{key}[{name!r}] must be a string, not {item!r}")
    return value


def _check_tags(key: str, value: list[Any]) -> list[Any]:
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise v.BadRequest(f"{key}[{i}] must be a string, not {item!r}")
    return value


CREATE = {
    "name": v.Field(str, check=v.check_name),
    "subject": v.Field(str, check=v.check_name),
    "body": v.Field(str),
    "encoding": v.Field(str, required=False, default="utf-8", check=v.one_of("utf-8", "base64")),
    "tags": v.Field(list, required=False, default=list, check=_check_tags),
    "properties": v.Field(dict, required=False, default=dict, check=_check_properties),
    "cron": v.Field(str, required=False),
    "every_ms": v.Field(int, required=False),
    "at": v.Field((str, int), required=False),
    "tz": v.Field(str, required=False, default="UTC"),
    "start": v.Field((str, int), required=False),
    "end": v.Field((str, int), required=False),
    "misfire": v.Field(str, required=False, default="skip", check=v.one_of(*MISFIRE_POLICIES)),
}


def _count(key: str, value: str) -> int:
    if not value.isdigit() or not 1 <= int(value) <= NEXT_COUNT_MAX:
        raise v.BadRequest(f"{key} {value!r} must be an integer from 1 to NEXT_COUNT_MAX "
                           f"{NEXT_COUNT_MAX}")
    return int(value)


NEXT_QUERY = {"n": v.Field(str, required=False, default="10", check=_count)}


def _grant(request: web.Request) -> Grant | None:
    grant = request.get(GRANT_KEY)
    assert grant is None or isinstance(grant, Grant)
    return grant


def _check_subject(request: web.Request, subject: str) -> None:
    """Forbidden unless the request's token may produce to ``subject`` (auth off: anyone)."""
    grant = _grant(request)
    if grant is not None and not grant.may_produce(subject):
        raise Forbidden(f"app {grant.app!r} may not schedule messages to subject {subject!r} "
                        f"(its produce patterns: {list(grant.produce)})")


def _schedules(request: web.Request) -> Schedules:
    return request.app[SCHEDULES_KEY]


async def _owned(request: web.Request) -> str:
    """The schedule name of the path, after checking the token may use its subject."""
    name = v.check_name("path.name", request.match_info["name"])
    row = await _schedules(request).get(name)
    _check_subject(request, row.subject)
    return name


def _changed(request: web.Request, answer: dict[str, Any]) -> web.Response:
    request.app[RUNNER_KEY].poke()
    return web.json_response(answer)


async def create(request: web.Request) -> web.Response:
    """``POST /api/schedules``: a new schedule (201), or the same one already there (200: a
    create tried again after its answer was lost)."""
    body = v.parse_object(v.load_json_object(await request.read()), CREATE)
    _check_subject(request, body["subject"])
    schedules = _schedules(request)
    new = check_new(body, schedules.registry.clock())
    grant = _grant(request)
    answer, made = await schedules.create(new, grant.app if grant is not None else NO_AUTH_APP)
    if made:
        request.app[RUNNER_KEY].poke()
    return web.json_response(answer, status=201 if made else 200)


async def list_all(request: web.Request) -> web.Response:
    """``GET /api/schedules``: the schedules whose subject the token may produce to."""
    v.parse_object(dict(request.query), {}, where="query")
    grant = _grant(request)
    rows = await _schedules(request).list()
    if grant is not None:
        rows = [row for row in rows if grant.may_produce(row["subject"])]
    return web.json_response({"schedules": rows})


async def show(request: web.Request) -> web.Response:
    """``GET /api/schedules/{name}``."""
    return web.json_response(await _schedules(request).show(await _owned(request)))


async def next_fires(request: web.Request) -> web.Response:
    """``GET /api/schedules/{name}/next?n=10``: the next fire times from now."""
    params = v.parse_object(dict(request.query), NEXT_QUERY, where="query")
    name = await _owned(request)
    return web.json_response(await _schedules(request).next_fires(name, params["n"]))


async def pause(request: web.Request) -> web.Response:
    """``POST /api/schedules/{name}/pause``."""
    return _changed(request, await _schedules(request).pause(await _owned(request)))


async def resume(request: web.Request) -> web.Response:
    """``POST /api/schedules/{name}/resume``."""
    return _changed(request, await _schedules(request).resume(await _owned(request)))


async def delete(request: web.Request) -> web.Response:
    """``DELETE /api/schedules/{name}``."""
    return _changed(request, await _schedules(request).delete(await _owned(request)))


def add_schedule_routes(app: web.Application) -> None:
    """Register the schedule paths on ``app``."""
    app.router.add_post("/api/schedules", create)
    app.router.add_get("/api/schedules", list_all)
    app.router.add_get("/api/schedules/{name}", show)
    app.router.add_get("/api/schedules/{name}/next", next_fires)
    app.router.add_post("/api/schedules/{name}/pause", pause)
    app.router.add_post("/api/schedules/{name}/resume", resume)
    app.router.add_delete("/api/schedules/{name}", delete)
