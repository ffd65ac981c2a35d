"""The console's forms that change things, and logging in and out.

Every POST carries the viewer's CSRF value (``render.page`` checks it before the handler runs)
and needs an admin token, or auth off. Each answers with a page that says what was done, with
the same figures the JSON admin API returns, and a link back.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from metaserver import dead_letters as dead
from metaserver import validation as v
from metaserver.console.render import SECURITY_HEADERS, page, redirect, render
from metaserver.console.session import (
    Viewer,
    anonymous_csrf,
    check_post,
    current_viewer,
    log_in,
    log_out,
    safe_next,
)
from metaserver.console.views import registry_of
from metaserver.errors import ApiError, BadRequest
from metaserver.handlers import realtime_brokers, redrive_dead
from metaserver.schedule_api import RUNNER_KEY, SCHEDULES_KEY
from metaserver.tokens import TOKENS_KEY
from wire.limits import MAX_TOKEN_CHARS

Context = dict[str, Any]


def _name(form: dict[str, str], key: str) -> str:
    return v.check_name(key, form.get(key, "").strip())


def _patterns(text: str) -> list[str]:
    """Patterns typed in a form: separated by commas, spaces or new lines."""
    return [p for p in text.replace(",", " ").split() if p]


def done(title: str, lines: list[str], back: str, errors: list[dict[str, Any]] | None = None,
         ) -> Context:
    """The context of ``done.html``: what an action did."""
    return {"title": title, "lines": lines, "back": back, "errors": errors or []}


@page("done.html", admin=True)
async def redrive(request: web.Request, viewer: Viewer, form: dict[str, str]) -> Context:
    """``POST /dead/redrive {subject, group, id?}``: re-drive the group's dead letters (or one)."""
    subject, group = _name(form, "subject"), _name(form, "group")
    ids = dead.check_ids("id", [form["id"]]) if form.get("id") else None
    answer = await redrive_dead(registry_of(request), str(request.url.origin()), viewer.token,
                                subject, group, ids)
    what = f"message {ids[0]}" if ids else "every dead letter"
    return done(f"Re-drove {what} of {subject} / {group}",
                [f"re-driven: {answer['redriven']}", f"duplicates (re-driven before, within the "
                 f"brokers' de-duplication window): {answer['duplicates']}"],
                f"/dead?subject={subject}&group={group}", answer["errors"])


@page("purge.html", admin=True)
async def purge_confirm(request: web.Request, viewer: Viewer, form: dict[str, str]) -> Context:
    """``GET /dead/purge?subject=&group=``: the confirmation before a purge."""
    subject = v.check_name("subject", request.query.get("subject", ""))
    group = v.check_name("group", request.query.get("group", ""))
    brokers = await realtime_brokers(registry_of(request), viewer.token)
    listing = await dead.list_dead(brokers, subject, group)
    return {"subject": subject, "group": group, "count": len(listing["dead"]),
            "truncated": listing["truncated"], "errors": listing["errors"]}


@page("done.html", admin=True)
async def purge(request: web.Request, viewer: Viewer, form: dict[str, str]) -> Context:
    """``POST /dead/purge {subject, group, confirm}``: purge every dead letter of the group."""
    subject, group = _name(form, "subject"), _name(form, "group")
    if form.get("confirm") != f"{subject}/{group}":
        raise BadRequest(f"type {subject}/{group} in the confirmation box to purge")
    brokers = await realtime_brokers(registry_of(request), viewer.token)
    answer = await dead.purge(brokers, subject, group, None)
    lines = [f"purged: {answer['purged']}"] + [
        f"broker {b['broker_group']} ({b['address']}): {b['purged']} purged, watermark now "
        f"{b['purged_before']}" for b in answer["brokers"]]
    return done(f"Purged the dead letters of {subject} / {group}", lines, "/dead",
                answer["errors"])


@page("tokens.html", admin=True)
async def token_create(request: web.Request, viewer: Viewer, form: dict[str, str]) -> Context:
    """``POST /tokens {app, produce, consume, admin?}``: a new token, its secret shown once."""
    tokens = request.app[TOKENS_KEY]
    created = await tokens.create(_name(form, "app"), _patterns(form.get("produce", "")),
                                  _patterns(form.get("consume", "")), form.get("admin") == "on")
    return {"tokens": await tokens.list(), "created": created}


@page("done.html", admin=True)
async def token_revoke(request: web.Request, viewer: Viewer, form: dict[str, str]) -> Context:
    """``POST /tokens/revoke {id}``."""
    text = form.get("id", "")
    if not (text.isascii() and text.isdigit()):
        raise BadRequest(f"token id {text!r} must be an integer")
    row = await request.app[TOKENS_KEY].revoke(int(text))
    return done(f"Token {row['id']} of app {row['app']} is revoked",
                ["Clients using it are refused from now on by the MetaServer, and by brokers "
                 "within their token cache time (10 s)."], "/tokens")


@page("done.html", admin=True)
async def schedule_change(request: web.Request, viewer: Viewer, form: dict[str, str]) -> Context:
    """``POST /schedules/pause|resume {name}``."""
    name = _name(form, "name")
    schedules = request.app[SCHEDULES_KEY]
    resume = request.path.endswith("/resume")
    row = await (schedules.resume(name) if resume else schedules.pause(name))
    request.app[RUNNER_KEY].poke()
    return done(f"Schedule {name} is {row['state']}",
                [f"next fire: {row['next_fire'] or '-'}"], "/schedules")


async def login_page(request: web.Request) -> web.StreamResponse:
    """``GET /login``: the token form (straight to the console when auth is off)."""
    viewer = await current_viewer(request)
    target = safe_next(request.query.get("next"))
    if viewer is not None and not viewer.auth_enabled:
        return redirect(request, target)
    return render(request, "login.html", None, {"next": target, "error": None,
                                                "csrf": anonymous_csrf(request)})


async def login(request: web.Request) -> web.StreamResponse:
    """``POST /login {token, next}``: start a session when the token is valid."""
    form = {k: v for k, v in (await request.post()).items() if isinstance(v, str)}
    target = safe_next(form.get("next"))
    context = {"next": target, "csrf": anonymous_csrf(request)}
    try:
        check_post(request, form, anonymous_csrf(request))
        token = form.get("token", "").strip()
        if not token or len(token) > MAX_TOKEN_CHARS:
            raise BadRequest(f"give a token of 1 to {MAX_TOKEN_CHARS} characters")
        checked = await request.app[TOKENS_KEY].check(token)
        if checked.grant is None:
            raise BadRequest("that token is unknown or revoked")
    except ApiError as exc:
        return render(request, "login.html", None, {**context, "error": exc.message},
                      exc.status if exc.status != 400 else 401)
    response = web.Response(status=303, headers={**SECURITY_HEADERS, "Location": target})
    log_in(request, response, token)
    return response


async def logout(request: web.Request) -> web.StreamResponse:
    """``POST /logout {csrf}``: end the session."""
    form = {k: v for k, v in (await request.post()).items() if isinstance(v, str)}
    viewer = await current_viewer(request)
    if viewer is not None:  # a session already gone (a revoked token) just loses its cookie
        try:
            check_post(request, form, viewer.csrf)
        except ApiError as exc:
            return render(request, "error.html", viewer, {"error": exc}, exc.status)
    response = web.Response(status=303, headers={**SECURITY_HEADERS, "Location": "/login"})
    log_out(response)
    return response

