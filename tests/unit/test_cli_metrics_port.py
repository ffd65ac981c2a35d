"""Which port a server's /metrics gets from the ``qmq`` command line."""

from __future__ import annotations

import pytest

from qmq.cli import METRICS_PORT_OFFSET, build_parser, metrics_port_for


def test_a_fixed_data_port_puts_metrics_ten_above_it():
    assert METRICS_PORT_OFFSET == 10
    assert metrics_port_for(20881, None) == 20891
    assert metrics_port_for(20801, None) == 20811


def test_data_port_zero_puts_metrics_on_a_free_port_too():
    assert metrics_port_for(0, None) == 0


def test_a_given_metrics_port_wins_and_no_metrics_turns_them_off():
    assert metrics_port_for(20881, 9100) == 9100
    assert metrics_port_for(20881, 0) == 0
    assert metrics_port_for(20881, 9100, enabled=False) is None


@pytest.mark.parametrize("command", ["realtime", "delay"])
def test_both_brokers_take_metrics_flags(command):
    args = build_parser().parse_args([command, "--data-dir", "d", "--metrics-port", "9100",
                                      "--no-metrics"])
    assert args.metrics_port == 9100 and args.no_metrics
