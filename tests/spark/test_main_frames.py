"""spark_audit.main's persisted frames: used through a plan that is only their cache."""

from __future__ import annotations

from pyspark.sql import functions as F
from pyspark.testing import assertDataFrameEqual

from spark_audit.main import _keep


def test_a_kept_frame_is_one_cache_leaf_with_the_same_rows_and_unpersists_from_kept(spark):
    frame = spark.range(50).withColumn("twice", F.col("id") * 2).where(F.col("id") % 3 == 0)
    kept = []
    leaf = _keep(frame, kept)
    try:
        plan = leaf._jdf.queryExecution().logical()
        assert plan.getClass().getSimpleName() == "InMemoryRelation"
        assert plan.children().isEmpty()
        assertDataFrameEqual(leaf.where(F.col("twice") > 10), frame.where(F.col("twice") > 10))
        assert frame.storageLevel.useMemory
    finally:
        for df in kept:
            df.unpersist()
    assert not frame.storageLevel.useMemory
