"""``qmq audit --master spark://...`` on a real standalone Spark cluster gives exactly what
``local[2]`` gives: the same exit code, verdict, Parquet tables and report.md.

The cluster is a master and one worker started from the pyspark package's ``bin/spark-class``
(``org.apache.spark.deploy.master.Master`` and ``...worker.Worker``), bound to 127.0.0.1 on
free ports, stopped at the end. The cluster audit runs as a ``qmq audit`` process; the local
one it is compared with runs in this process on the session's ``local[1]`` SparkSession (one
JVM and one audit fewer than a second process; a different parallelism and shuffle partitioning
that the results must not depend on). Both read the same trace (tests/spark/scenario.py,
whose outcome is known).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow.parquet as pq
import pyspark
import pytest

from qmq.cli import main
from tests.harness import free_port
from tests.spark.scenario import DEADLINE_MS, scenario_events
from tests.spark.test_cli import write_trace

SPARK_CLASS = Path(pyspark.__file__).parent / "bin" / "spark-class"
START_TIMEOUT_S = 120  # a JVM each, on a loaded 2-core machine
AUDIT_TIMEOUT_S = 900  # an executor to start, then the jobs, on a heavily loaded 2-core machine
OUTPUTS = ("delivery", "delay", "retries", "retry_summary", "anomalies", "gave_up",
           "latency_histogram", "lateness_histogram", "timeline")


def spark_env(work_dir: Path) -> dict[str, str]:
    return {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "SPARK_WORKER_DIR": str(work_dir),
            "SPARK_LOG_DIR": str(work_dir), "PYSPARK_PYTHON": sys.executable,
            "SPARK_NO_DAEMONIZE": "1"}


@contextmanager
def daemon(args: list[str], ready: str, log_path: Path, env: dict[str, str]
           ) -> Iterator[subprocess.Popen]:
    """A spark-class process, running once ``ready`` appears in its log; killed at the end."""
    with open(log_path, "wb") as log:
        process = subprocess.Popen([str(SPARK_CLASS), *args], stdout=log,
                                   stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while ready not in log_path.read_text(errors="replace"):
            assert process.poll() is None, log_path.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, f"{args[0]} not ready: {log_path.read_text()}"
            time.sleep(0.2)
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)


@contextmanager
def standalone_cluster(work_dir: Path) -> Iterator[str]:
    """A master and one worker (2 cores, 1 GiB) on 127.0.0.1; yields the master URL."""
    work_dir.mkdir(parents=True, exist_ok=True)
    env = spark_env(work_dir)
    port = free_port()
    url = f"spark://127.0.0.1:{port}"
    master = ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port",
              str(port), "--webui-port", str(free_port())]
    worker = ["org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1", "--webui-port",
              str(free_port()), "--cores", "2", "--memory", "1g", "--work-dir",
              str(work_dir / "work"), url]
    with daemon(master, "I have been elected leader", work_dir / "master.log", env):
        with daemon(worker, "Successfully registered with master", work_dir / "worker.log",
                    env):
            yield url


def audit_arguments(trace: Path, out: Path) -> list[str]:
    return ["audit", "--trace-dir", str(trace), "--out", str(out),
            "--deadline-ms", str(DEADLINE_MS)]


def run_audit(trace: Path, out: Path, master: str, *extra: str) -> subprocess.CompletedProcess:
    # Two shuffle partitions (a cluster's default of 200 is 200 tasks per stage on two cores).
    return subprocess.run(
        [sys.executable, "-m", "qmq", *audit_arguments(trace, out), "--master", master,
         "--conf", "spark.sql.shuffle.partitions=2", *extra],
        capture_output=True, text=True, timeout=AUDIT_TIMEOUT_S, env=spark_env(out.parent))


def table(out: Path, name: str) -> list[dict]:
    rows = pq.read_table(str(out / name)).to_pylist()
    return sorted(rows, key=repr)


def without_generated(report: str) -> str:
    return re.sub(r"(- Generated: ).*", r"\1-", report)


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_an_audit_on_a_standalone_cluster_gives_what_local_gives(spark, tmp_path, capsys):
    trace = tmp_path / "trace"
    write_trace(trace, scenario_events())
    with standalone_cluster(tmp_path / "spark") as url:
        on_cluster = run_audit(trace, tmp_path / "cluster", url,
                               "--conf", "spark.executor.memory=512m",
                               "--conf", "spark.driver.host=127.0.0.1",
                               "--conf", "spark.cores.max=2")
    capsys.readouterr()
    local_code = main(audit_arguments(trace, tmp_path / "local"))  # the session's local[1]
    local_out = capsys.readouterr().out
    assert on_cluster.returncode == 1, on_cluster.stderr[-4000:]  # the scenario loses m12
    assert local_code == 1
    assert "1 lost, 1 overdue, 1 early" in on_cluster.stdout
    assert on_cluster.stdout == local_out
    for name in OUTPUTS:
        assert table(tmp_path / "cluster", name) == table(tmp_path / "local", name), name
    reports = [without_generated((tmp_path / where / "report.md").read_text())
               for where in ("cluster", "local")]
    assert reports[0] == reports[1]
