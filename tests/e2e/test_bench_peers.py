"""The peers benchmark (bench/peers) runs its pyqmq part end to end at tiny sizes, and its
pure parts (systems, report, NATS schedule header) do what the docs say. The peers themselves
(NATS, Redis) are never run or installed by the suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench.peers import report, run, servers
from bench.peers.drivers_nats import at_header

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOKE_TIMEOUT_S = 240


@pytest.mark.slow  # four workloads, eight client processes: 10-40 s by the machine's load
def test_the_harness_measures_every_workload_of_pyqmq_with_a_sync_slave_with_nothing_lost(
        tmp_path):
    # pyqmq-slave runs the same workloads as plain pyqmq, plus the --replicas start and the
    # wait for the slaves to be in sync: the larger path, so the one smoke-tested.
    out = tmp_path / "peers.json"
    markdown = tmp_path / "peers.md"
    done = subprocess.run(
        [sys.executable, "-m", "bench.peers", "--systems", "pyqmq-slave", "--runs", "1",
         "--w1-messages", "40", "--w1-delay-s", "0.2,0.6", "--w2-messages", "40",
         "--messages", "400", "--latency-seconds", "0.5", "--rate", "200", "--shared-server",
         "--json", str(out), "--markdown", str(markdown), "--no-install",
         "--peers-venv", str(tmp_path / "no-venv")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert not (tmp_path / "no-venv").exists()  # pyqmq alone installs nothing
    figures = json.loads(out.read_text())["runs"]["pyqmq-slave"]
    for workload in ("w1", "w2", "e2e", "latency"):
        [one] = figures[workload]
        assert (one["missing"], one["duplicates"]) == (0, 0), (workload, one)
    assert figures["w1"][0]["early"] == 0 and figures["w2"][0]["early"] == 0
    assert figures["w1"][0]["sends_per_s"] > 0 and figures["e2e"][0]["consumed_per_s"] > 0
    assert figures["latency"][0]["server_cpu_us"] > 0
    # 40 sends take a few ms of server CPU, under /proc's 10 ms tick: the figure may read 0.
    assert figures["w1"][0]["server_cpu_us"] >= 0
    text = markdown.read_text()
    setting = servers.SETTINGS_BY_KEY["pyqmq-slave"]
    assert setting.durability in text
    assert text.count(f"| {setting.label} |") == 2  # a row in the delayed and realtime tables
    assert "- pyqmq-slave: W2: last received after due <= 0.2 s: " in text


def test_a_system_name_selects_both_of_its_settings_in_table_order():
    assert [s.key for s in run._parse_systems("redis,pyqmq")] == [
        "redis-always", "redis-everysec", "pyqmq", "pyqmq-slave"]
    assert [s.key for s in run._parse_systems("pyqmq-slave")] == ["pyqmq-slave"]
    # Each slave its own process: only when named.
    assert [s.key for s in run._parse_systems("pyqmq-slave,pyqmq-slave-procs")] == [
        "pyqmq-slave", "pyqmq-slave-procs"]
    with pytest.raises(SystemExit, match="unknown 'kafka'"):
        run._parse_systems("kafka")


def test_a_hand_off_lead_is_written_into_the_config_of_qmq_up_and_only_pyqmq_takes_one(
        tmp_path, monkeypatch):
    pyqmq = servers.SETTINGS_BY_KEY["pyqmq"]
    assert servers.with_handoff_lead(pyqmq, None) is pyqmq
    led = servers.with_handoff_lead(pyqmq, 3_000)
    assert (led.key, led.handoff_lead_ms, pyqmq.handoff_lead_ms) == ("pyqmq", 3_000, None)
    with pytest.raises(ValueError, match="handoff_lead_ms 3000 is a pyqmq setting, not nats"):
        servers.with_handoff_lead(servers.SETTINGS_BY_KEY["nats-always"], 3_000)
    started: list[list[str]] = []

    def start_process(name, argv, *args, **kwargs):
        started.append(argv)
        raise RuntimeError("not started in this test")

    monkeypatch.setattr(servers, "start_process", start_process)
    with pytest.raises(RuntimeError):
        servers._start_pyqmq(led, str(tmp_path))
    config = started[0][started[0].index("--config") + 1]
    assert open(config, encoding="utf-8").read() == "[delay]\nhandoff_lead_ms = 3000\n"
    with pytest.raises(RuntimeError):
        servers._start_pyqmq(pyqmq, str(tmp_path))
    assert "--config" not in started[1]


def test_a_nats_schedule_is_an_rfc3339_utc_instant_to_the_millisecond():
    assert at_header(1_795_622_400_123) == "@at 2026-11-25T16:00:00.123Z"


def test_the_report_names_each_run_that_lost_or_hurried_a_message_or_fell_behind():
    runs = {"pyqmq": {"w2": [{"missing": 0, "duplicates": 0, "early": 2, "failed_sends": 0,
                              "stored_before_due_s": -0.5}],
                      "e2e": [{"missing": 3, "duplicates": 0}],
                      "latency": [{"missing": 0, "rate_per_s": 2_000, "confirmed_per_s": 1_500.0}]}}
    assert report.delivery_problems(runs) == [
        "pyqmq w2 run 1: early 2",
        "pyqmq w2 run 1: the sends ended 0.50 s after the due time",
        "pyqmq e2e run 1: missing 3 (not received before the consumer's wait ended)",
        "pyqmq latency run 1: confirmed 1,500/s of the 2,000/s sent: a backlog, not the latency "
        "at that rate",
    ]


def test_the_goals_compare_pyqmq_with_the_best_peer_of_the_same_runs():
    runs = {
        "pyqmq": {"w1": [{"sends_per_s": 30_000.0}, {"sends_per_s": 50_000.0}],
                  "e2e": [{"consumed_per_s": 80_000.0}]},
        "nats-default": {"w1": [{"sends_per_s": 20_000.0}, {"sends_per_s": 22_000.0}]},
        "redis-always": {"e2e": [{"consumed_per_s": 35_000.0}]},
        "redis-everysec": {"e2e": [{"consumed_per_s": 45_000.0}]},  # not durable: not compared
    }
    assert report.goal_lines(runs) == [
        "- pyqmq: delayed sends/s with 32 in flight >= 2x NATS's best: 40,000.00 against "
        "42,000.00: not met",
        "- pyqmq: end to end msg/s >= 2x the best durable peer: 80,000 against 70,000: met",
    ]


def test_without_peers_the_goals_fall_back_to_the_issues_own_peer_figures():
    runs = {"pyqmq-slave": {"w1": [{"sends_per_s": 41_000.0, "server_cpu_us": 20.0}],
                            "latency": [{"p50_ms": 0.9, "p99_ms": 3.5, "server_cpu_us": 120.0}]}}
    assert report.goal_lines(runs) == [
        "- pyqmq-slave: delayed sends/s with 32 in flight >= 40,000 (2x NATS in the issue; NATS "
        "not run): 41,000.00 against 40,000.00: met",
        "- pyqmq-slave: server CPU-us per delayed send in W1 (no goal): 20",
        "- pyqmq-slave: latency p50 at the fixed rate (send -> consumer) <= 1.0 ms: 0.90 against "
        "1.00: met",
        "- pyqmq-slave: latency p99 at the fixed rate (send -> consumer) <= 3 ms: 3.50 against "
        "3.00: not met",
        "- pyqmq-slave: server CPU-us/msg at the fixed rate <= 150: 120 against 150: met",
    ]


def test_a_dated_sitting_lands_at_the_end_of_the_peers_section(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    path.write_text("# Benchmarks\n\n## Peers (bench/peers)\n\nHow to run.\n\n"
                    "### Peers, day 1\n\nold\n\n## Later section\n\ntext\n")
    report.append_to_benchmarks("### Peers, day 2\n\nnew\n", str(path))
    assert path.read_text() == (
        "# Benchmarks\n\n## Peers (bench/peers)\n\nHow to run.\n\n### Peers, day 1\n\nold"
        "\n\n### Peers, day 2\n\nnew\n\n## Later section\n\ntext\n")
    other = tmp_path / "other.md"
    other.write_text("# Benchmarks\n")
    report.append_to_benchmarks("### Peers, day 1\n", str(other))
    assert other.read_text() == "# Benchmarks\n\n## Peers (bench/peers)\n\n### Peers, day 1\n"


def test_keep_data_keeps_only_a_measurement_that_failed_or_lost_doubled_or_hurried_a_message(
        tmp_path):
    assert not run._suspect({"missing": 0, "duplicates": 0, "early": 0, "failed_sends": 0})
    assert run._suspect(None)  # the measurement raised
    for name in ("missing", "duplicates", "early", "failed_sends"):
        assert run._suspect({name: 1})
    kept, removed = tmp_path / "kept", tmp_path / "qmq-bench-peers-removed"
    for directory in (tmp_path / "qmq-bench-peers-kept", removed):
        (directory / "qmq").mkdir(parents=True)
    keeping = servers.Running("http://x", [], str(tmp_path / "qmq-bench-peers-kept"))
    keeping.keep_in = str(kept)
    keeping.close()
    servers.Running("http://x", [], str(removed)).close()
    assert (kept / "qmq-bench-peers-kept" / "qmq").is_dir() and not removed.exists()
