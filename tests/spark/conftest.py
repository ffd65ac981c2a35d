"""One session-scoped ``local[1]`` SparkSession for every Spark test (JVM start-up is seconds).

It runs with the settings ``qmq audit`` gives a small local trace (``spark_audit.main``: no
adaptive execution, no generated code, a JVM tuned to start fast), which cut the CPU the JVM
spends on these small queries; the cluster test and the e2e audit run the audit in processes of
their own, with the default settings and the small-trace ones respectively.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pyspark.sql import DataFrame, SparkSession

from spark_audit.main import SMALL_TRACE_CONF, SMALL_TRACE_JAVA_OPTIONS
from tests.spark.scenario import events_frame, scenario_events


# The first Spark test also pays for the session's JVM start, which took 120 s on this 2-core
# machine under a load average of 15: the suite's default 300 s is too tight for it.
SPARK_TEST_TIMEOUT_S = 900


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every Spark test without a time limit of its own gets SPARK_TEST_TIMEOUT_S."""
    for item in items:
        if "tests/spark/" in item.nodeid and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SPARK_TEST_TIMEOUT_S))


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """local[1], one shuffle partition, no UI: small hand-written rows need no parallelism."""
    builder = (SparkSession.builder.master("local[1]").appName("pyqmq-tests")
               .config("spark.sql.shuffle.partitions", "1")
               .config("spark.default.parallelism", "1")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.session.timeZone", "UTC")
               .config("spark.driver.extraJavaOptions", SMALL_TRACE_JAVA_OPTIONS))
    for key, value in SMALL_TRACE_CONF:
        builder = builder.config(key, value)
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture(scope="session")
def scenario(spark: SparkSession) -> DataFrame:
    """tests/spark/scenario.py's events, cached for the session."""
    return events_frame(spark, scenario_events()).cache()
