"""A local ``qmq audit`` caches its driver JVM's command line and later audits start that JVM
directly (no spark-submit, no launcher JVM), with exactly the same results; a cached command
that fails is forgotten and the audit starts its JVM through spark-submit (spark_audit.launch).

Each audit is a ``qmq audit`` process of its own: the tests' session JVM is already running, and
only a process without one starts a JVM.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.spark.scenario import scenario_events
from tests.spark.test_cli import write_trace
from tests.spark.test_cluster import OUTPUTS, audit_arguments, table, without_generated

AUDIT_TIMEOUT_S = 900  # a JVM to start and the jobs, on a heavily loaded 2-core machine
HIT = "started the driver JVM from the launch cache"
STORED = "cached the driver JVM's command for later audits"


def run_audit(trace: Path, out: Path, cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qmq", "--log-level", "info", *audit_arguments(trace, out),
         "--master", "local[1]", "--launch-cache-dir", str(cache)],
        capture_output=True, text=True, timeout=AUDIT_TIMEOUT_S,
        env={**os.environ, "QMQ_AUDIT_CLASS_ARCHIVE_DIR": "off"})


def entries(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.json"))


@pytest.mark.timeout(2700)
def test_a_cached_start_gives_the_same_audit_and_a_failing_one_falls_back(tmp_path):
    trace, cache = tmp_path / "trace", tmp_path / "launch-cache"
    write_trace(trace, scenario_events())

    first = run_audit(trace, tmp_path / "first", cache)
    assert first.returncode == 1, first.stderr[-4000:]  # the scenario loses m12
    assert STORED in first.stderr and HIT not in first.stderr
    [entry] = entries(cache)
    recorded = json.loads(entry.read_text())
    assert recorded["argv"][-1] == "pyspark-shell"
    assert "org.apache.spark.deploy.SparkSubmit" in recorded["argv"]

    second = run_audit(trace, tmp_path / "second", cache)
    assert second.returncode == 1, second.stderr[-4000:]
    assert HIT in second.stderr and STORED not in second.stderr
    assert second.stdout == first.stdout
    for name in OUTPUTS:
        assert table(tmp_path / "second", name) == table(tmp_path / "first", name), name
    reports = [without_generated((tmp_path / where / "report.md").read_text())
               for where in ("first", "second")]
    assert reports[0] == reports[1]

    # A cached command that no longer starts a JVM (here: one that exits at once).
    entry.write_text(json.dumps({**recorded, "argv": [sys.executable, "-c", "exit(7)"]}))
    third = run_audit(trace, tmp_path / "third", cache)
    assert third.returncode == 1, third.stderr[-4000:]
    assert "exited with 7" in third.stderr and "through spark-submit" in third.stderr
    assert third.stdout == first.stdout
    # Forgotten, then recorded again from the JVM spark-submit started.
    assert STORED in third.stderr
    assert json.loads(entry.read_text()) == recorded
