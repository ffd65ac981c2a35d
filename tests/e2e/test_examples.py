"""The examples and the ``qmq schedule`` commands against a real ``qmq up``, as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.harness import REPO_ROOT, Cluster, UpProcess, run_qmq


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    cluster = Cluster(tmp_path_factory.mktemp("examples-up"))
    try:
        yield cluster.start_up("--no-trace")
    finally:
        cluster.stop_all()


def test_the_order_timeout_example_cancels_the_unpaid_order_and_keeps_the_paid_one(
        up: UpProcess) -> None:
    done = subprocess.run([sys.executable, "examples/order_timeout.py", "--meta", up.meta_url,
                           "--timeout-s", "2"], capture_output=True, text=True, timeout=180,
                          cwd=REPO_ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "order 2: unpaid at its timeout, cancelled" in done.stdout
    assert "final states: {1: 'paid', 2: 'cancelled'}" in done.stdout


def test_the_schedule_commands_create_list_show_next_pause_and_delete(up: UpProcess) -> None:
    meta = ("--meta", up.meta_url)
    made = run_qmq("schedule", "create", "standup", "--subject", "team.remind", "--body", "hi",
                   "--cron", "55 8 * * MON-FRI", "--tz", "Europe/Berlin", "--json", *meta)
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["cron"] == "55 8 * * MON-FRI"
    listed = run_qmq("schedule", "list", *meta)
    assert "standup" in listed.stdout and "Europe/Berlin" in listed.stdout
    upcoming = run_qmq("schedule", "next", "standup", "-n", "3", *meta)
    lines = upcoming.stdout.splitlines()
    assert len(lines) == 3 and all(":55:00.000+0" in line for line in lines), upcoming.stdout
    refused = run_qmq("schedule", "create", "bad", "--subject", "x", "--body", "b", "--cron",
                      "0 9 * * 1-5", *meta)
    assert refused.returncode == 1 and "MON-FRI" in refused.stderr
    assert "paused" in run_qmq("schedule", "pause", "standup", *meta).stdout
    assert "deleted" in run_qmq("schedule", "delete", "standup", *meta).stdout
    assert run_qmq("schedule", "show", "standup", *meta).returncode == 1
