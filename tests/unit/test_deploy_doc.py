"""docs/DEPLOY.md and contrib/systemd stay true: each host's config file starts its servers and
each unit's command line is one the CLI takes (the three hosts themselves are not built here)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from delayserver.config import DelayConfig
from metaserver.config import MetaConfig
from qmq import cli, config_file
from realtime.config import RealtimeConfig

ROOT = Path(__file__).resolve().parents[2]
CLASSES = {"metaserver": MetaConfig, "realtime": RealtimeConfig, "delay": DelayConfig}
HOST_FILES = (ROOT / "docs" / "DEPLOY.md").read_text().split("```toml\n")[1:]
UNITS = sorted((ROOT / "contrib" / "systemd").glob("*.service"))


def test_the_guide_has_a_config_file_for_each_of_its_three_hosts():
    assert len(HOST_FILES) == 3


@pytest.mark.parametrize("index", range(len(HOST_FILES)))
def test_each_hosts_config_file_makes_a_valid_config_for_each_of_its_servers(tmp_path, index):
    path = tmp_path / "qmq.toml"
    path.write_text(HOST_FILES[index].split("```", 1)[0])
    data = config_file.load(str(path))
    for section in data:
        CLASSES[section](**config_file.settings(CLASSES[section], str(path), section, data))


@pytest.mark.parametrize("unit", UNITS, ids=[u.name for u in UNITS])
def test_each_systemd_units_command_is_one_the_cli_takes(unit):
    line = next(l for l in unit.read_text().splitlines() if l.startswith("ExecStart="))
    argv = shlex.split(line.removeprefix("ExecStart="))
    assert argv[0].endswith("/qmq")
    args = cli.build_parser().parse_args(argv[1:])
    assert args.command in CLASSES and args.config == "/etc/qmq/qmq.toml"
    assert args.log_format == "json"
