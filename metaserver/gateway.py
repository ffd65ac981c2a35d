"""The HTTP gateway: send, cancel, pull (long poll), ack and nack as JSON (docs/HTTP.md).

It lives in the MetaServer rather than in a process of its own: clients already know the
MetaServer's URL, the auth middleware and token store are here, routes come from the registry
in-process (``LocalRoutes``, no HTTP to itself), ``qmq up`` serves it with no more set-up, and
it keeps no state a client depends on (a pull's receipts name the broker, so any MetaServer
sharing the database acks them), so it scales as MetaServers do, behind any load balancer.

Per token it keeps one ``GatewayClient`` (at most ``GATEWAY_CLIENTS_MAX``, least recently used
closed first): an SDK ``Producer``, which batches the sends of concurrent HTTP requests into
one broker request per subject, retries with the same ids and finds delay servers, and a
connection pool for pulls, acks and nacks. Brokers see the caller's token in hello and check
it as they check any client's, so the gateway has the binary protocol's limits, patterns and
errors; it also refuses a subject outside the token's patterns before calling a broker.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from metaserver import gateway_codec as codec
from metaserver import validation as v
from metaserver.errors import ApiError, TooLarge
from metaserver.errors import NoRoute as ApiNoRoute
from metaserver.gateway_pull import Puller
from metaserver.handlers import REGISTRY_KEY
from metaserver.registry import Registry
from metaserver.tokens import GRANT_KEY, TOKEN_KEY
from sdk.connection import ConnectionPool
from sdk.producer import Producer
from sdk.routes import Role, Route, RouteCache, parse_route
from sdk.send_batch import Receipt
from serverkit.access import Grant
from wire.errors import NoRoute, QmqError
from wire.tls import client_context

log = logging.getLogger(__name__)

# Tokens with a client (producer and connections) kept at once; the least recently used goes.
GATEWAY_CLIENTS_MAX = 256
# The app brokers are told in hello while auth is off (no token names one).
GATEWAY_APP = "http-gateway"


class LocalRoutes(RouteCache):
    """Routes from this MetaServer's registry, in-process: the gateway asks no HTTP of itself,
    so it works behind any proxy. Cached and refreshed exactly as the SDK's RouteCache (this
    replaces only its ``_fetch``)."""

    # A URL only to satisfy RouteCache's parsing of its MetaServer list: this cache asks no
    # MetaServer over HTTP (``_fetch`` reads the registry), and ``.invalid`` (RFC 2606) names
    # no host, so a stray request could reach nothing.
    NO_URL = "http://in-process.invalid"

    def __init__(self, registry: Registry, kind: str) -> None:
        super().__init__(self.NO_URL, kind=kind)
        self._registry = registry

    async def _fetch(self, subject: str, role: Role) -> Route:
        try:
            answer = await self._registry.route(subject, role, self.kind)
        except ApiNoRoute as exc:
            raise NoRoute(exc.message) from None
        return parse_route(answer, subject, role)


class GatewayClient:
    """What the gateway sends and pulls with for one token."""

    def __init__(self, producer: Producer, puller: Puller) -> None:
        self.producer = producer
        self.puller = puller

    async def close(self) -> None:
        """Flush pending sends, then close every connection."""
        try:
            await self.producer.close()
        finally:
            await self.puller.close()


class Gateway:
    """The gateway of one MetaServer app: its clients per token and its routes."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.routes = LocalRoutes(registry, "realtime")
        self.delay_routes = LocalRoutes(registry, "delay")
        self._clients: OrderedDict[str | None, GatewayClient] = OrderedDict()
        self._closing: set[asyncio.Task[None]] = set()
        self._numbers = itertools.count(1)
        self._host = f"{socket.gethostname()[:80]}-{os.getpid()}"

    def client(self, token: str | None, grant: Grant | None) -> GatewayClient:
        """The client of ``token`` (made on first use; the least recently used one past
        GATEWAY_CLIENTS_MAX is closed)."""
        client = self._clients.get(token)
        if client is not None:
            self._clients.move_to_end(token)
            return client
        codec.check_token_length(token)
        app = grant.app if grant is not None else GATEWAY_APP
        client_id = f"gateway-{self._host}-{next(self._numbers)}"
        ssl_context = client_context(self.registry.config.tls_ca)
        producer = Producer("in-process", app=app, token=token, client_id=client_id,
                            routes=self.routes, delay_routes=self.delay_routes, tls=ssl_context)
        pool = ConnectionPool(client_id=client_id, app=app, token=token,
                              ssl_context=ssl_context)
        client = self._clients[token] = GatewayClient(
            producer, Puller(self.registry, self.routes, pool, ssl_context))
        while len(self._clients) > GATEWAY_CLIENTS_MAX:
            _, old = self._clients.popitem(last=False)
            task = asyncio.get_running_loop().create_task(old.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        return client

    async def close(self) -> None:
        """Close every client (pending sends are flushed first)."""
        clients, self._clients = list(self._clients.values()), OrderedDict()
        results = await asyncio.gather(*(c.close() for c in clients), *self._closing,
                                       return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                log.warning("closing a gateway client failed: %r", result)


GATEWAY_KEY = web.AppKey("metaserver_gateway", Gateway)


async def read_json(request: web.Request) -> dict[str, Any]:
    """The request's JSON object, at most GATEWAY_REQUEST_BYTES_MAX bytes (413 past it)."""
    limit = codec.GATEWAY_REQUEST_BYTES_MAX
    if request.content_length is not None and request.content_length > limit:
        raise TooLarge(f"request body of {request.content_length} bytes exceeds "
                       f"GATEWAY_REQUEST_BYTES_MAX {limit}")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_chunked(256 * 1024):
        size += len(chunk)
        if size > limit:
            raise TooLarge(f"request body exceeds GATEWAY_REQUEST_BYTES_MAX {limit} bytes")
        chunks.append(chunk)
    return v.load_json_object(b"".join(chunks))


def _client(request: web.Request) -> GatewayClient:
    return request.app[GATEWAY_KEY].client(request[TOKEN_KEY], _grant(request))


def _grant(request: web.Request) -> Grant | None:
    grant = request.get(GRANT_KEY)
    return grant if isinstance(grant, Grant) else None


def _check_produce(request: web.Request, subject: str) -> None:
    grant = _grant(request)
    if grant is not None:
        grant.check_produce(subject)


def _check_consume(request: web.Request, subject: str) -> None:
    grant = _grant(request)
    if grant is not None:
        grant.check_consume(subject)


async def send(request: web.Request) -> web.Response:
    """``POST /api/send {messages: [...]}``: one result per message, in order."""
    raw = v.parse_object(await read_json(request), codec.SEND)["messages"]
    # The shape of every message first: a malformed one refuses the request (400), as the
    # OpenAPI document says; values and limits are then checked per message.
    shaped = [v.parse_object(item, codec.SEND_MESSAGE, where=f"messages[{i}]")
              for i, item in enumerate(raw)]
    for fields in shaped:  # refused as a whole, as the binary protocol refuses a send
        _check_produce(request, fields["subject"])
    producer = _client(request).producer
    results = await asyncio.gather(*(_send_one(producer, fields, f"messages[{i}]")
                                     for i, fields in enumerate(shaped)))
    return web.json_response({"results": results})


async def _send_one(producer: Producer, fields: dict[str, Any], where: str) -> dict[str, Any]:
    given = fields["id"]
    try:
        item = codec.send_item(fields, where)
        receipt = await producer.send(
            item.subject, item.body, tags=item.tags, properties=item.properties,
            message_id=item.message_id, expire_at=item.expire_at_ms, delay=item.delay_ms,
            deliver_at=item.deliver_at_ms)
    except (QmqError, ApiError) as exc:
        return {"id": given, "error": codec.error_json(exc)}
    out: dict[str, Any] = {"id": receipt.message_id, "status": receipt.status,
                           "subject": receipt.subject, "broker_group": receipt.broker_group}
    if receipt.deliver_at_ms is not None:
        out["deliver_at_ms"] = receipt.deliver_at_ms
    return out


async def cancel(request: web.Request) -> web.Response:
    """``POST /api/cancel {messages: [{subject, id, broker_group, deliver_at_ms}]}``."""
    raw = v.parse_object(await read_json(request), codec.CANCEL)["messages"]
    shaped = [v.parse_object(item, codec.CANCEL_ITEM, where=f"messages[{i}]")
              for i, item in enumerate(raw)]
    for fields in shaped:
        _check_produce(request, fields["subject"])
    producer = _client(request).producer

    async def one(fields: dict[str, Any]) -> dict[str, Any]:
        try:
            status = await producer.cancel(Receipt(fields["id"], fields["subject"],
                                                   fields["broker_group"], "stored",
                                                   fields["deliver_at_ms"]))
        except (QmqError, ApiError) as exc:
            return {"id": fields["id"], "error": codec.error_json(exc)}
        return {"id": fields["id"], "status": status}

    results = await asyncio.gather(*(one(fields) for fields in shaped))
    return web.json_response({"results": results})


async def pull(request: web.Request) -> web.Response:
    """``POST /api/pull {subject, group, consumer_id, max_count?, wait_ms?, tags?, start?}``."""
    fields = v.parse_object(await read_json(request), codec.PULL)
    _check_consume(request, fields["subject"])
    messages = await _client(request).puller.pull(**fields)
    return web.json_response({"messages": messages})


async def ack(request: web.Request) -> web.Response:
    """``POST /api/ack {receipts: [...]}`` -> ``{acked}``."""
    fields = v.parse_object(await read_json(request), codec.ACK)
    receipts = [codec.read_receipt(f"receipts[{i}]", r) for i, r in enumerate(fields["receipts"])]
    for receipt in receipts:
        _check_consume(request, receipt.source)
    return web.json_response({"acked": await _client(request).puller.ack(receipts)})


async def nack(request: web.Request) -> web.Response:
    """``POST /api/nack {receipts: [...], retry_after_ms?}`` -> ``{nacked}``."""
    fields = v.parse_object(await read_json(request), codec.NACK)
    receipts = [codec.read_receipt(f"receipts[{i}]", r) for i, r in enumerate(fields["receipts"])]
    for receipt in receipts:
        _check_consume(request, receipt.source)
    nacked = await _client(request).puller.nack(receipts, fields["retry_after_ms"])
    return web.json_response({"nacked": nacked})


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    yield
    await app[GATEWAY_KEY].close()


def add_gateway_routes(app: web.Application) -> None:
    """Register the gateway's paths and close its clients when the app stops."""
    app[GATEWAY_KEY] = Gateway(app[REGISTRY_KEY])
    app.router.add_post("/api/send", send)
    app.router.add_post("/api/cancel", cancel)
    app.router.add_post("/api/pull", pull)
    app.router.add_post("/api/ack", ack)
    app.router.add_post("/api/nack", nack)
    app.cleanup_ctx.append(_lifecycle)
