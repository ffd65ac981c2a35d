"""The settings ``qmq audit`` derives from the trace's size and the driver's memory."""

from __future__ import annotations

import os
import subprocess

import pytest

from spark_audit.class_archive import java_binary
from spark_audit.main import (
    LAUNCHER_JAVA_OPTIONS,
    LAUNCHER_OPTIONS_ENV,
    AuditOptions,
    cache_uncompressed,
    launcher_options,
    memory_bytes,
    spark_session,
)

MB = 1 << 20
GB = 1 << 30


@pytest.mark.parametrize("text, expected", [
    ("6g", 6 * GB), ("6G", 6 * GB), ("2048m", 2048 * MB), ("512mb", 512 * MB),
    ("100", 100 * MB), ("64k", 64 << 10), ("1t", 1 << 40)])
def test_a_driver_memory_string_reads_as_spark_reads_it(text, expected):
    assert memory_bytes(text) == expected


@pytest.mark.parametrize("text", ["1.5g", "g", "", "six gigabytes", "-1g"])
def test_a_driver_memory_string_spark_would_not_take_reads_as_none(text):
    assert memory_bytes(text) is None


def test_the_ten_million_event_benchmark_trace_is_cached_uncompressed_in_a_6g_driver():
    assert cache_uncompressed(1_740 * 1_000_000, "6g")


def test_a_trace_whose_uncompressed_cache_would_not_fit_the_driver_is_cached_compressed():
    # 1,740 MB of trace: about 1.3 GB uncompressed, against ~0.5 GB of unevictable storage
    assert not cache_uncompressed(1_740 * 1_000_000, "2g")
    assert cache_uncompressed(500 * 1_000_000, "2g")


def test_an_unreadable_driver_memory_keeps_the_cache_compressed():
    assert not cache_uncompressed(1, "lots")


def test_no_driver_memory_means_sparks_default_of_one_gigabyte():
    assert cache_uncompressed(100 * MB, None)
    assert not cache_uncompressed(1 * GB, None)


def test_spark_submits_launcher_jvm_runs_with_the_short_run_options_while_a_session_starts(
        monkeypatch):
    monkeypatch.delenv(LAUNCHER_OPTIONS_ENV, raising=False)
    with launcher_options():
        assert os.environ[LAUNCHER_OPTIONS_ENV] == LAUNCHER_JAVA_OPTIONS
    assert LAUNCHER_OPTIONS_ENV not in os.environ


def test_an_operators_own_launcher_options_are_kept(monkeypatch):
    monkeypatch.setenv(LAUNCHER_OPTIONS_ENV, "-Xmx256m")
    with launcher_options():
        assert os.environ[LAUNCHER_OPTIONS_ENV] == "-Xmx256m"
    assert os.environ[LAUNCHER_OPTIONS_ENV] == "-Xmx256m"


def test_the_launcher_options_are_ones_this_java_accepts():
    java = java_binary()
    assert java is not None
    done = subprocess.run([java, *LAUNCHER_JAVA_OPTIONS.split(), "-version"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


class _Built(Exception):
    """Raised in place of starting a JVM: carries the settings the builder was given."""


def _settings_of_a_new_session(monkeypatch, options) -> dict:
    from pyspark.sql import SparkSession

    def capture(builder):
        raise _Built(dict(builder._options))

    monkeypatch.setattr(SparkSession, "getActiveSession", staticmethod(lambda: None))
    monkeypatch.setattr(SparkSession.Builder, "getOrCreate", capture)
    with pytest.raises(_Built) as built:
        spark_session(options)
    return built.value.args[0]


@pytest.mark.parametrize("master", ["local[2]", "spark://somewhere:7077"])
def test_every_session_the_audit_starts_has_pysparks_per_call_debugging_off(
        monkeypatch, tmp_path, master):
    # On, PySpark sends each Column and functions call's Python call site to the JVM: about
    # half of a 10k-event audit's py4j round trips.
    options = AuditOptions(trace_dirs=(str(tmp_path),), out_dir=str(tmp_path / "out"),
                           master=master)
    settings = _settings_of_a_new_session(monkeypatch, options)
    assert settings["spark.python.sql.dataFrameDebugging.enabled"] == "false"
