"""A server that registers with the MetaServer never registers an address no client can reach."""

from __future__ import annotations

import pytest

from delayserver.config import DelayConfig
from qmq.cli import build_parser
from realtime.config import RealtimeConfig

META = "http://10.0.0.1:8090"


@pytest.mark.parametrize("config_class", [RealtimeConfig, DelayConfig])
@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_a_wildcard_host_without_an_advertise_host_is_refused_naming_the_flag(config_class, host):
    with pytest.raises(ValueError, match=rf"host '{host}' cannot be registered .*--advertise-host"):
        config_class(data_dir="d", meta_url=META, host=host)


def test_a_wildcard_host_with_an_advertise_host_registers_the_advertised_address():
    config = RealtimeConfig(data_dir="d", meta_url=META, host="0.0.0.0", port=20881,
                            advertise_host="10.0.0.2")
    assert config.advertised_address == "10.0.0.2:20881"


def test_a_wildcard_advertise_host_is_refused_too():
    with pytest.raises(ValueError, match="advertise_host '0.0.0.0' cannot be registered"):
        DelayConfig(data_dir="d", meta_url=META, host="10.0.0.2", advertise_host="0.0.0.0")


def test_a_server_that_does_not_register_may_listen_on_every_address():
    assert RealtimeConfig(data_dir="d", meta_url=None, host="0.0.0.0").host == "0.0.0.0"


@pytest.mark.parametrize("command", ["realtime", "delay", "up"])
def test_each_server_command_takes_advertise_host(command):
    extra = ["--data-dir", "d"] if command != "up" else []
    args = build_parser().parse_args([command, *extra, "--host", "0.0.0.0",
                                      "--advertise-host", "10.0.0.2"])
    assert args.advertise_host == "10.0.0.2"
