"""One session-scoped ``local[1]`` SparkSession for every Spark test (JVM start-up is seconds)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from pyspark.sql import DataFrame, SparkSession

from tests.spark.scenario import events_frame, scenario_events


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """local[1], one shuffle partition, no UI: small hand-written rows need no parallelism."""
    session = (SparkSession.builder.master("local[1]").appName("pyqmq-tests")
               .config("spark.sql.shuffle.partitions", "1")
               .config("spark.default.parallelism", "1")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.session.timeZone", "UTC")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture(scope="session")
def scenario(spark: SparkSession) -> DataFrame:
    """tests/spark/scenario.py's events, cached for the session."""
    return events_frame(spark, scenario_events()).cache()
