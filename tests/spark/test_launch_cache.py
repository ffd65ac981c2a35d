"""A local ``qmq audit`` caches its driver JVM's command line and later audits start that JVM
directly (no spark-submit, no launcher JVM), with exactly the same results; a cached command
that fails, or that is not this java's driver command, is forgotten and the audit starts its JVM
through spark-submit (spark_audit.launch).

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


# `python -m qmq` whose first SparkSession fails once its SparkContext is built (injected).
SESSION_FAILS_ONCE = """
import sys
from pyspark.sql import session
from qmq.cli import main
real_init = session.SparkSession.__init__
def failing_init(self, *args, **kwargs):
    session.SparkSession.__init__ = real_init
    raise RuntimeError("injected: the session failed after its SparkContext was built")
session.SparkSession.__init__ = failing_init
sys.argv[0] = "qmq"
sys.exit(main())
"""


def run_audit(trace: Path, out: Path, cache: Path, session_fails_once: bool = False
              ) -> subprocess.CompletedProcess:
    python = [sys.executable, "-c", SESSION_FAILS_ONCE] if session_fails_once else [
        sys.executable, "-m", "qmq"]
    return subprocess.run(
        [*python, "--log-level", "info", *audit_arguments(trace, out),
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

    # A cached command that is not this java's driver (here: Python) is refused, not run.
    entry.write_text(json.dumps({**recorded, "argv": [sys.executable, "-c", "exit(7)"]}))
    third = run_audit(trace, tmp_path / "third", cache)
    assert third.returncode == 1, third.stderr[-4000:]
    assert "launch cache entry refused" in third.stderr and "exited with 7" not in third.stderr
    assert third.stdout == first.stdout
    # Forgotten, then recorded again from the JVM spark-submit started.
    assert STORED in third.stderr
    assert json.loads(entry.read_text()) == recorded

    # A session that fails over the cached JVM after its SparkContext was built: the fallback
    # gets a context of its own, not the failed one over a stopped JVM.
    fourth = run_audit(trace, tmp_path / "fourth", cache, session_fails_once=True)
    assert fourth.returncode == 1, fourth.stderr[-4000:]
    assert "injected: the session failed" in fourth.stderr
    assert "through spark-submit" in fourth.stderr and HIT not in fourth.stderr
    assert fourth.stdout == first.stdout
    assert json.loads(entry.read_text()) == recorded
