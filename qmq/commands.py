"""Client-side CLI commands: ``qmq send``, ``qmq cancel``, ``qmq consume``, and the MetaServer
request every client command makes (``admin_request``); ``qmq admin ...`` is in
``qmq.admin_commands``, so a send does not load (or, without bytecode caches, compile) it."""

from __future__ import annotations

import asyncio
import contextvars
import json
import sys
from dataclasses import dataclass
from typing import Any

from qmq.exits import EXIT_FAILED, EXIT_UNAVAILABLE, EXIT_USAGE, exit_code_of_http_status
from wire.http import bearer, http_ssl
from wire.tls import client_context


class CommandError(Exception):
    """A CLI command failed in a way the user should read (printed without a traceback);
    ``exit_code`` is its row of the table in qmq.exits (a usage error unless said)."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class ClientSettings:
    """How a client command reaches the service: its token (--token / QMQ_TOKEN) and the CA
    file that verifies TLS servers (--tls-ca / QMQ_TLS_CA); both optional."""

    token: str | None = None
    tls_ca: str | None = None


# Set once by the CLI before a client command runs (one command per process).
CLIENT: contextvars.ContextVar[ClientSettings] = contextvars.ContextVar(
    "qmq_client_settings", default=ClientSettings())


def _sdk_options() -> dict[str, Any]:
    """The Producer/Consumer keywords of the current ClientSettings."""
    settings = CLIENT.get()
    return {"token": settings.token, "tls": settings.tls_ca}


def parse_properties(pairs: list[str]) -> dict[str, str]:
    """Turn ``["k=v", ...]`` into a dict; a pair without ``=`` is an error naming it."""
    props = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CommandError(f"property {pair!r} must look like key=value")
        props[key] = value
    return props


def parse_deliver_at(text: str) -> int:
    """``--deliver-at``: an ISO 8601 time with a timezone, or epoch milliseconds."""
    if text.isdigit():
        return int(text)
    from datetime import datetime

    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise CommandError(f"--deliver-at {text!r} is neither ISO 8601 nor epoch ms") from None
    if moment.tzinfo is None:
        raise CommandError(f"--deliver-at {text!r} needs a timezone, e.g. {text}+00:00")
    return int(moment.timestamp() * 1000)


# ``qmq send --count N`` sends its copies in at least this many batches (fewer copies: one per
# batch), each to the next group of the route.
SEND_SPREAD_BATCHES = 8


async def send_command(meta_url: str, subject: str, body: bytes, tags: list[str],
                       properties: dict[str, str], count: int, delay_ms: int | None = None,
                       deliver_at_ms: int | None = None, as_json: bool = False) -> int:
    """Send ``count`` copies of a message (delayed if asked); prints one receipt line each
    (a JSON object each with ``as_json``).

    The copies travel in at least SEND_SPREAD_BATCHES batches (one each when fewer), and the
    producer's round robin starts at a random group, so CLI sends spread over the route's
    groups as an application's do."""
    from sdk.producer import Producer

    batch_size_max = max(1, -(-count // SEND_SPREAD_BATCHES))
    async with Producer(meta_url, batch_size_max=batch_size_max, **_sdk_options()) as producer:
        receipts = await asyncio.gather(*(
            producer.send(subject, body, tags=tags, properties=properties, delay=delay_ms,
                          deliver_at=deliver_at_ms)
            for _ in range(count)
        ))
    for receipt in receipts:
        if as_json:
            print(json.dumps({"status": receipt.status, "id": receipt.message_id,
                              "subject": receipt.subject, "group": receipt.broker_group,
                              "deliver_at_ms": receipt.deliver_at_ms if receipt.delayed else None}))
            continue
        due = f" deliver_at_ms={receipt.deliver_at_ms}" if receipt.delayed else ""
        print(f"{receipt.status} id={receipt.message_id} subject={receipt.subject} "
              f"group={receipt.broker_group}{due}")
    return 0


async def cancel_command(meta_url: str, subject: str, message_id: str, delay_group: str,
                         deliver_at_ms: int, as_json: bool = False) -> int:
    """Cancel a delayed message named as ``qmq send`` printed it; exit 0 only if cancelled."""
    from sdk.producer import Producer, Receipt

    receipt = Receipt(message_id, subject, delay_group, "stored", deliver_at_ms)
    async with Producer(meta_url, **_sdk_options()) as producer:
        status = await producer.cancel(receipt)
    print(json.dumps({"status": status, "id": message_id}) if as_json
          else f"{status} id={message_id}")
    return 0 if status in ("cancelled", "already_cancelled") else EXIT_FAILED


async def consume_command(meta_url: str, subject: str, group: str, tags: list[str] | None,
                          start: str, count: int | None, idle_timeout_s: float | None,
                          broadcast: bool) -> int:
    """Print messages as they arrive and ack them; stops after ``count`` or an idle timeout."""
    from sdk.consumer import Consumer

    # A long-running consumer rides out MetaServer outages on cached routes, but a CLI that
    # has never reached it should say so instead of waiting forever.
    await admin_request(meta_url, "GET", "/health")
    received = 0
    async with Consumer(meta_url, group=group, start=start, broadcast=broadcast,
                        **_sdk_options()) as consumer:
        iterator = consumer.subscribe(subject, tags=tags).__aiter__()
        while count is None or received < count:
            try:
                # asyncio.timeout: 3.11's wait_for can swallow a Ctrl-C's cancel.
                async with asyncio.timeout(idle_timeout_s):
                    msg = await iterator.__anext__()
            except (TimeoutError, StopAsyncIteration):
                break
            body = msg.body.decode("utf-8", "backslashreplace")
            print(json.dumps({"id": msg.id, "subject": msg.subject, "tags": list(msg.tags),
                              "properties": msg.properties, "redelivered": msg.redelivered,
                              "body": body}), flush=True)
            await msg.ack()
            received += 1
    print(f"consumed {received} message(s)", file=sys.stderr)
    return 0


# Seconds an admin request may take (qmq.admin_commands gives bulk ones longer).
ADMIN_TIMEOUT_S = 10


async def admin_request(meta_url: str, method: str, path: str,
                        body: dict[str, Any] | None = None,
                        params: dict[str, str] | None = None,
                        timeout_s: float = ADMIN_TIMEOUT_S) -> Any:
    """One admin call to the first MetaServer of ``meta_url`` (a comma-separated list) that
    answers; CommandError naming the error, or naming every MetaServer that failed."""
    from sdk.meta import MetaEndpoints, MetaUnavailable

    settings = CLIENT.get()
    try:
        endpoints = MetaEndpoints(meta_url)
    except ValueError as exc:
        raise CommandError(f"--meta: {exc}") from None
    try:  # sdk.http1, not aiohttp: a one-shot command starts faster without it
        answer = await endpoints.request(
            None, method, path, timeout_s=timeout_s, headers=bearer(settings.token),
            ssl=http_ssl(client_context(settings.tls_ca)), json=body, params=params)
    except MetaUnavailable as exc:
        raise CommandError(exc.message, EXIT_UNAVAILABLE) from None
    data = answer.data
    if answer.status >= 400:
        error = data.get("error", {}) if isinstance(data, dict) else {}
        raise CommandError(
            f"{method} {path} failed: {answer.status} "
            f"{error.get('code', '')}: {error.get('message', data)}",
            exit_code_of_http_status(answer.status))
    return data
