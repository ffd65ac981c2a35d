"""``qmq admin ...``'s work: the MetaServer's admin API calls and how their answers print
(``qmq.admin_cli`` parses the commands and calls these)."""

from __future__ import annotations

import asyncio
import json
import sys
from datetime import datetime, timezone
from typing import Any

from qmq.commands import CommandError, admin_request
from qmq.exits import EXIT_FAILED

# Seconds a re-drive or purge may take: it walks every broker.
ADMIN_BULK_TIMEOUT_S = 300


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
                "lag_bytes", "lag_ms", "undecodable", "heartbeat_age_ms"],
    "subjects": ["subject", "version", "groups"],
    "groups": ["subject", "group", "online_clients", "lag"],
}


async def admin_command(meta_url: str, what: str, as_json: bool, args: list[str]) -> int:
    """``qmq admin brokers|subjects|groups|readonly``."""
    if what == "readonly":
        if len(args) != 2 or args[1] not in ("on", "off"):
            raise CommandError("usage: qmq admin readonly GROUP on|off")
        data = await admin_request(meta_url, "POST", "/api/admin/brokers/readonly",
                                   {"group": args[0], "readonly": args[1] == "on"})
        print(json.dumps(data))
        return 0
    data = await admin_request(meta_url, "GET", f"/api/admin/{what}")
    rows = data.get(what, data) if isinstance(data, dict) else data
    if as_json:
        print(json.dumps(rows, indent=2))
    else:
        for row in rows:
            if what == "brokers":
                # An older MetaServer's rows have no undecodable_at: "?", not "-".
                row["undecodable"] = (_place(row["undecodable_at"]) if row.get("undecodable_at")
                                      else "-" if "undecodable_at" in row else "?")
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
        data = await admin_request(meta_url, "GET", "/api/admin/dead", params=params)
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
        data = await admin_request(meta_url, "GET", "/api/admin/dead/message", params=params)
        print(json.dumps(data, indent=2))
        return 0
    if action == "redrive" and len(rest) == 2:
        body: dict[str, Any] = {"subject": rest[0], "group": rest[1]}
        if ids:
            body["ids"] = ids
        data = await admin_request(meta_url, "POST", "/api/admin/dead/redrive", body,
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
        data = await admin_request(meta_url, "POST", "/api/admin/dead/purge", body,
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
    data = await admin_request(meta_url, "GET", "/api/admin/delay")
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
        data = await admin_request(meta_url, "POST", "/api/admin/tokens",
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
        data = await admin_request(meta_url, "GET", "/api/admin/tokens")
        tokens = data["tokens"]
        print(json.dumps(tokens, indent=2) if as_json
              else _table([_token_row(t) for t in tokens], _TOKEN_COLUMNS))
        return 0
    if action == "revoke" and len(args) == 2 and args[1].isdigit():
        data = await admin_request(meta_url, "POST", "/api/admin/tokens/revoke",
                                   {"id": int(args[1])})
        print(json.dumps(data) if as_json else
              f"revoked token id={data['id']} app={data['app']}")
        return 0
    raise CommandError("usage: qmq admin tokens create --app NAME ... | list | revoke ID")


_REPLICATION_COLUMNS = ["group", "kind", "epoch", "master_id", "master_address", "replication",
                        "min_insync", "insync", "slaves", "writable", "switchover_to",
                        "undecodable"]


def _place(at: dict[str, Any]) -> str:
    """``LOG@OFFSET/vVERSION``: where a slave's copy is stopped at a record it cannot decode
    (its ``undecodable_at``). One word, so a table's columns still split on white space."""
    return f"{at.get('log')}@{at.get('offset')}/v{at.get('version')}"


def _undecodable_cell(places: dict[str, Any] | None) -> str:
    """``SERVER:LOG@OFFSET/vVERSION`` per slave whose copy is stopped at a record it cannot
    decode ("-": none; an older MetaServer says nothing: "?")."""
    if places is None:
        return "?"
    return ",".join(f"{server}:{_place(at)}" for server, at in sorted(places.items())) or "-"


async def admin_replication_command(meta_url: str, args: list[str], *, mode: str | None,
                                    min_insync: int | None, as_json: bool = False) -> int:
    """``qmq admin replication [GROUP --mode M --min-insync N]``: per group its epoch, master,
    in-sync set, settings and the slaves whose copy stopped at a record they cannot decode;
    with a GROUP and a flag, change that group's settings."""
    if args:
        if len(args) != 1 or (mode is None and min_insync is None):
            raise CommandError("usage: qmq admin replication [GROUP --mode sync|async "
                               "--min-insync N]")
        body: dict[str, Any] = {"group": args[0]}
        if mode is not None:
            body["mode"] = mode
        if min_insync is not None:
            body["min_insync"] = min_insync
        data = await admin_request(meta_url, "POST", "/api/admin/replication", body)
        print(json.dumps(data))
        return 0
    rows = (await admin_request(meta_url, "GET", "/api/admin/replication"))["replication"]
    if as_json:
        print(json.dumps(rows, indent=2))
        return 0
    shown = [{**row, "insync": ",".join(row["insync"]) or "-",
              "slaves": ",".join(row["slaves"]) or "-",
              "switchover_to": row["switchover_to"] or "-",
              "undecodable": _undecodable_cell(row.get("undecodable"))} for row in rows]
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
    started = await admin_request(meta_url, "POST", "/api/admin/switchover", body)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    row: dict[str, Any] = {}
    while True:
        rows = (await admin_request(meta_url, "GET", "/api/admin/replication"))["replication"]
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


__all__ = ["ADMIN_BULK_TIMEOUT_S", "SWITCHOVER_POLL_S", "admin_command", "admin_dead_command",
           "admin_delay_command", "admin_replication_command", "admin_switchover_command",
           "admin_tokens_command", "format_delay_stats"]
