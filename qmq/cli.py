"""The ``qmq`` command line: servers, the all-in-one launcher, send/consume and admin commands.

Client commands (send, consume, cancel, admin, schedule, outbox) load the SDK and nothing of the
servers: ``qmq.launcher``, which imports the MetaServer (SQLAlchemy, Alembic) and both brokers,
is imported only by the server commands (tests/unit/test_layout.py holds the client commands'
import closure), so ``qmq send`` starts in a fraction of a second.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

from qmq.event_loop import EVENT_LOOPS, EventLoopUnavailable, default_choice, loop_factory

DEFAULT_META_URL = os.environ.get("QMQ_META", "http://127.0.0.1:8090")

# Without --metrics-port a server's /metrics listens this far above its data port (realtime
# 20881 -> 20891, delay 20801 -> 20811); with --port 0 it picks a free port too.
METRICS_PORT_OFFSET = 10


def metrics_port_for(data_port: int, metrics_port: int | None, enabled: bool = True) -> int | None:
    """The metrics port a server gets: the one given, else ``data_port + METRICS_PORT_OFFSET``
    (0 when the data port is 0); None when metrics are turned off."""
    if not enabled:
        return None
    if metrics_port is not None:
        return metrics_port
    return 0 if data_port == 0 else data_port + METRICS_PORT_OFFSET


def meta_url(text: str) -> str:
    """``--meta``: a MetaServer URL (``http://HOST:PORT`` or ``https://``), or several separated
    by commas; one without a scheme is refused with the URL it probably meant."""
    for part in text.split(","):
        part = part.strip()
        if not part.startswith(("http://", "https://")):
            hint = f"http://{part}" if part else DEFAULT_META_URL
            raise argparse.ArgumentTypeError(f"{part!r} is not a URL: did you mean {hint}?")
    return text


def _add_metrics_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--metrics-port", type=int, default=None,
                        help="HTTP port of GET /metrics (Prometheus) on --host; default "
                             f"--port + {METRICS_PORT_OFFSET}, or any free port with --port 0")
    parser.add_argument("--no-metrics", action="store_true", help="serve no /metrics")


META_HELP = ("MetaServer URL, or several separated by commas: tried in order from the last "
             "one that answered (default $QMQ_META)")


def _add_replication_flags(parser: argparse.ArgumentParser) -> None:
    """``--replication`` and ``--min-insync``: set the group's settings (docs/REPLICATION.md 7)."""
    parser.add_argument("--replication", choices=["sync", "async"], default=None,
                        help="set the group's replication: sync (answer once every in-sync "
                             "slave has a write; the group's default) or async")
    parser.add_argument("--min-insync", type=int, default=None,
                        help="set the group's fewest in-sync slaves to accept writes with "
                             "(0, the default: carry on degraded)")
    # Defaults live in serverkit.config (SCRUB_*_DEFAULT), which client commands never load.
    parser.add_argument("--scrub-bytes-per-s", type=int, default=None,
                        help="a slave re-reads its copy at this pace to find bit rot (default "
                             "4 MiB/s; 0: never)")
    parser.add_argument("--scrub-pause-ms", type=int, default=None,
                        help="rest between two scrub passes over the whole copy (default "
                             "3600000: an hour)")


def _add_token(parser: argparse.ArgumentParser, what: str) -> None:
    """``--token`` (default $QMQ_TOKEN) and ``--tls-ca`` (default $QMQ_TLS_CA) of a client or
    broker command."""
    parser.add_argument("--token", default=os.environ.get("QMQ_TOKEN"),
                        help=f"{what} (default $QMQ_TOKEN); needed when the MetaServer has auth on")
    parser.add_argument("--tls-ca", default=os.environ.get("QMQ_TLS_CA"),
                        help="PEM CA file trusted for TLS servers (default $QMQ_TLS_CA); "
                             "given: broker connections use TLS")


def _add_tls_server(parser: argparse.ArgumentParser) -> None:
    """``--tls-cert``/``--tls-key`` of a server: serve TLS with this PEM chain and key."""
    parser.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve TLS")
    parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")


def _add_event_loop_flag(parser: argparse.ArgumentParser) -> None:
    """``--event-loop`` of a server command (qmq.event_loop)."""
    parser.add_argument("--event-loop", choices=EVENT_LOOPS, default=default_choice(),
                        help="the process's event loop: uvloop (faster), asyncio's own, or "
                             "auto: uvloop when installed (default $QMQ_EVENT_LOOP, else auto)")


class _VersionAction(argparse.Action):
    """``qmq --version``: the installed distribution's version (read only when asked)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            text = version("pyqmq")
        except PackageNotFoundError:  # run from a source tree that was never installed
            text = "unknown (not installed)"
        print(f"qmq (pyqmq) {text}")
        parser.exit()


# The server commands take no abbreviated flags (``--flu`` for ``--flush``): a flag given wins
# over the --config file, and config_file.explicit_flags knows a flag by its full name only, so
# an abbreviation would have been obeyed by argparse yet lost to the file's value.
_SERVER_PARSER: dict[str, Any] = {"allow_abbrev": False}


class _Unbuilt:
    """What a sub-command that is not being run gets instead of its parser: every call and
    attribute is a no-op returning another ``_Unbuilt``, so its flags cost nothing."""

    def __getattr__(self, name: str) -> _Unbuilt:
        return self

    def __call__(self, *args: Any, **kwargs: Any) -> _Unbuilt:
        return self

    def __iter__(self) -> Any:
        return iter(())


class _OnlyCommand:
    """The sub-parsers action, registering only the sub-command ``only`` (all when None)."""

    def __init__(self, actions: Any, only: str | None) -> None:
        self._actions = actions
        self._only = only

    def add_parser(self, name: str, **kwargs: Any) -> Any:
        if self._only is None or name == self._only:
            return self._actions.add_parser(name, **kwargs)
        return _Unbuilt()


# Top-level flags that take a value (``qmq --log-level debug send ...``).
_TOP_VALUE_FLAGS = ("--log-level", "--log-format")


def command_of(argv: list[str]) -> str | None:
    """The sub-command ``argv`` runs, when only top-level flags with values come before it;
    None when help or the version is asked for, or no command is named."""
    index = 0
    while index < len(argv) and argv[index].startswith("-"):
        token = argv[index]
        if "=" in token:
            index += 1
        elif any(flag.startswith(token) for flag in _TOP_VALUE_FLAGS) and len(token) > 2:
            index += 2
        else:
            return None  # --help, --version, or a mistake argparse should explain
    return argv[index] if index < len(argv) else None


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """Return the top-level argument parser with every sub-command registered, or only the
    sub-command ``only``: building all of them (some 300 flags) was a tenth of a one-shot
    ``qmq send``'s start-up."""
    parser = argparse.ArgumentParser(prog="qmq", description="pyqmq: delayed and realtime messaging")
    parser.add_argument("--version", action=_VersionAction, help="print the version and exit")
    parser.add_argument("--log-level", default="info", help="debug, info, warning, error")
    parser.add_argument("--log-format", choices=["text", "json"], default="text",
                        help="text lines, or one JSON object per line (for a log pipeline)")
    actions = parser.add_subparsers(dest="command", metavar="COMMAND")
    if only not in COMMANDS:
        only = None
    sub: Any = _OnlyCommand(actions, only)

    up = sub.add_parser("up", help="run MetaServer + realtime server in one process (SQLite)",
                        **_SERVER_PARSER)
    up.add_argument("--data-dir", default="./qmq-data", help="where all state lives")
    up.add_argument("--config", default=None, metavar="FILE",
                    help="a TOML file of settings (docs/CLI.md); flags given win over it")
    up.add_argument("--meta-port", type=int, default=8090, help="MetaServer HTTP port (0 = any)")
    up.add_argument("--realtime-port", type=int, default=20881, help="realtime port (0 = any)")
    up.add_argument("--host", default="127.0.0.1", help="address to listen on")
    up.add_argument("--advertise-host", default=None,
                    help="the address the brokers register and clients are told "
                         "(default --host; needed when --host is 0.0.0.0 or ::)")
    up.add_argument("--delay-port", type=int, default=20801, help="delay server port (0 = any)")
    up.add_argument("--flush", choices=["sync", "async"], default="sync")
    up.add_argument("--replicas", type=int, default=1,
                    help="servers per group: a master and N-1 slaves that copy it (1..5)")
    up.add_argument("--clock-offset-ms", type=int, default=0, help=argparse.SUPPRESS)
    up.add_argument("--no-trace", action="store_true", help="do not write trace events")
    up.add_argument("--ack-timeout-ms", type=int, default=60_000,
                    help="a pulled message not acked in this time is handed out again")
    up.add_argument("--consumer-expiry-ms", type=int, default=30_000,
                    help="a consumer silent this long is offline; its unacked messages move")
    up.add_argument("--retry-backoff-ms", default=None,
                    help="comma-separated delays before retry 1, 2, ... (last repeats)")
    up.add_argument("--retries-max", type=int, default=16,
                    help="after this many retries a nacked message goes to the dead letters")
    up.add_argument("--admin-token", default=os.environ.get("QMQ_ADMIN_TOKEN"),
                    help="turn auth on with this admin token (default $QMQ_ADMIN_TOKEN; "
                         "unset: auth off until a token is created)")
    up.add_argument("--realtime-metrics-port", type=int, default=None,
                    help=f"realtime /metrics port (default --realtime-port + {METRICS_PORT_OFFSET})")
    up.add_argument("--delay-metrics-port", type=int, default=None,
                    help=f"delay /metrics port (default --delay-port + {METRICS_PORT_OFFSET})")
    _add_event_loop_flag(up)

    meta = sub.add_parser("metaserver", help="run a MetaServer", **_SERVER_PARSER)
    meta.add_argument("--db", default="sqlite+aiosqlite:///./qmq-meta.db",
                      help="sqlite+aiosqlite:///FILE or postgresql+asyncpg://USER@HOST/DB")
    meta.add_argument("--host", default="127.0.0.1")
    meta.add_argument("--config", default=None, metavar="FILE",
                      help="a TOML file of settings (docs/CLI.md); flags given win over it")
    meta.add_argument("--port", type=int, default=8090)
    meta.add_argument("--admin-token", default=os.environ.get("QMQ_ADMIN_TOKEN"),
                      help="accept this secret as an admin token and turn auth on "
                           "(default $QMQ_ADMIN_TOKEN)")
    meta.add_argument("--broker-expiry-ms", type=int, default=15_000,
                      help="a server silent this long is offline")
    meta.add_argument("--lease-ms", type=int, default=3_000,
                      help="how long a master may accept writes after a renewal "
                           "(docs/REPLICATION.md)")
    meta.add_argument("--lease-margin-ms", type=int, default=500,
                      help="extra wait past a lease before a slave may be promoted")
    _add_tls_server(meta)
    meta.add_argument("--tls-ca", default=os.environ.get("QMQ_TLS_CA"),
                      help="PEM CA file trusted for TLS brokers (dead-letter admin calls)")
    meta.add_argument("--trace-dir", action="append", default=[], dest="trace_dirs",
                      help="a directory of trace files (or above some) the console's message "
                           "lookup reads; repeat for several")
    meta.add_argument("--schedule-misfire-grace-ms", type=int, default=60_000,
                      help="a schedule's occurrence handed over later than this is a misfire, "
                           "and the schedule's --misfire policy decides (default 60000)")
    meta.add_argument("--schedule-lease-ms", type=int, default=30_000,
                      help="how long a claim on a schedule's next occurrence is this "
                           "MetaServer's alone; another resolves it after (default 30000)")
    _add_event_loop_flag(meta)

    rt = sub.add_parser("realtime", help="run a realtime broker", **_SERVER_PARSER)
    rt.add_argument("--meta", default=DEFAULT_META_URL, type=meta_url,
                    help=META_HELP)
    rt.add_argument("--data-dir", default=None, help="required, here or in --config")
    rt.add_argument("--config", default=None, metavar="FILE",
                    help="a TOML file of settings (docs/CLI.md); flags given win over it")
    rt.add_argument("--host", default="127.0.0.1")
    rt.add_argument("--advertise-host", default=None,
                    help="the address registered with the MetaServer and told to clients "
                         "(default --host; needed when --host is 0.0.0.0 or ::)")
    rt.add_argument("--port", type=int, default=20881)
    rt.add_argument("--group", default="realtime-1", help="broker group name")
    rt.add_argument("--flush", choices=["sync", "async"], default="sync")
    rt.add_argument("--ack-timeout-ms", type=int, default=60_000)
    rt.add_argument("--consumer-expiry-ms", type=int, default=30_000)
    rt.add_argument("--no-trace", action="store_true", help="do not write trace events")
    rt.add_argument("--trace-dir", default=None, help="trace files (default DATA_DIR/trace)")
    rt.add_argument("--retry-backoff-ms", default=None,
                    help="comma-separated delays before retry 1, 2, ... (last repeats); "
                         "default 5s,10s,30s,1m,2m,5m,10m,30m,1h,2h")
    rt.add_argument("--retries-max", type=int, default=16,
                    help="after this many retries a nacked message goes to the dead letters")
    rt.add_argument("--clock-offset-ms", type=int, default=0,
                    help="TEST ONLY: shift this server's clock (pair with the delay server's)")
    _add_token(rt, "this broker's admin token")
    _add_event_loop_flag(rt)
    _add_tls_server(rt)
    _add_metrics_flags(rt)
    _add_replication_flags(rt)

    delay = sub.add_parser("delay", help="run a delay server", **_SERVER_PARSER)
    delay.add_argument("--meta", default=DEFAULT_META_URL, type=meta_url,
                       help=META_HELP)
    delay.add_argument("--data-dir", default=None, help="required, here or in --config")
    delay.add_argument("--config", default=None, metavar="FILE",
                       help="a TOML file of settings (docs/CLI.md); flags given win over it")
    delay.add_argument("--host", default="127.0.0.1")
    delay.add_argument("--advertise-host", default=None,
                    help="the address registered with the MetaServer and told to clients "
                         "(default --host; needed when --host is 0.0.0.0 or ::)")
    delay.add_argument("--port", type=int, default=20801)
    delay.add_argument("--group", default="delay-1", help="delay group name")
    delay.add_argument("--flush", choices=["sync", "async"], default="sync")
    delay.add_argument("--bucket-ms", type=int, default=60_000, help="schedule bucket width")
    delay.add_argument("--wheel-entries-max", type=int, default=200_000,
                       help="most entries held in memory in the preload window (~600 bytes "
                            "each); a bucket with more is loaded in part, the rest as the "
                            "window drains")
    delay.add_argument("--max-delay-ms", type=int, default=None,
                       help="furthest deliver time ahead of now (default 2 years)")
    delay.add_argument("--handoff-lead-ms", type=int, default=None,
                       help="hand each message to a realtime broker that holds this long "
                            "before its due time (default 0: at the due time; 3000 hands a hot slot off 3 s early)")
    delay.add_argument("--no-trace", action="store_true", help="do not write trace events")
    delay.add_argument("--trace-dir", default=None, help="trace files (default DATA_DIR/trace)")
    delay.add_argument("--clock-offset-ms", type=int, default=0,
                       help="TEST ONLY: shift this server's clock to prove long delays quickly")
    _add_token(delay, "this server's admin token")
    _add_event_loop_flag(delay)
    _add_tls_server(delay)
    _add_metrics_flags(delay)
    _add_replication_flags(delay)

    send = sub.add_parser("send", help="send a message")
    send.add_argument("subject")
    send.add_argument("body", help="message body (UTF-8 text); '-' reads stdin")
    send.add_argument("--meta", default=DEFAULT_META_URL, type=meta_url,
                      help=META_HELP)
    send.add_argument("--tag", action="append", default=[], help="a tag (repeatable)")
    send.add_argument("--prop", action="append", default=[], help="key=value (repeatable)")
    send.add_argument("--count", type=int, default=1, help="send this many copies")
    when = send.add_mutually_exclusive_group()
    when.add_argument("--delay-ms", type=int, default=None, help="deliver this many ms from now")
    when.add_argument("--deliver-at", default=None,
                      help="deliver at this time: ISO 8601 with a timezone, or epoch ms")
    send.add_argument("--json", action="store_true", help="print each receipt as JSON")
    _add_token(send, "the app's token")

    cancel = sub.add_parser("cancel", help="cancel a delayed message (as qmq send printed it)")
    cancel.add_argument("subject")
    cancel.add_argument("id", help="the message id")
    cancel.add_argument("--group", required=True, help="the delay group in the receipt")
    cancel.add_argument("--deliver-at-ms", type=int, required=True,
                        help="deliver_at_ms from the receipt")
    cancel.add_argument("--meta", default=DEFAULT_META_URL, type=meta_url,
                        help=META_HELP)
    cancel.add_argument("--json", action="store_true", help="print the outcome as JSON")
    _add_token(cancel, "the app's token")

    consume = sub.add_parser("consume", help="print and ack messages of a subject")
    consume.add_argument("subject")
    consume.add_argument("--group", required=True)
    consume.add_argument("--meta", default=DEFAULT_META_URL, type=meta_url,
                         help=META_HELP)
    consume.add_argument("--tag", action="append", default=None, help="only these tags")
    consume.add_argument("--start", choices=["latest", "earliest"], default="latest")
    consume.add_argument("--broadcast", action="store_true")
    consume.add_argument("--count", type=int, default=None, help="stop after this many")
    consume.add_argument("--idle-timeout-s", type=float, default=None,
                         help="stop when nothing arrives for this long")
    _add_token(consume, "the app's token")

    # The admin, audit and schedule parsers are modules of their own, loaded only when needed.
    if only in (None, "admin"):
        from qmq.admin_cli import add_admin_parser

        add_admin_parser(sub, lambda parser: (
            parser.add_argument("--meta", default=DEFAULT_META_URL, type=meta_url,
                                help=META_HELP),
            _add_token(parser, "an admin token")))
    if only in (None, "audit"):
        from qmq.audit import add_audit_parser

        add_audit_parser(sub)
    if only in (None, "schedule"):
        from qmq.schedule_cli import add_schedule_parser

        add_schedule_parser(sub, _add_token, DEFAULT_META_URL, meta_url)
    outbox = sub.add_parser("outbox", help="the transactional outbox (docs/OUTBOX.md)")
    outbox_actions = outbox.add_subparsers(dest="action", metavar="ACTION", required=True)
    relay = outbox_actions.add_parser("relay", help="send what committed in the outbox table "
                                      "(one relay per table at a time)")
    relay.add_argument("--db", required=True, help="the application's database: "
                       "postgresql://USER@HOST/DB or sqlite:///FILE (async drivers are used)")
    relay.add_argument("--meta", default=DEFAULT_META_URL, type=meta_url, help=META_HELP)
    relay.add_argument("--batch", type=int, default=2000, help="rows per pass")
    relay.add_argument("--json", action="store_true",
                       help="print each status line as a JSON object")
    _add_token(relay, "the app's token")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    parser = build_parser(command_of(sys.argv[1:] if argv is None else argv))
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    from qmq.commands import CommandError
    from qmq.exits import EXIT_INTERRUPTED, EXIT_USAGE, exit_code_of_error
    from qmq.logs import setup_logging
    from wire.errors import QmqError

    setup_logging(args.log_level, args.log_format)
    if args.command in SERVER_COMMANDS:
        from qmq import config_file

        args.explicit = config_file.explicit_flags(sys.argv[1:] if argv is None else argv)
        try:
            args.config_data = config_file.load(args.config) if args.config else {}
        except ValueError as exc:
            print(f"qmq: {exc}", file=sys.stderr)
            return EXIT_USAGE
    try:
        factory = (loop_factory(event_loop_choice(args))
                   if args.command in SERVER_COMMANDS else None)
    except EventLoopUnavailable as exc:
        print(f"qmq: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:  # one exit-code table for every command: qmq.exits
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(_run(args))
    except CommandError as exc:
        print(f"qmq: {exc}", file=sys.stderr)
        return exc.exit_code
    except QmqError as exc:  # the service refused or could not be reached: say so, no traceback
        print(f"qmq: {args.command} failed: {exc.code}: {exc.message}", file=sys.stderr)
        return exit_code_of_error(exc.retriable)
    except ValueError as exc:  # configuration errors name the key and the value
        print(f"qmq: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def event_loop_choice(args: argparse.Namespace) -> str:
    """A server command's ``--event-loop``: the flag given, else the ``--config`` file's
    top-level ``event_loop``, else the flag's default ($QMQ_EVENT_LOOP, else auto)."""
    if "event_loop" in args.explicit:
        return str(args.event_loop)
    return str(args.config_data.get("event_loop", args.event_loop))


SERVER_COMMANDS = ("up", "metaserver", "realtime", "delay")
# Every sub-command build_parser registers.
COMMANDS = (*SERVER_COMMANDS, "send", "cancel", "consume", "admin", "audit", "schedule", "outbox")


async def _run(args: argparse.Namespace) -> int:
    if args.command in SERVER_COMMANDS:
        from qmq.server_cli import run_server

        return await run_server(args)
    return await _run_client(args)


async def _run_client(args: argparse.Namespace) -> int:
    """The client commands: the SDK and the MetaServer's HTTP API, no server code."""
    from qmq import commands

    if hasattr(args, "token"):
        commands.CLIENT.set(commands.ClientSettings(token=args.token, tls_ca=args.tls_ca))
    if args.command == "send":
        body = sys.stdin.buffer.read() if args.body == "-" else args.body.encode("utf-8")
        deliver_at_ms = (commands.parse_deliver_at(args.deliver_at)
                         if args.deliver_at is not None else None)
        return await commands.send_command(args.meta, args.subject, body, args.tag,
                                           commands.parse_properties(args.prop), args.count,
                                           args.delay_ms, deliver_at_ms, args.json)
    if args.command == "cancel":
        return await commands.cancel_command(args.meta, args.subject, args.id, args.group,
                                             args.deliver_at_ms, args.json)
    if args.command == "consume":
        return await commands.consume_command(args.meta, args.subject, args.group, args.tag,
                                              args.start, args.count, args.idle_timeout_s,
                                              args.broadcast)
    if args.command == "outbox":
        from qmq.outbox_relay import run_relay_command

        return await run_relay_command(args.db, args.meta, token=args.token, tls=args.tls_ca,
                                       batch_max=args.batch, as_json=args.json)
    if args.command == "schedule":
        from qmq.schedule_cli import run_schedule

        return await run_schedule(args, commands.parse_properties(getattr(args, "prop", [])))
    if args.command == "audit":
        from qmq.audit import run_audit

        return run_audit(args)  # blocking Spark driver; nothing else runs on this loop
    if args.command == "admin":
        from qmq.admin_cli import run_admin

        return await run_admin(args)
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
