"""``qmq admin ...``: nested sub-commands, each with its own ``--help`` (as git's are).

    qmq admin brokers | subjects | groups | delay          [--json]
    qmq admin readonly GROUP on|off
    qmq admin dead list [--subject S] [--group G]          [--json]
    qmq admin dead show BROKER_GROUP DEAD_SUBJECT SEQUENCE
    qmq admin dead redrive SUBJECT GROUP [--id ID ...]     [--json]
    qmq admin dead purge SUBJECT GROUP [--through N] [--broker-group B] [--json]
    qmq admin tokens create --app A [--produce P] [--consume P] [--admin] [--json]
    qmq admin tokens list | revoke ID                      [--json]
    qmq admin replication [GROUP --mode M --min-insync N]  [--json]
    qmq admin switchover GROUP [--to SERVER_ID] [--unclean] [--wait-s S] [--json]

Every leaf takes ``--meta``, ``--token`` and ``--tls-ca``. The work is done by
qmq.admin_commands; this module only parses (a leaf's ``run`` default names what to call).
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable
from typing import Any

Runner = Callable[[argparse.Namespace], Awaitable[int]]


def _leaf(actions: Any, name: str, help_text: str, run: Runner, client_flags: Callable[..., None],
          as_json: bool = True) -> argparse.ArgumentParser:
    """One runnable ``qmq admin ...`` command with the flags every admin command takes."""
    parser: argparse.ArgumentParser = actions.add_parser(name, help=help_text,
                                                         description=help_text)
    parser.set_defaults(run=run)
    client_flags(parser)
    if as_json:
        parser.add_argument("--json", action="store_true", help="print JSON")
    else:
        parser.set_defaults(json=True)
    return parser


async def _listing(args: argparse.Namespace) -> int:
    from qmq.admin_commands import admin_command

    return await admin_command(args.meta, args.what, args.json, [])


async def _readonly(args: argparse.Namespace) -> int:
    from qmq.admin_commands import admin_command

    return await admin_command(args.meta, "readonly", True, [args.group, args.state])


async def _delay(args: argparse.Namespace) -> int:
    from qmq.admin_commands import admin_delay_command

    return await admin_delay_command(args.meta, args.json)


async def _dead(args: argparse.Namespace) -> int:
    from qmq.admin_commands import admin_dead_command

    rest: list[str] = []
    if args.action == "show":
        rest = [args.broker_group_name, args.dead_subject, str(args.sequence)]
    elif args.action in ("redrive", "purge"):
        rest = [args.subject, args.group]
    listing = args.action == "list"
    return await admin_dead_command(
        args.meta, [args.action, *rest], subject=args.subject if listing else None,
        group=args.group if listing else None, ids=getattr(args, "ids", None),
        through=getattr(args, "through", None), broker_group=getattr(args, "broker_group", None),
        as_json=args.json)


async def _tokens(args: argparse.Namespace) -> int:
    from qmq.admin_commands import admin_tokens_command

    rest = [str(args.id)] if args.action == "revoke" else []
    return await admin_tokens_command(
        args.meta, [args.action, *rest], app=getattr(args, "app", None),
        produce=getattr(args, "produce", []), consume=getattr(args, "consume", []),
        admin=getattr(args, "admin", False), as_json=args.json)


async def _replication(args: argparse.Namespace) -> int:
    from qmq.admin_commands import admin_replication_command

    return await admin_replication_command(
        args.meta, [args.group] if args.group else [], mode=args.mode,
        min_insync=args.min_insync, as_json=args.json)


async def _switchover(args: argparse.Namespace) -> int:
    from qmq.admin_commands import admin_switchover_command

    return await admin_switchover_command(args.meta, [args.group], to=args.to,
                                          unclean=args.unclean, wait_s=args.wait_s,
                                          as_json=args.json)


def _add_replication_parsers(whats: Any, add_client_flags: Callable[..., None]) -> None:
    """``qmq admin replication`` and ``qmq admin switchover`` (docs/REPLICATION.md)."""
    replication = _leaf(whats, "replication", "per broker group its epoch, master, in-sync "
                        "slaves and settings; with GROUP and a flag, change its settings",
                        _replication, add_client_flags)
    replication.add_argument("group", nargs="?", metavar="GROUP",
                             help="the broker group whose settings to change")
    replication.add_argument("--mode", choices=["sync", "async"], default=None,
                             help="set the group's replication mode")
    replication.add_argument("--min-insync", type=int, default=None,
                             help="set the group's fewest in-sync slaves")
    switchover = _leaf(whats, "switchover", "hand a broker group's master role to a slave and "
                       "wait until the group's epoch moves", _switchover, add_client_flags)
    switchover.add_argument("group", metavar="GROUP", help="the broker group")
    switchover.add_argument("--to", default=None, metavar="SERVER_ID",
                            help="the server id to hand over to (default: the best in-sync "
                                 "slave)")
    switchover.add_argument("--unclean", action="store_true",
                            help="promote --to although it is not in sync (the master is gone "
                                 "for good; what it lacks is lost)")
    switchover.add_argument("--wait-s", type=float, default=40.0,
                            help="seconds to wait for the handover")


def add_admin_parser(sub: Any, add_client_flags: Callable[..., None]) -> None:
    """Register ``qmq admin ...``; ``add_client_flags(parser)`` adds --meta, --token, --tls-ca."""
    admin = sub.add_parser("admin", help="inspect and steer the cluster",
                           description="inspect and steer the cluster (each command has --help)")
    whats = admin.add_subparsers(dest="what", metavar="COMMAND", required=True)
    for name, text in (("brokers", "broker groups and brokers: address, server id, role, "
                                   "epoch, state, in sync, lag, heartbeat age"),
                       ("subjects", "subjects and the broker groups of their routes"),
                       ("groups", "consumer groups: online clients and lag")):
        _leaf(whats, name, text, _listing, add_client_flags)
    _leaf(whats, "delay", "pending delayed messages, dispatch rate and lateness of every delay "
          "server", _delay, add_client_flags)
    readonly = _leaf(whats, "readonly", "turn a broker group's readonly mode on (producers go "
                     "to other groups; consumers drain it) or off", _readonly, add_client_flags,
                     as_json=False)
    readonly.add_argument("group", help="the broker group")
    readonly.add_argument("state", choices=["on", "off"])

    dead = whats.add_parser("dead", help="dead letters: list, show, redrive, purge",
                            description="dead letters: messages that used up their retries")
    dead_actions = dead.add_subparsers(dest="action", metavar="ACTION", required=True)
    listed = _leaf(dead_actions, "list", "list dead letters", _dead, add_client_flags)
    listed.add_argument("--subject", help="only this subject")
    listed.add_argument("--group", help="only this consumer group")
    show = _leaf(dead_actions, "show", "one dead letter in full (JSON)", _dead, add_client_flags,
                 as_json=False)
    show.add_argument("broker_group_name", metavar="BROKER_GROUP")
    show.add_argument("dead_subject", metavar="DEAD_SUBJECT", help="%%dead%%SUBJECT%%GROUP")
    show.add_argument("sequence", metavar="SEQUENCE", type=int)
    redrive = _leaf(dead_actions, "redrive", "send a group's dead letters back to their subject",
                    _dead, add_client_flags)
    purge = _leaf(dead_actions, "purge", "delete a group's dead letters", _dead, add_client_flags)
    for parser in (redrive, purge):
        parser.add_argument("subject", metavar="SUBJECT")
        parser.add_argument("group", metavar="GROUP", help="the consumer group")
    redrive.add_argument("--id", action="append", dest="ids", default=None,
                         help="only this message id (repeatable)")
    purge.add_argument("--through", type=int, default=None,
                       help="purge through this sequence (default: all)")
    purge.add_argument("--broker-group", default=None, help="only this broker group")

    tokens = whats.add_parser("tokens", help="app and admin tokens: create, list, revoke",
                              description="app and admin tokens (docs/SECURITY.md)")
    token_actions = tokens.add_subparsers(dest="action", metavar="ACTION", required=True)
    create = _leaf(token_actions, "create", "create a token and print its secret (once)",
                   _tokens, add_client_flags)
    create.add_argument("--app", required=True, help="the app the token is for")
    create.add_argument("--produce", action="append", default=[],
                        help="a subject pattern it may send to, e.g. 'order.*' (repeatable)")
    create.add_argument("--consume", action="append", default=[],
                        help="a subject pattern it may consume (repeatable)")
    create.add_argument("--admin", action="store_true",
                        help="an admin token (admin API, brokers, every subject)")
    _leaf(token_actions, "list", "list tokens (never their secrets)", _tokens, add_client_flags)
    revoke = _leaf(token_actions, "revoke", "revoke a token by id", _tokens, add_client_flags)
    revoke.add_argument("id", type=int, metavar="ID")
    _add_replication_parsers(whats, add_client_flags)


async def run_admin(args: argparse.Namespace) -> int:
    """Run the ``qmq admin ...`` command that parsing chose."""
    run: Runner = args.run
    return await run(args)


__all__ = ["add_admin_parser", "run_admin"]
