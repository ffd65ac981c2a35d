"""``--config FILE``: every setting of a server in TOML; flags given win; mistakes fail at start."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from delayserver.config import DelayConfig
from metaserver.config import MetaConfig
from qmq import cli, config_file, server_cli
from realtime.config import RealtimeConfig

FILE = """
[metaserver]
db_url = "sqlite+aiosqlite:///meta.db"
broker_expiry_ms = 20000

[realtime]
data_dir = "/var/lib/qmq/rt"
retention_ms = 3600000
dedup_window_ms = 120000
flush_interval_ms = 50
retry_backoff_ms = [1000, 2000]
ack_timeout_ms = 45000
ack_timeout_ms_by_group = { billing = 120000 }

[delay]
data_dir = "/var/lib/qmq/delay"
tick_ms = 2
dispatch_batch_max = 64
"""


def config_of(tmp_path: Path, argv: list[str], text: str = FILE):
    """The config ``qmq ARGV --config FILE`` would start with (nothing is started)."""
    path = tmp_path / "qmq.toml"
    path.write_text(text)
    argv = [*argv, "--config", str(path)]
    args = cli.build_parser().parse_args(argv)
    args.explicit = config_file.explicit_flags(argv)
    args.config_data = config_file.load(str(path))
    cls, section = {"realtime": (RealtimeConfig, "realtime"), "delay": (DelayConfig, "delay"),
                    "metaserver": (MetaConfig, "metaserver")}[args.command]
    flags = {"data_dir": args.data_dir} if section != "metaserver" else {"db_url": args.db}
    if section == "realtime":
        flags["ack_timeout_ms"] = args.ack_timeout_ms
    return server_cli.server_settings(args, cls, section, flags,
                                args.port if section != "metaserver" else None)


def test_settings_no_flag_has_come_from_the_file(tmp_path):
    config = config_of(tmp_path, ["realtime"])
    assert (config.data_dir, config.retention_ms, config.dedup_window_ms) == (
        "/var/lib/qmq/rt", 3_600_000, 120_000)
    assert config.retry_backoff_ms == (1000, 2000)  # a TOML array becomes the tuple
    assert config.ack_timeout_ms_by_group == {"billing": 120_000}
    assert config.ack_timeout_ms == 45_000
    delay = config_of(tmp_path, ["delay"])
    assert (delay.tick_ms, delay.dispatch_batch_max) == (2, 64)
    assert config_of(tmp_path, ["metaserver"]).broker_expiry_ms == 20_000


def test_a_flag_given_wins_over_the_file_and_the_file_over_the_flags_defaults(tmp_path):
    config = config_of(tmp_path, ["realtime", "--ack-timeout-ms", "5000", "--data-dir", "here"])
    assert (config.ack_timeout_ms, config.data_dir) == (5000, "here")
    assert config_of(tmp_path, ["realtime", "--ack-timeout-ms=7000"]).ack_timeout_ms == 7000


@pytest.mark.parametrize("text, said", [
    ("[realtime]\nretension_ms = 1\n", "[realtime]: unknown key 'retension_ms'"),
    ("[broker]\nport = 1\n", "unknown table or key 'broker'"),
    ("[realtime]\nretention_ms = \"3d\"\n", "[realtime] retention_ms = '3d': must be int"),
    ("[realtime]\nretention_ms = true\n", "[realtime] retention_ms = True: must be int"),
    ("[realtime]\nretry_backoff_ms = [1, \"x\"]\n", "retry_backoff_ms = 'x': must be int"),
    ("[realtime]\nretention_ms = -5\n", "retention_ms must be a positive integer, got -5"),
    ("[realtime]\nscrub_pause_ms = -1\n", "scrub_pause_ms must be an integer >= 0, got -1"),
    ("[realtime\n", "not valid TOML"),
])
def test_a_bad_key_or_value_fails_at_start_naming_it(tmp_path, text, said):
    with pytest.raises(ValueError, match=re.escape(said)):
        config_of(tmp_path, ["realtime", "--data-dir", "d"], text)


def test_a_data_dir_is_needed_from_a_flag_or_the_file(tmp_path):
    with pytest.raises(ValueError, match="give --data-dir, or data_dir in \\[delay\\]"):
        config_of(tmp_path, ["delay"], "[delay]\ntick_ms = 2\n")


def test_qmq_up_takes_each_servers_table_and_its_flags_win(tmp_path):
    path = tmp_path / "qmq.toml"
    path.write_text(FILE)
    argv = ["up", "--config", str(path), "--ack-timeout-ms", "9000"]
    args = cli.build_parser().parse_args(argv)
    args.explicit = config_file.explicit_flags(argv)
    args.config_data = config_file.load(str(path))
    options = server_cli.up_options(args)
    assert options["realtime_options"]["ack_timeout_ms"] == 9000
    assert options["realtime_options"]["retention_ms"] == 3_600_000
    assert options["delay_options"]["tick_ms"] == 2
    assert options["meta_options"]["broker_expiry_ms"] == 20_000


def test_every_server_command_takes_config():
    for command in ("up", "metaserver", "realtime", "delay"):
        assert cli.build_parser().parse_args([command, "--config", "f"]).config == "f"


def test_the_explicit_flags_are_config_field_names():
    assert config_file.explicit_flags(["--meta", "u", "--no-trace", "--tick-ms=5", "--",
                                       "--db"]) == {"meta_url", "trace", "tick_ms"}


def test_the_example_file_of_docs_cli_md_starts_every_server(tmp_path):
    text = (Path(__file__).resolve().parents[2] / "docs" / "CLI.md").read_text()
    path = tmp_path / "example.toml"
    path.write_text(text.split("```toml\n", 1)[1].split("```", 1)[0])
    data = config_file.load(str(path))
    for cls, section in ((MetaConfig, "metaserver"), (RealtimeConfig, "realtime"),
                         (DelayConfig, "delay")):
        cls(**config_file.settings(cls, str(path), section, data))


@pytest.mark.parametrize("command", ["up", "metaserver", "realtime", "delay"])
def test_a_server_command_refuses_an_abbreviated_flag_so_none_is_lost_to_the_file(command,
                                                                                   capsys):
    # argparse would read --flu as --flush, but only full names count as given over the file
    flag = {"metaserver": "--broker-exp"}.get(command, "--flu")
    with pytest.raises(SystemExit) as stopped:
        cli.build_parser().parse_args([command, flag, "5", "--config", "f"])
    assert stopped.value.code == 2
    assert f"unrecognized arguments: {flag}" in capsys.readouterr().err


def test_qmq_up_takes_the_metrics_ports_from_the_file(tmp_path):
    def up_options(text: str, *flags: str) -> dict:
        path = tmp_path / "qmq.toml"
        path.write_text(text)
        argv = ["up", "--config", str(path), *flags]
        args = cli.build_parser().parse_args(argv)
        args.explicit = config_file.explicit_flags(argv)
        args.config_data = config_file.load(str(path))
        return server_cli.up_options(args)

    given = up_options("[realtime]\nmetrics_port = 9101\n[delay]\nmetrics_port = 9102\n")
    assert (given["realtime_options"]["metrics_port"],
            given["delay_options"]["metrics_port"]) == (9101, 9102)
    moved = up_options("[realtime]\nport = 30000\n[delay]\nport = 0\n")
    assert (moved["realtime_options"]["metrics_port"],
            moved["delay_options"]["metrics_port"]) == (30010, 0)  # its data port + 10; 0: any
    assert up_options("[realtime]\nport = 30000\n")["delay_options"]["metrics_port"] == 20811
    flagged = up_options("[realtime]\nmetrics_port = 9101\n", "--realtime-metrics-port", "9201")
    assert flagged["realtime_options"]["metrics_port"] == 9201  # a flag given wins
