"""The console's pages that show things: overview, subjects and groups, the delay chart, dead
letters, message lookup, schedules and tokens (``actions`` has the forms that change things).

Every page reads the same registry and broker calls as the JSON admin API, in-process. An app
token sees what its patterns cover and no buttons; the dead-letter pages then reach the
brokers with the MetaServer's own configured token (``--admin-token`` or ``qmq up``'s internal
one) and say so when it has none.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from metaserver import dead_letters as dead
from metaserver import validation as v
from metaserver.console import model
from metaserver.console.chart import bar_chart
from metaserver.console.render import format_ms, page
from metaserver.console.session import Viewer
from metaserver.console.snapshot import Snapshot, Snapshots
from metaserver.errors import BadRequest, NotFound
from metaserver.handlers import REGISTRY_KEY, realtime_brokers
from metaserver.registry import Registry
from metaserver.schedule_api import SCHEDULES_KEY
from metaserver.tokens import TOKENS_KEY
from metaserver.trace_lookup import (
    TRACE_WINDOW_HOURS_DEFAULT,
    TRACE_WINDOW_HOURS_MAX,
    find_message,
)
from tracelog.events import HOUR_MS
from wire.limits import MAX_MESSAGE_ID_CHARS
from wire.message import parse_internal_subject

Context = dict[str, Any]
SNAPSHOTS_KEY = web.AppKey("console_snapshots", Snapshots)


def registry_of(request: web.Request) -> Registry:
    """The registry of the app serving ``request``."""
    return request.app[REGISTRY_KEY]


def int_param(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    """Query parameter ``name`` as an integer in ``[low, high]``; BadRequest otherwise."""
    text = request.query.get(name, "")
    if not text:
        return default
    if not (text.isascii() and text.isdigit()) or not low <= int(text) <= high:
        raise BadRequest(f"{name} {text!r} must be an integer from {low} to {high}")
    return int(text)


def name_param(request: web.Request, name: str) -> str | None:
    """Query parameter ``name`` as a subject or group name, or None when empty."""
    text = request.query.get(name, "").strip()
    return v.check_name(name, text) if text else None


def broker_token(request: web.Request, viewer: Viewer) -> tuple[bool, str | None]:
    """(whether brokers can be asked, the token to ask them with) for this viewer: an admin's
    own token; for an app token the MetaServer's configured one, if it has one."""
    if viewer.admin:
        return True, viewer.token
    config = registry_of(request).config
    token = config.admin_token or config.internal_token
    return token is not None, token


def snapshots(request: web.Request) -> Snapshots:
    """The console's shared figures (see ``snapshot``)."""
    return request.app[SNAPSHOTS_KEY]


def _figures(request: web.Request, snap: Snapshot) -> Context:
    """What every page drawn from a snapshot says about its age."""
    return {"snap": snap, "snapshot_ttl_ms": snapshots(request).ttl_ms}


@page("overview.html")
async def overview(request: web.Request, viewer: Viewer, form: dict[str, str]) -> Context:
    """``GET /``: every broker and delay server with state, role, heartbeat age and lag."""
    snap = await snapshots(request).get()
    return {**_figures(request, snap), "overview": snap.overview,
            "subjects": len(snap.subjects), "groups": len(snap.groups),
            "expiry_ms": registry_of(request).config.broker_expiry_ms}


@page("subjects.html")
async def subjects(request: web.Request, viewer: Viewer, form: dict[str, str]) -> Context:
    """``GET /subjects?q=&page=&gpage=``: routed subjects and consumer groups with backlog,
    online consumers, redelivery and retry counts, a page of each at a time."""
    snap = await snapshots(request).get()
    query = request.query.get("q", "")[:200]
    groups, rows = viewer.visible(snap.groups), viewer.visible(snap.subjects)
    subject_page = model.paginate(model.matching(rows, query, "subject"),
                                  int_param(request, "page", 1, 1, 10**9))
    group_page = model.paginate(model.matching(groups, query, "subject", "group"),
                                int_param(request, "gpage", 1, 1, 10**9))
    return {**_figures(request, snap), "q": query, "subject_page": subject_page,
            "group_page": group_page, "internal": snap.internal_subjects}


@page("delay.html")
async def delay(request: web.Request, viewer: Viewer, form: dict[str, str]) -> Context:
    """``GET /delay?hours=N``: pending delayed messages per hour as a chart, per server and per
    subject."""
    hours = int_param(request, "hours", model.CHART_HOURS_DEFAULT, 1, model.CHART_HOURS_MAX)
    snap = await snapshots(request).get()
    servers = snap.delay
    per_hour = model.delay_hours(servers, registry_of(request).clock(), hours)
    points = [(format_ms(start)[11:16], count) for start, count in per_hour.hours]
    # The date under the first bar and under each midnight, so the day shows where it changes.
    marks = {i: format_ms(start)[:10] for i, (start, _) in enumerate(per_hour.hours)
             if i == 0 or start % (24 * HOUR_MS) == 0}
    top = [(s, c) for s, c in model.delay_subjects(servers) if viewer.may_see(s)]
    return {**_figures(request, snap), "servers": servers, "per_hour": per_hour,
            "chart": bar_chart(points, marks=marks), "hours": hours, "top_subjects": top}


@page("dead.html")
async def dead_letters(request: web.Request, viewer: Viewer, form: dict[str, str]) -> Context:
    """``GET /dead?subject=&group=``: the dead letters on every online broker."""
    subject, group = name_param(request, "subject"), name_param(request, "group")
    can_ask, token = broker_token(request, viewer)
    listing: dict[str, Any] = {"dead": [], "truncated": False, "errors": []}
    if can_ask:
        brokers = await realtime_brokers(registry_of(request), token)
        listing = await dead.list_dead(brokers, subject, group)
        listing["dead"] = [r for r in listing["dead"] if viewer.may_see(r["subject"])]
    return {"listing": listing, "summary": model.dead_summary(listing["dead"]),
            "subject": subject or "", "group": group or "", "can_ask": can_ask}


@page("dead_message.html")
async def dead_message(request: web.Request, viewer: Viewer, form: dict[str, str]) -> Context:
    """``GET /dead/message?broker_group=&dead_subject=&sequence=``: one dead letter whole, and
    its trace history."""
    params = v.parse_object(dict(request.query), dead.DEAD_MESSAGE_QUERY, where="query")
    internal = parse_internal_subject(params["dead_subject"])
    assert internal is not None  # check_dead_subject made sure
    if not viewer.may_see(internal.subject):
        raise NotFound(f"{params['dead_subject']} is not a subject app {viewer.app!r} "
                            "may see")
    can_ask, token = broker_token(request, viewer)
    if not can_ask:
        raise BadRequest("dead letters need an admin token: log in with one")
    registry = registry_of(request)
    brokers = await realtime_brokers(registry, token, params["broker_group"])
    message = await dead.show_dead(brokers, params["broker_group"], params["dead_subject"],
                                   params["sequence"])
    trace = await _lookup(registry, message["origin_id"], TRACE_WINDOW_HOURS_DEFAULT, viewer)
    return {"message": message, "trace": trace}


async def _lookup(registry: Registry, message_id: str, hours: int,
                  viewer: Viewer) -> dict[str, Any]:
    now_ms = registry.clock()
    found = await asyncio.to_thread(find_message, registry.config.trace_dirs, message_id,
                                    now_ms - hours * HOUR_MS, now_ms)
    answer = found.to_json()
    answer["events"] = [e for e in answer["events"] if viewer.may_see(e["subject"])]
    answer["configured"] = list(registry.config.trace_dirs)
    return answer


def _message_id(text: str) -> str:
    text = text.strip()
    if not 1 <= len(text) <= MAX_MESSAGE_ID_CHARS or not text.isprintable():
        raise BadRequest(f"message id {text[:40]!r} must be 1 to {MAX_MESSAGE_ID_CHARS} "
                         "printable characters")
    return text


@page("message.html")
async def message_lookup(request: web.Request, viewer: Viewer, form: dict[str, str]) -> Context:
    """``GET /messages?id=&hours=``: a message's history across servers, from the trace."""
    hours = int_param(request, "hours", TRACE_WINDOW_HOURS_DEFAULT, 1, TRACE_WINDOW_HOURS_MAX)
    text = request.query.get("id", "")
    trace = None
    if text.strip():
        trace = await _lookup(registry_of(request), _message_id(text), hours, viewer)
    return {"id": text.strip(), "hours": hours, "hours_max": TRACE_WINDOW_HOURS_MAX,
            "trace": trace, "configured": list(registry_of(request).config.trace_dirs)}


async def trace_api(request: web.Request) -> web.Response:
    """``GET /api/admin/trace?id=ID&hours=N``: the message lookup as JSON (admin tokens)."""
    params = v.parse_object(dict(request.query), {
        "id": v.Field(str), "hours": v.Field(str, required=False)}, where="query")
    hours = int_param(request, "hours", TRACE_WINDOW_HOURS_DEFAULT, 1, TRACE_WINDOW_HOURS_MAX)
    viewer = Viewer(auth_enabled=False, app=None, admin=True)
    return web.json_response(await _lookup(registry_of(request), _message_id(params["id"]),
                                           hours, viewer))


@page("schedules.html")
async def schedules(request: web.Request, viewer: Viewer, form: dict[str, str]) -> Context:
    """``GET /schedules``: recurring schedules with their next fire time."""
    rows = await request.app[SCHEDULES_KEY].list()
    if viewer.grant is not None:
        rows = [r for r in rows if viewer.grant.may_produce(r["subject"])]
    return {"schedule_page": model.paginate(rows, int_param(request, "page", 1, 1, 10**9))}


@page("tokens.html", admin=True)
async def tokens(request: web.Request, viewer: Viewer, form: dict[str, str]) -> Context:
    """``GET /tokens``: every token (never a secret), with the create and revoke forms."""
    return {"tokens": await request.app[TOKENS_KEY].list(), "created": None}
