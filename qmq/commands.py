"""Client-side CLI commands: ``qmq send``, ``qmq consume`` and ``qmq admin ...``."""

from __future__ import annotations

import asyncio
import contextvars
import json
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
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
    await _admin_request(meta_url, "GET", "/health")
    received = 0
    async with Consumer(meta_url, group=group, start=start, broadcast=broadcast,
                        **_sdk_options()) as consumer:
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


# Seconds an admin request may take; re-driving or purging walks every broker, so it gets longer.
ADMIN_TIMEOUT_S = 10
ADMIN_BULK_TIMEOUT_S = 300


async def _admin_request(meta_url: str, method: str, path: str,
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


def _table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    if not rows:
        return "(none)"
    cells = [[str(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


_ADMIN_COLUMNS = {
    "brokers": ["group", "kind", "address", "server_id", "role", "epoch", "state", "in_sync",
                "lag_bytes", "lag_ms", "heartbeat_age_ms"],
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
                if value is None and key in ("lag_bytes", "lag_ms"):
                    row[key] = "-"  # nothing reported yet (no data plane, or a master)
                elif isinstance(value, bool) and key == "in_sync":
                    row[key] = "yes" if value else "no"
                if isinstance(value, list):
                    row[key] = ",".join(
                        v.get("group", str(v)) if isinstance(v, dict) else str(v) for v in value
                    )
        print(_table(rows, _ADMIN_COLUMNS[what]))
    return 0


def _iso_ms(ms: int | None) -> str:
    """Epoch ms as an ISO-8601 UTC time (second precision unless ms are set)."""
    if ms is None:
        return "-"
    text = datetime.fromtimestamp(ms / 1000, tz=timezone.utc).isoformat(
        timespec="milliseconds" if ms % 1000 else "seconds")
    return text.replace("+00:00", "Z")


def _print_errors(errors: list[dict[str, Any]]) -> int:
    """Print the brokers that failed to stderr; returns the exit code (1 if any failed)."""
    for error in errors:
        where = error.get("broker_group", "")
        if error.get("address"):
            where += f" ({error['address']})"
        print(f"qmq: broker {where or '?'}: {error.get('code', '')}: {error.get('message', '')}",
              file=sys.stderr)
    return EXIT_FAILED if errors else 0


_DEAD_USAGE = (
    "usage: qmq admin dead list [--subject S] [--group G] [--json]\n"
    "       qmq admin dead show BROKER_GROUP DEAD_SUBJECT SEQUENCE\n"
    "       qmq admin dead redrive SUBJECT GROUP [--id ID ...]\n"
    "       qmq admin dead purge SUBJECT GROUP [--through N] [--broker-group B]"
)
_DEAD_COLUMNS = ["broker_group", "sequence", "subject", "group", "id", "retries", "created_at",
                 "size_bytes", "body_preview"]
_PREVIEW_CHARS_IN_TABLE = 40


async def admin_dead_command(meta_url: str, args: list[str], *, subject: str | None = None,
                             group: str | None = None, ids: list[str] | None = None,
                             through: int | None = None, broker_group: str | None = None,
                             as_json: bool = False) -> int:
    """``qmq admin dead list|show|redrive|purge``."""
    action, rest = (args[0], args[1:]) if args else ("", [])
    if action == "list" and not rest:
        params = {k: v for k, v in (("subject", subject), ("group", group)) if v is not None}
        data = await _admin_request(meta_url, "GET", "/api/admin/dead", params=params)
        if as_json:
            print(json.dumps(data, indent=2))
            return _print_errors(data["errors"])
        rows = []
        for row in data["dead"]:
            preview = row["body_preview"].replace("\n", " ")
            if len(preview) > _PREVIEW_CHARS_IN_TABLE:
                preview = preview[:_PREVIEW_CHARS_IN_TABLE - 3] + "..."
            rows.append({**row, "created_at": _iso_ms(row["created_at_ms"]),
                         "body_preview": preview})
        print(_table(rows, _DEAD_COLUMNS))
        if data["truncated"]:
            print(f"(only the first {len(rows)} dead letters are shown)")
        return _print_errors(data["errors"])
    if action == "show" and len(rest) == 3:
        params = {"broker_group": rest[0], "dead_subject": rest[1], "sequence": rest[2]}
        data = await _admin_request(meta_url, "GET", "/api/admin/dead/message", params=params)
        print(json.dumps(data, indent=2))
        return 0
    if action == "redrive" and len(rest) == 2:
        body: dict[str, Any] = {"subject": rest[0], "group": rest[1]}
        if ids:
            body["ids"] = ids
        data = await _admin_request(meta_url, "POST", "/api/admin/dead/redrive", body,
                                    timeout_s=ADMIN_BULK_TIMEOUT_S)
        if as_json:
            print(json.dumps(data, indent=2))
        else:
            print(f"redriven {data['redriven']} message(s) to {rest[0]}"
                  + (f", {data['duplicates']} already re-driven" if data["duplicates"] else ""))
        return _print_errors(data["errors"])
    if action == "purge" and len(rest) == 2:
        body = {"subject": rest[0], "group": rest[1]}
        if through is not None:
            body["through_sequence"] = through
        if broker_group is not None:
            body["broker_group"] = broker_group
        data = await _admin_request(meta_url, "POST", "/api/admin/dead/purge", body,
                                    timeout_s=ADMIN_BULK_TIMEOUT_S)
        if as_json:
            print(json.dumps(data, indent=2))
        else:
            print(f"purged {data['purged']} dead letter(s) of {rest[0]} / {rest[1]}")
        return _print_errors(data["errors"])
    raise CommandError(_DEAD_USAGE)


def _lateness(value: int | None) -> str:
    # The stats give each percentile as the upper bound of its histogram bucket; -1 is the open
    # bucket past the last bound.
    if value is None:
        return "n/a"
    return "over the last bound" if value < 0 else f"<={value} ms"


def format_delay_stats(entry: dict[str, Any]) -> str:
    """The text block ``qmq admin delay`` prints for one delay broker."""
    stats = entry.get("stats") or {}
    lines = [f"delay group {entry['group']} at {entry['address']} "
             f"(heartbeat {entry.get('heartbeat_age_ms', '?')} ms ago)",
             f"  pending total: {stats.get('pending_total', 0)}"]
    per_hour = stats.get("pending_per_hour") or {}
    lines.append("  pending per hour:" + ("" if per_hour else " (none)"))
    for hour, count in sorted(per_hour.items(), key=lambda kv: int(kv[0])):
        lines.append(f"    {_iso_ms(int(hour))}  {count}")
    per_subject = stats.get("pending_per_subject") or {}
    lines.append("  pending per subject:" + ("" if per_subject else " (none)"))
    for subject, count in sorted(per_subject.items()):
        lines.append(f"    {subject}  {count}")
    lines.append(f"  dispatch rate: {stats.get('dispatch_rate_per_s', 0)}/s "
                 f"(dispatched {stats.get('dispatched', 0)})")
    lines.append(f"  lateness: p50 {_lateness(stats.get('lateness_ms_p50_le'))}, "
                 f"p99 {_lateness(stats.get('lateness_ms_p99_le'))}, "
                 f"max {stats.get('lateness_ms_max', 0)} ms; early {stats.get('early', 0)}")
    histogram = stats.get("lateness_histogram") or {}
    lines.append("  lateness histogram: " + (
        ", ".join(f"{bucket} {count}" for bucket, count in histogram.items()) or "(empty)"))
    return "\n".join(lines)


async def admin_delay_command(meta_url: str, as_json: bool = False) -> int:
    """``qmq admin delay``: every online delay broker's pending counts and dispatch stats."""
    data = await _admin_request(meta_url, "GET", "/api/admin/delay")
    if as_json:
        print(json.dumps(data["delay"], indent=2))
    elif not data["delay"]:
        print("(no online delay server)")
    else:
        print("\n\n".join(format_delay_stats(entry) for entry in data["delay"]))
    return 0


_TOKEN_COLUMNS = ["id", "app", "hint", "admin", "produce", "consume", "created", "revoked"]


def _token_row(token: dict[str, Any]) -> dict[str, Any]:
    """One token as ``qmq admin tokens list`` prints it."""
    return {**token, "produce": ",".join(token["produce"]) or "-",
            "consume": ",".join(token["consume"]) or "-",
            "created": _iso_ms(token["created_at_ms"]),
            "revoked": _iso_ms(token["revoked_at_ms"]) if token["revoked_at_ms"] else "-"}


async def admin_tokens_command(meta_url: str, args: list[str], *, app: str | None,
                               produce: list[str], consume: list[str], admin: bool,
                               as_json: bool = False) -> int:
    """``qmq admin tokens create --app A [--produce P] [--consume P] [--admin] | list |
    revoke ID``. ``create`` prints the secret: it is shown this once and never again."""
    action = args[0] if args else "list"
    if action == "create" and len(args) == 1:
        if not app:
            raise CommandError("usage: qmq admin tokens create --app NAME [--produce PATTERN] "
                               "[--consume PATTERN] [--admin]")
        data = await _admin_request(meta_url, "POST", "/api/admin/tokens",
                                    {"app": app, "produce": produce, "consume": consume,
                                     "admin": admin})
        if as_json:
            print(json.dumps(data, indent=2))
        else:
            print(f"created token id={data['id']} app={data['app']} admin={data['admin']}")
            print(f"token: {data['token']}")
            print("store it now: the MetaServer keeps only its hash and cannot show it again",
                  file=sys.stderr)
        return 0
    if action == "list" and len(args) <= 1:
        data = await _admin_request(meta_url, "GET", "/api/admin/tokens")
        tokens = data["tokens"]
        print(json.dumps(tokens, indent=2) if as_json
              else _table([_token_row(t) for t in tokens], _TOKEN_COLUMNS))
        return 0
    if action == "revoke" and len(args) == 2 and args[1].isdigit():
        data = await _admin_request(meta_url, "POST", "/api/admin/tokens/revoke",
                                    {"id": int(args[1])})
        print(json.dumps(data) if as_json else
              f"revoked token id={data['id']} app={data['app']}")
        return 0
    raise CommandError("usage: qmq admin tokens create --app NAME ... | list | revoke ID")


_REPLICATION_COLUMNS = ["group", "kind", "epoch", "master_id", "master_address", "replication",
                        "min_insync", "insync", "slaves", "writable", "switchover_to"]


async def admin_replication_command(meta_url: str, args: list[str], *, mode: str | None,
                                    min_insync: int | None, as_json: bool = False) -> int:
    """``qmq admin replication [GROUP --mode M --min-insync N]``: per group its epoch, master,
    in-sync set and settings; with a GROUP and a flag, change that group's settings."""
    if args:
        if len(args) != 1 or (mode is None and min_insync is None):
            raise CommandError("usage: qmq admin replication [GROUP --mode sync|async "
                               "--min-insync N]")
        body: dict[str, Any] = {"group": args[0]}
        if mode is not None:
            body["mode"] = mode
        if min_insync is not None:
            body["min_insync"] = min_insync
        data = await _admin_request(meta_url, "POST", "/api/admin/replication", body)
        print(json.dumps(data))
        return 0
    rows = (await _admin_request(meta_url, "GET", "/api/admin/replication"))["replication"]
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    shown = [{**row, "insync": ",".join(row["insync"]) or "-",
              "slaves": ",".join(row["slaves"]) or "-",
              "switchover_to": row["switchover_to"] or "-"} for row in rows]
    print(_table(shown, _REPLICATION_COLUMNS))
    return 0


# Seconds between two looks at a switchover under way.
SWITCHOVER_POLL_S = 0.2


async def admin_switchover_command(meta_url: str, args: list[str], *, to: str | None,
                                   unclean: bool, wait_s: float, as_json: bool = False) -> int:
    """``qmq admin switchover GROUP [--to SERVER_ID] [--unclean]``: ask for a planned change
    of master and wait (up to ``wait_s``) until the group's epoch moves; EXIT_FAILED (1) if it
    did not."""
    if len(args) != 1:
        raise CommandError("usage: qmq admin switchover GROUP [--to SERVER_ID] [--unclean]")
    group = args[0]
    body: dict[str, Any] = {"group": group, "unclean": unclean}
    if to is not None:
        body["to"] = to
    started = await _admin_request(meta_url, "POST", "/api/admin/switchover", body)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    row: dict[str, Any] = {}
    while True:
        rows = (await _admin_request(meta_url, "GET", "/api/admin/replication"))["replication"]
        row = next((r for r in rows if r["group"] == group), {})
        if row.get("epoch", 0) > started["epoch"] or started["state"] == "done":
            break
        if not row.get("switchover_to") or loop.time() > deadline:
            if as_json:
                print(json.dumps({**started, "state": "cancelled", "group_now": row}))
            print(f"qmq: switchover of {group} to {started['to']} did not complete; "
                  f"{row.get('master_id')} is still master at epoch {row.get('epoch')}",
                  file=sys.stderr)
            return EXIT_FAILED
        await asyncio.sleep(SWITCHOVER_POLL_S)
    if as_json:
        print(json.dumps({**started, "state": "done", "epoch": row.get("epoch")}))
    else:
        print(f"switched group {group} from {started['from']} to {row.get('master_id')} "
              f"at epoch {row.get('epoch')}")
    return 0
