"""``--event-loop auto|uvloop|asyncio``: which loop a server command runs on, from the flag, the
``--config`` file's top-level key or $QMQ_EVENT_LOOP; unknown or missing loops are usage errors."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from qmq import cli, config_file
from qmq.event_loop import EVENT_LOOP_ENV, EventLoopUnavailable, loop_factory, loop_name

uvloop = pytest.importorskip("uvloop")


def choice_of(tmp_path: Path, argv: list[str], text: str | None = None) -> str:
    """The loop ``qmq ARGV`` (with a --config file of ``text``) would choose; nothing starts."""
    if text is not None:
        path = tmp_path / "qmq.toml"
        path.write_text(text)
        argv = [*argv, "--config", str(path)]
    args = cli.build_parser().parse_args(argv)
    args.explicit = config_file.explicit_flags(argv)
    args.config_data = config_file.load(args.config) if args.config else {}
    return cli.event_loop_choice(args)


def test_auto_takes_uvloop_when_it_imports_and_asyncio_when_it_does_not(monkeypatch):
    assert loop_factory("auto") is uvloop.new_event_loop
    assert loop_factory("uvloop") is uvloop.new_event_loop
    assert loop_factory("asyncio") is None
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop now raises ImportError
    assert loop_factory("auto") is None
    with pytest.raises(EventLoopUnavailable, match="'uvloop' cannot be imported"):
        loop_factory("uvloop")


def test_the_pure_python_twins_leave_the_loop_alone(monkeypatch):
    monkeypatch.setenv("QMQ_NO_EXTENSIONS", "1")  # our C twins off; uvloop is not one of them
    assert loop_factory("auto") is uvloop.new_event_loop


def test_an_unknown_loop_is_refused_naming_it_and_the_choices():
    with pytest.raises(EventLoopUnavailable, match=r"'trio' is unknown .*auto, uvloop, asyncio"):
        loop_factory("trio")


def test_loop_name_tells_the_two_loops_apart():
    for factory, name in ((uvloop.new_event_loop, "uvloop"), (asyncio.new_event_loop, "asyncio")):
        loop = factory()
        try:
            assert loop_name(loop) == name
        finally:
            loop.close()


@pytest.mark.parametrize("command", ["up", "metaserver", "realtime", "delay"])
def test_every_server_command_takes_the_flag_and_the_config_key(tmp_path, monkeypatch, command):
    monkeypatch.delenv(EVENT_LOOP_ENV, raising=False)
    assert choice_of(tmp_path, [command]) == "auto"
    assert choice_of(tmp_path, [command, "--event-loop", "asyncio"]) == "asyncio"
    assert choice_of(tmp_path, [command], 'event_loop = "asyncio"\n') == "asyncio"
    # The flag given wins over the file, the file over the flag's default.
    assert choice_of(tmp_path, [command, "--event-loop=uvloop"],
                     'event_loop = "asyncio"\n') == "uvloop"
    monkeypatch.setenv(EVENT_LOOP_ENV, "asyncio")
    assert choice_of(tmp_path, [command]) == "asyncio"
    assert choice_of(tmp_path, [command], 'event_loop = "uvloop"\n') == "uvloop"


def test_a_config_file_with_an_unknown_loop_fails_naming_the_file_and_the_value(tmp_path):
    path = tmp_path / "qmq.toml"
    path.write_text('event_loop = "trio"\n[realtime]\ndata_dir = "x"\n')
    with pytest.raises(ValueError, match=r"qmq.toml event_loop = 'trio': must be one of auto, "
                                         r"uvloop, asyncio"):
        config_file.load(str(path))


def test_client_commands_have_no_event_loop_flag(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["send", "s", "b", "--event-loop", "uvloop"])
    assert "unrecognized arguments: --event-loop" in capsys.readouterr().err
