"""Client-side CLI commands: ``qmq send``, ``qmq consume`` and ``qmq admin ...``."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import aiohttp


class CommandError(Exception):
    """A CLI command failed in a way the user should read (printed without a traceback)."""


def parse_properties(pairs: list[str]) -> dict[str, str]:
    """Turn ``["k=v", ...]`` into a dict; a pair without ``=`` is an error naming it."""
    props = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CommandError(f"property {pair!r} must look like key=value")
        props[key] = value
    return props


async def send_command(meta_url: str, subject: str, body: bytes, tags: list[str],
                       properties: dict[str, str], count: int) -> int:
    """Send ``count`` copies of a message; prints one receipt line per message."""
    from sdk.producer import Producer

    async with Producer(meta_url) as producer:
        receipts = await asyncio.gather(*(
            producer.send(subject, body, tags=tags, properties=properties) for _ in range(count)
        ))
    for receipt in receipts:
        print(f"{receipt.status} id={receipt.message_id} subject={receipt.subject} "
              f"group={receipt.broker_group}")
    return 0


async def consume_command(meta_url: str, subject: str, group: str, tags: list[str] | None,
                          start: str, count: int | None, idle_timeout_s: float | None,
                          broadcast: bool) -> int:
    """Print messages as they arrive and ack them; stops after ``count`` or an idle timeout."""
    from sdk.consumer import Consumer

    # A long-running consumer rides out MetaServer outages on cached routes, but a CLI that
    # has never reached it should say so instead of waiting forever.
    await _admin_request(meta_url, "GET", "/health")
    received = 0
    async with Consumer(meta_url, group=group, start=start, broadcast=broadcast) as consumer:
        iterator = consumer.subscribe(subject, tags=tags).__aiter__()
        while count is None or received < count:
            try:
                msg = await asyncio.wait_for(iterator.__anext__(), idle_timeout_s)
            except (asyncio.TimeoutError, StopAsyncIteration):
                break
            body = msg.body.decode("utf-8", "backslashreplace")
            print(json.dumps({"id": msg.id, "subject": msg.subject, "tags": list(msg.tags),
                              "properties": msg.properties, "redelivered": msg.redelivered,
                              "body": body}), flush=True)
            await msg.ack()
            received += 1
    print(f"consumed {received} message(s)", file=sys.stderr)
    return 0


async def _admin_request(meta_url: str, method: str, path: str,
                         body: dict[str, Any] | None = None) -> Any:
    url = meta_url.rstrip("/") + path
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            async with session.request(method, url, json=body) as response:
                data = await response.json(content_type=None)
                if response.status >= 400:
                    error = data.get("error", {}) if isinstance(data, dict) else {}
                    raise CommandError(
                        f"{method} {path} failed: {response.status} "
                        f"{error.get('code', '')}: {error.get('message', data)}"
                    )
                return data
    except aiohttp.ClientError as exc:
        raise CommandError(f"cannot reach the MetaServer at {meta_url}: {exc}") from exc


def _table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    if not rows:
        return "(none)"
    cells = [[str(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


_ADMIN_COLUMNS = {
    "brokers": ["group", "kind", "address", "state", "heartbeat_age_ms"],
    "subjects": ["subject", "version", "groups"],
    "groups": ["subject", "group", "online_clients", "lag"],
}


async def admin_command(meta_url: str, what: str, as_json: bool, args: list[str]) -> int:
    """``qmq admin brokers|subjects|groups|readonly``."""
    if what == "readonly":
        if len(args) != 2 or args[1] not in ("on", "off"):
            raise CommandError("usage: qmq admin readonly GROUP on|off")
        data = await _admin_request(meta_url, "POST", "/api/admin/brokers/readonly",
                                    {"group": args[0], "readonly": args[1] == "on"})
        print(json.dumps(data))
        return 0
    data = await _admin_request(meta_url, "GET", f"/api/admin/{what}")
    rows = data.get(what, data) if isinstance(data, dict) else data
    if as_json:
        print(json.dumps(rows, indent=2))
    else:
        for row in rows:
            for key, value in list(row.items()):
                if isinstance(value, list):
                    row[key] = ",".join(
                        v.get("group", str(v)) if isinstance(v, dict) else str(v) for v in value
                    )
        print(_table(rows, _ADMIN_COLUMNS[what]))
    return 0
