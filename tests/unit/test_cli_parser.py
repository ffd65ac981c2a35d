"""The CLI builds only the parser of the command it runs, and parses it as the full one does."""

from __future__ import annotations

import pytest

from qmq import cli

ARGVS = (
    ["send", "t.x", "hi", "--tag", "a", "--delay-ms", "5", "--json"],
    ["--log-level", "debug", "consume", "t.x", "--group", "g", "--count", "1"],
    ["--log-format=json", "admin", "dead", "list", "--subject", "s"],
    ["admin", "tokens", "create", "--app", "a", "--produce", "x.*"],
    ["schedule", "create", "n", "--subject", "s", "--body", "b", "--every", "1m"],
    ["realtime", "--data-dir", "d", "--flush", "async", "--port", "0"],
    ["up", "--meta-port", "0", "--replicas", "2"],
    ["cancel", "s", "id", "--group", "delay-1", "--deliver-at-ms", "5"],
    ["outbox", "relay", "--db", "sqlite:///x"],
)


@pytest.mark.parametrize("argv", ARGVS, ids=lambda argv: " ".join(argv[:3]))
def test_the_parser_of_one_command_parses_like_the_full_one(argv):
    command = cli.command_of(argv)
    assert command in cli.COMMANDS
    alone = vars(cli.build_parser(command).parse_args(argv))
    full = vars(cli.build_parser().parse_args(argv))
    assert {k: v for k, v in alone.items() if k != "run"} == {
        k: v for k, v in full.items() if k != "run"}
    assert (alone.get("run") is None) == (full.get("run") is None)


@pytest.mark.parametrize("argv", [[], ["--help"], ["--version"], ["-h", "send"], ["sedn", "x"]])
def test_help_the_version_or_an_unknown_command_builds_every_command(argv):
    command = cli.command_of(argv)
    assert command is None or command not in cli.COMMANDS  # so build_parser registers them all


def test_only_the_command_run_is_registered():
    parser = cli.build_parser("send")
    [actions] = [a for a in parser._actions if a.dest == "command"]
    assert list(actions.choices) == ["send"]
