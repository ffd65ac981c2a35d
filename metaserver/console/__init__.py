"""The web console the MetaServer serves at ``/`` (docs/CONSOLE.md).

Server-rendered HTML from Jinja2 templates shipped in the wheel, one stylesheet, no script and
nothing fetched from elsewhere. ``add_console_routes`` puts its pages on the MetaServer's app:

* ``views``: the pages that show (overview, subjects and groups, delay chart, dead letters,
  message lookup, schedules, tokens);
* ``actions``: the forms that change things (re-drive, purge, tokens, schedules) and login;
* ``session``: the cookie session and CSRF; ``render``: templates and the page wrapper;
* ``snapshot``: the registry's figures shared by every request for up to 5 s;
* ``model`` and ``chart``: the figures and the chart geometry, pure functions.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from metaserver.console import actions, views
from metaserver.console.render import ENV_KEY, make_environment
from metaserver.console.snapshot import Snapshots
from metaserver.handlers import REGISTRY_KEY

STATIC_DIR = Path(__file__).resolve().parent / "static"


def add_console_routes(app: web.Application) -> None:
    """Register the console's pages, its static files and ``GET /api/admin/trace``."""
    app[ENV_KEY] = make_environment()
    app[views.SNAPSHOTS_KEY] = Snapshots(app[REGISTRY_KEY])
    app.on_cleanup.append(_close_snapshots)
    router = app.router
    router.add_get("/", views.overview)
    router.add_get("/subjects", views.subjects)
    router.add_get("/delay", views.delay)
    router.add_get("/dead", views.dead_letters)
    router.add_get("/dead/message", views.dead_message)
    router.add_post("/dead/redrive", actions.redrive)
    router.add_get("/dead/purge", actions.purge_confirm)
    router.add_post("/dead/purge", actions.purge)
    router.add_get("/messages", views.message_lookup)
    router.add_get("/schedules", views.schedules)
    router.add_post("/schedules/pause", actions.schedule_change)
    router.add_post("/schedules/resume", actions.schedule_change)
    router.add_get("/tokens", views.tokens)
    router.add_post("/tokens", actions.token_create)
    router.add_post("/tokens/revoke", actions.token_revoke)
    router.add_get("/login", actions.login_page)
    router.add_post("/login", actions.login)
    router.add_post("/logout", actions.logout)
    router.add_get("/api/admin/trace", views.trace_api)
    router.add_static("/static", STATIC_DIR, append_version=False)


async def _close_snapshots(app: web.Application) -> None:
    await app[views.SNAPSHOTS_KEY].close()
