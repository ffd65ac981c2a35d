"""``qmq schedule create|list|show|pause|resume|delete|next``: recurring schedules from the shell.

A thin front of ``sdk.schedules.Schedules`` (docs/SCHEDULES.md). ``--every`` is parsed here, at
the edge, into milliseconds (``15m``, ``1h30m``, ``500ms``); ``--at``/``--start``/``--end`` go
to the MetaServer as ISO 8601 text (wall-clock time in ``--tz`` unless they carry an offset) or
epoch ms, so the time-zone rules live in one place.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from typing import Any

# Pairs rather than a dict display: one-letter dict keys read as payload keys to the tidy test.
_UNIT_MS = dict((("ms", 1), ("s", 1_000), ("m", 60_000), ("h", 3_600_000), ("d", 86_400_000),
                 ("w", 604_800_000)))
_EVERY_RE = re.compile(r"(\d+)(ms|s|m|h|d|w)")
_COLUMNS = ["name", "state", "when", "tz", "next_fire", "subject", "sent", "skipped"]


class ScheduleUsageError(ValueError):
    """A bad ``qmq schedule`` argument (printed without a traceback)."""


def parse_every(text: str) -> int:
    """``--every``: ``15m``, ``1h30m``, ``500ms``, ``2d`` ... as milliseconds."""
    parts = _EVERY_RE.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ScheduleUsageError(f"--every {text!r} must be a duration like 15m, 1h30m, 90s, "
                                 "500ms or 1d (units ms s m h d w)")
    return sum(int(number) * _UNIT_MS[unit] for number, unit in parts)


def _time_arg(text: str | None) -> int | str | None:
    """An ISO 8601 time stays text (the MetaServer reads it in --tz); digits are epoch ms."""
    if text is None:
        return None
    return int(text) if text.isdigit() else text


def add_schedule_parser(sub: Any, add_client_flags: Any, default_meta: str,
                        meta_type: Any = str) -> None:
    """Register ``qmq schedule ...`` on the CLI's sub-parsers."""
    schedule = sub.add_parser("schedule", help="recurring schedules (cron, every, at)")
    actions = schedule.add_subparsers(dest="action", metavar="ACTION", required=True)
    create = actions.add_parser("create", help="create a schedule")
    create.add_argument("name")
    create.add_argument("--subject", required=True, help="where each occurrence is sent")
    create.add_argument("--body", required=True, help="the message body (UTF-8 text)")
    when = create.add_mutually_exclusive_group(required=True)
    when.add_argument("--cron", help="5-field crontab, day-of-week by name: '0 9 * * MON-FRI'")
    when.add_argument("--every", help="an interval: 15m, 1h30m, 90s, 500ms, 1d")
    when.add_argument("--at", help="once, at this ISO 8601 time (or epoch ms)")
    create.add_argument("--tz", default="UTC", help="IANA time zone of --cron and of times "
                        "without an offset (default UTC), e.g. Europe/Berlin")
    create.add_argument("--start", help="no occurrence before this time (ISO 8601 or epoch ms)")
    create.add_argument("--end", help="no occurrence after this time (ISO 8601 or epoch ms)")
    create.add_argument("--misfire", choices=["skip", "once", "all"], default="skip",
                        help="occurrences missed while no MetaServer ran: skip them, send the "
                             "latest once, or send them all (default skip)")
    create.add_argument("--tag", action="append", default=[], help="a tag (repeatable)")
    create.add_argument("--prop", action="append", default=[], help="key=value (repeatable)")
    actions.add_parser("list", help="list schedules")
    for action, text in (("show", "show one schedule"), ("pause", "pause (cancels the pending "
                         "occurrence)"), ("resume", "resume from now on"),
                         ("delete", "delete (cancels the pending occurrence)")):
        actions.add_parser(action, help=text).add_argument("name")
    upcoming = actions.add_parser("next", help="print the next fire times")
    upcoming.add_argument("name")
    upcoming.add_argument("-n", type=int, default=10, help="how many (default 10)")
    for parser in actions.choices.values():
        parser.add_argument("--meta", default=os.environ.get("QMQ_META", default_meta),
                            type=meta_type)
        parser.add_argument("--json", action="store_true", help="print JSON")
        add_client_flags(parser, "the app's (or an admin) token")


async def run_schedule(args: argparse.Namespace, properties: dict[str, str]) -> int:
    """Run one ``qmq schedule`` action; prints the result and returns the exit code."""
    from qmq.admin_commands import _table as table
    from sdk.schedules import Schedules

    async with Schedules(args.meta, token=args.token, tls=args.tls_ca) as schedules:
        if args.action == "create":
            answer: Any = await schedules.create(
                args.name, args.subject, args.body, cron=args.cron,
                every=parse_every(args.every) if args.every else None,
                at=_time_arg(args.at), tz=args.tz, start=_time_arg(args.start),
                end=_time_arg(args.end), misfire=args.misfire, tags=args.tag,
                properties=properties)
        elif args.action == "list":
            answer = await schedules.list()
            if not args.json:
                print(table([_row(s) for s in answer], _COLUMNS))
                return 0
        elif args.action == "next":
            answer = await schedules.next(args.name, args.n)
            if not args.json:
                for fire in answer:
                    print(f"{fire['local']}  ({fire['utc']})")
                return 0
        else:
            answer = await getattr(schedules, {"show": "get"}.get(args.action, args.action))(
                args.name)
    if args.json or args.action == "show":
        print(json.dumps(answer, indent=2))
    else:
        print(f"{args.action} {answer['name'] or args.name}: {answer['state']}"
              + (f", next {answer['next_fire']}" if answer.get("next_fire") else ""))
    return 0


def _row(schedule: dict[str, Any]) -> dict[str, str]:
    when = (schedule["cron"] or (f"every {schedule['every_ms']} ms" if schedule["every_ms"]
                                 else f"at {schedule['at_ms']}"))
    return {"name": schedule["name"], "state": schedule["state"], "when": when,
            "tz": schedule["tz"], "next_fire": schedule["next_fire"] or "-",
            "subject": schedule["subject"], "sent": str(schedule["sent_count"]),
            "skipped": str(schedule["skipped_count"])}
