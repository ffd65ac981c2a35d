"""HTTP handlers of the MetaServer API and the middleware that turns errors into JSON."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from metaserver import dead_letters as dead
from metaserver import validation as v
from metaserver.errors import ApiError, BadRequest, InternalError, NotFound, TooLarge
from metaserver.gateway_codec import error_status
from metaserver.registry import Registry
from metaserver.replication import RoleRequest, synthetic_id
from metaserver.tokens import AUTH_ENABLED_KEY, CREATE, REVOKE, TOKEN_KEY, TOKENS_KEY, Tokens
from serverkit.payload_sender import PayloadSender
from wire.errors import QmqError
from wire.tls import client_context

log = logging.getLogger(__name__)

REGISTRY_KEY = web.AppKey("metaserver_registry", Registry)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answer every error as ``{"error": {"code", "message"}}`` with a matching status."""
    try:
        return await handler(request)
    except ApiError as exc:
        return _error_response(exc)
    except QmqError as exc:  # the gateway's: a broker's answer or the SDK's own check
        return web.json_response({"error": {"code": exc.code, "message": exc.message}},
                                 status=error_status(exc.code, exc.retriable))
    except web.HTTPRequestEntityTooLarge:
        size = request.content_length
        what = f"request body of {size} bytes" if size is not None else "request body"
        return _error_response(TooLarge(
            f"{what} exceeds BODY_SIZE_BYTES_MAX {v.BODY_SIZE_BYTES_MAX}"))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        error: ApiError = NotFound(f"no such path {request.path!r}")
        if exc.status != 404:
            error = BadRequest(f"{request.method} {request.path}: {exc.reason}")
            error.status = exc.status
        response = _error_response(error)
        if "Allow" in exc.headers:  # a 405 says which methods the path has (RFC 9110)
            response.headers["Allow"] = exc.headers["Allow"]
        return response
    except ConnectionResetError as exc:
        if not _client_gone(request):  # another connection's (a broker's, say): ours to fix
            return _internal_error(request)
        # The client closed its connection before its body arrived (it timed out, stalled or
        # exited; aiohttp's request.read() says so): a departed client, nothing broke here,
        # and nobody is left to answer.
        log.info("client %s (%s) closed its connection during %s %s; not answered: %s",
                 request.remote, request.headers.get("User-Agent", "no User-Agent"),
                 request.method, request.path, exc)
        return _error_response(BadRequest(f"{request.method} {request.path}: the client closed "
                                          "its connection before its request was read"))
    except Exception:
        return _internal_error(request)


def _client_gone(request: web.Request) -> bool:
    """True when the client's connection is closed (or closing)."""
    transport = request.transport
    return transport is None or transport.is_closing()


def _internal_error(request: web.Request) -> web.Response:
    """Log the exception being handled as a MetaServer bug and answer ``internal``."""
    log.exception("internal error on %s %s", request.method, request.path)
    return _error_response(InternalError("internal error; see the MetaServer log"))


def _error_response(error: ApiError) -> web.Response:
    """Return the JSON response of ``error``."""
    return web.json_response(error.to_json(), status=error.status)


async def _body(request: web.Request, spec: dict[str, v.Field]) -> dict[str, Any]:
    """Read, decode and check the JSON body of ``request`` against ``spec``."""
    return v.parse_object(v.load_json_object(await request.read()), spec)


def _registry(request: web.Request) -> Registry:
    """Return the registry of the app serving ``request``."""
    return request.app[REGISTRY_KEY]


async def health(request: web.Request) -> web.Response:
    """``GET /health``: the server is up and its database is migrated."""
    return web.json_response({"ok": True})


def _role_request(body: dict[str, Any]) -> RoleRequest:
    """Take the replication fields out of a register or heartbeat body."""
    server_id = body.pop("server_id") or synthetic_id(body["group"], body["address"])
    return RoleRequest(server_id=server_id, epoch=body.pop("epoch"), role=body.pop("role"),
                       master_id=body.pop("master_id"), replication=body.pop("replication"),
                       replica=body.pop("replica", None))


async def _with_auth(request: web.Request, answer: dict[str, Any]) -> web.Response:
    """A broker answer plus ``auth``: whether auth is on, so a server that has not yet checked
    a token knows whether to let clients in (it fails closed until it knows)."""
    enabled = request.get(AUTH_ENABLED_KEY)
    if enabled is None:
        enabled = await request.app[TOKENS_KEY].enabled()
    return web.json_response({**answer, "auth": enabled})


async def register_broker(request: web.Request) -> web.Response:
    """``POST /api/brokers/register``."""
    body = await _body(request, v.REGISTER)
    role = _role_request(body)
    return await _with_auth(request, await _registry(request).register_broker(**body, role=role))


async def heartbeat_broker(request: web.Request) -> web.Response:
    """``POST /api/brokers/heartbeat``."""
    body = await _body(request, v.HEARTBEAT)
    role = _role_request(body)
    return await _with_auth(request, await _registry(request).heartbeat_broker(**body, role=role))


async def report_backlog(request: web.Request) -> web.Response:
    """``POST /api/brokers/backlog``: a server's backlog, apart from its lease renewals."""
    body = await _body(request, v.BACKLOG_REPORT)
    return web.json_response(await _registry(request).report_backlog(**body))


async def deregister_broker(request: web.Request) -> web.Response:
    """``POST /api/brokers/deregister``."""
    body = await _body(request, v.DEREGISTER)
    return web.json_response(await _registry(request).deregister_broker(**body))


async def admin_replication(request: web.Request) -> web.Response:
    """``GET /api/admin/replication``: per group its epoch, master, in-sync set, settings."""
    _query(request, {})
    return web.json_response({"replication":
                              await _registry(request).replication.list_groups()})


async def admin_replication_set(request: web.Request) -> web.Response:
    """``POST /api/admin/replication {group, mode?, min_insync?}``."""
    body = await _body(request, v.REPLICATION_SETTINGS)
    return web.json_response(await _registry(request).replication.set_settings(
        body["group"], body["mode"], body["min_insync"]))


async def admin_switchover(request: web.Request) -> web.Response:
    """``POST /api/admin/switchover {group, to?, unclean?}``."""
    body = await _body(request, v.SWITCHOVER)
    return web.json_response(await _registry(request).replication.switchover(
        body["group"], body["to"], body["unclean"]))


def _query(request: web.Request, spec: dict[str, v.Field]) -> dict[str, Any]:
    """Check the query parameters of ``request`` (each given once) against ``spec``."""
    query: dict[str, str] = {}
    for key in request.query:
        values = request.query.getall(key)
        if len(values) != 1:
            raise BadRequest(f"query parameter {key!r} is given {len(values)} times")
        query[key] = values[0]
    return v.parse_object(query, spec, where="query")


async def route(request: web.Request) -> web.Response:
    """``GET /api/route?subject=S&role=producer|consumer&kind=realtime|delay``."""
    params = _query(request, v.ROUTE_QUERY)
    return web.json_response(await _registry(request).route(**params))


async def client_heartbeat(request: web.Request) -> web.Response:
    """``POST /api/clients/heartbeat``."""
    body = await _body(request, v.CLIENT_HEARTBEAT)
    if body["role"] == "consumer" or body["group"]:
        v.check_name("body.group", body["group"])
    return web.json_response(await _registry(request).client_heartbeat(**body))


async def client_heartbeats(request: web.Request) -> web.Response:
    """``POST /api/clients/heartbeats {clients, left}``: a client process's heartbeat for all of
    its clients, and those that closed since, in one request."""
    body = await _body(request, v.CLIENT_HEARTBEATS)
    return web.json_response(await _registry(request).client_heartbeats(**body))


async def client_leave(request: web.Request) -> web.Response:
    """``POST /api/clients/leave``: a client closing gracefully is offline at once."""
    body = await _body(request, v.CLIENT_LEAVE)
    return web.json_response(await _registry(request).client_leave(**body))


async def admin_brokers(request: web.Request) -> web.Response:
    """``GET /api/admin/brokers``."""
    _query(request, {})  # takes none: a typo'd filter is a 400, not ignored
    return web.json_response({"brokers": await _registry(request).list_brokers()})


async def admin_subjects(request: web.Request) -> web.Response:
    """``GET /api/admin/subjects``."""
    _query(request, {})  # takes none: a typo'd filter is a 400, not ignored
    return web.json_response({"subjects": await _registry(request).list_subjects()})


async def admin_groups(request: web.Request) -> web.Response:
    """``GET /api/admin/groups``."""
    _query(request, {})  # takes none: a typo'd filter is a 400, not ignored
    return web.json_response({"groups": await _registry(request).list_consumer_groups()})


async def admin_readonly(request: web.Request) -> web.Response:
    """``POST /api/admin/brokers/readonly``."""
    body = await _body(request, v.READONLY)
    return web.json_response(await _registry(request).set_group_readonly(**body))


async def realtime_brokers(registry: Registry, token: str | None, group: str | None = None
                           ) -> list[dead.BrokerRef]:
    """The online realtime brokers (of ``group``), to be called with ``token``: the admin's
    own, an admin token whenever auth is on."""
    return dead.realtime_brokers(await registry.list_brokers(backlog_rows=False), group,
                                 token=token,
                                 ssl_context=client_context(registry.config.tls_ca))


async def _realtime_brokers(request: web.Request, group: str | None = None
                            ) -> list[dead.BrokerRef]:
    return await realtime_brokers(_registry(request), request[TOKEN_KEY], group)


async def admin_dead(request: web.Request) -> web.Response:
    """``GET /api/admin/dead?subject=S&group=G``: unpurged dead letters on every online broker."""
    params = _query(request, dead.DEAD_LIST_QUERY)
    brokers = await _realtime_brokers(request)
    return web.json_response(await dead.list_dead(brokers, params["subject"], params["group"]))


async def admin_dead_message(request: web.Request) -> web.Response:
    """``GET /api/admin/dead/message?broker_group=B&dead_subject=D&sequence=N``."""
    params = _query(request, dead.DEAD_MESSAGE_QUERY)
    brokers = await _realtime_brokers(request, params["broker_group"])
    return web.json_response(await dead.show_dead(
        brokers, params["broker_group"], params["dead_subject"], params["sequence"]))


async def redrive_dead(registry: Registry, origin: str, token: str | None, subject: str,
                       group: str, ids: list[str] | None) -> dict[str, object]:
    """Re-drive dead letters of ``subject``/``group`` through the realtime route this very
    server (at ``origin``) answers, on behalf of ``token``'s holder."""
    brokers = await realtime_brokers(registry, token)
    sender = PayloadSender(origin, kind="realtime", client_id=dead.ADMIN_CLIENT_ID,
                           app=dead.ADMIN_APP, token=token,
                           ssl_context=client_context(registry.config.tls_ca))
    try:
        return await dead.redrive(brokers, sender, subject, group, ids, registry.clock())
    finally:
        await sender.close()


async def admin_dead_redrive(request: web.Request) -> web.Response:
    """``POST /api/admin/dead/redrive {subject, group, ids?}``."""
    body = await _body(request, dead.REDRIVE)
    return web.json_response(await redrive_dead(
        _registry(request), str(request.url.origin()), request[TOKEN_KEY], body["subject"],
        body["group"], body["ids"]))


async def admin_dead_purge(request: web.Request) -> web.Response:
    """``POST /api/admin/dead/purge {subject, group, through_sequence?, broker_group?}``."""
    body = await _body(request, dead.PURGE)
    brokers = await _realtime_brokers(request, body["broker_group"])
    return web.json_response(await dead.purge(brokers, body["subject"], body["group"],
                                              body["through_sequence"]))


async def admin_delay(request: web.Request) -> web.Response:
    """``GET /api/admin/delay``: the latest stats of every online delay broker."""
    _query(request, {})
    brokers = await _registry(request).list_brokers(backlog_rows=False)
    return web.json_response({"delay": dead.delay_stats(brokers)})


def _tokens(request: web.Request) -> Tokens:
    """Return the token store of the app serving ``request``."""
    return request.app[TOKENS_KEY]


async def admin_tokens_create(request: web.Request) -> web.Response:
    """``POST /api/admin/tokens {app, produce?, consume?, admin?}``: the secret, shown once."""
    body = await _body(request, CREATE)
    return web.json_response(await _tokens(request).create(**body))


async def admin_tokens_list(request: web.Request) -> web.Response:
    """``GET /api/admin/tokens``: every token without its secret."""
    _query(request, {})  # takes none: a typo'd filter is a 400, not ignored
    return web.json_response({"tokens": await _tokens(request).list()})


async def admin_tokens_revoke(request: web.Request) -> web.Response:
    """``POST /api/admin/tokens/revoke {id}``."""
    body = await _body(request, REVOKE)
    return web.json_response(await _tokens(request).revoke(body["id"]))


async def auth_check(request: web.Request) -> web.Response:
    """``POST /api/auth/check {token}``: what a token grants, for brokers checking a hello."""
    body = await _body(request, {"token": v.Field(str, required=False)})
    checked = await _tokens(request).check(body["token"])
    answer: dict[str, object] = {"enabled": checked.enabled, "valid": checked.grant is not None}
    if checked.grant is not None:
        answer.update(app=checked.grant.app, produce=list(checked.grant.produce),
                      consume=list(checked.grant.consume), admin=checked.grant.admin)
    return web.json_response(answer)


def add_routes(app: web.Application) -> None:
    """Register every path of the API on ``app``."""
    app.router.add_get("/health", health)
    app.router.add_post("/api/brokers/register", register_broker)
    app.router.add_post("/api/brokers/heartbeat", heartbeat_broker)
    app.router.add_post("/api/brokers/deregister", deregister_broker)
    app.router.add_post("/api/brokers/backlog", report_backlog)
    app.router.add_get("/api/route", route)
    app.router.add_post("/api/clients/heartbeat", client_heartbeat)
    app.router.add_post("/api/clients/leave", client_leave)
    app.router.add_post("/api/clients/heartbeats", client_heartbeats)
    app.router.add_get("/api/admin/brokers", admin_brokers)
    app.router.add_get("/api/admin/subjects", admin_subjects)
    app.router.add_get("/api/admin/groups", admin_groups)
    app.router.add_post("/api/admin/brokers/readonly", admin_readonly)
    app.router.add_get("/api/admin/replication", admin_replication)
    app.router.add_post("/api/admin/replication", admin_replication_set)
    app.router.add_post("/api/admin/switchover", admin_switchover)
    app.router.add_get("/api/admin/dead", admin_dead)
    app.router.add_get("/api/admin/dead/message", admin_dead_message)
    app.router.add_post("/api/admin/dead/redrive", admin_dead_redrive)
    app.router.add_post("/api/admin/dead/purge", admin_dead_purge)
    app.router.add_get("/api/admin/delay", admin_delay)
    app.router.add_post("/api/admin/tokens", admin_tokens_create)
    app.router.add_get("/api/admin/tokens", admin_tokens_list)
    app.router.add_post("/api/admin/tokens/revoke", admin_tokens_revoke)
    app.router.add_post("/api/auth/check", auth_check)
