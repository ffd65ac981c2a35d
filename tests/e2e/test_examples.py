"""The examples and the ``qmq schedule`` commands against a real ``qmq up``, as a user runs them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import REPO_ROOT, Cluster, UpProcess, run_qmq


@pytest.fixture(scope="module")
def up(module_up: UpProcess) -> UpProcess:
    return module_up


def test_the_order_timeout_example_cancels_the_unpaid_order_and_keeps_the_paid_one(
        up: UpProcess) -> None:
    done = subprocess.run([sys.executable, "examples/order_timeout.py", "--meta", up.meta_url,
                           "--timeout-s", "2"], capture_output=True, text=True, timeout=180,
                          cwd=REPO_ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "order 2: unpaid at its timeout, cancelled" in done.stdout
    assert "final states: {1: 'paid', 2: 'cancelled'}" in done.stdout


@pytest.fixture(scope="module")
def up_a_day_ahead(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    """``qmq up`` whose servers' clocks run 24 h minus 5 s ahead, as red_packet.py asks."""
    cluster = Cluster(tmp_path_factory.mktemp("examples-up-offset"))
    try:
        yield cluster.start_up("--no-trace", "--clock-offset-ms", "86395000")
    finally:
        cluster.stop_all()


def run_example(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``python examples/NAME ARGS`` as the example's docstring says to run it."""
    return subprocess.run([sys.executable, f"examples/{name}", *args], capture_output=True,
                          text=True, timeout=180, cwd=REPO_ROOT)


def test_the_red_packet_example_refunds_the_unclaimed_packet_after_24_hours(
        up_a_day_ahead: UpProcess) -> None:
    done = run_example("red_packet.py", "--meta", up_a_day_ahead.meta_url)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "packet 1: claimed, its refund cancelled" in done.stdout
    assert "packet 2: unclaimed after 24 h, refunded" in done.stdout
    assert "final states: {1: 'claimed', 2: 'refunded'}" in done.stdout


def test_the_elastic_pool_example_loses_nothing_while_workers_join_and_leave(
        up: UpProcess) -> None:
    qmq = str(Path(sys.executable).parent / "qmq")  # the qmq of this environment
    done = subprocess.run(["sh", "examples/elastic_pool.sh", up.meta_url, "600"],
                          capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
                          env={**os.environ, "QMQ": qmq})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "round 4: " in done.stdout and "600 sent" in done.stdout, done.stdout
    assert re.search(r"600 distinct\), 0 lost", done.stdout), done.stdout


def test_the_scheduled_report_example_builds_a_report_per_occurrence(up: UpProcess) -> None:
    done = run_example("scheduled_report.py", "--meta", up.meta_url, "--every-s", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "06:00:00" in done.stdout  # the daily schedule's next occurrences, Berlin time
    assert "report 3: built for the quick schedule" in done.stdout
    assert "schedules deleted" in done.stdout


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
