"""Rendering console pages: the Jinja2 environment, its filters, the page wrapper that checks
the session, CSRF and rights, and the security headers of every answer.

Templates live in ``metaserver/console/templates`` and the stylesheet in ``static/``, shipped in
the wheel (package data); autoescaping is on for every template, so text from brokers, tokens
or messages can never become markup. Pages carry no script at all and a Content-Security-Policy
that allows only this server's own stylesheet and images.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlencode

import jinja2
from aiohttp import web

from metaserver.console.session import (
    LoginRequired,
    Viewer,
    check_post,
    current_viewer,
    set_cookies,
)
from metaserver.errors import ApiError, Forbidden
from metaserver.handlers import REGISTRY_KEY

log = logging.getLogger(__name__)

# Every page: only our own stylesheet and images, no script, no framing, forms only to us.
CONTENT_SECURITY_POLICY = ("default-src 'none'; style-src 'self'; img-src 'self' data:; "
                           "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}

PageHandler = Callable[[web.Request, Viewer, dict[str, str]],
                       Awaitable["dict[str, Any] | web.StreamResponse"]]


def format_ms(value: int | None) -> str:
    """Epoch ms as ``YYYY-MM-DD HH:MM:SS.mmm`` UTC; ``-`` for None."""
    if value is None:
        return "-"
    seconds, ms = divmod(int(value), 1000)
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(seconds)) + f".{ms:03d}"


def format_age(value: int | None) -> str:
    """A duration in ms as a short human text: ``850 ms``, ``4.2 s``, ``3 min``, ``2.5 h``."""
    if value is None:
        return "-"
    ms = int(value)
    if abs(ms) < 1000:
        return f"{ms} ms"
    if abs(ms) < 60_000:
        return f"{ms / 1000:.1f} s"
    if abs(ms) < 3_600_000:
        return f"{ms // 60_000} min"
    if abs(ms) < 172_800_000:
        return f"{ms / 3_600_000:.1f} h"
    return f"{ms / 86_400_000:.1f} d"


def format_count(value: Any) -> str:
    """An integer with thousands separators; ``-`` for None, other values as they are."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.1f}"
    return str(value)


def make_environment() -> jinja2.Environment:
    """The Jinja2 environment of the console's templates (package data of metaserver)."""
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("metaserver", "console/templates"),
        autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True,
        lstrip_blocks=True,
        # The templates ship in the wheel and change only with it: no stat of the template
        # file on every page (auto_reload's check was about 1 ms a request under load).
        auto_reload=False)
    env.filters.update(ms=format_ms, age=format_age, count=format_count)
    return env


ENV_KEY = web.AppKey("console_jinja", jinja2.Environment)


def render(request: web.Request, template: str, viewer: Viewer | None,
           context: dict[str, Any], status: int = 200) -> web.Response:
    """The HTML answer of ``template`` with ``context``, the viewer and the security headers."""
    env = request.app[ENV_KEY]
    html = env.get_template(template).render(
        viewer=viewer, path=request.path, now_ms=request.app[REGISTRY_KEY].clock(), **context)
    response = web.Response(text=html, status=status, content_type="text/html",
                            charset="utf-8", headers=SECURITY_HEADERS)
    set_cookies(request, response)
    return response


def redirect(request: web.Request, location: str) -> web.Response:
    """A 303 to ``location`` (a local path), with the cookies made while answering."""
    response = web.Response(status=303, headers={**SECURITY_HEADERS, "Location": location})
    set_cookies(request, response)
    return response


def page(template: str, *, admin: bool = False) -> Callable[[PageHandler], Callable[
        [web.Request], Awaitable[web.StreamResponse]]]:
    """Wrap a page handler: find the viewer (to /login without a session), refuse app tokens
    on ``admin`` pages and every POST without the viewer's CSRF value, and render ``template``
    with what the handler returns, or an error page for an ApiError."""

    def wrap(handler: PageHandler) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        @functools.wraps(handler)
        async def serve(request: web.Request) -> web.StreamResponse:
            viewer: Viewer | None = None
            try:
                viewer = await current_viewer(request)
                if viewer is None:
                    raise LoginRequired("log in with a token to use the console")
                form: dict[str, str] = {}
                if request.method == "POST":
                    form = {k: v for k, v in (await request.post()).items()
                            if isinstance(v, str)}
                    check_post(request, form, viewer.csrf)
                if admin and not viewer.admin:
                    raise Forbidden(f"app {viewer.app!r} has a read-only view: this needs an "
                                    "admin token")
                answer = await handler(request, viewer, form)
            except LoginRequired as exc:
                if request.method == "GET":
                    return redirect(request, "/login" if request.path == "/" else
                                    "/login?" + urlencode({"next": request.path_qs}))
                return render(request, "error.html", None, {"error": exc}, exc.status)
            except ApiError as exc:
                return render(request, "error.html", viewer, {"error": exc}, exc.status)
            if isinstance(answer, web.StreamResponse):
                return answer
            return render(request, template, viewer, answer)

        return serve

    return wrap
